"""The CUDA trainer's pure-PyTorch fusions (runtime/mcore/fusions.py), checked on CPU without compiling:

* our fused-RoPE function, eager, against megatron's unfused ``_apply_rotary_pos_emb_bshd``: the same
  values and gradients (rotate-half and interleaved, whole and partial rotary dims, fp32 and bf16);
* megatron's own routing (``apply_rotary_pos_emb`` with ``apply_rope_fusion``) reaches it;
* a whole tiny GPT with RoPE, SwiGLU and bias-dropout-add fusions on (torch.compile forced eager)
  gives the logits and gradients of the unfused model;
* SdpaCoreAttention with native GQA (``enable_gqa``) against the ``repeat_interleave`` path;
* the RMSNorm fusion's math against ``F.rms_norm``, and a model's norms switched and back;
* the switches: nothing on CPU, ``train.fusions`` on CUDA.
"""
from __future__ import annotations

import types

import pytest
import torch

from runtime.mcore import fusions as mf


def _freqs(s: int, rot_dim: int, interleaved: bool, base: float = 10000.0) -> torch.Tensor:
    """What megatron's RotaryEmbedding.get_emb returns: [s, 1, 1, rot_dim] fp32 angles."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    f = torch.outer(torch.arange(s, dtype=torch.float32), inv_freq)
    emb = torch.cat((f, f), -1) if not interleaved else torch.stack((f.view(-1, 1), f.view(-1, 1)), -1).view(s, -1)
    return emb[:, None, None, :]


ROPE_CASES = [  # (interleaved, head_dim, rot_dim)
    (False, 32, 32), (False, 32, 16), (True, 32, 32), (True, 32, 16)]


@pytest.mark.parametrize("interleaved,d,rot", ROPE_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_megatrons_unfused_values_and_gradients(interleaved, d, rot, dtype):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    g = torch.Generator().manual_seed(d + rot + int(interleaved))
    s, b, h = 11, 3, 4
    t0 = torch.randn(s, b, h, d, generator=g).to(dtype)
    f0 = _freqs(s, rot, interleaved)
    grad_out = torch.randn(s, b, h, d, generator=g).to(dtype)

    outs, grads = [], []
    for fn in (lambda t, f: _apply_rotary_pos_emb_bshd(t, f, rotary_interleaved=interleaved),
               lambda t, f: mf.fused_apply_rotary_pos_emb(t, f, interleaved=interleaved)):
        t, f = t0.clone().requires_grad_(True), f0.clone().requires_grad_(True)
        y = fn(t, f)
        y.backward(grad_out)
        outs.append(y.detach())
        grads.append((t.grad, f.grad))
    assert outs[1].shape == (s, b, h, d) and outs[1].dtype == dtype
    # the same ops in the same order: bitwise equal, forward and backward
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[1][1], grads[0][1], rtol=0, atol=0)
    if rot < d:  # the unrotated part passes through untouched, and so does its gradient
        assert torch.equal(outs[1][..., rot:], t0[..., rot:])
        assert torch.equal(grads[1][0][..., rot:], grad_out[..., rot:])


def test_megatron_routes_apply_rope_fusion_to_ours(monkeypatch):
    """megatron's apply_rotary_pos_emb with config.apply_rope_fusion calls the installed global
    (eager here: CPU tensors are never compiled) and gives what the unfused path gives."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import TransformerConfig

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)
    assert mf.install_rope_fusion() == "grpoflow"
    calls = []
    real = rope_utils.fused_apply_rotary_pos_emb
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda *a, **k: calls.append(k) or real(*a, **k))
    kw = dict(num_layers=1, hidden_size=64, num_attention_heads=4, kv_channels=16)
    fused = TransformerConfig(apply_rope_fusion=True, **kw)  # validation reads the global: no TE needed now
    plain = TransformerConfig(apply_rope_fusion=False, **kw)
    t = torch.randn(7, 2, 4, 16)
    f = _freqs(7, 16, False)
    cp = object()  # only the packed (thd) path reads the context-parallel group
    a = rope_utils.apply_rotary_pos_emb(t, f, config=fused, cp_group=cp)
    b = rope_utils.apply_rotary_pos_emb(t, f, config=plain, cp_group=cp)
    assert calls == [{"interleaved": False}]
    assert torch.equal(a, b)


