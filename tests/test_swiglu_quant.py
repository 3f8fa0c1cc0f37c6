"""The FP8 engine's SwiGLU-and-quantise kernel (runtime/kernels/swiglu_quant.py) against the eager path it replaces:
`quantize_activation_rows(F.silu(g) * u)`.

On the CPU Triton's interpreter runs it in a child process (bf16 rows at GLM-Z1-9B's width and a small one, an
all-zero row, no rows). On a GPU: e4m3 against the eager path at GLM-Z1-9B's and Qwen3-0.6B's widths, and a row's
bits alone and among others (one program a row).
"""

import pytest

pytest.importorskip("triton")

from tests.triton_checks import run_interpreted  # noqa: E402


def _eager(gu, ffn):
    """The path the kernel replaces: `quantize_activation_rows(F.silu(g) * u)` (e4m3 rows [rows, ffn], scales
    [rows])."""
    import torch.nn.functional as F

    from runtime.rollout.fp8_weights import quantize_activation_rows
    g, u = gu.split([ffn, ffn], dim=-1)
    rq, rs = quantize_activation_rows(F.silu(g) * u)
    return rq, rs.reshape(-1)


def _check_interpreted() -> None:
    """The values before their rounding to e4m3 (an fp32 output: the interpreter's fp32-to-e4m3 conversion drops
    the carry of a mantissa rounded up, 127.9 -> 64; the GPU test checks the hardware's) against the eager path's
    e4m3 rows, and the scales. The interpreter also rounds fp32 to bf16 toward zero (the GPU to nearest): its
    activation may come out two bf16 steps from the eager one's, and so may the scale."""
    import torch

    from runtime.kernels import swiglu_quant as sq
    torch.manual_seed(0)
    for rows, ffn in ((3, 13696), (5, 96)):
        gu = (torch.randn(rows, 2 * ffn) * 3).to(torch.bfloat16)
        gu[1] = 0  # an all-zero row: zeros and the floor's scale, no division by zero
        scaled, hs = torch.empty(rows, ffn), torch.empty(rows)
        sq.launch(gu, ffn, scaled, hs)
        rq, rs = _eager(gu, ffn)
        assert torch.allclose(hs, rs, rtol=2 ** -6, atol=0), (hs, rs)
        assert hs[1] == rs[1] and not scaled[1].any()
        assert scaled.abs().max() <= sq.FP8_MAX
        got, ref = scaled * hs[:, None], rq.float() * rs[:, None]  # within half an e4m3 step, and two bf16 ones
        assert ((got - ref).abs() <= ref.abs() * (2 ** -4 + 2 ** -6) + rs[:, None] * 2 ** -9).all()
    hq, hs = sq.swiglu_quant_rows(torch.zeros(0, 64, dtype=torch.bfloat16), 32)
    assert hq.shape == (0, 32) and hq.dtype == torch.float8_e4m3fn and hs.shape == (0,)


def test_the_kernel_quantises_the_swiglu_as_the_eager_path_does():
    run_interpreted(__file__, timeout=300)


if __name__ == "__main__":  # run_interpreted's child (the repository root on its path)
    _check_interpreted()


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="the kernel compiled for a GPU")
def test_on_a_gpu_the_kernel_matches_the_eager_path_and_a_row_keeps_its_bits_among_others():
    import torch

    from runtime.kernels.swiglu_quant import swiglu_quant_rows
    g = torch.Generator(device="cuda").manual_seed(0)
    for ffn in (13696, 3072):  # GLM-Z1-9B's, Qwen3-0.6B's
        gu = torch.randn(128, 2 * ffn, device="cuda", generator=g).to(torch.bfloat16) * 3
        hq, hs = swiglu_quant_rows(gu, ffn)
        rq, rs = _eager(gu, ffn)
        assert torch.allclose(hs, rs, rtol=2 ** -8, atol=0)
        got, ref = hq.float() * hs[:, None], rq.float() * rs[:, None]
        assert ((got - ref).abs() <= ref.abs() * 2 ** -3 + rs[:, None] * 2 ** -9).all()
        assert (hq.view(torch.uint8) == rq.view(torch.uint8)).float().mean().item() > 0.99
        one_q, one_s = swiglu_quant_rows(gu[5:6].contiguous(), ffn)
        assert torch.equal(one_q.view(torch.uint8), hq[5:6].view(torch.uint8)) and torch.equal(one_s, hs[5:6])
