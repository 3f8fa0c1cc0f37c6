"""The built-in engine's FP8 linear at a decode step's few rows (``rollout.weights_dtype: fp8``): e4m3 weight and input,
the product computed as (W · xᵀ)ᵀ.

Why not ``torch._scaled_mm`` as ``x · Wᵀ``: at decode's 8 to 128 rows the tensor cores' tile (64 or 128 rows on
sm90) is mostly empty along the tokens, and cuBLASLt's rowwise FP8 kernels at those rows ran at the bf16 GEMM's time,
not at half its bytes (bench/README.md, fp8_rollout on an H200: 1.007x the bf16 rollout at GLM-Z1-9B's shape).
Here the weight's output rows sit on the tile's long side and the tokens on its short one (16 to 128 wide), the
tiles are sized for streaming the weight (bench/fp8_matmul.py's sweep), and the inner dimension is split across
programs when the weight has too few output tiles to fill the SMs (an o or down projection). (cuBLASLt given the
operands swapped was no faster: the gain is the tiles and the split, not the orientation alone.) Both operands are
e4m3, so the tensor cores read them as they are: nothing is widened in registers (the retired weight-only kernel's
cost). On an H200 one GLM-Z1-9B layer's projections take 0.067 ms at 8 rows against bf16's 0.113 (the e4m3 bytes'
floor: 0.043).

Deterministic for a given shape (a resumed run's engine gives the bits the unbroken one gave): the tiles and the
split are a function of (rows, out, in, the device's SM count), and a split's programs write fp32 partial sums that
a second kernel adds in split order. No atomics, no timing-based autotuning.
"""
from __future__ import annotations

import functools

import torch

