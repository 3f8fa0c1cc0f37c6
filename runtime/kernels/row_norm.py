"""The batch-invariant RMS norm of ``rollout.true_on_policy`` on CUDA: one Triton kernel for the engine's decode, its
prefill and the trainer's forward (issue 61).

One program per row, the whole row in one tile (the width padded to a power of two, masked): the sum of squares in
fp32 by one `tl.sum`, then `batch_invariant._rms_rows`'s rounding (fp32 inside, the weight multiplied in fp32, one
cast to the input's dtype). The tile, its warps and so the reduction's order follow the width alone (not the
addresses: see the kernel's note), and a program holds no other row, so a row's bits do not depend on how many rows
came with it: no blocks of `FIXED_ROWS` on CUDA (the PyTorch form's Python loop over them cost the trainer's q/k
norms, tokens x heads rows, thousands of launches a layer). The result is close to the PyTorch form (what the CPU runs) but not its bits: each side runs the same one.

The trainer trains through its norms: `row_rms_norm` with a gradient to take runs the kernel inside an autograd
Function whose backward is the PyTorch form's gradient, recomputed in fp32 from the saved input and weight (its bits
need match nothing); without one it is the kernel alone.
"""
from __future__ import annotations

import torch

from runtime.rollout.decode_attention import triton_available

if triton_available():
    import triton
    import triton.language as tl

    # Nothing of a call's addresses reaches the compiler: told a pointer is 16-byte aligned or a row stride a multiple
    # of 16, it gives each thread a vector of adjacent elements in place of one every 32, and the sum of squares then
    # adds them in another order (sm_90 PTX, bf16, widths 128 and 1024). An engine's slice of rows, megatron's
    # strided query and a weight inside a flat parameter buffer would each get a kernel of their own.
    @triton.jit(do_not_specialize=["stride_x", "stride_o"], do_not_specialize_on_alignment=["X", "W", "OUT"])
    def _row_rms_norm_kernel(X, W, OUT, stride_x, stride_o, eps, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < WIDTH
        x = tl.load(X + r * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / WIDTH + eps)
        tl.store(OUT + r * stride_o + cols, ((x * rstd) * w).to(OUT.dtype.element_ty), mask=inside)


def row_norm_fits(x: torch.Tensor) -> bool:
    """The kernel serves x: a CUDA tensor and Triton installed. Both sides ask this of the same model, so both take
    one path."""
    return x.is_cuda and triton_available()


def _warps(block: int) -> int:
    """Warps per program, a function of the tile alone (the reduction's order follows them): 1 for a head's 128."""
    return min(8, max(1, block // 256))


def _forward(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    rows, width = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(rows, width, dtype=x.dtype, device=x.device)
    if rows:
        block = triton.next_power_of_2(width)
        _row_rms_norm_kernel[(rows,)](x, w.contiguous(), out, x.stride(0), out.stride(0), float(eps),
                                      WIDTH=width, BLOCK=block, num_warps=_warps(block))
    return out


class _TrainableRowNorm(torch.autograd.Function):
    """The kernel's forward; the PyTorch form's gradient, recomputed in fp32 from the saved input and weight."""

    @staticmethod
    def forward(ctx, x, w, eps: float):
        ctx.save_for_backward(x, w)
        ctx.eps = eps
        return _forward(x, w, eps)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        xf, g = x.float(), grad.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + ctx.eps)
        x_hat = xf * rstd
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # rstd * (w g - x_hat mean(w g x_hat)) over each row
            wg = g * w.float()
            grad_x = (rstd * (wg - x_hat * (wg * x_hat).mean(-1, keepdim=True))).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = (g * x_hat).sum(0).to(w.dtype)
        return grad_x, grad_w, None


def row_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm of rows x [rows, width] (last dimension contiguous or not) with weight w [width]: one program per row.
    Through autograd only when a gradient is to be taken (no_grad and inference add nothing)."""
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return _TrainableRowNorm.apply(x, w, eps)
    return _forward(x, w, eps)


__all__ = ["row_norm_fits", "row_rms_norm"]