def test_install_keeps_an_existing_te_kernel(monkeypatch):
    from megatron.core.models.common.embeddings import rope_utils

    def te_kernel(t, freqs, transpose_output_memory=False, interleaved=False):
        return t

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", te_kernel)
    assert mf.install_rope_fusion() == "te"
    assert rope_utils.fused_apply_rotary_pos_emb is te_kernel


# ---- the switches ----------------------------------------------------------------------------------------

def _qwen3_config(**kw):
    from transformers import Qwen3Config
    args = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=256,
                hidden_act="silu", tie_word_embeddings=False)
    args.update(kw)
    return Qwen3Config(**args)


def test_switches():
    import torch.nn.functional as F

    assert mf.active("cpu") == () and mf.active("cuda") == mf.FUSIONS
    assert mf.active("cpu", "auto") == ()  # CPU: never, whatever the setting says
    assert mf.active("cuda", ["gqa", "rope"]) == ("rope", "gqa")
    assert mf.active("cuda", "none") == ()
    with pytest.raises(ValueError, match="flash"):
        mf.active("cuda", ["rope", "flash"])

    arch = dict(gated_linear_unit=True, activation_func=F.silu, rotary_interleaved=False)
    assert mf.config_kwargs("cpu", arch) == dict(apply_rope_fusion=False, bias_activation_fusion=False,
                                                 bias_dropout_fusion=False)
    assert mf.config_kwargs("cuda", arch) == dict(apply_rope_fusion=True, bias_activation_fusion=True,
                                                  bias_dropout_fusion=True)
    # GLM4's interleaved RoPE: megatron refuses the fusion without TE >= 2.3, so it stays unfused
    assert mf.config_kwargs("cuda", {**arch, "rotary_interleaved": True})["apply_rope_fusion"] is False
    assert mf.config_kwargs("cuda", arch, ["swiglu"]) == dict(apply_rope_fusion=False, bias_activation_fusion=True,
                                                            bias_dropout_fusion=False)
    # the config section takes the same values and refuses others
    from runtime.config import TrainSection
    assert TrainSection(fusions=["rope", "swiglu"]).fusions == ["rope", "swiglu"]
    with pytest.raises(Exception, match="fusions"):
        TrainSection(fusions=["flash"])


def test_transformer_config_flags_per_device():
    """CPU builds keep every fusion off; a CUDA config (built, not run) passes megatron's validation
    with them on, and each is switched off by the setting."""
    from runtime.mcore.env import build_transformer_config

    cfg = _qwen3_config()
    flags = ("apply_rope_fusion", "bias_activation_fusion", "bias_dropout_fusion")
    cpu = build_transformer_config(cfg, device="cpu")
    assert [getattr(cpu, f) for f in flags] == [False, False, False]
    cuda = build_transformer_config(cfg, device="cuda", dtype=torch.bfloat16)
    assert [getattr(cuda, f) for f in flags] == [True, True, True]
    cuda = build_transformer_config(cfg, device="cuda", dtype=torch.bfloat16, fusions="none")
    assert [getattr(cuda, f) for f in flags] == [False, False, False]


