"""The FP8 engine's norm-and-quantise kernel (runtime/kernels/norm_quant.py) against the eager path it replaces:
decode_model's ``_rms`` and residual add, then `quantize_activation_rows`, in the four forms the engine calls (the
pre-attention norm; the attention output alone; Qwen3's residual add and norm; GLM4's post-attention norm, residual
add and norm).

On the CPU Triton's interpreter runs it in a child process at GLM-Z1-9B's width and a small one (masked), with an
all-zero row. On a GPU: e4m3 against the eager path, and a row's bits alone and among others.
"""

import pytest

pytest.importorskip("triton")

from tests.triton_checks import run_interpreted  # noqa: E402

FORMS = {"norm": (False, False, True), "alone": (False, False, False), "residual+norm": (True, False, True),
         "post-norm+residual+norm": (True, True, True)}  # (residual, pre-norm, norm)


def _inputs(rows, width, form, device, generator=None):
    import torch
    residual, pre, norm = FORMS[form]

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, generator=generator) * scale).to(torch.bfloat16)
    return (randn(rows, width, scale=2.0), randn(rows, width, scale=4.0) if residual else None,
            randn(width, scale=0.5) + 1 if pre else None, randn(width, scale=0.5) + 1 if norm else None)


def _eager(x, residual, pre_w, w, eps):
    """(the residual stream after the add or None, the eager e4m3 rows, their scales [rows])."""
    from runtime.rollout.decode_model import _rms
    from runtime.rollout.fp8_weights import quantize_activation_rows
    a = _rms(x, pre_w, eps) if pre_w is not None else x
    h = residual + a if residual is not None else None
    y = h if h is not None else a
    rq, rs = quantize_activation_rows(_rms(y, w, eps) if w is not None else y)
    return h, rq, rs.reshape(-1)


def _rounding_toward_zero(x, residual, pre_w, w, eps):
    """The eager path in fp32 with each of its bf16 roundings toward zero, as Triton's interpreter rounds (the GPU
    rounds to nearest): (the residual stream after the add or None, the row divided by its scale, the scales)."""
    import torch

    def bf16(t):  # drop the low 16 bits of the fp32 pattern
        return (t.float().contiguous().view(torch.int32) & -65536).view(torch.float32)

    def rms(t, weight):
        return bf16(weight.float() * bf16(t * torch.rsqrt((t * t).mean(-1, keepdim=True) + eps)))
    a = rms(x.float(), pre_w) if pre_w is not None else x.float()
    h = bf16(residual.float() + a) if residual is not None else None
    y = h if h is not None else a
    y = rms(y, w) if w is not None else y
    s = y.abs().amax(-1).clamp(min=1e-12) / 448.0
    return h, (y / s[:, None]).clamp(-448.0, 448.0), s


def _check_interpreted() -> None:
    """The values before their rounding to e4m3 (an fp32 output: the interpreter's fp32-to-e4m3 conversion drops the
    carry of a mantissa rounded up; the GPU test checks the hardware's) against the eager path with the
    interpreter's bf16 rounding (`_rounding_toward_zero`); the sums' order differs, so a bf16 step may too."""
    import torch

    from runtime.kernels import norm_quant as nq
    torch.manual_seed(0)
    eps = 1e-5
    for width in (4096, 96):
        for form in FORMS:
            x, residual, pre_w, w = _inputs(4, width, form, "cpu")
            x[2] = 0
            if residual is not None:
                residual[2] = 0  # an all-zero row: zeros and the floor's scale
            h_out = torch.empty(4 if residual is not None else 0, width, dtype=torch.bfloat16)
            scaled, xs = torch.empty(4, width), torch.empty(4)
            nq.launch(x, residual, pre_w, w, eps, h_out, scaled, xs)
            h, ref, rs = _rounding_toward_zero(x, residual, pre_w, w, eps)
            if h is not None:
                assert ((h_out.float() - h).abs() <= h.abs() * 2 ** -7).all(), form
            assert torch.allclose(xs, rs, rtol=2 ** -7, atol=0), (form, xs, rs)
            assert xs[2] == rs[2] and not scaled[2].any()
            assert ((scaled - ref).abs() <= ref.abs() * 2 ** -6 + 2 ** -6).all(), (width, form)
    hq = nq.norm_quant_rows(torch.zeros(0, 64, dtype=torch.bfloat16), None, None, None, eps)[1]
    assert hq.shape == (0, 64) and hq.dtype == torch.float8_e4m3fn


def test_the_kernel_norms_and_quantises_as_the_eager_path_does():
    run_interpreted(__file__, timeout=300)


if __name__ == "__main__":  # run_interpreted's child (the repository root on its path)
    _check_interpreted()


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="the kernel compiled for a GPU")
def test_on_a_gpu_the_kernel_matches_the_eager_path_and_a_row_keeps_its_bits_among_others():
    import torch

    from runtime.kernels.norm_quant import norm_quant_rows
    g = torch.Generator(device="cuda").manual_seed(0)
    for width in (4096, 1024):  # GLM-Z1-9B's, Qwen3-0.6B's
        for form in FORMS:
            x, residual, pre_w, w = _inputs(64, width, form, "cuda", g)
            h_out, xq, xs = norm_quant_rows(x, residual, pre_w, w, 1e-5)
            h, rq, rs = _eager(x, residual, pre_w, w, 1e-5)
            if h is not None:
                assert (h_out != h).float().mean().item() < 0.01, form
            assert torch.allclose(xs, rs, rtol=2 ** -7, atol=0), form
            got, ref = xq.float() * xs[:, None], rq.float() * rs[:, None]
            assert ((got - ref).abs() <= ref.abs() * 2 ** -3 + rs[:, None] * 2 ** -8).all(), form
            assert (xq.view(torch.uint8) == rq.view(torch.uint8)).float().mean().item() > 0.98, form
            one = norm_quant_rows(x[5:6].contiguous(), None if residual is None else residual[5:6].contiguous(),
                                  pre_w, w, 1e-5)
            assert torch.equal(one[1].view(torch.uint8), xq[5:6].view(torch.uint8)) and torch.equal(one[2], xs[5:6])
