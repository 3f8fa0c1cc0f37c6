"""FP8 weights for the built-in engine's linear layers (``rollout.weights_dtype: fp8``): rowwise e4m3.

A weight [out, in] is stored as float8_e4m3fn with one fp32 scale per output row (its absolute max / 448), and
each matmul quantises its input the same way per token row, then multiplies the two e4m3 operands with both scale
vectors and writes the activation dtype (bf16 on a GPU): on a GPU runtime/kernels/fp8_matmul.py's kernel (the
weight's rows on the tensor cores' long side, for decode's few rows), elsewhere `scaled_product`. Why rowwise:
a row's scale applies once to its sum, in any kernel (and it is the scaling torch's sm90 ``_scaled_mm`` takes with a
bf16 output, and the mixture's grouped GEMM's); per-tensor scales let
one outlier row coarsen every other row of the matrix (and one outlier token every other token of a batch), and
128-block scales need the activation cut into 128-column blocks with their own scale layout, for accuracy a rowwise
scale already gives at these widths. Rowwise also makes a row's quantisation depend on that row only, so quantising
q, k and v (or gate and up) one by one into row ranges of the fused buffer gives the bits quantising the fused matrix
would: a weight sync quantises each tensor as it arrives, in place in static buffers (captured CUDA graphs stay
valid), and the same trainer weights give the same bits (a resumed run's engine runs what the uninterrupted one ran).
A mixture's experts run one grouped FP8 GEMM (``torch._scaled_grouped_mm``) on the same per-row quantised input.
A SwiGLU's down projection takes its input from runtime/kernels/swiglu_quant.py on a GPU: the activation and its
row quantisation in one pass (`fp8_swiglu_linear`).
(On an H200 at GLM-Z1-9B's shape the rollout ran 1.25x bf16 with those kernels, 1.005x on ``_scaled_mm``; a Triton
kernel that widened the e4m3 weight in registers and left the input unquantised ran 0.37-0.52x and was retired:
bench/README.md.)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.kernels.fp8_matmul import swapped_scaled_mm
from runtime.kernels.swiglu_quant import FP8_MAX, MIN_AMAX as _MIN_AMAX, swiglu_quant_rows
from runtime.rollout.decode_attention import triton_available

FP8 = torch.float8_e4m3fn
WEIGHTS_DTYPES = ("bf16", "fp8")


_CHUNK_ELEMENTS = 2**24  # rows quantised at a time: fp32 temporaries of <= 64 MiB each during a weight sync


def quantize_rows_into(w: torch.Tensor, into: torch.Tensor, scales: torch.Tensor) -> None:
    """Quantise ``w`` [out, in] (any float dtype) into ``into`` [out, in] e4m3 and ``scales`` [1, out] fp32, in place
    (rows a chunk at a time: a row's bits depend on that row only)."""
    step = max(_CHUNK_ELEMENTS // max(w.shape[1], 1), 1)
    with torch.no_grad():
        for r in range(0, w.shape[0], step):
            wf = w[r:r + step].to(device=into.device, dtype=torch.float32)
            s = wf.abs().amax(dim=1).clamp(min=_MIN_AMAX) / FP8_MAX
            into[r:r + step].copy_((wf / s[:, None]).clamp(-FP8_MAX, FP8_MAX))
            scales[:, r:r + step].copy_(s[None, :])


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 copy of ``w`` [out, in], its scales [1, out] fp32), new buffers on ``w``'s device."""
    into = torch.empty(w.shape, dtype=FP8, device=w.device)
    scales = torch.empty(1, w.shape[0], dtype=torch.float32, device=w.device)
    quantize_rows_into(w, into, scales)
    return into, scales


def quantize_activation_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 rows of ``x`` [..., k] as [n, k], their scales [n, 1] fp32): a scale per token row, on the way into an FP8
    matmul."""
    x2 = x.reshape(-1, x.shape[-1]).to(torch.float32)
    xs = x2.abs().amax(dim=-1, keepdim=True).clamp(min=_MIN_AMAX) / FP8_MAX
    return (x2 / xs).clamp(-FP8_MAX, FP8_MAX).to(FP8), xs


def fp8_linear(x: torch.Tensor, w8: torch.Tensor, w_scales: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` with ``w`` given rowwise-quantised (`quantize_rows`); ``x`` is quantised per token
    row on the way in. The output has ``x``'s dtype. The bias is added after the product (in the output dtype,
    as F.linear's epilogue does). On a GPU with Triton the product is runtime/kernels/fp8_matmul.py's (the weight's
    rows on the tensor cores' long side: decode's few rows), else `scaled_product`."""
    lead = x.shape[:-1]
    xq, xs = quantize_activation_rows(x)
    if x.is_cuda and triton_available():
        return _swapped_product(xq, xs, w8, w_scales, bias, x.dtype).reshape(*lead, w8.shape[0])
    out = scaled_product(xq, xs, w8, w_scales, x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, w8.shape[0])