def test_packed_rope_restarts_positions_per_sample():
    """The packed (thd) RoPE megatron calls with the fusion on: each sample rotated from position 0,
    equal to megatron's unfused thd path (eager here: CPU tensors are not compiled)."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    lens = [5, 1, 7]
    cu = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    assert mf.packed_positions(cu, 13).tolist() == [0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 5, 6]
    g = torch.Generator().manual_seed(4)
    t = torch.randn(13, 4, 32, generator=g)
    freqs = _freqs(7, 32, False)
    got = mf.fused_apply_rotary_pos_emb_thd(t, cu, freqs)
    start = 0
    for n in lens:  # each sample alone, bshd, positions 0..n-1
        ref = _apply_rotary_pos_emb_bshd(t[start:start + n, None], freqs[:n])[:, 0]
        torch.testing.assert_close(got[start:start + n], ref, rtol=0, atol=1e-6)
        start += n


# ---- a whole model with the fusions on, compiled code forced eager ---------------------------------------

def test_tiny_gpt_with_fusions_matches_unfused(monkeypatch):
    """megatron's fused paths as our CUDA config takes them (RoPE via our global, bias_swiglu_impl with
    no bias, the bias-dropout-add functions), run eagerly on CPU: the unfused model's logits and grads."""
    from megatron.core.models.common.embeddings import rope_utils

    from runtime.mcore.env import build_gpt_model, causal_attention_mask

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", rope_utils.fused_apply_rotary_pos_emb)
    mf.install_rope_fusion()
    cfg = _qwen3_config()
    torch.manual_seed(0)
    plain = build_gpt_model(cfg)
    fused = build_gpt_model(cfg, init_weights=False, apply_rope_fusion=True, bias_activation_fusion=True,
                            bias_dropout_fusion=True)
    fused.load_state_dict(plain.state_dict())
    assert fused.config.apply_rope_fusion and fused.config.bias_activation_fusion and fused.config.bias_dropout_fusion
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (3, 10), generator=g)
    pos = torch.arange(10).expand(3, 10)
    mask = causal_attention_mask(3, 10)
    outs = []
    with torch.compiler.set_stance("force_eager"):  # megatron's jit_fuser is torch.compile: not on CPU CI
        for model in (plain, fused):
            model.zero_grad(set_to_none=True)
            logits = model(ids, pos, mask)
            (logits.float().square().mean()).backward()
            outs.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-6, atol=1e-6)
    assert outs[0][1].keys() == outs[1][1].keys()
    for n in outs[0][1]:
        torch.testing.assert_close(outs[1][1][n], outs[0][1][n], rtol=1e-5, atol=1e-6, msg=n)
    assert mf.report(fused)["rope"] == "grpoflow-compiled" and mf.report(plain)["rope"] is False


# ---- RMSNorm ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_torchs(dtype):
    """The math the norm fusion compiles is F.rms_norm's: equal values, gradients within rounding."""
    g = torch.Generator().manual_seed(0)
    for shape in ((37, 64), (5, 7, 4, 16)):
        x = (torch.randn(*shape, generator=g) * 3).to(dtype).requires_grad_()
        w = (torch.randn(shape[-1], generator=g) * 0.1 + 1).to(dtype).requires_grad_()
        y, ref = mf.rms_norm(x, w, 1e-6), torch.nn.functional.rms_norm(x, (shape[-1],), w, 1e-6)
        assert torch.equal(y, ref)
        gy = torch.randn(y.shape, generator=g).to(dtype)
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.02, atol=0.02)
        for a, b in zip(torch.autograd.grad(y, (x, w), gy), torch.autograd.grad(ref, (x, w), gy)):
            torch.testing.assert_close(a, b, **tol)


def test_use_compiled_norms_switches_every_rmsnorm_and_back():
    """Every RMSNorm of a tiny Qwen3 (pre-norms, q/k norms, final norm) switched in place: same parameters,
    and on CPU (eager) bitwise the same logits; switched back, plain torch RMSNorms again."""
    from runtime.mcore.env import build_gpt_model, causal_attention_mask

    cfg = _qwen3_config()
    torch.manual_seed(0)
    model = build_gpt_model(cfg)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.RMSNorm)]
    assert len(norms) == 4 * cfg.num_hidden_layers + 1 and mf.report(model)["norm"] is False
    ids, pos = torch.randint(0, 96, (2, 9)), torch.arange(9).expand(2, 9)
    before, state = model(ids, pos, causal_attention_mask(2, 9)), model.state_dict()
    assert mf.use_compiled_norms(model) == len(norms) and mf.report(model)["norm"] is True
    assert all(type(m) is mf.CompiledRMSNorm for m in norms)
    assert torch.equal(model(ids, pos, causal_attention_mask(2, 9)), before)
    assert model.state_dict().keys() == state.keys()
    assert mf.use_compiled_norms(model, False) == len(norms) and all(type(m) is torch.nn.RMSNorm for m in norms)


