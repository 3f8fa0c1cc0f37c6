"""Token log-probs (and entropy) through the output layer without materialising full-vocab logits.

`linear_logprobs(hidden, weight, targets, temperature)` returns log_softmax(hidden @ weight.T /
temperature)[target] per row, computing the [rows, vocab] logits a chunk of rows at a time in the
forward and again in the backward (no [tokens x 152k] fp32 tensor is kept for autograd). The
arithmetic is the one the plain path does: the matmul in the weight's dtype (bf16 on GPU), then
fp32 for the division by the temperature, the log-sum-exp and the gather; the gradient w.r.t. the
logits is cast back to the weight's dtype for the two backward matmuls, as autograd would.

Only tensor-parallel size 1: the trainer keeps megatron's vocab-parallel cross-entropy under TP.
"""
from __future__ import annotations

import torch

from runtime.kernels import batch_invariant as bi


def _fwd_math(zb: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool):
    """From the chunk's logits (matmul dtype) to (logp, lse, entropy|None), all fp32."""
    z = zb.to(torch.float32) / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    ent = None
    if with_entropy:
        ent = lse - (torch.exp(z - lse[:, None]) * z).sum(-1)
    return logp, lse, ent


def _bwd_math(zb, targets, lse, g, ge, ent, temperature: float, out_dtype: torch.dtype):
    """d(loss)/d(logits) of the chunk, in the matmul dtype: (onehot - p) g - ge p (z - lse + H), over T."""
    z = zb.to(torch.float32) / temperature
    p = torch.exp(z - lse[:, None])
    onehot = (torch.arange(z.shape[-1], device=z.device)[None, :] == targets[:, None]).to(torch.float32)
    dz = (onehot - p) * g[:, None]
    if ge is not None:
        dz = dz - (ge[:, None] * p) * (z - lse[:, None] + ent[:, None])
    return (dz / temperature).to(out_dtype)


_FNS: dict[str, object] = {}


def _fns(device: torch.device):
    """(forward math, backward math): torch.compile'd on CUDA (one fused pass over the chunk's logits
    instead of ~10 fp32 passes), eager elsewhere or with GRPOFLOW_COMPILE_LOGPROBS=0."""
    import os
    if device.type != "cuda" or os.environ.get("GRPOFLOW_COMPILE_LOGPROBS", "1") in ("0", "false", ""):
        return _fwd_math, _bwd_math
    if "fwd" not in _FNS:
        try:
            _FNS["fwd"] = torch.compile(_fwd_math, dynamic=True)
            _FNS["bwd"] = torch.compile(_bwd_math, dynamic=True)
        except Exception:  # noqa: BLE001 - no compiler: eager is the same math
            _FNS["fwd"], _FNS["bwd"] = _fwd_math, _bwd_math
    return _FNS["fwd"], _FNS["bwd"]


def _call(fn_compiled, fn_eager, *args):
    if fn_compiled is fn_eager:
        return fn_eager(*args)
    try:
        return fn_compiled(*args)
    except Exception:  # noqa: BLE001 - a compiler failure at first call: fall back for good
        _FNS["fwd"], _FNS["bwd"] = _fwd_math, _bwd_math
        return fn_eager(*args)


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int, with_entropy: bool,
                batch_invariant: bool = False):
        n = hidden.shape[0]
        fwd, _ = _fns(hidden.device)
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse_all = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(n, dtype=torch.float32, device=hidden.device) if with_entropy else None
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            if batch_invariant:  # the engine's: GEMM and log-softmax on rows in fixed blocks (the backward as it is)
                zb = bi.fixed_shape_mm(hidden[s:e], weight)
                lp, lse, en = bi.token_logprobs(zb, targets[s:e], temperature, with_entropy)
            else:
                zb = hidden[s:e] @ weight.t()
                lp, lse, en = _call(fwd, _fwd_math, zb, targets[s:e], temperature, with_entropy)
            logp[s:e], lse_all[s:e] = lp, lse
            if with_entropy:
                ent[s:e] = en
            del zb
        ctx.save_for_backward(hidden, weight, targets, lse_all, ent if with_entropy else lse_all)
        ctx.temperature, ctx.chunk, ctx.with_entropy = temperature, chunk, with_entropy
        if ent is None:
            ent = torch.zeros(0, device=hidden.device)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, targets, lse_all, ent = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        use_ent = ctx.with_entropy and g_ent is not None and g_ent.numel() > 0
        n = hidden.shape[0]
        _, bwd = _fns(hidden.device)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        if g_logp is None:
            g_logp = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            h = hidden[s:e]
            zb = h @ weight.t()
            dz = _call(bwd, _bwd_math, zb, targets[s:e], lse_all[s:e], g_logp[s:e].to(torch.float32),
                       g_ent[s:e].to(torch.float32) if use_ent else None, ent[s:e] if use_ent else None, t,
                       weight.dtype)
            del zb
            if need_h:
                grad_h[s:e] = dz @ weight
            if need_w:
                grad_w += (dz.t() @ h).to(torch.float32)
            del dz
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None, None, None


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                    *, chunk: int = 2048, with_entropy: bool = False, batch_invariant: bool = False):
    """hidden [n, H] (any float dtype), weight [V, H], targets [n] -> (logp [n] fp32, entropy [n] fp32 or None).

    The entropy (of softmax(logits / temperature)) is differentiable too; detach it when it is only a metric.
    ``batch_invariant`` (``rollout.true_on_policy``): the forward by runtime/kernels/batch_invariant.py, as the
    engine computes its sampled tokens' log-probs.
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be [n, H] and targets [n], got {tuple(hidden.shape)} and {tuple(targets.shape)}")
    logp, ent = _LinearLogprobs.apply(hidden, weight, targets, float(temperature), int(chunk), bool(with_entropy),
                                      bool(batch_invariant))
    return logp, (ent if with_entropy else None)


__all__ = ["linear_logprobs"]