def fp8_swiglu_linear(gu: torch.Tensor, ffn: int, w8: torch.Tensor, w_scales: torch.Tensor) -> torch.Tensor:
    """``fp8_linear(silu(g) * u, w8, w_scales)`` for ``gu`` [..., 2·ffn] (gate then up): the down projection of a
    SwiGLU MLP. On a GPU with Triton the activation and its quantisation are one kernel
    (runtime/kernels/swiglu_quant.py), into the FP8 product."""
    if gu.is_cuda and triton_available():
        lead = gu.shape[:-1]
        hq, hs = swiglu_quant_rows(gu.reshape(-1, 2 * ffn).contiguous(), ffn)
        return _swapped_product(hq, hs, w8, w_scales, None, gu.dtype).reshape(*lead, w8.shape[0])
    g, u = gu.split([ffn, ffn], dim=-1)
    return fp8_linear(F.silu(g) * u, w8, w_scales)


def _swapped_product(xq: torch.Tensor, xs: torch.Tensor, w8: torch.Tensor, w_scales: torch.Tensor,
                     bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """runtime/kernels/fp8_matmul.py's [m, n] product of ``xq`` [m, k] and ``w8`` [n, k], the scales in any shape of
    one row's or one token's (``xs`` m values, ``w_scales`` n)."""
    return swapped_scaled_mm(xq, xs.reshape(-1), w8.contiguous(), w_scales.reshape(-1), bias, dtype)


def scaled_product(xq: torch.Tensor, xs: torch.Tensor, w8: torch.Tensor, w_scales: torch.Tensor,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """``xq`` [m, k] · ``w8`` [n, k]ᵀ with their rowwise scales (``xs`` [m, 1], ``w_scales`` [1, n]), in
    ``out_dtype``: ``torch._scaled_mm`` on a GPU; on the CPU the same product in fp32 (torch before 2.13 has no
    rowwise-scaled CPU ``_scaled_mm``)."""
    if xq.is_cuda:
        return torch._scaled_mm(xq, w8.t(), scale_a=xs, scale_b=w_scales, out_dtype=out_dtype)
    return ((xq.float() @ w8.float().t()) * xs * w_scales).to(out_dtype)


def fp8_shape_reason(name: str, w: torch.Tensor) -> str | None:
    """None when ``_scaled_mm`` on a GPU takes this weight ([out, in], both multiples of 16), else why not."""
    out, inp = w.shape
    if out % 16 or inp % 16:
        return f"{name} is [{out}, {inp}]; FP8 matmuls need both sizes multiples of 16"
    return None


__all__ = ["FP8", "FP8_MAX", "WEIGHTS_DTYPES", "fp8_linear", "fp8_shape_reason", "fp8_swiglu_linear",
           "quantize_activation_rows",
           "quantize_rows", "quantize_rows_into", "scaled_product"]