def test_the_compiled_norm_sees_rows_of_one_layout_for_every_token_count():
    """What CompiledRMSNorm hands its compiled function: [tokens, hidden] rows with the strides (hidden, 1), whatever
    the token count and whether megatron passed the first norm's [s, 1, h] view of a [1, s, h] tensor (its size-1 dim
    strided s x h) or a plain tensor; a view of the input, no copy; the values of the eager norm. (torch 2.11's dynamo
    guarded on that size-1 stride: a new compile per token count, past its limit eager for some shapes only.)"""
    seen = []

    def compiled(x, weight, eps):  # stands for the compiled norm: records what the graph would be traced on
        seen.append((tuple(x.shape), x.stride(), x.data_ptr()))
        return mf.rms_norm(x, weight, eps)

    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, generator=g)
    for s in (37, 53, 250):
        embedded = torch.randn(1, s, 16, generator=g)
        for x in (embedded.transpose(0, 1), torch.randn(s, 1, 16, generator=g)):
            y = mf.rowwise(compiled, x, w, 1e-6)
            assert y.shape == x.shape and torch.equal(y, mf.rms_norm(x, w, 1e-6))
            assert seen[-1] == ((s, 16), (16, 1), x.data_ptr())
    assert embedded.transpose(0, 1).stride() == (16, 250 * 16, 1)  # the layout the direct call would have passed


def test_the_trainers_norm_leaves_the_sum_over_tokens_to_torch_while_it_computes_deterministically(monkeypatch):
    """Under train.deterministic (the trainer's methods run in torch's deterministic mode) the norm's compiled pieces
    keep every token apart (inductor would size a sum over the tokens from whichever token count first compiled it,
    in whichever process filled the cache) and torch sums the weight's gradient; the math is the norm's. Outside it
    (an engine in the same process, train.deterministic off) the whole norm compiled. Each is built once."""
    from runtime.mcore.determinism import trainer_compute
    compiled, outputs = [], []

    def fake_compile(fn, **kw):  # the pieces eagerly, each output's shape recorded
        compiled.append((fn.__name__, kw.get("options")))

        def run(*a):
            out = fn(*a)
            outputs.append((fn.__name__, [tuple(t.shape) for t in (out if isinstance(out, tuple) else (out,))]))
            return out
        return run

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(mf, "_NORM", {"compiled": {}, "error": None})

    class Trainer:
        def __init__(self, deterministic):
            self.train_cfg = types.SimpleNamespace(deterministic=deterministic)

        @trainer_compute
        def norm(self):
            return mf._compiled_norm()

    det = Trainer(True).norm()
    assert Trainer(False).norm() is not det and Trainer(True).norm() is det
    assert compiled == [(n, {"deterministic": True}) for n in ("_norm_forward", "_norm_grad_input", "_norm_weight_terms")] \
        + [("rms_norm", None)]
    g = torch.Generator().manual_seed(4)
    x, w, gy = torch.randn(37, 16, generator=g) * 3, 1 + 0.1 * torch.randn(16, generator=g), torch.randn(37, 16, generator=g)
    got, ref = [(x.clone().requires_grad_(), w.clone().requires_grad_()) for _ in range(2)]
    y, y_ref = det(*got, 1e-6), mf.rms_norm(*ref, 1e-6)
    y.backward(gy)
    y_ref.backward(gy)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6)
    assert {name for name, _ in outputs} == {"_norm_forward", "_norm_grad_input", "_norm_weight_terms"}
    assert all(shape[0] == 37 for _, shapes in outputs for shape in shapes)  # no compiled piece sums the tokens
    with torch.no_grad():  # the trainer's log-probs: the same forward
        assert torch.equal(det(x, w, 1e-6), y.detach())


