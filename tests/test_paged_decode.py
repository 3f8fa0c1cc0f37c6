"""The built-in engine's paged decoder on CPU (fp32, tiny Qwen3): the same tokens as HF's forward,
preempted-and-continued sequences the same as uninterrupted ones, and a pool that never leaks."""
from __future__ import annotations

import pytest
import torch

from runtime.rollout import BuiltinEngine, SampleRequest, SamplingParams
from runtime.rollout.kv_pages import PagePool, PoolExhausted, kv_bytes_per_token, kv_pool_pages, pages_for

PAGE = 4  # small pages: prompts and responses span several, and a tiny pool preempts


@pytest.fixture(scope="module", autouse=True)
def single_cpu_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from test_rollout import _build_tiny_model
    d = tmp_path_factory.mktemp("tiny_paged")
    _build_tiny_model(d)
    return str(d)


@pytest.fixture(scope="module")
def hf(model_dir):
    return BuiltinEngine(model_dir, decode_path="hf")


def _paged(model_dir, rows: int, pages: int | None = None, sync_every: int = 16, cascade: bool = False) -> BuiltinEngine:
    from transformers import AutoConfig
    per_page = PAGE * kv_bytes_per_token(AutoConfig.from_pretrained(model_dir), "float32")
    gb = None if pages is None else pages * per_page / 2**30
    eng = BuiltinEngine(model_dir, decode_path="paged", max_batch_size=rows, page_size=PAGE, kv_cache_gb=gb,
                        sync_every=sync_every, cascade_attention=cascade)
    assert eng.decode_path == "paged" and (pages is None or eng.decoder.kv_cache_bytes() == 0)
    return eng


