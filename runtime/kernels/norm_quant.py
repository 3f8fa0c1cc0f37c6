"""The FP8 engine's inputs to its attention and gate/up projections (``rollout.weights_dtype: fp8`` on a GPU): a row's
RMS norm (after an optional residual add, itself after an optional norm of what is added: GLM4's post-attention norm)
quantised per row to e4m3 with its scale, in one pass over the row.

Why a kernel of our own: compiled by Inductor, the norm and the quantisation are two or three chained reductions
over a 4,096-wide row, which Inductor (persistent only to 1,024 columns) makes a looped kernel walking the row once
per reduction: 4.5 µs a layer for GLM-Z1-9B's residual, post-attention norm, norm and quantisation at 32 rows on an
H200, 2.5 µs for the pre-attention norm and quantisation, 2.6 µs for the attention output's quantisation alone (the
profile in bench/README.md, fp8_rollout --profile). Here a program holds its row in registers and reads it once.

The arithmetic is the eager path's (decode_model's ``_rms``: fp32 inside, the normalised row rounded to the activation
dtype, then the weight's product rounded; the residual add rounded; then fp8_weights.quantize_activation_rows: the
row's absolute max in fp32 over 448, at least 1e-12 / 448, the division, the clamp, the round to nearest e4m3), with
the sums in another order. One program per row and the width alone fix that order: a row's bits do not depend on
which rows came with it.
"""
from __future__ import annotations

import torch

from runtime.kernels.swiglu_quant import FP8_MAX, MIN_AMAX, warps_for
from runtime.rollout.decode_attention import triton_available

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _rms(x, W, cols, inside, eps, WIDTH: tl.constexpr, DT: tl.constexpr):
        """decode_model._rms of an fp32 row: the normalised row rounded to DT, times the weight, rounded."""
        xn = (x * tl.rsqrt(tl.sum(x * x, axis=0) / WIDTH + eps)).to(DT).to(tl.float32)
        w = tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
        return (w * xn).to(DT).to(tl.float32)

    @triton.jit
    def _norm_quant_kernel(X, RES, PRE_W, W, H_OUT, XQ, XS, stride_x, stride_r, eps, WIDTH: tl.constexpr,
                           BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_PRE_NORM: tl.constexpr,
                           HAS_NORM: tl.constexpr, FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < WIDTH
        DT: tl.constexpr = X.dtype.element_ty
        x = tl.load(X + r * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
        if HAS_PRE_NORM:
            x = _rms(x, PRE_W, cols, inside, eps, WIDTH, DT)
        if HAS_RESIDUAL:  # the residual stream after the add: the caller's new hidden states
            x = (tl.load(RES + r * stride_r + cols, mask=inside, other=0.0).to(tl.float32) + x).to(DT)
            tl.store(H_OUT + r * WIDTH + cols, x, mask=inside)
            x = x.to(tl.float32)
        if HAS_NORM:
            x = _rms(x, W, cols, inside, eps, WIDTH, DT)
        s = tl.maximum(tl.max(tl.abs(x), axis=0), MIN_AMAX) / FP8_MAX
        tl.store(XQ + r * WIDTH + cols, tl.clamp(x / s, -FP8_MAX, FP8_MAX).to(XQ.dtype.element_ty), mask=inside)
        tl.store(XS + r, s)


def launch(x: torch.Tensor, residual: torch.Tensor | None, pre_w: torch.Tensor | None, w: torch.Tensor | None,
           eps: float, h_out: torch.Tensor, xq: torch.Tensor, xs: torch.Tensor) -> None:
    """Rows of ``x`` [rows, width]: normed by ``pre_w`` (if given), added to ``residual`` (if given; the sum into
    ``h_out``), normed by ``w`` (if given), divided by their scale into ``xq`` (e4m3; fp32 gives the values before
    their rounding to e4m3), the scales into ``xs`` [rows]."""
    rows, width = x.shape
    if not rows:
        return
    block = triton.next_power_of_2(width)
    _norm_quant_kernel[(rows,)](x, residual if residual is not None else x, pre_w if pre_w is not None else x,
                                w if w is not None else x, h_out, xq, xs, x.stride(0),
                                residual.stride(0) if residual is not None else 0, eps, WIDTH=width, BLOCK=block,
                                HAS_RESIDUAL=residual is not None, HAS_PRE_NORM=pre_w is not None,
                                HAS_NORM=w is not None, FP8_MAX=FP8_MAX, MIN_AMAX=MIN_AMAX,
                                num_warps=warps_for(block))


@torch.library.custom_op("grpoflow::norm_quant_rows", mutates_args=())
def norm_quant_rows(x: torch.Tensor, residual: torch.Tensor | None, pre_w: torch.Tensor | None,
                    w: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the hidden states after the residual add [rows, width] (empty without ``residual``), the e4m3 rows of the
    normed input [rows, width], their scales [rows] fp32): see `launch`. An op of its own to torch.compile (Inductor
    would otherwise fuse the norm into its own looped reduction)."""
    rows, width = x.shape
    h_out = torch.empty(rows if residual is not None else 0, width, dtype=x.dtype, device=x.device)
    xq = torch.empty(rows, width, dtype=torch.float8_e4m3fn, device=x.device)
    xs = torch.empty(rows, dtype=torch.float32, device=x.device)
    launch(x, residual, pre_w, w, eps, h_out, xq, xs)
    return h_out, xq, xs


@norm_quant_rows.register_fake
def _(x, residual, pre_w, w, eps):
    rows, width = x.shape
    return (x.new_empty(rows if residual is not None else 0, width), x.new_empty(rows, width, dtype=torch.float8_e4m3fn),
            x.new_empty(rows, dtype=torch.float32))


__all__ = ["launch", "norm_quant_rows"]
