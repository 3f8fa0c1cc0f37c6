"""The FP8 engine's SwiGLU into its down projection's input (``rollout.weights_dtype: fp8`` on a GPU): silu(gate) · up
quantised per row to e4m3 with its scale, in one pass over the gate/up projection's output.

Why a kernel of our own: compiled by Inductor, silu · up and the row's quantisation (an absolute max, then a
division) became a looped reduction, one program per row walking GLM-Z1-9B's 13,696 columns twice, a round trip to
memory per step of the loop: 10 µs a layer at 8 to 128 rows on an H200, 7 % of a 32-row decode step (the profile in
bench/README.md, fp8_rollout --profile). Here a program holds its whole row in registers: the gate and up halves are
read once, the activation and its absolute max come from them, and the e4m3 row and its scale are written.

The arithmetic is the eager path's (`fp8_weights.quantize_activation_rows(F.silu(g) * u)`): silu and the product each
rounded to the activation dtype, then the row's absolute max in fp32 over 448 (at least 1e-12 / 448), the division,
the clamp to ±448 and the round to nearest e4m3. One program per row and the row's width alone fix the reduction's
order: the same bits for a row whatever rows came with it.
"""
from __future__ import annotations

import torch

from runtime.rollout.decode_attention import triton_available

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
MIN_AMAX = 1e-12  # the floor on a row's absolute max (an all-zero row: zeros, no division by zero); fp8_weights' too

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _swiglu_quant_kernel(GU, HQ, HS, stride_gu, FFN: tl.constexpr, BLOCK: tl.constexpr,
                             FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < FFN
        g = tl.load(GU + r * stride_gu + cols, mask=inside, other=0.0).to(tl.float32)
        u = tl.load(GU + r * stride_gu + FFN + cols, mask=inside, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(GU.dtype.element_ty)  # F.silu, rounded as the eager op rounds it
        h = (act.to(tl.float32) * u).to(GU.dtype.element_ty).to(tl.float32)
        s = tl.maximum(tl.max(tl.abs(h), axis=0), MIN_AMAX) / FP8_MAX
        q = tl.clamp(h / s, -FP8_MAX, FP8_MAX)
        tl.store(HQ + r * FFN + cols, q.to(HQ.dtype.element_ty), mask=inside)
        tl.store(HS + r, s)


def warps_for(block: int) -> int:
    """A row of `block` columns over 4 to 16 warps: at most 32 columns a thread (the row stays in registers)."""
    return min(16, max(4, block // 1024))


def launch(gu: torch.Tensor, ffn: int, hq: torch.Tensor, hs: torch.Tensor) -> None:
    """silu(gate) · up of ``gu`` [rows, 2·ffn] divided by its row's scale into ``hq`` [rows, ffn] (e4m3; fp32 gives
    the values before their rounding to e4m3), the scales into ``hs`` [rows]."""
    if gu.shape[0]:
        block = triton.next_power_of_2(ffn)
        _swiglu_quant_kernel[(gu.shape[0],)](gu, hq, hs, gu.stride(0), FFN=ffn, BLOCK=block, FP8_MAX=FP8_MAX,
                                             MIN_AMAX=MIN_AMAX, num_warps=warps_for(block))


@torch.library.custom_op("grpoflow::swiglu_quant_rows", mutates_args=())
def swiglu_quant_rows(gu: torch.Tensor, ffn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``gu`` [rows, 2·ffn] (gate then up) -> (silu(gate) · up as e4m3 [rows, ffn], its scale per row [rows] fp32).
    An op of its own to torch.compile (Inductor would otherwise fuse the SwiGLU into its own reduction)."""
    hq = torch.empty(gu.shape[0], ffn, dtype=torch.float8_e4m3fn, device=gu.device)
    hs = torch.empty(gu.shape[0], dtype=torch.float32, device=gu.device)
    launch(gu, ffn, hq, hs)
    return hq, hs


@swiglu_quant_rows.register_fake
def _(gu, ffn):
    return (gu.new_empty(gu.shape[0], ffn, dtype=torch.float8_e4m3fn),
            gu.new_empty(gu.shape[0], dtype=torch.float32))


__all__ = ["FP8_MAX", "MIN_AMAX", "launch", "swiglu_quant_rows", "warps_for"]
