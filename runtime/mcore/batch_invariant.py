"""The trainer's model on the batch-invariant kernels the engine runs too (``rollout.true_on_policy``, issue 61).

Bound when the model is built (`runtime.mcore.env.build_gpt_model(batch_invariant=True)`), not a branch per call:
the core attention is :class:`BatchInvariantCoreAttention` (`common_attention` on each sequence: a micro-batch's
rows, or each sample of a packed one by ``cu_seqlens``), every ``torch.nn.RMSNorm`` is :class:`BatchInvariantRMSNorm`
every column/row-parallel linear's GEMM is `fixed_shape_mm` (`use_batch_invariant_linears`), and RoPE's table is
the host's (`use_host_rope_table`). TP 1 only (a TP 2
trainer sums partial products in another order than a TP 1 engine). The forward's bits are what must equal the
engine's (the attention on CUDA: the engine's Triton kernel, runtime/kernels/row_attention.py); the backward is
autograd through the same ops, the attention's a plain causal attention's (`batch_invariant.trainable_attention`).
"""
from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule

from runtime.kernels.batch_invariant import fixed_shape_mm, rms_norm, rope_inv_freq, trainable_attention


class BatchInvariantRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` whose forward is `batch_invariant.rms_norm` (the same rounding: fp32 inside, the weight
    in fp32, one cast): on CUDA the Triton kernel, one program per row; elsewhere rows in fixed blocks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps if self.eps is not None else torch.finfo(x.dtype).eps)


def use_batch_invariant_norms(model: torch.nn.Module) -> int:
    """Every ``torch.nn.RMSNorm`` of ``model`` (compiled or not) made :class:`BatchInvariantRMSNorm`, in place (only the
    class changes: parameters and state dict stay); returns how many."""
    n = 0
    for m in model.modules():
        if isinstance(m, torch.nn.RMSNorm) and m.elementwise_affine:
            m.__class__ = BatchInvariantRMSNorm
            n += 1
    return n


def use_host_rope_table(model: torch.nn.Module) -> None:
    """The model's RoPE inverse frequencies from `rope_inv_freq` (the engine's table), in place of the ones megatron
    computed on the GPU."""
    rot = getattr(model, "rotary_pos_emb", None)
    if rot is None or not hasattr(rot, "inv_freq"):
        raise ValueError("rollout.true_on_policy: this model has no rotary embedding table to align")
    rot.inv_freq = rope_inv_freq(model.rotary_base, 2 * rot.inv_freq.numel()).to(rot.inv_freq.device)
    rot.forward.cache_clear()  # megatron caches the angles per length


def _fixed_shape_linear(input, weight, bias=None, **_tp_arguments):
    """megatron's ``_forward_impl`` signature at TP 1 (no communication to do): `fixed_shape_mm`, bias after."""
    return fixed_shape_mm(input, weight, bias)


def use_batch_invariant_linears(model: torch.nn.Module) -> int:
    """Every column/row-parallel linear of ``model`` (the output layer included) computes by `fixed_shape_mm`."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    n = 0
    for m in model.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            m._forward_impl = _fixed_shape_linear
            n += 1
    return n


class BatchInvariantCoreAttention(MegatronModule):
    """Drop-in for the core attention (causal self-attention, no dropout): [s, b, h, d] in, [s, b, h*d] out, or
    packed (``thd``: [t, h, d] in, [t, h*d] out, ``cu_seqlens`` marking the samples); each sequence by
    `common_attention` (`trainable_attention`: SDPA's backward), K/V at their own (fewer) heads."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **_ignored):
        super().__init__(config=config)
        self.heads = config.num_attention_heads
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else self.head_dim ** -0.5

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        assert attention_bias is None
        if packed_seq_params is not None:
            cu = packed_seq_params.cu_seqlens_q.tolist()
            lens = [e - s for s, e in zip(cu[:-1], cu[1:])]  # split: autograd cats the grads
            out = torch.cat([trainable_attention(q, k, v, self.softmax_scale)
                             for q, k, v in zip(query.split(lens), key.split(lens), value.split(lens))])
            return out.reshape(query.shape[0], self.heads * self.head_dim)
        sq, b = query.shape[:2]
        out = torch.stack([trainable_attention(q, k, v, self.softmax_scale)  # unbind: autograd stacks the grads
                           for q, k, v in zip(query.unbind(1), key.unbind(1), value.unbind(1))], dim=1)
        return out.reshape(sq, b, self.heads * self.head_dim)


def with_batch_invariant_core_attention(spec):
    """The layer spec with its core attention (megatron's or :class:`runtime.mcore.env.SdpaCoreAttention`) replaced by
    :class:`BatchInvariantCoreAttention`."""
    import copy

    from megatron.core.transformer.spec_utils import ModuleSpec
    attn = getattr(getattr(spec, "submodules", None), "self_attention", None)
    if getattr(attn, "submodules", None) is None or getattr(attn.submodules, "core_attention", None) is None:
        raise ValueError("rollout.true_on_policy: this family's layer spec has no core attention to replace")
    spec = copy.deepcopy(spec)
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(module=BatchInvariantCoreAttention)
    return spec