def _requests() -> list[SampleRequest]:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 100, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
               for _ in range(6)]
    # groups of 3 share a prompt (its pages prefilled once); prompt 0 comes back after its group finished
    which = [0, 0, 0, 1, 1, 1, 2, 2, 2, 0, 3, 4, 5]
    return [SampleRequest(prompt_ids=prompts[w], key=(1, 2, i // 3, i % 3)) for i, w in enumerate(which)]


SAMPLINGS = (SamplingParams(max_new_tokens=14, stop_token_ids=[5, 6, 7]),
             SamplingParams(temperature=0.7, top_p=0.9, top_k=30, max_new_tokens=9),
             SamplingParams(temperature=0.0, max_new_tokens=5))


def _same(a, b) -> None:
    assert [r.response_ids for r in a] == [r.response_ids for r in b]
    assert [r.finish_reason for r in a] == [r.finish_reason for r in b]
    assert max(abs(p - q) for x, y in zip(a, b) for p, q in zip(x.response_logprobs, y.response_logprobs)) < 1e-5


def test_paged_draws_the_hf_paths_tokens(model_dir, hf):
    paged = _paged(model_dir, rows=3)  # 3 rows for 13 requests: rows are refilled while others decode
    reqs = _requests()
    for sp in SAMPLINGS:
        _same(hf.generate(reqs, sp), paged.generate(reqs, sp))
        st = paged.decoder.stats
        assert st["max_active"] <= 3 and st["preemptions"] == 0
        assert 6 <= st["prefills"] < len(reqs)  # a shared prompt is prefilled once while a sample holds it
        assert paged.decoder.pool.used == 0  # every page back
        assert int(paged.decoder.live.sum()) == 0 and int(paged.decoder.table.abs().sum()) == 0
    assert {r.finish_reason for r in paged.generate(reqs, SAMPLINGS[0])} == {"stop", "length"}
    # 12 rows (batch buckets of 8 and 12), the requests of rows 8-11 long (forced stops: `stop_at`): once
    # the short ones finished (in the first chunk; the second is already queued in the bucket of 12), the
    # long rows move down to rows 0-3 and decode their third chunk in the bucket of 8
    from runtime.rollout.keyed_sampling import sample_key_hash
    prompts, kh = [r.prompt_ids for r in reqs[:12]], sample_key_hash(torch.tensor([r.key for r in reqs[:12]]))
    lengths, sp = [2] * 8 + [37, 38, 39, 40], SamplingParams(max_new_tokens=40)
    wide = _paged(model_dir, rows=12)
    got = wide.decoder.generate(prompts, kh, sp, set(), stop_at=lengths)
    assert wide.decoder.stats["compactions"] > 0 and wide.decoder.pool.used == 0
    narrow = paged.decoder.generate(prompts, kh, sp, set(), stop_at=lengths)  # 3 rows: never moved
    assert got[0] == narrow[0] and got[2] == narrow[2]
    assert max(abs(p - q) for x, y in zip(got[1], narrow[1]) for p, q in zip(x, y)) < 1e-5
    assert [len(x) for x in got[0]] == lengths and got[2] == ["stop"] * 11 + ["length"]
    # weights pushed into the engine reach the decoder's fused buffers
    new = {k: v * 1.05 for k, v in hf.model.state_dict().items()}
    other_hf = BuiltinEngine(model_dir, decode_path="hf")
    other_hf.update_weights(new, 1)
    paged.update_weights(new, 1)
    _same(other_hf.generate(reqs, SAMPLINGS[0]), paged.generate(reqs, SAMPLINGS[0]))


def test_a_chunk_queued_before_the_last_is_read_changes_no_token(model_dir, hf):
    """All 13 requests in rows at once and chunks of 4 steps: each chunk is queued before the last one's
    tokens are read, so rows that stopped run one more chunk for nobody; the tokens, log-probs and finish
    reasons are those of the same engine waiting every chunk, and of HF's path, also when the caller stops
    with a chunk queued."""
    from runtime.rollout import GroupsDone
    ahead, waits = _paged(model_dir, rows=13, sync_every=4), _paged(model_dir, rows=13, sync_every=4)
    waits.decoder.overlap_chunks = False
    reqs = _requests()
    for sp in (SamplingParams(max_new_tokens=20, stop_token_ids=[5, 6, 7]), SAMPLINGS[1]):
        got = ahead.generate(reqs, sp)
        _same(waits.generate(reqs, sp), got)
        _same(hf.generate(reqs, sp), got)
        assert ahead.decoder.stats["queued_ahead"] > 0 and waits.decoder.stats["queued_ahead"] == 0
        assert ahead.decoder.pool.used == 0 and int(ahead.decoder.live.sum()) == 0
    sp = SamplingParams(max_new_tokens=20, stop_token_ids=[5, 6, 7])
    until = GroupsDone(group_size=3, count=1)
    got = ahead.generate(reqs, sp, until=until)
    _same(waits.generate(reqs, sp, until=until), got)
    assert "abort" in [r.finish_reason for r in got] and ahead.decoder.stats["queued_ahead"] > 0
    assert ahead.decoder.pool.used == 0 and int(ahead.decoder.table.abs().sum()) == 0


def test_cascade_attention_draws_the_same_tokens_and_the_same_bits_twice(model_dir, hf):
    """rollout.cascade_attention: a group's prompt pages read once per step for its rows (here lines of 2, so a group
    of 3 is cut in two), merged with each row's own pages by log-sum-exp. The tokens of the plain engine (and HF's),
    log-probs within float noise, the same bits twice and from a fresh engine (the resume contract), also with
    rows preempted and with a caller that stops once a group is complete."""
    from runtime.rollout import GroupsDone

    def cascade(rows, **kw):
        eng = _paged(model_dir, rows=rows, cascade=True, **kw)
        eng.decoder.group_rows = 2
        lines = []
        set_groups = eng.decoder.set_groups
        eng.decoder.set_groups = lambda *a: (set_groups(*a), lines.append(eng.decoder.groups.clone()))[0]
        return eng, lines

    reqs, sp = _requests(), SAMPLINGS[0]
    plain = _paged(model_dir, rows=6)
    on, lines = cascade(6)
    got = on.generate(reqs, sp)
    _same(plain.generate(reqs, sp), got)
    assert on.decoder.stats["attention"] == "sdpa_paged_reference_cascade" and on.health()["cascade_attention"]
    assert any(((g >= 0).sum(1) == 2).any() for g in lines)  # some step read a prompt once for two rows
    again, fresh = on.generate(reqs, sp), cascade(6)[0].generate(reqs, sp)
    for other in (again, fresh):
        assert [r.response_ids for r in other] == [r.response_ids for r in got]
        assert [r.response_logprobs for r in other] == [r.response_logprobs for r in got]
    # 12 pages of 4 tokens for 6 rows: rows preempted and prefilled again
    small = cascade(6, pages=12)[0]
    _same(hf.generate(reqs, SamplingParams(max_new_tokens=20)), small.generate(reqs, SamplingParams(max_new_tokens=20)))
    assert small.decoder.stats["preemptions"] > 0 and small.decoder.pool.used == 0
    until = GroupsDone(group_size=3, count=1)
    _same(plain.generate(reqs, sp, until=until), on.generate(reqs, sp, until=until))
    assert int(on.decoder.table.abs().sum()) == 0 and on.decoder.pool.used == 0


def test_each_decode_chunk_is_a_moment_named_by_its_place_in_the_call(model_dir, tmp_path, monkeypatch):
    """`decode-chunk-<k>` is reached once a generate call's k-th decode chunk is read
    (runtime/testing/moments.py); `decode-chunk-2#2` is the second call in a process to reach its 2nd chunk.
    The fault bench (bench/ray_faults.py) pauses an engine there, mid-rollout, and kills it."""
    from collections import Counter

    from runtime.testing import moments
    monkeypatch.setattr(moments, "_hits", Counter())  # hits of earlier tests in this process
    root, snaps = tmp_path / "root", tmp_path / "snaps"
    root.mkdir()
    monkeypatch.setenv("GRPOFLOW_TEST_SNAPSHOT_AT", "decode-chunk-2#2,decode-chunk-5,decode-chunk-6")
    monkeypatch.setenv("GRPOFLOW_TEST_SNAPSHOT_ROOT", str(root))
    monkeypatch.setenv("GRPOFLOW_TEST_SNAPSHOT_DIR", str(snaps))
    eng = _paged(model_dir, rows=13, sync_every=4)
    sp = SamplingParams(max_new_tokens=20)  # no stop: 19 steps after the prefill's token, in 5 chunks of <= 4
    eng.generate(_requests(), sp)
    assert sorted(p.name for p in snaps.iterdir()) == ["decode-chunk-5"]
    eng.generate(_requests(), sp)
    assert sorted(p.name for p in snaps.iterdir()) == ["decode-chunk-2#2", "decode-chunk-5"]


def test_preempted_sequences_continue_with_the_same_tokens(model_dir, hf):
    reqs = _requests()
    sp = SamplingParams(max_new_tokens=20)
    uninterrupted = hf.generate(reqs, sp)
    # 12 pages of 4 tokens for 6 rows: the pool runs out, the newest rows give their pages back and are
    # prefilled again (prompt + the tokens they made) when pages free up
    small = _paged(model_dir, rows=6, pages=12)
    _same(uninterrupted, small.generate(reqs, sp))
    st = small.decoder.stats
    assert st["preemptions"] > 0 and st["reprefill_tokens"] > 0
    assert st["peak_pages_used"] <= small.decoder.pool.capacity == 11 and small.decoder.pool.used == 0


def test_a_prefill_pack_of_preempted_rows_keeps_to_its_budget(model_dir, hf):
    """Preempted rows of one group come back prefilling their prompt again (its pages held by the group) and
    their tokens: the pack's budget counts that prompt (it counted only the tokens, and a pack of 40 tokens
    took 48: the plan's rollout working set assumes the budget)."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 100, (10,), generator=g).tolist()
    reqs = [SampleRequest(prompt_ids=prompt, key=(1, 2, 0, i)) for i in range(8)]
    sp = SamplingParams(max_new_tokens=24)  # a sample's longest re-prefill, 10 + 23 tokens, is under the budget
    eng = _paged(model_dir, rows=8, pages=16, sync_every=4)
    eng.decoder.prefill_tokens = 40
    _same(hf.generate(reqs, sp), eng.generate(reqs, sp))
    st = eng.decoder.stats
    assert st["preemptions"] > 1 and st["reprefill_tokens"] > 40  # several rows came back
    assert 0 < st["prefill_pack_max"] <= 40


def test_pool_accounting_never_leaks(model_dir, hf, monkeypatch):
    reqs = _requests()
    sp = SamplingParams(max_new_tokens=20)
    eng = _paged(model_dir, rows=6, pages=12)
    dec = eng.decoder
    # a failure part-way through a call (at the first step after a preemption, while rows hold prompt and
    # own pages): every page is back, and the next call is exact
    real_step = dec._run_step

    def failing_step(*a, **k):
        if dec.stats["preemptions"]:
            raise RuntimeError("injected failure")
        return real_step(*a, **k)

    monkeypatch.setattr(dec, "_run_step", failing_step)
    with pytest.raises(RuntimeError, match="injected"):
        eng.generate(reqs, sp)
    assert dec.pool.used == 0 and dec.stats["preemptions"] > 0
    monkeypatch.setattr(dec, "_run_step", real_step)
    _same(hf.generate(reqs, sp), eng.generate(reqs, sp))
    assert dec.pool.used == 0
    # a prompt longer than the whole pool: one clear error, nothing held
    with pytest.raises(MemoryError, match="rollout.kv_cache_gb"):
        eng.generate([SampleRequest(prompt_ids=list(range(3, 50)), key=(0, 0, 0, 0))], sp)
    assert dec.pool.used == 0


def test_release_and_resume_memory(model_dir, hf):
    eng = _paged(model_dir, rows=4)
    reqs, sp = _requests(), SAMPLINGS[0]
    first = eng.generate(reqs, sp)
    assert eng.decoder.kv_cache_bytes() > 0
    eng.release_memory()
    assert eng.decoder.kv_cache_bytes() == 0 and eng.decoder.pool is None
    eng.update_weights({k: v.clone() for k, v in hf.model.state_dict().items()}, 3)  # weights stay usable
    eng.resume_memory()
    assert eng.decoder.kv_cache_bytes() > 0
    _same(first, eng.generate(reqs, sp))
    eng.release_memory()
    _same(first, eng.generate(reqs, sp))  # generate makes the pool itself when nobody resumed it


def test_page_pool_and_its_size():
    pool = PagePool(6, 16)
    a = pool.alloc(3)
    assert 0 not in a and pool.free == 2 and pool.capacity == 5  # page 0 is the null page
    pool.share(a[:2])
    pool.release(a)
    assert pool.used == 2  # the shared pages still have a holder
    with pytest.raises(PoolExhausted):
        pool.alloc(4)
    pool.release(a[:2])
    pool.check_all_free()
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release(a[:1])

    from transformers import Qwen3Config
    cfg = Qwen3Config(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128)
    assert kv_bytes_per_token(cfg, "bfloat16") == 114688  # Qwen3-0.6B: 112 KiB per token
    got = kv_pool_pages(cfg, 7.0, 16, "bfloat16")
    assert got["pages"] == 7 * 2**30 // (16 * 114688) and got["tokens"] == (got["pages"] - 1) * 16
    assert kv_pool_pages(cfg, None, 16, "bfloat16", "cuda", free_bytes=10 * 2**30)["bytes"] <= 0.85 * 10 * 2**30


def test_decode_path_setting(model_dir, tmp_path):
    from runtime.config import GrpoConfig
    from runtime.errors import ConfigError
    from runtime.rollout.factory import make_engine

    cfg = GrpoConfig(rollout={"decode_path": "hf"})
    assert make_engine(cfg=cfg, model_dir=model_dir, device="cpu", dtype="float32").decode_path == "hf"
    cfg = GrpoConfig(rollout={"kv_cache_gb": 0.001})
    eng = make_engine(cfg=cfg, model_dir=model_dir, device="cpu", dtype="float32")
    assert eng.decode_path == "paged" and eng.decoder.kv_cache_gb == 0.001  # auto: the family has it
    with pytest.raises(ConfigError, match="decode_path"):
        BuiltinEngine(model_dir, decode_path="fast")


# ---- partial rollout's engine side: continued samples, and stopping once enough groups are complete ----------

def _continued(reqs, results, cut) -> list[SampleRequest]:
    """Each request again, with the first cut(i, result) tokens of its result as its prefix."""
    out = []
    for i, (q, r) in enumerate(zip(reqs, results)):
        t = cut(i, r)
        out.append(SampleRequest(prompt_ids=q.prompt_ids, key=q.key, prefix_ids=r.response_ids[:t],
                                 prefix_logprobs=r.response_logprobs[:t]))
    return out


@pytest.mark.parametrize("path", ["paged", "hf"])
def test_a_continued_sample_is_the_uninterrupted_sample(model_dir, hf, path):
    eng = _paged(model_dir, rows=4) if path == "paged" else hf
    reqs = _requests()
    for sp in SAMPLINGS[:2]:
        whole = hf.generate(reqs, sp)
        # cut every sample after 0, 1, ... tokens (a cut at or past its end leaves it complete)
        for k in (1, 3, 7):
            again = eng.generate(_continued(reqs, whole, lambda i, r: (i * k) % (len(r.response_ids) + 1)), sp)
            _same(whole, again)
    if path == "paged":
        assert eng.decoder.stats["reprefill_tokens"] > 0 and eng.decoder.pool.used == 0


@pytest.mark.parametrize("path", ["paged", "hf"])
def test_generation_stops_once_enough_groups_are_complete(model_dir, hf, path):
    from runtime.rollout import GroupsDone
    eng = _paged(model_dir, rows=6) if path == "paged" else BuiltinEngine(model_dir, decode_path="hf", max_batch_size=6)
    reqs = _requests()  # 13 requests: groups of 3, the last one alone
    sp = SamplingParams(max_new_tokens=20, stop_token_ids=[5, 6, 7])
    whole = hf.generate(reqs, sp)
    until = GroupsDone(group_size=3, count=2)
    got = eng.generate(reqs, sp, until=until)
    assert eng.generate(reqs, sp, until=until) == got  # where it stops depends on nothing but the inputs
    done = [r.finish_reason != "abort" for r in got]
    assert until.reached(done) and not all(done)
    for w, g in zip(whole, got):
        if g.finish_reason == "abort":  # unfinished: the beginning of what an unbroken call makes
            assert w.response_ids[:len(g.response_ids)] == g.response_ids and len(g.response_ids) < len(w.response_ids)
        else:
            assert (g.response_ids, g.finish_reason) == (w.response_ids, w.finish_reason)
    # the aborted samples, continued under the same weights, end as the unbroken call's
    _same(whole, eng.generate(_continued(reqs, got, lambda i, r: len(r.response_ids)), sp))
    # count 0: nothing is generated; a count no call can reach: everything finishes
    assert all(r.finish_reason == "abort" and not r.response_ids
               for r in eng.generate(reqs, sp, until=GroupsDone(3, 0)))
    _same(whole, eng.generate(reqs, sp, until=GroupsDone(3, 99)))
    if path == "paged":
        assert eng.decoder.pool.used == 0


# ---- speed features that fail, and running out of memory -----------------------------------------------------
# On CPU the compiler and graph capture are off; these tests turn them on where the decoder takes them:
# `torch.compile` is replaced by a compiler that hands back the function as it is (so the "compiled" path
# runs the same math) and raises where a test asks, and graph capture is the decoder's `_capture` (its
# CUDA calls cannot run here), replaced by one that raises.

OOM_TEXT = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.39 GiB"


def _compiling(model_dir, monkeypatch, fail_at=lambda call: None, seen: list | None = None,
               **kw) -> tuple[BuiltinEngine, list[int]]:
    """A paged engine with compile on, torch.compile replaced (above); `fail_at(n)`: the error the n-th call
    of a compiled piece raises, or None; `seen` gets (piece, the compiler options it was given) per compile.
    Returns the engine and the count of such calls."""
    from runtime.rollout import keyed_sampling
    calls = [0]

    def fake_compile(fn, **options):
        if seen is not None:
            seen.append((fn.__name__, options.get("options")))

        def compiled(*args, **kwargs):
            calls[0] += 1
            error = fail_at(calls[0])
            if error is not None:
                raise error
            return fn(*args, **kwargs)
        return compiled

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(keyed_sampling, "_COMPILED_GUMBEL", [])  # its cache: not the fake's outside this test
    eng = BuiltinEngine(model_dir, decode_path="paged", max_batch_size=6, page_size=PAGE, compile_decode=True, **kw)
    assert eng.decoder.compiled
    return eng, calls


def _wrapped_oom() -> RuntimeError:
    """Out of memory as a compiler reports it: its own error, the allocator's as the cause."""
    error = RuntimeError("backend='inductor' raised: RuntimeError: triton autotuning failed")
    error.__cause__ = torch.OutOfMemoryError(OOM_TEXT)
    return error


def test_rollout_deterministic_compiles_every_reducing_piece_with_no_timed_configurations(model_dir, monkeypatch):
    """rollout.deterministic (on by default) reaches each torch.compile of the decoder as inductor's deterministic
    mode: one configuration per kernel, none chosen by timing (on an H100 two fresh processes' log-probs were
    apart without it, bench/results/engine_repeat_*); off, inductor's defaults. The keyed noise is elementwise."""
    import torch._inductor.config as inductor_config

    from runtime.config import GrpoConfig
    from runtime.rollout.factory import make_engine
    for rollout, options in (({}, {"deterministic": True}), ({"deterministic": False}, None)):
        cfg = GrpoConfig.model_validate({"rollout": rollout})
        assert make_engine(cfg=cfg, model_dir=model_dir, device="cpu", dtype="float32").decoder.compile_options == options
    for flag, options in ((True, {"deterministic": True}), (False, None)):
        seen: list = []
        _compiling(model_dir, monkeypatch, seen=seen, deterministic=flag)
        assert sorted(seen, key=str) == sorted([(n, options) for n in ("pre", "post", "head", "plain_sample")]
                                               + [("gumbel_noise", None)], key=str)
    assert inductor_config.deterministic is False  # a real setting of inductor's, and nothing set process-wide


def test_an_engine_draws_a_fresh_engines_bits_whatever_it_generated_before(model_dir):
    """An engine rebuilt after a fault must draw what the unbroken one draws, whatever the unbroken one generated
    before. Its page table, widened for the longest prompt met, moved the positions the attention summed over:
    an engine that first decoded prompts of 60 tokens (15 pages, against 2) drew the next call 4.8e-7 apart
    from a fresh one. Now the same tokens and log-probs, bit for bit."""
    g = torch.Generator().manual_seed(0)
    short = [torch.randint(3, 100, (5,), generator=g).tolist() for _ in range(3)]
    long = [torch.randint(3, 100, (60,), generator=g).tolist() for _ in range(2)]
    reqs = [SampleRequest(prompt_ids=p, key=(1, 1, i, j)) for i, p in enumerate(short) for j in range(2)]
    sampling = SamplingParams(max_new_tokens=30)
    seasoned, fresh = _paged(model_dir, 6), _paged(model_dir, 6)
    seasoned.generate([SampleRequest(prompt_ids=p, key=(1, -1, i, 0)) for i, p in enumerate(long)], sampling)
    assert seasoned.decoder.prefix_cols > 2 * pages_for(5, PAGE)
    a, b = seasoned.generate(reqs, sampling), fresh.generate(reqs, sampling)
    assert [r.response_ids for r in a] == [r.response_ids for r in b]
    assert [r.response_logprobs for r in a] == [r.response_logprobs for r in b]


def test_a_compiled_engine_compiles_each_piece_once_on_its_own_shape_whatever_it_is_asked_first(model_dir):
    """The compiled pieces are compiled on the engine's own shape before its first call (`settle_compiled`), so the
    kernels do not depend on what an engine is asked first. Before, a fresh engine whose first prefill packed exactly
    nh * hd tokens (8 prompts of 256 for Qwen3-0.6B) had `post` compiled for that token count alone (dynamo took it
    for the attention's width) and recompiled for everything after; on two H100s (2026-11-27) a split run whose
    engine was rebuilt drew 48 of its 96 samples apart from the first token on, the prompts of that first prefill
    (bench/results/ray_faults_*_split-draws.json). Here such a first call compiles nothing more (it did: pre and post
    again, at the next decode step)."""
    import logging
    recompiled: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            recompiled.append(record.getMessage().splitlines()[0])
    keep = Keep()
    torch._dynamo.reset()  # no other test's graphs: this engine's own first compiles
    torch._logging.set_logs(recompiles=True)
    logging.getLogger("torch._dynamo").addHandler(keep)
    try:
        eng = BuiltinEngine(model_dir, decode_path="paged", max_batch_size=4, page_size=PAGE, compile_decode=True)
        dec = eng.decoder
        width = dec.nh * dec.hd
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(3, 100, (width // 2,), generator=g).tolist() for _ in range(2)]
        reqs = [SampleRequest(prompt_ids=p, key=(1, 1, i, j)) for i, p in enumerate(prompts) for j in range(2)]
        out = eng.generate(reqs, SamplingParams(max_new_tokens=6))
        assert dec.stats["prefill_pack_max"] == width and all(len(r.response_ids) == 6 for r in out)
        assert dec.compiled and not dec.stats.get("fallbacks")
        assert recompiled == []
        assert {k if isinstance(k, str) else k[0] for k in dec._settled} == {"layers", "step", "prefill"}
    finally:
        logging.getLogger("torch._dynamo").removeHandler(keep)
        torch._logging.set_logs()
        torch._dynamo.reset()


def test_a_failing_compiler_or_graph_capture_is_switched_off_and_the_tokens_stay(model_dir, hf, monkeypatch):
    reqs = _requests()
    plain = _paged(model_dir, rows=6)
    # the compiler fails at its first call: compile is off, the same tokens as the plain engine and HF's path
    eng, _ = _compiling(model_dir, monkeypatch, lambda n: RuntimeError("inductor: C++ compile failed") if n == 1 else None)
    for sp in SAMPLINGS:
        _same(plain.generate(reqs, sp), eng.generate(reqs, sp))
    dec = eng.decoder
    assert not dec.compiled and dec.stats["fallbacks"] == ["compile: RuntimeError: inductor: C++ compile failed"]
    _same(hf.generate(reqs, SAMPLINGS[0]), eng.generate(reqs, SAMPLINGS[0]))
    # graph capture fails (compile working): only the graphs go, compile stays on
    eng, calls = _compiling(model_dir, monkeypatch)
    dec = eng.decoder
    dec.use_graphs = True

    def capture(b, sample_fn):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    dec._capture = capture
    for sp in SAMPLINGS:
        _same(plain.generate(reqs, sp), eng.generate(reqs, sp))
    assert dec.compiled and not dec.use_graphs and calls[0] > 0
    assert [f.split(":")[0] for f in dec.stats["fallbacks"]] == ["cuda_graphs"] and dec.pool.used == 0


def test_a_feature_failing_midway_redoes_the_call_up_to_the_check_point_reached(model_dir, monkeypatch):
    """The engine driven one check point at a time (as a pool of engines drives it): the compiler failing in
    the middle of a call is switched off and the call redone to where it was, silently."""
    from runtime.rollout import GroupsDone
    reqs = _requests()
    sp = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=20, stop_token_ids=[5, 6, 7])
    until = GroupsDone(group_size=3, count=2)
    whole, calls = _compiling(model_dir, monkeypatch)
    want = whole.generate(reqs, sp, until=until)
    midway = calls[0] // 2
    eng, _ = _compiling(model_dir, monkeypatch, lambda n: RuntimeError("the compiler gave up") if n == midway else None)
    eng.start_generation(reqs, sp)
    asked = 0
    while (done := eng.advance_generation()) is not None:
        asked += 1
        if until.reached(done):
            break
    got = eng.finish_generation()
    dec = eng.decoder
    assert asked >= 3 and not dec.compiled and "the compiler gave up" in dec.stats["fallbacks"][0]
    _same(want, got)
    assert [r.finish_reason for r in got].count("abort") and dec.pool.used == 0


@pytest.mark.parametrize("where", ["compile", "compile_wrapped", "graph_capture"])
def test_out_of_memory_is_one_error_with_the_plan_and_switches_nothing_off(model_dir, monkeypatch, where):
    from runtime.errors import MemoryPlanError, UserError
    reqs, sp = _requests(), SAMPLINGS[0]
    want = _paged(model_dir, rows=6).generate(reqs, sp)
    oom = [True]  # a transient shortage: the first failure only
    error = _wrapped_oom() if where == "compile_wrapped" else torch.OutOfMemoryError(OOM_TEXT)

    def fail_at(n):
        if oom[0] and where != "graph_capture" and n == 5:
            oom[0] = False
            return error
        return None

    eng, _ = _compiling(model_dir, monkeypatch, fail_at, kv_cache_gb=0.01, gpu_memory_gb=24)
    dec = eng.decoder
    if where == "graph_capture":
        dec.use_graphs, real = True, dec._step

        def capture(b, sample_fn):
            if oom[0]:
                oom[0] = False
                raise error
            real(b, sample_fn)  # the step the capture would have warmed; the "graph" replays it
            return type("Graph", (), {"replay": lambda _: real(b, sample_fn)})()

        dec._capture = capture
    with pytest.raises(MemoryPlanError) as raised:
        eng.generate(reqs, sp)
    msg = str(raised.value)
    assert isinstance(raised.value, UserError) and "\n" not in msg  # the CLI prints it as one line
    for part in ("out of device memory", "tried to allocate 2.00 GiB", "KV pool 0.01 GiB (rollout.kv_cache_gb)",
                 "engine weights", "24 GiB card (cluster.gpu_memory_gb)", "cluster.offload_trainer_state: on"):
        assert part in msg, (part, msg)
    assert dec.compiled and dec.use_graphs == (where == "graph_capture") and "fallbacks" not in dec.stats
    assert dec.pool.used == 0
    # memory back: the next call runs with every feature still on, and makes the same tokens
    _same(want, eng.generate(reqs, sp))
    assert dec.compiled and dec.use_graphs == (where == "graph_capture") and "fallbacks" not in dec.stats


def test_out_of_memory_while_making_the_pool_leaves_no_half_pool(model_dir, monkeypatch):
    """The pool's second tensor cannot be allocated: one clear error (not taken for a compiler failure), no
    half-made pool behind, and the next call makes the pool whole (before: every retry met a missing
    page allocator, `'NoneType' object has no attribute 'num_pages'`)."""
    from runtime.errors import MemoryPlanError
    from runtime.rollout import paged_decode
    reqs, sp = _requests(), SAMPLINGS[0]
    want = _paged(model_dir, rows=6).generate(reqs, sp)
    eng, _ = _compiling(model_dir, monkeypatch)
    dec, zeros, made = eng.decoder, torch.zeros, []

    def zeros_running_out(*shape, **kw):
        if len(shape) == 1 and isinstance(shape[0], tuple) and len(shape[0]) == 5:  # a pool [layer, page, ...]
            made.append(shape[0])
            if len(made) == 2:
                raise torch.OutOfMemoryError(OOM_TEXT)
        return zeros(*shape, **kw)

    monkeypatch.setattr(paged_decode.torch, "zeros", zeros_running_out)
    with pytest.raises(MemoryPlanError, match=r"KV pool .* being allocated"):
        eng.generate(reqs, sp)
    assert dec.pool is None and dec.k_pool is None and dec.v_pool is None and dec.compiled
    monkeypatch.setattr(paged_decode.torch, "zeros", zeros)
    _same(want, eng.generate(reqs, sp))
    assert dec.compiled and "fallbacks" not in dec.stats
