"""Causal attention within each sample of a packed micro-batch on CUDA: q [t, h, d], k/v [t, hk, d] (hk divides
h), ``cu_*`` int32 sample offsets on the device; out [t, h, d]. One function per kernel, all with one signature
(:data:`KERNELS`), so the trainer picks one by name (``train.packed_attention``):

- ``flash2``: FlashAttention-2's variable-length kernels as torch ships them (``aten._flash_attention_*``).
- ``fa4``: FlashAttention's CuTe kernels (the ``flash-attn-4`` package: on Hopper the warp-specialised forward
  and backward of FA3's design), compiled on first use for each shape class; an optional install. On the H100
  at the recipe's packed micro-batches its forward + backward is about 2x FA2's
  (bench/results/varlen_attention_H100_2026-11-25_fa4.json).

cuDNN's ragged attention as torch 2.11 ships it (``aten._cudnn_attention_forward`` with ``cum_seq``) was tried
too: an illegal memory access on these shapes, so it is not offered.

No megatron import here: the benches time these kernels on machines without it."""
from __future__ import annotations

import torch

from runtime.errors import ConfigError


class _FlashVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale):
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng_state, unused)
        ctx.max_q, ctx.max_k, ctx.scale = max_q, max_k, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu_q, cu_k, rng_state, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out.contiguous(), q, k, v, out, lse, cu_q, cu_k, ctx.max_q, ctx.max_k, 0.0, True, rng_state,
            unused, scale=ctx.scale)
        return dq, dk, dv, None, None, None, None, None


def _prepared(q, k, v, cu_q, cu_k):
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    return q, k, v, cu_q.to(torch.int32), cu_k.to(torch.int32)


def flash2(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float) -> torch.Tensor:
    q, k, v, cu_q, cu_k = _prepared(q, k, v, cu_q, cu_k)
    return _FlashVarlen.apply(q, k, v, cu_q, cu_k, max_q, max_k, scale)


def fa4(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float) -> torch.Tensor:
    from flash_attn.cute import flash_attn_varlen_func
    q, k, v, cu_q, cu_k = _prepared(q, k, v, cu_q, cu_k)
    out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                                 max_seqlen_k=max_k, softmax_scale=scale, causal=True)
    return out[0] if isinstance(out, tuple) else out


KERNELS = {"flash2": flash2, "fa4": fa4}


def check_available(name: str) -> None:
    """A one-line error when the kernel ``train.packed_attention`` names cannot run in this process."""
    if name not in KERNELS:
        raise ConfigError(f"train.packed_attention={name!r}: choose one of {', '.join(KERNELS)}")
    if name == "fa4":
        try:
            import flash_attn.cute  # noqa: F401
        except ImportError as e:
            raise ConfigError(f"train.packed_attention=fa4 needs the flash-attn-4 package on the trainer's machine "
                              f"({type(e).__name__}: {e}); install it (pip install 'grpoflow[fa4]') or set "
                              f"train.packed_attention=flash2") from None
