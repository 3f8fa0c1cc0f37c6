"""The built-in engine's FP8-weight linear (``rollout.weights_dtype: fp8``): e4m3 weights, activations left as they are.

Why not ``torch._scaled_mm``: a decode step's few rows (8 to a few hundred) make its linears bound by the weight
bytes they read, and at those rows cuBLASLt's rowwise FP8 kernels ran at the bf16 GEMM's time, not at half its bytes,
after a quantisation of the activation per call (bench/README.md, fp8_rollout on an H200: 1.007x the bf16 rollout at
GLM-Z1-9B's shape). Here a program reads a tile of the e4m3 weight, widens it to the activation's dtype in registers
and runs the tensor cores' bf16 (or fp16) dot with fp32 accumulation; each output row's fp32 scale is applied once to
the sum. The activation is never quantised, so the weight's rounding is the only error the setting adds.

Deterministic for a given shape (a resumed run's engine gives the bits the unbroken one gave): the tiles are a
function of (rows, out, in, the device's SM count), and when a split of the inner dimension is needed to fill the SMs
(few output tiles: the 0.6B's o and down projections) the splits write fp32 partial sums that a second kernel adds
in split order. No atomics, no timing-based autotuning.

The CPU (and a CUDA build without Triton) runs the same arithmetic in PyTorch: the product in fp32, the row scale,
one cast, then the bias in the activation's dtype.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from runtime.rollout.decode_attention import triton_available

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _w8_matmul_kernel(X, W, S, BIAS, OUT, PART, M, N, K, K_PER_SPLIT, stride_x, stride_o,
                          HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_in, n_in = rm < M, rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_lo = pid_k * K_PER_SPLIT
        k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:  # no mask along the contiguous dimension: the weight's bytes load as wide vectors
                x = tl.load(X + rm[:, None].to(tl.int64) * stride_x + rk[None, :], mask=m_in[:, None], other=0.0)
                w = tl.load(W + rn[:, None].to(tl.int64) * K + rk[None, :], mask=n_in[:, None], other=0.0)
            else:
                k_in = rk < K
                x = tl.load(X + rm[:, None].to(tl.int64) * stride_x + rk[None, :],
                            mask=m_in[:, None] & k_in[None, :], other=0.0)
                w = tl.load(W + rn[:, None].to(tl.int64) * K + rk[None, :], mask=n_in[:, None] & k_in[None, :],
                            other=0.0)
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
        if SPLIT == 1:
            out = (acc * tl.load(S + rn, mask=n_in, other=0.0)[None, :]).to(OUT.dtype.element_ty)
            if HAS_BIAS:  # F.linear's epilogue in the output dtype: the sum in fp32, rounded once
                b = tl.load(BIAS + rn, mask=n_in, other=0.0)
                out = (out.to(tl.float32) + b.to(tl.float32)[None, :]).to(OUT.dtype.element_ty)
            tl.store(OUT + rm[:, None].to(tl.int64) * stride_o + rn[None, :], out, mask=m_in[:, None] & n_in[None, :])
        else:
            tl.store(PART + (pid_k * M + rm[:, None]).to(tl.int64) * N + rn[None, :], acc,
                     mask=m_in[:, None] & n_in[None, :])

    @triton.jit
    def _split_sum_kernel(PART, S, BIAS, OUT, M, N, stride_o, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                          BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = i < M * N
        m, n = i // N, i % N
        acc = tl.load(PART + i, mask=inside, other=0.0)
        for s in tl.static_range(1, SPLIT):  # in split order: the same bits every call
            acc += tl.load(PART + s * M * N + i, mask=inside, other=0.0)
        out = (acc * tl.load(S + n, mask=inside, other=0.0)).to(OUT.dtype.element_ty)
        if HAS_BIAS:
            b = tl.load(BIAS + n, mask=inside, other=0.0)
            out = (out.to(tl.float32) + b.to(tl.float32)).to(OUT.dtype.element_ty)
        tl.store(OUT + m * stride_o + n, out, mask=inside)


# (rows up to, BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): decode's rows read a wide K slab per weight tile (the bytes
# are the cost); from 128 rows on the tile is a square of the tensor cores' usual shape (the FLOPs start to count).
TILES = ((16, 16, 64, 128, 4, 4), (32, 32, 64, 128, 4, 4), (64, 64, 64, 128, 4, 3), (128, 64, 128, 64, 4, 4),
         (None, 128, 128, 64, 8, 3))
MAX_SPLIT = 8
MIN_K_PER_SPLIT = 512  # a split's share of the inner dimension: at least this many columns


def tiles_for(m: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of a call with ``m`` rows."""
    return next(t[1:] for t in TILES if t[0] is None or m <= t[0])


