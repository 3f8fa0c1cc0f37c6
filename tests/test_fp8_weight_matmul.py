"""The FP8-weight linear of the built-in engine (runtime/kernels/fp8_weight_matmul.py): e4m3 weights widened in the
kernel, the activation as it is, fp32 sums, a scale per output row.

On the CPU by Triton's interpreter in a child process (it decides at import time), in fp16 (its bf16 dot is wrong);
the sm_90 build of every tile by Triton's compiler; the kernel on a GPU where there is one."""
from __future__ import annotations

import pytest

from tests.triton_checks import has_nvidia_backend, interpreter_reads_loop_bounds, run_interpreted


def _case(m, n, k, dtype, device, seed=0, bias=True):
    import torch

    from runtime.rollout.fp8_weights import quantize_rows
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 1, n)[:, None]  # rows of every scale
    w8, s = quantize_rows(w)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = (torch.randn(n, generator=g) * 0.1).to(dtype) if bias else None
    return (x.to(device), w8.to(device), s.to(device), None if b is None else b.to(device))


def _reference(x, w8, s, b):
    """The arithmetic the kernel promises: the product of the widened weight in fp32, the row scale, one cast, then
    the bias in the output dtype."""
    out = ((x.float() @ w8.float().t()) * s).to(x.dtype)
    return out if b is None else out + b


def _check_interpreted() -> None:
    import torch

    from runtime.kernels import fp8_weight_matmul as mm
    mm.MIN_K_PER_SPLIT = 64  # splits on a short inner dimension
    for m, n, k, sms in ((1, 48, 200, 1), (5, 96, 300, 1000), (20, 70, 256, 1), (40, 130, 520, 1000),
                         (70, 64, 128, 1), (130, 40, 192, 1000)):
        x, w8, s, b = _case(m, n, k, torch.float16, "cpu", seed=m)
        split = mm.split_for(m, n, k, sms)
        assert (split > 1) == (sms == 1000), (m, n, k, split)
        for bias in (b, None):
            out = torch.empty(m, n, dtype=torch.float16)
            mm.launch_w8_linear(x, w8, s.reshape(-1), bias, out, sms)
            ref = _reference(x, w8, s, bias)
            err = ((out.float() - ref.float()).abs() / (ref.float().abs() + 1e-2)).max().item()
            assert err < 4e-3, (m, n, k, split, err)
            again = torch.empty_like(out)
            mm.launch_w8_linear(x, w8, s.reshape(-1), bias, again, sms)
            assert torch.equal(out, again)
    # a strided activation (a slice of a wider buffer's columns keeps unit column stride, its own row stride)
    x, w8, s, b = _case(9, 48, 100, torch.float16, "cpu")
    wide = torch.zeros(9, 160, dtype=torch.float16)
    wide[:, 30:130] = x
    out = torch.empty(9, 48, dtype=torch.float16)
    mm.launch_w8_linear(wide[:, 30:130], w8, s.reshape(-1), b, out, 1)
    ref = torch.empty_like(out)
    mm.launch_w8_linear(x, w8, s.reshape(-1), b, ref, 1)
    assert torch.equal(out, ref)


@pytest.mark.skipif(not interpreter_reads_loop_bounds(), reason="Triton < 3.7: its interpreter cannot run the kernel")
def test_the_kernel_gives_the_widened_weights_product_with_and_without_a_split():
    run_interpreted(__file__, timeout=600)


if __name__ == "__main__":  # run_interpreted's child (the repository root on its path)
    _check_interpreted()


def test_the_inner_dimension_splits_only_where_output_tiles_leave_sms_idle():
    from runtime.kernels.fp8_weight_matmul import split_for
    # GLM-Z1-9B on 132 SMs: gate/up (27,392 rows) fills them whole; o and down (4,096) at 16 rows are 64 tiles: 2
    # splits; the 0.6B's o (1,024 out, 2,048 in) 16 tiles: 4 splits of 512; a prefill's 4,096 rows never split
    assert split_for(16, 27392, 4096, 132) == 1
    assert split_for(16, 4096, 4096, 132) == 2 and split_for(16, 4096, 13696, 132) == 2
    assert split_for(16, 1024, 2048, 132) == 4
    assert split_for(4096, 1024, 4096, 132) == 1


@pytest.mark.skipif(not has_nvidia_backend(), reason="Triton without its NVIDIA backend")
def test_every_tile_compiles_for_sm90_to_tensor_core_dots_on_widened_weights():
    """No GPU needed: each row range's tile (and the split sum) compiled for an H100/H200 in bf16; the matmul kernel's
    PTX converts e4m3 and multiplies on the tensor cores."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from runtime.kernels.fp8_weight_matmul import TILES, _split_sum_kernel, _w8_matmul_kernel

    def ptx(kernel, types, consts, warps, stages):
        names = list(inspect.signature(kernel.fn).parameters)
        types = {**{n: "i32" for n in names}, **types, **{n: "constexpr" for n in consts}}
        src = ASTSource(fn=kernel, signature={n: types[n] for n in names},
                        constexprs={(i,): consts[n] for i, n in enumerate(names) if n in consts})
        return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps, num_stages=stages)).asm["ptx"]

    ptrs = dict(X="*bf16", W="*fp8e4nv", S="*fp32", BIAS="*bf16", OUT="*bf16", PART="*fp32")
    for _, bm, bn, bk, warps, stages in TILES:
        for split, even_k in ((1, True), (2, False)):
            code = ptx(_w8_matmul_kernel, ptrs, dict(HAS_BIAS=True, SPLIT=split, EVEN_K=even_k, BLOCK_M=bm, BLOCK_N=bn,
                                                     BLOCK_K=bk), warps, stages)
            assert "mma" in code and "e4m3" in code, (bm, bn, bk)
    code = ptx(_split_sum_kernel, dict(PART="*fp32", S="*fp32", BIAS="*bf16", OUT="*bf16"),
               dict(HAS_BIAS=True, SPLIT=4, BLOCK=1024), 4, 1)
    assert "cvt.rn.bf16" in code


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="the kernel compiled for a GPU")
@pytest.mark.parametrize("m", [8, 128, 1000])
def test_on_a_gpu_the_kernel_matches_the_promised_arithmetic_at_glm_shapes(m):
    import torch

    from runtime.kernels.fp8_weight_matmul import split_for, w8_linear
    for n, k in ((4608, 4096), (4096, 13696), (1024, 2048)):
        x, w8, s, b = _case(m, n, k, torch.bfloat16, "cuda", seed=n)
        out = w8_linear(x, w8, s, b)
        ref = _reference(x, w8, s, b)
        # sums of up to 13,696 terms in another order, each rounded to bf16 once: apart by a bf16 step of the
        # result plus the fp32 order error, which scales with the terms' magnitudes, not the sum's (an output near 0
        # in a row of large terms)
        terms = (x.float().abs() @ w8.float().abs().t()) * s
        excess = (out.float() - ref.float()).abs() / (ref.float().abs() * 2**-7 + terms * 5e-5)
        assert excess.max().item() <= 1, (m, n, k, excess.max().item())
        assert torch.equal(out, w8_linear(x, w8, s, b)), split_for(m, n, k, 132)
