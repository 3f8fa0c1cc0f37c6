"""The batch-invariant Triton RMS norm of rollout.true_on_policy (runtime/kernels/row_norm.py): a row has the same
bits alone or among many rows, in any order, from a strided view; its values are close to the PyTorch form's
(`batch_invariant._rms_rows`, what the CPU runs) and its gradients, the PyTorch form's, equal autograd's through that
form.

On the CPU by Triton's interpreter in a child process with TRITON_INTERPRET=1 (tests/test_row_attention.py's pattern;
fp32 and fp16: the interpreter's bf16 is unreliable), and the kernel compiled for sm_90 without a GPU. On a GPU
(`-k gpu`) in bf16 through `batch_invariant.rms_norm`, the engine's call shapes against the trainer's
`BatchInvariantRMSNorm` on megatron's query layout.
"""

import pytest

pytest.importorskip("triton")

from tests.triton_checks import has_nvidia_backend, run_interpreted  # noqa: E402

EPS = 1e-6


def _rows(n, width, dtype, device, seed=0):
    """n rows of width `width` at scales from 1e-2 to 1e2 (a row's sum of squares far from the others'), a weight
    1 + 0.1 N(0, 1)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    scale = 10.0 ** (torch.rand(n, 1, generator=g) * 4 - 2)
    x = torch.randn(n, width, generator=g) * scale
    w = 1 + 0.1 * torch.randn(width, generator=g)
    return x.to(device, dtype), w.to(device, dtype)


def _check_invariance(norm, x, w):
    """norm(x, w, eps) of all the rows; each of a few rows alone, the rows three times in another order and the rows
    read through a strided view (every other row of a wider buffer) give the same bits."""
    import torch
    full = norm(x, w, EPS)
    assert full.shape == x.shape and full.dtype == x.dtype
    n = x.shape[0]
    for i in (0, n // 2, n - 1):
        assert torch.equal(norm(x[i:i + 1], w, EPS), full[i:i + 1])
    many = torch.arange(n, device=x.device).repeat(3).flip(0)
    assert torch.equal(norm(x[many], w, EPS), full[many])
    wide = torch.zeros(n, 2, x.shape[1] + 8, dtype=x.dtype, device=x.device)
    wide[:, 1, 3:3 + x.shape[1]] = x
    view = wide[:, 1, 3:3 + x.shape[1]]
    assert view.stride(0) != x.shape[1]
    assert torch.equal(norm(view, w, EPS), full)
    return full


def _check_gradients(x, w, tol):
    """The kernel through its autograd Function: both gradients close to autograd's through the PyTorch form, and its
    forward the no-grad call's bits."""
    import torch

    from runtime.kernels.batch_invariant import _rms_rows
    from runtime.kernels.row_norm import row_rms_norm
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(x.device, x.dtype)
    grads = []
    for norm in (row_rms_norm, lambda a, b, eps: _rms_rows(a, b, eps)[0]):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = norm(xg, wg, EPS)
        (y.float() * g.float()).sum().backward()
        grads.append((y.detach(), xg.grad, wg.grad))
    (y, gx, gw), (_, rx, rw) = grads
    assert torch.equal(y, row_rms_norm(x, w, EPS))
    for got, ref in ((gx, rx), (gw, rw)):
        assert got.dtype == ref.dtype and got.isfinite().all()
        err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        assert err < tol, err
    with torch.no_grad():  # nothing to differentiate: the kernel alone
        assert row_rms_norm(x.requires_grad_(), w, EPS).grad_fn is None
    x.requires_grad_(False)


def _check_interpreted() -> None:
    import torch

    from runtime.kernels.batch_invariant import _rms_rows
    from runtime.kernels.row_norm import row_rms_norm
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        for width in (128, 1024, 1000):  # a head's q/k norm, the hidden size, a width the tile masks
            x, w = _rows(24, width, dtype, "cpu", seed=width)
            y = _check_invariance(row_rms_norm, x, w)
            ref = _rms_rows(x, w, EPS)[0]
            err = ((y.float() - ref.float()).abs() / ref.float().abs().clamp(min=1e-3)).max().item()
            assert err < tol, (dtype, width, err)
        _check_gradients(*_rows(16, 1000, dtype, "cpu", seed=7), tol=tol)


def test_a_row_has_the_same_bits_alone_or_among_many_and_the_gradient_is_the_pytorch_forms():
    run_interpreted(__file__, timeout=600)


if __name__ == "__main__":  # run_interpreted's child (the repository root on its path)
    _check_interpreted()


