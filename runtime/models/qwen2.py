"""Qwen2 / Qwen2.5 dense models (Qwen2.5-0.5B ... 72B, Qwen2.5-Math, DeepSeek-R1-Distill-Qwen):
the LLaMA layout with a bias on q, k and v (always on; o_proj and the MLP have none).

Megatron holds the q/k/v bias in the fused ``linear_qkv.bias`` (``add_qkv_bias``), laid out per
query group like the weight. Sliding-window attention (``use_sliding_window=true``) is refused:
megatron's local attention has no per-layer window.
"""
from __future__ import annotations

from runtime.models.base import DenseDecoderAdapter


class Qwen2Adapter(DenseDecoderAdapter):
    model_types = ("qwen2",)

    def qkv_bias(self, hf_config) -> bool:
        return True  # Qwen2Attention builds q/k/v with bias=True whatever the config says
