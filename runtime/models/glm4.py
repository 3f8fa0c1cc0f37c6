"""GLM-4 dense models (GLM-4-9B-0414, GLM-Z1-9B-0414, GLM-4-32B): the LLaMA layout plus

* two extra RMSNorms per layer: ``post_self_attn_layernorm`` on the attention output and
  ``post_mlp_layernorm`` on the MLP output, each applied before its residual add;
* partial, interleaved RoPE: only the first ``partial_rotary_factor`` (0.5) of each head's dims is
  rotated, in GPT-J style adjacent pairs (megatron ``rotary_percent`` + ``rotary_interleaved``);
* a q/k/v bias (``attention_bias``, true in every release; o_proj has none);
* the MLP's gate and up projections stored fused as ``gate_up_proj`` = cat(gate, up), which is
  megatron's ``linear_fc1`` layout as is.

megatron-core has no post-norms, so :meth:`Glm4Adapter.layer_spec` builds the local spec with a
``TransformerLayer`` subclass that owns the two norms and applies them to the attention / MLP output
inside the bias-dropout-add (exact because GLM4's linears have no output bias). Their megatron names
mirror HF's: ``decoder.layers.N.post_self_attn_layernorm.weight`` / ``.post_mlp_layernorm.weight``.
"""
from __future__ import annotations

from typing import Callable

import torch

from runtime.models.base import DenseDecoderAdapter

_LAYER_CLASS = None


def _normed_bda(bda_factory: Callable, norm: torch.nn.Module) -> Callable:
    """A bias-dropout-add factory that normalises the sublayer output first: residual + norm(out)."""

    def factory(training: bool, fused: bool):
        bda = bda_factory(training, fused)

        def apply(x_with_bias, residual, prob):
            out, bias = x_with_bias
            if bias is not None:  # norm(out + bias) != norm(out) + bias: never built for GLM4
                raise RuntimeError("GLM4 post-norms need sublayers without an output bias")
            return bda((norm(out), None), residual, prob)

        return apply

    return factory


def glm4_transformer_layer_class():
    """``Glm4TransformerLayer`` (built on first use so that this module imports without megatron)."""
    global _LAYER_CLASS
    if _LAYER_CLASS is not None:
        return _LAYER_CLASS
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_layer import TransformerLayer

    class Glm4TransformerLayer(TransformerLayer):
        """megatron's TransformerLayer with GLM4's post-attention and post-MLP RMSNorms."""

        def __init__(self, config, submodules, *args, **kwargs):
            super().__init__(config, submodules, *args, **kwargs)
            # the same norm implementation as the layer's pre-norms (local spec: torch RMSNorm)
            for name in ("post_self_attn_layernorm", "post_mlp_layernorm"):
                setattr(self, name, build_module(submodules.input_layernorm, config=self.config,
                                                 hidden_size=self.config.hidden_size,
                                                 eps=self.config.layernorm_epsilon))
            self.self_attn_bda = _normed_bda(self.self_attn_bda, self.post_self_attn_layernorm)
            self.mlp_bda = _normed_bda(self.mlp_bda, self.post_mlp_layernorm)

    _LAYER_CLASS = Glm4TransformerLayer
    return _LAYER_CLASS


class Glm4Adapter(DenseDecoderAdapter):
    model_types = ("glm4",)
    rotary_interleaved = True
    post_norms = True  # two more RMSNorms per layer (read by runtime.plan.memory)

    def qkv_bias(self, hf_config) -> bool:
        return bool(getattr(hf_config, "attention_bias", True))

    def layer_spec(self, hf_config):
        spec = super().layer_spec(hf_config)
        spec.module = glm4_transformer_layer_class()
        return spec

    # HF's gate_up_proj is already cat(gate, up) along the output dim: megatron's fc1 layout.
    def fc1_from_hf(self, take, hp):
        return take(hp + "mlp.gate_up_proj.weight")

    def fc1_to_hf(self, fc1, hp):
        return {hp + "mlp.gate_up_proj.weight": fc1}

    # GLM4's two extra norms, on each sublayer's output before the residual add.
    def layer_from_hf(self, take, hp, mp, hf_config):
        return {**super().layer_from_hf(take, hp, mp, hf_config),
                mp + "post_self_attn_layernorm.weight": take(hp + "post_self_attn_layernorm.weight"),
                mp + "post_mlp_layernorm.weight": take(hp + "post_mlp_layernorm.weight")}

    def layer_to_hf(self, take, hp, mp, hf_config, experts=None):
        return {**super().layer_to_hf(take, hp, mp, hf_config, experts),
                hp + "post_self_attn_layernorm.weight": take(mp + "post_self_attn_layernorm.weight"),
                hp + "post_mlp_layernorm.weight": take(mp + "post_mlp_layernorm.weight")}