@pytest.mark.skipif(not has_nvidia_backend(), reason="Triton without its NVIDIA backend")
def test_the_kernel_is_one_whatever_the_addresses_and_compiles_for_sm90():
    """No GPU needed. The launcher's key (Triton's own binder) is one for contiguous rows, a slice at an odd offset, a
    strided view and a weight inside a flat buffer: told of an alignment the compiler would vectorise the loads and
    sum each row in another order. Compiled from that key for an H100/H200 (sm_90, bf16) at a head's width (128) and
    a hidden size (1024): one reciprocal square root (one row per program)."""
    import re

    import torch
    import triton
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import create_function_from_signature

    from runtime.kernels.row_norm import _row_rms_norm_kernel as kernel, _warps
    bind = create_function_from_signature(kernel.signature, kernel.params, BaseBackend)
    names = list(kernel.signature.parameters)
    for width in (128, 1024, 1000):
        block = triton.next_power_of_2(width)
        buf = torch.zeros(64 * (width + 8) + 16, dtype=torch.bfloat16)
        rows = buf[:16 * width].view(16, width)
        calls = [(rows, buf[:width], rows),  # all 16-byte aligned, row stride the width
                 (buf[3:3 + 5 * width].view(5, width), buf[width + 1:2 * width + 1], rows[1:6]),  # odd offsets
                 (buf[8:].as_strided((16, width), (2 * (width + 8), 1)), buf[16:16 + width], rows)]  # strided
        keys = [bind(x, w, o, x.stride(0), o.stride(0), EPS, WIDTH=width, BLOCK=block)[1] for x, w, o in calls]
        assert keys[1] == keys[0] and keys[2] == keys[0], keys
        if width == 1000:
            continue
        key = dict(zip(names, keys[0]))
        types = {n: t for n, (t, _) in key.items()}
        src = ASTSource(fn=kernel, signature=types,
                        constexprs={(i,): key[n][1] for i, n in enumerate(names) if types[n] == "constexpr"})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=_warps(block))).asm["ptx"]
        assert len(re.findall(r"\brsqrt\.approx", ptx)) == 1, width


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


@pytest.mark.skipif(not _cuda(), reason="the kernel compiled for a GPU")
def test_on_a_gpu_a_rows_bits_do_not_depend_on_the_batch():
    """bf16 through `batch_invariant.rms_norm` (the dispatch both sides bind): the hidden size and the q/k norms' rows
    at the recipe's scale (24k tokens x 16 heads of 128), a row alone its bits among all; close to the PyTorch form;
    the gradient finite and close to autograd's through the PyTorch form."""
    import torch

    from runtime.kernels.batch_invariant import _rms_rows, rms_norm
    for n, width in ((24_576 * 16, 128), (4096, 1024), (512, 1000)):
        x, w = _rows(n, width, torch.bfloat16, "cuda", seed=width)
        y = _check_invariance(rms_norm, x, w)
        ref = _rms_rows(x, w, EPS)[0]
        err = ((y.float() - ref.float()).abs() / ref.float().abs().clamp(min=1e-2)).max().item()
        assert err < 2e-2, (width, err)
    _check_gradients(*_rows(512, 1024, torch.bfloat16, "cuda", seed=3), tol=2e-2)


@pytest.mark.skipif(not _cuda(), reason="the kernel compiled for a GPU")
def test_on_a_gpu_the_engines_norm_calls_give_the_trainers_module_bits():
    """The trainer's q and k norms (`BatchInvariantRMSNorm`; megatron-core needed: `bench/gpu_carry.py install`) on
    megatron's query [s, b, heads, 128] (reshaped from the fused q/k/v, per-group order) and key (a strided view of
    it) while training, against the engine's calls on contiguous rows: decode steps [B, heads, 128] and a prefill's
    packed rows."""
    pytest.importorskip("megatron.core")
    import torch

    from runtime.kernels.batch_invariant import rms_norm
    from runtime.mcore.batch_invariant import BatchInvariantRMSNorm
    s, nkv, rep, hd = 3000, 8, 2, 128
    g = torch.Generator().manual_seed(5)
    mixed = torch.randn(s, 1, nkv, (rep + 2) * hd, generator=g).to("cuda", torch.bfloat16)  # megatron's fused q/k/v
    query = mixed[..., :rep * hd].reshape(s, 1, nkv * rep, hd)
    key = mixed[..., rep * hd:(rep + 1) * hd]
    assert not key.is_contiguous()
    for x in (query, key):
        module = BatchInvariantRMSNorm(hd, eps=EPS, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            module.weight.copy_(1 + 0.1 * torch.randn(hd, generator=g))
        trained = module(x.detach().requires_grad_())
        trained.float().square().mean().backward()
        assert module.weight.grad is not None and module.weight.grad.isfinite().all()
        rows = x[:, 0].contiguous()  # the engine's q or k rows [tokens, heads, hd]
        w = module.weight.detach()
        for pick in ([s - 1], [0, 17, 999, 2999], list(range(0, s, 31))):  # decode steps of 1, 4 and 97 live rows
            at = torch.tensor(pick, device="cuda")
            assert torch.equal(rms_norm(rows[at], w, EPS), trained[at, 0].detach())
        assert torch.equal(rms_norm(rows[1000:2200], w, EPS), trained[1000:2200, 0].detach())  # a packed prompt