# ---- SDPA core attention: native GQA vs repeat_interleave --------------------------------------------------

@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_native_gqa_equals_repeat_interleave(causal):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from runtime.mcore.env import SdpaCoreAttention, causal_attention_mask

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                               kv_channels=16, attention_dropout=0.0, hidden_dropout=0.0)
    pg = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1))
    mask_type = AttnMaskType.causal if causal else AttnMaskType.padding
    attn = SdpaCoreAttention(config, 1, mask_type, "self", pg_collection=pg)
    g = torch.Generator().manual_seed(2)
    s, b = 9, 3
    # q/k/v as megatron hands them over: [s, b, heads, d], k/v with the query-group count of heads
    q0, k0, v0 = (torch.randn(s, b, n, 16, generator=g) for n in (8, 2, 2))
    mask = causal_attention_mask(b, s)
    if not causal:  # a padding mask: the last two keys of sample 0 masked out for every query
        mask = torch.zeros(b, 1, s, s, dtype=torch.bool)
        mask[0, :, :, -2:] = True
    grad_out = torch.randn(s, b, 8 * 16, generator=g)
    results = []
    for native in (False, True):
        attn.native_gqa = native
        q, k, v = (x.clone().requires_grad_(True) for x in (q0, k0, v0))
        out = attn(q, k, v, mask)
        out.backward(grad_out)
        results.append((out.detach(), q.grad, k.grad, v.grad))
    assert results[0][0].shape == (s, b, 8 * 16)
    for a, b_ in zip(results[0], results[1]):
        torch.testing.assert_close(b_, a, rtol=1e-5, atol=1e-6)
    # and both are attention: a direct softmax reference for the forward
    kr, vr = (x.repeat_interleave(4, dim=2) for x in (k0, v0))
    scores = torch.einsum("sbhd,tbhd->bhst", q0, kr) / 4.0
    scores = scores.masked_fill(mask, float("-inf"))
    ref = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), vr).reshape(s, b, -1)
    torch.testing.assert_close(results[1][0], ref, rtol=1e-5, atol=1e-5)


# ---- on a GPU only (skipped on CPU CI): the compiled RoPE and the SDPA backends' GQA ----------------------

@pytest.fixture
def cuda_process():
    """This file's CPU models leave megatron's CPU state up in the test process, with its shim answering
    ``torch.cuda.current_device()`` with "cpu"; inductor asks it for the card to compile for. On an H100 the whole
    file failed its four compiling CUDA tests (list indices must be integers ... not str), each alone passed."""
    from runtime.mcore.env import destroy_parallel
    destroy_parallel()


def needs_cuda(test):
    return pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(
        pytest.mark.usefixtures("cuda_process")(test))


