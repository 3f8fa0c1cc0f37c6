"""LLaMA-family dense models (Llama 2, Llama 3.x, and checkpoints that reuse ``model_type: llama``).

The base layout as is. Llama 3.1+ ``rope_type: llama3`` frequency scaling maps onto megatron's
``rope_scaling`` (which hard-codes Llama 3.1's low/high frequency factors 1 and 4 and original
context 8192): configs with exactly those values are mapped, others refused. ``attention_bias``
puts a bias on o_proj too and ``mlp_bias`` on the MLP, which megatron's layer specs cannot hold
without biases on every linear: both are refused (no released Llama uses them).
"""
from __future__ import annotations

from typing import Any

from runtime.errors import ModelError
from runtime.models.base import DenseDecoderAdapter, rope_parameters

# what megatron's RotaryEmbedding._apply_scaling hard-codes
_MEGATRON_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class LlamaAdapter(DenseDecoderAdapter):
    model_types = ("llama",)
    supported_rope_types = ("default", "llama3")

    def o_proj_bias(self, hf_config) -> bool:
        return bool(getattr(hf_config, "attention_bias", False))

    def check_rope(self, hf_config, name: str) -> None:
        super().check_rope(hf_config, name)
        params = rope_parameters(hf_config)
        if params["rope_type"] == "llama3":
            for key, want in _MEGATRON_LLAMA3.items():
                if float(params.get(key, float("nan"))) != want:
                    raise ModelError(
                        f"config.json: rope_type 'llama3' with {key}={params.get(key)} is not supported "
                        f"(megatron's llama3 scaling fixes {key}={want:g})")

    def check_supported(self, hf_config) -> None:
        super().check_supported(hf_config)
        if getattr(hf_config, "mlp_bias", False):
            raise ModelError("config.json: mlp_bias=true is not supported for llama (megatron's layer "
                             "specs hold MLP biases only together with attention biases); only mlp_bias=false is")

    def rope_kwargs(self, hf_config) -> dict[str, Any]:
        kwargs = super().rope_kwargs(hf_config)
        params = rope_parameters(hf_config)
        if params["rope_type"] == "llama3":
            kwargs.update(rope_scaling=True, rope_scaling_factor=float(params["factor"]))
        return kwargs
