"""Qwen3 dense models (Qwen3-0.6B ... 32B): the LLaMA layout plus per-head q/k RMSNorm.

Qwen3's ``attention_bias`` puts a bias on q, k, v *and* o_proj. Megatron holds a q/k/v bias
(``add_qkv_bias``) but an o_proj bias only together with MLP biases, so ``attention_bias=true`` is
refused with a clear error (no released Qwen3 uses it).
"""
from __future__ import annotations

from runtime.models.base import DenseDecoderAdapter


class Qwen3Adapter(DenseDecoderAdapter):
    model_types = ("qwen3",)
    qk_layernorm = True

    def o_proj_bias(self, hf_config) -> bool:
        return bool(getattr(hf_config, "attention_bias", False))