@needs_cuda
def test_compiled_rope_on_cuda_matches_megatron():
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    for grad in (False, True):
        for s, b, h in ((64, 4, 16), (64, 4, 8), (96, 1, 8)):
            t = torch.randn(s, b, h, 128, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
            f = _freqs(s, 128, False).cuda()
            with torch.set_grad_enabled(grad):
                y = mf.fused_apply_rotary_pos_emb(t, f, interleaved=False)
                ref = _apply_rotary_pos_emb_bshd(t, f)
            # compiled code may skip eager's intermediate bf16 roundings: one bf16 ulp at |x| < 8
            torch.testing.assert_close(y, ref, rtol=0, atol=0.0625)
            if grad:
                g = torch.randn_like(y)
                (a,) = torch.autograd.grad(y, t, g)
                (r,) = torch.autograd.grad(ref, t, g)
                torch.testing.assert_close(a, r, rtol=0, atol=0.125)
    assert mf._ROPE["error"] is None, mf._ROPE["error"]


@needs_cuda
@pytest.mark.parametrize("deterministic", [False, True])
def test_compiled_rms_norm_on_cuda_matches_torchs(deterministic):
    from runtime.mcore.determinism import deterministic_kernels
    with deterministic_kernels(deterministic):
        _compiled_rms_norm_matches_torchs()


def _compiled_rms_norm_matches_torchs():
    for shape in ((4099, 1024), (4099, 16, 128)):
        x = (torch.randn(*shape, device="cuda") * 3).bfloat16().requires_grad_()
        w = (torch.randn(shape[-1], device="cuda") * 0.1 + 1).bfloat16().requires_grad_()
        norm = mf.CompiledRMSNorm(shape[-1], eps=1e-6, device="cuda", dtype=torch.bfloat16)
        norm.weight.data.copy_(w)
        y, ref = norm(x), torch.nn.functional.rms_norm(x, (shape[-1],), w, 1e-6)
        torch.testing.assert_close(y, ref, rtol=0.0079, atol=0.0079)  # one bf16 ulp
        gy = torch.randn_like(y)
        (dx,) = torch.autograd.grad(y, x, gy)
        (rx,) = torch.autograd.grad(ref, x, gy)
        torch.testing.assert_close(dx, rx, rtol=0.02, atol=0.02)
    assert mf._NORM["error"] is None, mf._NORM["error"]


@needs_cuda
def test_the_deterministic_norms_weight_gradient_is_the_same_whatever_token_count_compiled_it():
    """Compiled afresh on a first call of 3000 tokens, then of 12000, each in empty caches (a cached graph would be
    handed back whatever its token count): the same later call gives the same bits (an fp32 weight, so no rounding to
    bf16 hides a sum taken in another order)."""
    from torch._inductor import utils as inductor_utils

    from runtime.mcore.determinism import deterministic_kernels
    fresh_cache = getattr(inductor_utils, "fresh_cache", None) or inductor_utils.fresh_inductor_cache
    g = torch.Generator(device="cuda").manual_seed(5)
    w0 = 1 + 0.1 * torch.randn(1024, device="cuda", generator=g)
    x, gy = torch.randn(9216, 1024, device="cuda", generator=g).bfloat16(), torch.randn(9216, 1024, device="cuda", generator=g)
    grads = []
    for first in (3000, 12000):
        torch._dynamo.reset()
        norm = mf.deterministic_norm()
        with fresh_cache(), deterministic_kernels(True):
            w = w0.clone().requires_grad_()
            norm(torch.randn(first, 1024, device="cuda").bfloat16(), w, 1e-6).float().sum().backward()
            w = w0.clone().requires_grad_()
            norm(x, w, 1e-6).backward(gy.bfloat16())
        grads.append(w.grad)
    assert torch.equal(grads[0], grads[1])


@needs_cuda
@pytest.mark.parametrize("backend", ["CUDNN_ATTENTION", "FLASH_ATTENTION"])
def test_sdpa_backends_take_native_gqa_on_megatron_layout(backend):
    """cuDNN (what H100 picks) and flash accept enable_gqa on permuted [s, b, h, d] views (no
    'No available kernel' error) and match the repeat_interleave path; cuDNN returns the output in
    the [s, b, h, d] layout, so SdpaCoreAttention's final reshape is a view."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    F = torch.nn.functional
    s, b, h, g, d = 256, 4, 16, 8, 128
    q, k, v = (torch.randn(s, b, n, d, device="cuda", dtype=torch.bfloat16) for n in (h, g, g))
    q, k, v = (x.permute(1, 2, 0, 3) for x in (q, k, v))
    with sdpa_kernel(getattr(SDPBackend, backend)):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        ref = F.scaled_dot_product_attention(q, k.repeat_interleave(h // g, 1), v.repeat_interleave(h // g, 1),
                                             is_causal=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-2)
    if backend == "CUDNN_ATTENTION":  # cuDNN allocates the output in the query's layout (MHA.cpp)
        assert out.permute(2, 0, 1, 3).is_contiguous()