def split_for(m: int, n: int, k: int, sms: int) -> int:
    """How many slices the inner dimension is cut into: doubled until the programs reach 90 % of the SMs (one wave,
    not two), while each slice keeps at least MIN_K_PER_SPLIT columns."""
    bm, bn = tiles_for(m)[:2]
    programs = _cdiv(m, bm) * _cdiv(n, bn)
    split = 1
    while split < MAX_SPLIT and programs * split < 0.9 * sms and k // (2 * split) >= MIN_K_PER_SPLIT:
        split *= 2
    return split


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def kernel_serves(x: torch.Tensor) -> bool:
    """The Triton kernel runs this call: a CUDA activation in bf16 or fp16, and Triton installed."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and triton_available()


def w8_linear(x: torch.Tensor, w8: torch.Tensor, w_scales: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` for ``w`` [out, in] given as e4m3 ``w8`` with one fp32 scale per output row
    (``w_scales`` [1, out]); the output in ``x``'s dtype."""
    lead, k = x.shape[:-1], x.shape[-1]
    n = w8.shape[0]
    if not kernel_serves(x):
        out = (F.linear(x.reshape(-1, k).float(), w8.float()) * w_scales).to(x.dtype)
        if bias is not None:
            out = out + bias
        return out.reshape(*lead, n)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if w8.stride() != (k, 1):  # the kernel walks the weight's rows k apart (the engine's buffers are laid out so)
        w8 = w8.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*lead, n)
    launch_w8_linear(x2, w8, w_scales.reshape(-1), bias, out, _sm_count(x.device.index or 0))
    return out.reshape(*lead, n)


def launch_w8_linear(x2: torch.Tensor, w8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                     out: torch.Tensor, sms: int) -> None:
    """The kernel(s) on ``x2`` [m, k] (unit column stride) into ``out`` [m, n]; ``sms`` picks the split."""
    (m, k), n = x2.shape, w8.shape[0]
    launch_tiled(x2, w8, scales, bias, out, tiles_for(m), split_for(m, n, k, sms))


def launch_tiled(x2: torch.Tensor, w8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 out: torch.Tensor, tiles: tuple[int, int, int, int, int], split: int,
                 even_k: bool | None = None) -> None:
    """launch_w8_linear with the tiles (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) and split given (the tile bench;
    ``even_k=False`` keeps the inner dimension's mask where it is not needed)."""
    (m, k), n = x2.shape, w8.shape[0]
    bm, bn, bk, warps, stages = tiles
    k_per_split = _cdiv(_cdiv(k, split), bk) * bk  # whole K blocks: a block never straddles two splits
    part = torch.empty(split, m, n, dtype=torch.float32, device=x2.device) if split > 1 else out
    b = bias if bias is not None else scales  # a pointer the kernel never reads
    _w8_matmul_kernel[(_cdiv(n, bn), _cdiv(m, bm), split)](
        x2, w8, scales, b, out, part, m, n, k, k_per_split, x2.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, SPLIT=split, EVEN_K=k % bk == 0 if even_k is None else even_k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
        num_stages=stages)
    if split > 1:
        block = 1024
        _split_sum_kernel[(_cdiv(m * n, block),)](part, scales, b, out, m, n, out.stride(0),
                                                   HAS_BIAS=bias is not None, SPLIT=split, BLOCK=block)


__all__ = ["kernel_serves", "launch_tiled", "launch_w8_linear", "split_for", "tiles_for", "w8_linear"]
