"""The trainer's memory settings on CPU (issue 17): activation recomputation, micro-batches by a token
budget packed without padding, and the state offload of the colocated hand-off. Each must leave the
update as it was: recompute bitwise, packing within float tolerance (other attention kernel, other
summation order), offload bitwise."""
from __future__ import annotations

import pytest
import torch

from runtime.config import AlgorithmSection, TrainSection
from runtime.trainer.batch import TrainBatch, pack_varlen, token_budget_micro_batches


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random tiny Qwen3 (3 layers, GQA) and its torch_dist conversion."""
    from runtime.mcore.convert import hf_to_torch_dist
    from runtime.models.tiny import build_tiny_qwen3

    work = tmp_path_factory.mktemp("trainer-memory")
    info = build_tiny_qwen3(work / "hf", seed=3, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                            head_dim=16, ffn_hidden_size=128)
    hf_to_torch_dist(work / "hf", work / "td")
    return {"hf": str(work / "hf"), "td": str(work / "td"), "vocab": info["vocab_size"]}


def _trainer(tiny, dtype="float32", algorithm=None, **train):
    from runtime.trainer.megatron_trainer import MegatronTrainer
    t = TrainSection(**{"lr": 1e-3, "global_batch_size": 6, "micro_batch_size": 2, "num_rollout": 4, **train})
    return MegatronTrainer(hf_dir=tiny["hf"], init_checkpoint=tiny["td"], train=t,
                           algorithm=algorithm or AlgorithmSection(use_tis=True), temperature=1.0, dtype=dtype)


def _batch(vocab: int, lengths=((5, 9), (3, 4), (7, 13), (4, 2), (6, 7), (2, 11)), seed: int = 0) -> TrainBatch:
    """Samples of different prompt and response lengths (some loss-masked tokens), fixed advantages."""
    g = torch.Generator().manual_seed(seed)
    tokens, masks = [], []
    for p, r in lengths:
        tokens.append(torch.randint(3, vocab, (p + r,), generator=g).tolist())
        m = [1] * r
        if r > 3:
            m[1] = 0  # e.g. a tool-output token: not trained on
        masks.append(m)
    return TrainBatch(tokens=tokens, prompt_lens=[p for p, _ in lengths],
                      advantages=[1.0, -0.5, 0.25, -1.0, 0.75, -0.25][:len(lengths)], loss_masks=masks,
                      rollout_logprobs=[[-2.0] * r for _, r in lengths])


def _grads(tr) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in tr.grads().items()}


# ---- recompute -------------------------------------------------------------------------------------------

class _Calls:
    """Counts forward calls of a module (a recomputed module runs again in the backward)."""

    def __init__(self, module):
        self.n = 0
        module.register_forward_hook(lambda *_: self._hit())

    def _hit(self):
        self.n += 1


@pytest.mark.parametrize("setting,mlp_calls_per_micro_batch,bitwise", [
    (dict(recompute="selective", recompute_modules=["mlp"]), 2, True),
    (dict(recompute="full"), 2, True),
    (dict(recompute="full", recompute_num_layers=1), 1, True),  # layer 0 recomputed; layer 1 (counted) keeps its own
    # the norms' recompute (megatron's CheckpointWithoutOutput) runs their backward inside its own
    # autograd.backward, so the residual stream's three gradient terms are summed in another order:
    # equal to a few fp32 ulps, not bitwise
    (dict(recompute="selective", recompute_modules=["layernorm", "mlp"]), 2, False),
])
def test_recompute_gives_bitwise_equal_gradients(tiny, setting, mlp_calls_per_micro_batch, bitwise):
    batch = _batch(tiny["vocab"])
    base = _trainer(tiny)
    m_base = base.train(batch)
    want = _grads(base)
    tr = _trainer(tiny, **setting)
    calls = _Calls(tr.model.decoder.layers[1].mlp)
    m = tr.train(batch)
    assert tr.model.config.recompute_granularity == setting["recompute"]
    # the recomputation ran (3 micro-batches of 2 samples) ...
    assert calls.n == 3 * mlp_calls_per_micro_batch
    # ... and changed nothing
    got = _grads(tr)
    assert got.keys() == want.keys()
    for k in want:
        if bitwise:
            assert torch.equal(got[k], want[k]), k
        else:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-8, msg=k)
    assert m["loss"] == m_base["loss"]  # the forward is the same
    assert m["grad_norm"] == m_base["grad_norm"] if bitwise else m["grad_norm"] == pytest.approx(m_base["grad_norm"])


# ---- micro-batches by token budget, packed ------------------------------------------------------------------

def test_token_budget_micro_batches():
    lengths = [14, 7, 20, 6, 13, 13]
    bins = token_budget_micro_batches(list(range(6)), lengths, 27)
    # longest first, each into the first micro-batch with room: 20+7, 14+13, 13+6
    assert bins == [[2, 1], [0, 4], [5, 3]]
    assert all(sum(lengths[i] for i in b) <= 27 for b in bins)
    assert sorted(i for b in bins for i in b) == list(range(6))
    with pytest.raises(ValueError, match="longer than train.max_tokens_per_micro_batch=19"):
        token_budget_micro_batches([0, 2], lengths, 19)


def test_pack_varlen_layout():
    batch = _batch(50, lengths=((2, 3), (3, 1)))
    mb = pack_varlen(batch, [1, 0])
    assert mb.input_ids.shape == (1, 9) and mb.cu_seqlens.tolist() == [0, 4, 9] and mb.max_seqlen == 5
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4]]  # positions restart per sample
    assert mb.input_ids[0].tolist() == batch.tokens[1] + batch.tokens[0]
    # sample layout: row 0 = sample 1 (prompt 3, 1 response token), row 1 = sample 0 (prompt 2, 3 tokens)
    assert mb.resp_mask.tolist() == [[0, 0, 1, 0], [0, 1, 1, 1]]
    # the forward-layout target of each sample position: sample 1 at 0..2, sample 0 at 4..7
    assert mb.row_index[mb.row_valid].tolist() == [0, 1, 2, 4, 5, 6, 7]
    flat = torch.arange(8.0).view(1, 8)
    assert mb.to_rows(flat).tolist() == [[0, 1, 2, 0], [4, 5, 6, 7]]
    assert mb.loss_select().tolist() == [[False, False, True, False, False, True, True, True]]
    assert mb.response_select(batch).tolist() == mb.loss_select().tolist()


@pytest.mark.parametrize("loss_agg,chunked,recompute", [("token_mean", "off", "none"), ("seq_mean", "on", "full")])
def test_packed_update_equals_the_unpacked_one(tiny, loss_agg, chunked, recompute):
    batch = _batch(tiny["vocab"])
    algo = AlgorithmSection(use_tis=True, loss_agg=loss_agg, entropy_coef=0.01)
    plain = _trainer(tiny, algorithm=algo, chunked_logprobs=chunked)
    packed = _trainer(tiny, algorithm=algo, chunked_logprobs=chunked, max_tokens_per_micro_batch=30,
                      recompute=recompute)
    assert type(packed.model.decoder.layers[0].self_attention.core_attention).__name__ == "SdpaCoreAttention"
    lp_plain, lp_packed = plain.compute_logprobs(batch), packed.compute_logprobs(batch)
    for a, b in zip(lp_plain, lp_packed):
        assert len(a) == len(b)
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=0, atol=1e-5)
    m_plain, m_packed = plain.train(batch), packed.train(batch)
    # the loss is normalised per step, whatever the micro-batches: the same loss and metrics
    for k in ("loss", "pg_loss", "entropy", "grad_norm", "train_rollout_logp_absdiff"):
        if k in m_plain:
            assert m_packed[k] == pytest.approx(m_plain[k], rel=1e-5, abs=1e-6), k
    assert m_packed["train_tokens"] == m_plain["train_tokens"] == batch.response_token_count()
    g_plain, g_packed = _grads(plain), _grads(packed)
    for k in g_plain:
        torch.testing.assert_close(g_packed[k], g_plain[k], rtol=1e-4, atol=1e-6, msg=k)
    assert max(v.abs().max() for v in g_plain.values()) > 1e-3  # a real update, not zeros


def test_block_causal_attention_is_per_sample_causal_attention():
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from runtime.mcore.env import SdpaCoreAttention

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                               kv_channels=16, attention_dropout=0.0, hidden_dropout=0.0)
    pg = type("PG", (), {"tp": type("TP", (), {"size": staticmethod(lambda: 1)})})()
    attn = SdpaCoreAttention(config, 1, AttnMaskType.causal, "self", pg_collection=pg)
    lens = [5, 1, 7]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lens), n, 16, generator=g, requires_grad=True) for n in (8, 2, 2))
    cu = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    out = attn(q, k, v, None, packed_seq_params=PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7))
    assert out.shape == (13, 8 * 16)
    for s, e in ((0, 5), (5, 6), (6, 13)):  # each sample alone, unpacked [s, b=1, h, d]
        ref = attn(q[s:e, None], k[s:e, None], v[s:e, None], None)
        torch.testing.assert_close(out[s:e], ref[:, 0], rtol=1e-6, atol=1e-6)


# ---- the colocated hand-off: state off the device and back ---------------------------------------------------

def _state(tr) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tr.offload._tensors()]


@pytest.mark.parametrize("distributed", [False, True], ids=["replicated", "distributed_optimizer"])
def test_offload_round_trip_restores_the_state_bitwise(tiny, distributed):
    batch = _batch(tiny["vocab"])
    a, b = (_trainer(tiny, dtype="bfloat16", distributed_optimizer=distributed) for _ in range(2))
    a.train(batch)
    b.train(batch)
    before = _state(a)
    # fp32 DDP grads, fp32 master weights (bf16 params), Adam's two moments per master weight (distributed:
    # this DP rank's shards of them, here all of them at DP 1); never the weights themselves
    n_params = len(list(a.model.parameters()))
    assert len(before) == len(a.ddp.buffers) + 3 * n_params
    weights = {p.untyped_storage().data_ptr() for p in a.model.parameters()}
    assert not weights & {st.data_ptr() for st in a.offload._unique_storages(force=True)}
    assert a.offload_state() == {"bytes": 0.0, "seconds": 0.0}  # on CPU without force: nothing moves
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    assert RotaryEmbedding.forward.cache_info().currsize > 0  # the step's rotary tables, one per sequence length
    moved = a.offload_state(force=True)
    assert moved["bytes"] == sum(t.untyped_storage().nbytes() for t in before) > 0
    # nothing the step grew stays: a table made mid-step would keep a GPU segment reserved beside the engine
    assert RotaryEmbedding.forward.cache_info().currsize == 0
    assert all(t.untyped_storage().nbytes() == 0 for t in a.offload._tensors())  # the device memory is freed
    a.reload_state()
    for x, y in zip(before, _state(a)):
        assert torch.equal(x, y)
    # a second step after the round trip equals one without it (train() reloads by itself, too)
    a.offload_state(force=True)
    a.train(_batch(tiny["vocab"], seed=1))
    b.train(_batch(tiny["vocab"], seed=1))
    for x, y in zip(_state(a), _state(b)):
        assert torch.equal(x, y)


# ---- on a GPU only: FlashAttention's variable-length kernel ----------------------------------------------------

def _installed(module: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kernel", ["flash2", pytest.param("fa4", marks=pytest.mark.skipif(
    not _installed("flash_attn.cute"), reason="needs flash-attn-4"))])
def test_flash_varlen_equals_per_sample_sdpa_on_cuda(kernel):
    """Each packed-attention kernel on CUDA (train.packed_attention, over cu_seqlens, K/V at their own
    heads): output and q/k/v gradients equal per-sample causal SDPA within bf16 noise."""
    from runtime.mcore.varlen_attention import KERNELS
    flash_varlen_attention = KERNELS[kernel]

    lens = [300, 1, 517, 64]
    cu = torch.tensor([0, 300, 301, 818, 882], dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(sum(lens), n, 128, generator=g, device="cuda", dtype=torch.bfloat16)
               for n in (16, 8, 8))
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    out = flash_varlen_attention(q, k, v, cu, cu, max(lens), max(lens), 128 ** -0.5)
    grad = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    refs, start = [], 0
    for n in lens:
        qs, ks, vs = (x[start:start + n].transpose(0, 1)[None] for x in (q, k, v))
        refs.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                                                     enable_gqa=True)[0].transpose(0, 1))
        start += n
    ref = torch.cat(refs)
    rq, rk, rv = torch.autograd.grad(ref, (q, k, v), grad)
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-2)
    for a, b in ((dq, rq), (dk, rk), (dv, rv)):
        torch.testing.assert_close(a, b, rtol=0, atol=5e-2)


@pytest.mark.skipif(_installed("flash_attn.cute"), reason="flash-attn-4 is installed here")
def test_packed_attention_fa4_without_the_package_is_a_one_line_error():
    from runtime.errors import ConfigError
    from runtime.mcore.varlen_attention import check_available

    check_available("flash2")
    with pytest.raises(ConfigError) as err:
        check_available("fa4")
    msg = str(err.value)
    assert "\n" not in msg and "train.packed_attention=fa4" in msg and "train.packed_attention=flash2" in msg
    assert "pip install 'grpoflow[fa4]'" in msg


def test_grad_dtype_sets_the_gradient_buffer(tiny):
    """train.grad_dtype: bf16 weights keep fp32 gradients by default and bf16 ones (half the memory) on
    request; the step still trains (same loss, grad norm within bf16 rounding)."""
    batch = _batch(tiny["vocab"])
    out = {}
    for grad_dtype in ("float32", "bfloat16"):
        tr = _trainer(tiny, dtype="bfloat16", grad_dtype=grad_dtype)
        assert {b.grad_data.dtype for b in tr.ddp.buffers} == {getattr(torch, grad_dtype)}
        out[grad_dtype] = tr.train(batch)
    assert out["bfloat16"]["loss"] == out["float32"]["loss"]
    assert abs(out["bfloat16"]["grad_norm"] - out["float32"]["grad_norm"]) <= 1e-2 * out["float32"]["grad_norm"]


# ---- train.deterministic ------------------------------------------------------------------------------------

def _modes_seen(model) -> list[tuple[str, bool, bool]]:
    """(forward or backward, deterministic mode on, warn-only) each time the model's output layer runs."""
    seen: list[tuple[str, bool, bool]] = []

    def mode(kind):
        return lambda *_: seen.append((kind, torch.are_deterministic_algorithms_enabled(),
                                       torch.is_deterministic_algorithms_warn_only_enabled()))
    from runtime.mcore.env import unwrap_model
    head = unwrap_model(model).output_layer
    head.register_forward_pre_hook(mode("forward"))
    head.register_full_backward_pre_hook(mode("backward"))
    return seen