from runtime.rollout.decode_attention import triton_available

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _swapped_kernel(XQ, XS, W, WS, BIAS, OUT, PART, M, N, K, K_PER_SPLIT, stride_o,
                        HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        n_in, m_in = rn < N, rm < M
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        k_lo = pid_k * K_PER_SPLIT
        k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:  # whole blocks along the contiguous dimension: wide vector loads
                w = tl.load(W + rn[:, None].to(tl.int64) * K + rk[None, :], mask=n_in[:, None], other=0.0)
                x = tl.load(XQ + rm[:, None].to(tl.int64) * K + rk[None, :], mask=m_in[:, None], other=0.0)
            else:
                k_in = rk < k_hi
                w = tl.load(W + rn[:, None].to(tl.int64) * K + rk[None, :], mask=n_in[:, None] & k_in[None, :],
                            other=0.0)
                x = tl.load(XQ + rm[:, None].to(tl.int64) * K + rk[None, :], mask=m_in[:, None] & k_in[None, :],
                            other=0.0)
            acc = tl.dot(w, tl.trans(x), acc)
        if SPLIT == 1:
            ws = tl.load(WS + rn, mask=n_in, other=0.0)
            xs = tl.load(XS + rm, mask=m_in, other=0.0)
            out = (acc * ws[:, None] * xs[None, :]).to(OUT.dtype.element_ty)
            if HAS_BIAS:  # F.linear's epilogue in the output dtype: the product rounded, then the bias added
                b = tl.load(BIAS + rn, mask=n_in, other=0.0)
                out = (out.to(tl.float32) + b.to(tl.float32)[:, None]).to(OUT.dtype.element_ty)
            tl.store(OUT + rm[None, :].to(tl.int64) * stride_o + rn[:, None], out, mask=n_in[:, None] & m_in[None, :])
        else:
            tl.store(PART + (pid_k * M + rm[None, :]).to(tl.int64) * N + rn[:, None], acc,
                     mask=n_in[:, None] & m_in[None, :])

    @triton.jit
    def _split_sum_kernel(PART, XS, WS, BIAS, OUT, M, N, stride_o, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                          BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = i < M * N
        m, n = i // N, i % N
        acc = tl.load(PART + i, mask=inside, other=0.0)
        for s in tl.static_range(1, SPLIT):  # in split order: the same bits every call
            acc += tl.load(PART + s * M * N + i, mask=inside, other=0.0)
        ws = tl.load(WS + n, mask=inside, other=0.0)
        xs = tl.load(XS + m, mask=inside, other=0.0)
        out = (acc * ws * xs).to(OUT.dtype.element_ty)
        if HAS_BIAS:
            b = tl.load(BIAS + n, mask=inside, other=0.0)
            out = (out.to(tl.float32) + b.to(tl.float32)).to(OUT.dtype.element_ty)
        tl.store(OUT + m * stride_o + n, out, mask=inside)


MAX_SPLIT = 16
MIN_K_PER_SPLIT = 512


def tiles_for(rows: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_M, BLOCK_K, warps, stages) for a call of ``rows`` tokens: the tokens' side is the smallest
    tensor-core width over them (16 to 128); to 32 rows a weight tile of 64 rows x 256 bytes a stage, from 64 rows
    128 bytes a stage and more stages, 128 weight rows from 128 tokens (the sweep in bench/fp8_matmul.py, H200)."""
    bm = 16
    while bm < min(rows, 128):
        bm *= 2
    if bm <= 32:
        return 64, bm, 256, 4, 4
    return (64 if bm == 64 else 128), bm, 128, 4, 5


def split_for(rows: int, out: int, inner: int, block_n: int, block_m: int, block_k: int, sms: int) -> int:
    """How many programs share a tile's inner dimension: doubled while the tiles fill under 90 % of the SMs and each
    part keeps at least `MIN_K_PER_SPLIT` of it."""
    programs = -(-out // block_n) * -(-rows // block_m)
    split = 1
    while (split < MAX_SPLIT and programs * split < 0.9 * sms
           and -(-inner // (2 * split)) >= max(MIN_K_PER_SPLIT, block_k)):
        split *= 2
    return split


@functools.lru_cache(maxsize=None)
def _sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def launch(xq: torch.Tensor, xs: torch.Tensor, w8: torch.Tensor, ws: torch.Tensor, bias: torch.Tensor | None,
           out: torch.Tensor, tiles: tuple[int, int, int, int, int], split: int) -> None:
    """``out`` [m, n] = (xq [m, k] · w8 [n, k]ᵀ) · xs [m] · ws [n] (+ bias), with the given tiles and split."""
    m, k = xq.shape
    n = w8.shape[0]
    bn, bm, bk, warps, stages = tiles
    k_per_split = -(-(-(-k // bk)) // split) * bk  # whole blocks per split
    part = torch.empty(split, m, n, dtype=torch.float32, device=xq.device) if split > 1 else out
    grid = (-(-m // bm), -(-n // bn), split)  # the token tiles of a weight tile launch together: one read of it
    _swapped_kernel[grid](xq, xs, w8, ws, bias if bias is not None else ws, out, part, m, n, k, k_per_split,
                          out.stride(0), HAS_BIAS=bias is not None and split == 1, SPLIT=split,
                          EVEN_K=k % bk == 0, BLOCK_N=bn, BLOCK_M=bm, BLOCK_K=bk,
                          num_warps=warps, num_stages=stages)
    if split > 1:
        block = 1024
        _split_sum_kernel[(-(-(m * n) // block),)](part, xs, ws, bias if bias is not None else ws, out, m, n,
                                                    out.stride(0), HAS_BIAS=bias is not None, SPLIT=split,
                                                    BLOCK=block)


@torch.library.custom_op("grpoflow::fp8_swapped_mm", mutates_args=())
def swapped_scaled_mm(xq: torch.Tensor, xs: torch.Tensor, w8: torch.Tensor, ws: torch.Tensor,
                      bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """[m, n] in ``out_dtype``: ``xq`` [m, k] e4m3 with ``xs`` [m] fp32, ``w8`` [n, k] e4m3 with ``ws`` [n] fp32.
    An op of its own to torch.compile: the tiles and split are picked from the call's concrete rows (no guards on
    a dynamic batch, no recompiles per row class), and a captured CUDA graph replays the kernels they launched."""
    m, k = xq.shape
    n = w8.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    tiles = tiles_for(m)
    sms = _sms(xq.device.index or 0) if xq.is_cuda else 132  # Triton's CPU interpreter (tests): an H100's count
    launch(xq, xs, w8, ws, bias, out, tiles, split_for(m, n, k, *tiles[:3], sms))
    return out


@swapped_scaled_mm.register_fake
def _(xq, xs, w8, ws, bias, out_dtype):
    return xq.new_empty(xq.shape[0], w8.shape[0], dtype=out_dtype)


__all__ = ["launch", "split_for", "swapped_scaled_mm", "tiles_for"]
