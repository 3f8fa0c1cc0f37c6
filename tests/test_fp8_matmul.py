"""The FP8 engine linear's swapped kernel (runtime/kernels/fp8_matmul.py) against the product it computes.

On the CPU Triton's interpreter runs it in a child process (TRITON_INTERPRET=1 is read at import time), in fp32 and
fp16 outputs: tiles and splits of every kind, an inner dimension that is not whole blocks, a bias, more rows than a
tile, no rows. On a GPU: against torch._scaled_mm at GLM-Z1-9B's projections and a decode step's rows, the same bits
twice and from a captured CUDA graph.
"""

import pytest

pytest.importorskip("triton")

from tests.triton_checks import interpreter_reads_loop_bounds, run_interpreted  # noqa: E402


def _check_interpreted() -> None:
    import torch

    from runtime.kernels import fp8_matmul as fm
    from runtime.rollout.fp8_weights import quantize_activation_rows, quantize_rows

    torch.manual_seed(0)
    # (rows, out, in, tiles, split, bias, out dtype): one program; a split of 2 and of 3 (a second kernel adds the
    # parts in order); an inner dimension of 200 and of 328 (not whole 128-blocks: masked); rows over one tile
    cases = [(8, 96, 256, (32, 16, 128, 4, 2), 1, False, torch.float32),
             (20, 64, 512, (32, 16, 128, 4, 2), 2, True, torch.float32),
             (5, 130, 384, (64, 16, 128, 4, 2), 3, False, torch.float16),
             (9, 40, 200, (32, 16, 128, 4, 2), 1, True, torch.float16),
             (9, 40, 328, (32, 16, 128, 4, 2), 2, False, torch.float32),
             (40, 48, 256, (32, 16, 128, 4, 2), 2, True, torch.float32)]
    for m, n, k, tiles, split, with_bias, dtype in cases:
        x, w = torch.randn(m, k), torch.randn(n, k)
        bias = torch.randn(n).to(dtype) if with_bias else None
        w8, ws = quantize_rows(w)
        xq, xs = quantize_activation_rows(x)
        out = torch.empty(m, n, dtype=dtype)
        fm.launch(xq, xs.reshape(-1), w8, ws.reshape(-1), bias, out, tiles, split)
        ref = ((xq.float() @ w8.float().t()) * xs * ws).to(dtype)
        if bias is not None:
            ref = (ref.float() + bias.float()).to(dtype)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert (out.float() - ref.float()).abs().max() <= tol * ref.float().abs().max(), (m, n, k, split)
    # the op as fp8_linear calls it: its own tiles and split, and no rows
    x, w = torch.randn(24, 256), torch.randn(80, 256)
    w8, ws = quantize_rows(w)
    xq, xs = quantize_activation_rows(x)
    got = fm.swapped_scaled_mm(xq, xs.reshape(-1), w8, ws.reshape(-1), None, torch.float32)
    assert (got - (xq.float() @ w8.float().t()) * xs * ws).abs().max() < 1e-4
    assert fm.swapped_scaled_mm(xq[:0], xs[:0].reshape(-1), w8, ws.reshape(-1), None, torch.float32).shape == (0, 80)


@pytest.mark.skipif(not interpreter_reads_loop_bounds(), reason="Triton < 3.7: its interpreter cannot run the kernel")
def test_the_swapped_kernel_computes_the_scaled_product_in_every_tiling():
    run_interpreted(__file__, timeout=300)


if __name__ == "__main__":  # run_interpreted's child (the repository root on its path)
    _check_interpreted()


def test_tiles_and_splits_follow_the_rows_and_fill_the_gpu():
    from runtime.kernels.fp8_matmul import split_for, tiles_for
    assert [tiles_for(r)[1] for r in (1, 8, 16, 17, 32, 33, 64, 100, 128, 4000)] == [16, 16, 16, 32, 32, 64, 64, 128,
                                                                                     128, 128]
    # GLM-Z1-9B's qkv at 8 rows: 72 weight tiles of 64 rows on 132 SMs, split in 2; gate_up's 428 tiles fill them
    assert split_for(8, 4608, 4096, 64, 16, 256, 132) == 2
    assert split_for(8, 27392, 4096, 64, 16, 256, 132) == 1
    # a split keeps at least 512 of the inner dimension
    assert split_for(8, 64, 1024, 64, 16, 256, 132) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="sm90's FP8 tensor cores: a GPU")
def test_on_a_gpu_the_swapped_kernel_matches_scaled_mm_and_repeats_its_bits_in_a_graph():
    import torch

    from runtime.kernels.fp8_matmul import swapped_scaled_mm
    from runtime.rollout.fp8_weights import quantize_activation_rows, quantize_rows
    g = torch.Generator(device="cuda").manual_seed(0)
    for n, k in ((4608, 4096), (4096, 4096), (27392, 4096), (4096, 13696)):  # GLM-Z1-9B's projections
        w8, ws = quantize_rows(torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02)
        for m in (8, 24, 64, 128, 200):
            xq, xs = quantize_activation_rows(torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16))
            ref = torch._scaled_mm(xq, w8.t(), scale_a=xs, scale_b=ws, out_dtype=torch.float32)
            got = swapped_scaled_mm(xq, xs.reshape(-1), w8, ws.reshape(-1), None, torch.bfloat16)
            assert (got.float() - ref).abs().max() <= 1e-2 * ref.abs().max(), (n, k, m)
            assert torch.equal(got, swapped_scaled_mm(xq, xs.reshape(-1), w8, ws.reshape(-1), None, torch.bfloat16))
            graph = torch.cuda.CUDAGraph()
            swapped_scaled_mm(xq, xs.reshape(-1), w8, ws.reshape(-1), None, torch.bfloat16)  # compiled before capture
            with torch.cuda.graph(graph):
                captured = swapped_scaled_mm(xq, xs.reshape(-1), w8, ws.reshape(-1), None, torch.bfloat16)
            graph.replay()
            assert torch.equal(captured, got), (n, k, m)
