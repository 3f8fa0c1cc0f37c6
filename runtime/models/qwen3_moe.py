"""Qwen3-MoE models (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention with a mixture of experts in place of
every layer's MLP.

The router (HF ``mlp.gate``, megatron ``mlp.router``) is a bias-free linear to ``num_experts`` logits; a token
goes to the ``num_experts_per_tok`` experts of highest softmax probability, weighted by those probabilities,
renormalised to sum to 1 when ``norm_topk_prob``. Megatron's router gives the same weights: softmax before the
top-k (``moe_router_pre_softmax``) without the renormalisation, and with it a softmax over the top-k logits,
which is the renormalised top-k probabilities. Its softmax runs in fp32 (``moe_router_dtype``), as HF's does.

Each expert is a SwiGLU MLP of ``moe_intermediate_size``. The hub's checkpoints store them one by one
(``mlp.experts.{e}.gate_proj/up_proj/down_proj``), which is what the export writes; transformers 5 holds them
fused in memory (``mlp.experts.gate_up_proj`` [E, 2F, H], ``down_proj`` [E, H, F]), which the import also reads.
Megatron's experts (``SequentialMLP``, no Transformer Engine) are ``mlp.experts.local_experts.{e}.linear_fc1``
(cat(gate, up)) and ``linear_fc2``.

The load-balancing loss is megatron's ``aux_loss`` (switch-transformer form, per MoE layer) with
``router_aux_loss_coef``; the router z-loss is ``train.router_z_loss_coef`` (ours, off by default). Dense layers
between MoE layers (``decoder_sparse_step`` > 1, ``mlp_only_layers``; no released Qwen3-MoE has them) are refused.
"""
from __future__ import annotations

from typing import Any

import torch

from runtime.errors import ModelError
from runtime.models.qwen3 import Qwen3Adapter


def moe_shape(hf_config) -> tuple[int, int, int]:
    """(experts, experts per token, expert ffn size) of a Qwen3-MoE config."""
    return (int(hf_config.num_experts), int(hf_config.num_experts_per_tok),
            int(hf_config.moe_intermediate_size))


class Qwen3MoeAdapter(Qwen3Adapter):
    model_types = ("qwen3_moe",)
    is_moe = True  # read by the trainer (router losses) and the plan

    def check_supported(self, hf_config) -> None:
        super().check_supported(hf_config)
        step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
        dense = list(getattr(hf_config, "mlp_only_layers", None) or [])
        if step != 1 or dense:
            raise ModelError(
                f"config.json: decoder_sparse_step={step}, mlp_only_layers={dense}: dense MLP layers between the "
                f"MoE layers are not supported for qwen3_moe; only decoder_sparse_step=1 and mlp_only_layers=[]")
        experts, topk, _ = moe_shape(hf_config)
        if not 1 <= topk <= experts:
            raise ModelError(f"config.json: num_experts_per_tok={topk} must be between 1 and num_experts={experts}")

    def transformer_config_kwargs(self, hf_config) -> dict[str, Any]:
        kwargs = super().transformer_config_kwargs(hf_config)
        experts, topk, ffn = moe_shape(hf_config)
        coef = float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0)
        kwargs.update(
            num_moe_experts=experts,
            moe_ffn_hidden_size=ffn,
            moe_router_topk=topk,
            moe_router_score_function="softmax",
            moe_router_pre_softmax=not bool(hf_config.norm_topk_prob),
            moe_router_dtype="fp32",
            moe_router_load_balancing_type="aux_loss" if coef > 0 else "none",
            moe_aux_loss_coeff=coef,
            moe_token_dispatcher_type="allgather",  # alltoall makes a CUDA stream at build: not on the CPU
            moe_grouped_gemm=False,
        )
        return kwargs

    def layer_spec(self, hf_config):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        experts, _, _ = moe_shape(hf_config)
        return get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, qk_layernorm=True,
                                        normalization="RMSNorm")

    def mlp_from_hf(self, take, hp, mp, hf_config):
        experts, _, ffn = moe_shape(hf_config)
        out = {mp + "mlp.router.weight": take(hp + "mlp.gate.weight")}
        fused = hp + "mlp.experts.gate_up_proj"
        if take.has(fused):  # transformers 5's in-memory layout: gate_up_proj[e] is cat(gate, up) already
            gate_up, down = take(fused), take(hp + "mlp.experts.down_proj")
            if gate_up.shape[0] != experts or gate_up.shape[1] != 2 * ffn:
                raise ModelError(f"{fused} has shape {tuple(gate_up.shape)}, not ({experts}, {2 * ffn}, hidden): "
                                 f"check num_experts and moe_intermediate_size in config.json")
        for e in range(experts):
            ep, me = f"{hp}mlp.experts.{e}.", f"{mp}mlp.experts.local_experts.{e}."
            if take.has(fused):
                out[me + "linear_fc1.weight"] = gate_up[e]
                out[me + "linear_fc2.weight"] = down[e]
            else:
                out[me + "linear_fc1.weight"] = torch.cat([take(ep + "gate_proj.weight"),
                                                           take(ep + "up_proj.weight")], dim=0)
                out[me + "linear_fc2.weight"] = take(ep + "down_proj.weight")
        return out

    def mlp_to_hf(self, take, hp, mp, hf_config, experts=None):
        n, _, _ = moe_shape(hf_config)
        out = {hp + "mlp.gate.weight": take(mp + "mlp.router.weight")}
        for e in range(n) if experts is None else experts:
            ep, me = f"{hp}mlp.experts.{e}.", f"{mp}mlp.experts.local_experts.{e}."
            gate, up = torch.chunk(take(me + "linear_fc1.weight"), 2, dim=0)
            out[ep + "gate_proj.weight"] = gate.contiguous()
            out[ep + "up_proj.weight"] = up.contiguous()
            out[ep + "down_proj.weight"] = take(me + "linear_fc2.weight")
        return out