def test_train_deterministic_is_on_while_the_trainer_computes_and_keeps_the_update(tiny):
    """train.deterministic (the default): torch's deterministic kernels while the trainer runs its model, warn-only in
    the forwards and strict in the backward (cuBLAS's workspace fixed at construction), and the process's mode as it
    was outside (an engine in the same process keeps its kernels). On CPU, deterministic already, the same update."""
    import os
    batch = _batch(tiny["vocab"])
    plain = _trainer(tiny, dtype="bfloat16", deterministic=False)
    strict = _trainer(tiny, dtype="bfloat16")
    assert strict.train_cfg.deterministic and os.environ["CUBLAS_WORKSPACE_CONFIG"] in (":4096:8", ":16:8")
    off, on = _modes_seen(plain.model), _modes_seen(strict.model)
    strict.compute_logprobs(batch)
    a, b = plain.train(batch), strict.train(batch)
    assert not torch.are_deterministic_algorithms_enabled()  # outside the trainer's calls
    assert {m for m in off} == {("forward", False, False), ("backward", False, False)}
    assert {m for m in on} == {("forward", True, True), ("backward", True, False)}
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    for x, y in zip(plain.model.parameters(), strict.model.parameters()):
        assert torch.equal(x, y)


def test_the_backward_is_strict_only_where_deterministic_mode_is_on():
    """torch's FlashAttention backward takes its deterministic kernel only in strict mode: the trainer's backward runs
    strict under (warn-only) deterministic mode, and the mode is as it was afterwards."""
    from runtime.mcore.determinism import strict_if_deterministic
    for enabled, warn_only, inside in ((False, False, (False, False)), (True, True, (True, False)),
                                       (True, False, (True, False))):
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        try:
            with strict_if_deterministic():
                seen = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
            after = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
        finally:
            torch.use_deterministic_algorithms(False)
        assert seen == inside and after == (enabled, warn_only)

