"""The recipe's rollout on the built-in engine's paged decoder at realistic lengths (and the fixed 512 shape).

    python bench/rollout_bench.py --results-dir bench/results    # H100 (< 8 min), carry the gpu-cap tool as .gpucap
    python bench/rollout_bench.py --cpu                          # CI smoke: tiny shapes, same code paths

Shape (issue 18): random-init Qwen3-0.6B shape, bf16; 32 prompts x 8 samples with 1.5x over-sampling = 384
requests, 1024-token prompts, at most 8192 new tokens. Each request's length comes from a fixed keyed schedule
(`schedule`: log-normal, median 1700, sigma 0.8, clipped to [16, 8192]: mean ~2.1k, a tail to the cap) and its
stop token is forced at that position (`stop_at`), so every engine makes exactly the same number of tokens
(asserted), whatever its bf16 noise samples.

Sections, each its own process (the capped one under ../shared/tools/gpu-cap, carried as .gpucap):
  paged    the paged decoder (`runtime/rollout/paged_decode.py`), KV_GIB of pages: the fixed 512-token shape
           (16 x 8, 256-token prompts, the regression row), the memory hand-off (release_memory, resume_memory,
           the next generate with graph re-capture), the realistic rollout (pages in use over time, decode
           steps, preemptions), a kernel profile of a mid-rollout step, the per-step latency at batch 8 by
           context (the tail floor), the HBM bandwidth, and the paged attention kernel against FlexAttention's
           paged path; the fixed shape again waiting for every chunk's tokens before queueing the next (with
           --overlap-ab the realistic rollout too): what queueing a chunk ahead saves
  (the fixed-slot decoder this replaced made 6,808 tok/s on this schedule with the same KV GiB on the H100:
   bench/results/rollout_bench_H100_2026-11-23_run2.json, its last run before it was deleted)
  capped   the paged decoder on the same schedule under a 24 GiB card (GPU_CAP_GIB = 24 - the measured
           CUDA context), its pool at the default size (a share of what is free)
  kernels  the paged attention kernel against FlexAttention's paged path (torch's experimental PagedAttention)
  cascade  (not in the default set: --sections cascade) one engine, KV_GIB of pages, with cascade attention off and
           on (``rollout.cascade_attention``: a group's prompt pages read once per step for its samples): the
           realistic rollout, the decode step at the rollout's start (every request, 16 tokens made), middle (128
           rows at the mean length, groups of 8) and tail (8 rows of distinct prompts at the longest length), the
           fixed 512 shape with the engine's log-probs against HF's forward; the tail-aware floor from the off
           engine's batch-8 latencies and the HBM bandwidth, and each mode's time against it
(The retired sweep, merge and settle sections: bench/README.md.)
Results: OUT/results.jsonl (one line per section) and OUT/rollout_bench.json (summary: device, date, floor,
ratios, targets); with --results-dir a copy named by device and date.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import harness as H
from gpu_grpo import _torch, kv_bytes_per_token
from harness import ROOT, peak_gib, reset_peak, sync

SHAPES = {
    "gpu": dict(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, ffn=3072, vocab=151936, dtype="bfloat16",
                device="cuda", prompts=32, samples=8, over_sampling=1.5, prompt_len=1024, max_new=8192,
                median=1700, sigma=0.8, min_len=16, kv_gib=56.0, page_size=16, cap_gib=24.0,
                fixed=dict(prompts=16, samples=8, prompt_len=256, new=512, reps=2)),
    "cpu": dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=512, dtype="float32",
                device="cpu", prompts=4, samples=2, over_sampling=1.5, prompt_len=12, max_new=40,
                median=10, sigma=0.8, min_len=2, kv_gib=0.002, page_size=4, cap_gib=None,
                fixed=dict(prompts=2, samples=2, prompt_len=8, new=8, reps=1)),
}
SECTIONS = ("paged", "capped", "kernels")
ALL_SECTIONS = SECTIONS + ("cascade",)
SECTION_MAX_S = {"paged": 200, "capped": 150, "kernels": 90, "cascade": 480}
# the fixed-slot decoder on this schedule (H100, same KV GiB, CUDA graphs), before it was deleted
FIXED_SLOT_TOK_S = {"file": "bench/results/rollout_bench_H100_2026-11-23_run2.json", "tok_s": 6808, "new_tokens": 809287}
SEED = 18


# ---- the workload -------------------------------------------------------------------------------------------

def schedule(S) -> list[int]:
    """Each request's response length, a pure function of (SEED, prompt, sample): `lengths_for_hashes`."""
    torch = _torch()
    from runtime.rollout.keyed_sampling import sample_key_hash
    n_prompts = round(S["prompts"] * S["over_sampling"])
    keys = torch.tensor([[SEED, 0, p, j] for p in range(n_prompts) for j in range(S["samples"])], dtype=torch.long)
    return lengths_for_hashes(S, sample_key_hash(keys))


def lengths_for_hashes(S, key_hash) -> list[int]:
    """A response length per sample key hash: log-normal around `median` with spread `sigma`, clipped to
    [min_len, max_new]. Reasoning-like: most short, a tail to the cap."""
    torch = _torch()
    from runtime.rollout.keyed_sampling import uniform_noise
    key_hash = key_hash.cpu()
    u = uniform_noise(key_hash, torch.zeros(len(key_hash), dtype=torch.long), 1)[:, 0].double().tolist()
    normal = statistics.NormalDist()
    return [int(min(S["max_new"], max(S["min_len"], round(S["median"] * math.exp(S["sigma"] * normal.inv_cdf(x))))))
            for x in u]


def prompts_of(S, n_prompts: int, prompt_len: int, seed: int) -> list[list[int]]:
    torch = _torch()
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, S["vocab"], (n_prompts, prompt_len), generator=g).tolist()


def requests(S, n_prompts: int, samples: int, prompt_len: int, rollout: int, seed: int):
    from runtime.rollout.base import SampleRequest
    ids = prompts_of(S, n_prompts, prompt_len, seed)
    return [SampleRequest(prompt_ids=ids[p], key=(7, rollout, p, j)) for p in range(n_prompts) for j in range(samples)]


def weight_bytes(S) -> int:
    h, L, nh, kv, hd, ff, V = (S[k] for k in ("hidden", "layers", "heads", "kv_heads", "head_dim", "ffn", "vocab"))
    n = V * h + L * (h * (nh + 2 * kv) * hd + nh * hd * h + 3 * h * ff + 2 * h + 2 * hd) + h
    return n * (2 if S["dtype"] == "bfloat16" else 4)


# ---- the model ----------------------------------------------------------------------------------------------

def make_model(S, W: Path) -> dict:
    """A random Qwen3 (``S["family"]`` "glm4": a GLM-4) of the shape, saved as an HF dir with the tiny tokenizer (its
    ids stay below the vocab)."""
    torch = _torch()
    from transformers import GenerationConfig

    from runtime.models.tiny import build_tiny_qwen3
    hf = W / "hf"
    if (hf / "config.json").exists():
        return {"model_dir": str(hf), "reused": True}
    t0 = time.time()
    build_tiny_qwen3(W / "tok")
    if S.get("family") == "glm4":  # GLM-4's layout (post-norms, partial interleaved RoPE) at the shape's sizes
        save_random_glm4(S, hf)
    else:
        _save_random_qwen3(S, hf)
    for f in os.listdir(W / "tok"):
        if f.startswith("tokenizer") or f == "special_tokens_map.json":
            (hf / f).write_bytes((W / "tok" / f).read_bytes())
    GenerationConfig(eos_token_id=2, pad_token_id=0).save_pretrained(hf)
    if S["device"] == "cuda":
        torch.cuda.empty_cache()
    return {"model_dir": str(hf), "reused": False, "model_s": round(time.time() - t0, 1)}


GLM4_9B = ROOT / "runtime" / "models" / "known_configs" / "GLM-4-9B-0414.json"


def save_random_glm4(S, hf: Path) -> None:
    """A random GLM-4 of the shape's sizes (GLM-4-9B-0414's config otherwise), built in the shape's dtype on its
    device (bench/glm4_engine.py), saved as an HF dir."""
    torch = _torch()
    import glm4_engine
    cfg = dict(json.loads(GLM4_9B.read_text()), vocab_size=S["vocab"], hidden_size=S["hidden"],
               intermediate_size=S["ffn"], num_hidden_layers=S["layers"], num_attention_heads=S["heads"],
               num_key_value_heads=S["kv_heads"], head_dim=S["head_dim"], bos_token_id=None, eos_token_id=2,
               pad_token_id=0)
    model = glm4_engine.build(cfg, S["device"], {"bfloat16": torch.bfloat16, "float32": torch.float32}[S["dtype"]])
    model.config.architectures = ["Glm4ForCausalLM"]
    model.save_pretrained(hf, max_shard_size="5GB")


def _save_random_qwen3(S, hf: Path) -> None:
    torch = _torch()
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=S["vocab"], hidden_size=S["hidden"], intermediate_size=S["ffn"],
                      num_hidden_layers=S["layers"], num_attention_heads=S["heads"], num_key_value_heads=S["kv_heads"],
                      head_dim=S["head_dim"], hidden_act="silu", max_position_embeddings=40960, rms_norm_eps=1e-6,
                      tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                      bos_token_id=None, eos_token_id=2, pad_token_id=0)
    cfg.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    with torch.device(S["device"]):
        model = Qwen3ForCausalLM(cfg)
    model.to({"bfloat16": torch.bfloat16, "float32": torch.float32}[S["dtype"]]).save_pretrained(hf)


def engine(S, W: Path, decode_path: str, kv_gib: float | None, rows: int):
    torch = _torch()
    from runtime.rollout.builtin import BuiltinEngine
    eng = BuiltinEngine(str(W / "hf"), device=S["device"], dtype={"bfloat16": torch.bfloat16,
                                                                    "float32": torch.float32}[S["dtype"]],
                        max_batch_size=rows, decode_path=decode_path, kv_cache_gb=kv_gib, page_size=S["page_size"])
    assert eng.decode_path == decode_path, eng.decode_path
    return eng


def run_schedule(S, eng, lengths: list[int]) -> dict:
    """The realistic rollout with forced stops; returns speed, steps, memory and the per-chunk trace."""
    torch = _torch()
    from runtime.rollout.base import SamplingParams
    from runtime.rollout.keyed_sampling import sample_key_hash
    n_prompts = round(S["prompts"] * S["over_sampling"])
    reqs = requests(S, n_prompts, S["samples"], S["prompt_len"], rollout=3, seed=3)
    assert len(reqs) == len(lengths)
    dec = eng.decoder
    sp = SamplingParams(temperature=1.0, max_new_tokens=S["max_new"])
    kh = sample_key_hash(torch.tensor([r.key for r in reqs], dtype=torch.long, device=eng.device))
    # warm-up: compile and the first graphs on a short run of the same requests
    t0 = time.perf_counter()
    dec.generate([r.prompt_ids for r in reqs[:16]], kh[:16], SamplingParams(temperature=1.0, max_new_tokens=32),
                 set(), stop_at=[32] * 16)
    sync(S)
    warm = time.perf_counter() - t0
    reset_peak(S)
    dec.trace = []
    sync(S)
    t0 = time.perf_counter()
    ids, _, finish = dec.generate([r.prompt_ids for r in reqs], kh, sp, set(), stop_at=lengths)
    sync(S)
    t = time.perf_counter() - t0
    got = [len(x) for x in ids]
    assert got == lengths, "every request must stop exactly at its scheduled length"
    st = dict(dec.stats)
    ntok = sum(got)
    tr = dec.trace
    dec.trace = None
    res = {"requests": len(reqs), "new_tokens": ntok, "s": round(t, 2), "tok_s": round(ntok / t),
           "warmup_s": round(warm, 1), "decode_steps": st["decode_steps"], "row_steps": st["row_steps"],
           "row_utilisation": round(ntok / max(st["row_steps"], 1), 3), "prefill_s": round(st["prefill_s"], 2),
           "decode_s": round(st["decode_s"], 2), "max_active": st["max_active"], "graphs": st.get("graphs"),
           "kv_cache_GiB": round(dec.kv_cache_bytes() / 2**30, 2), "peak_mem_GiB": peak_gib(S),
           "stopped": sum(f == "stop" for f in finish), "attention": st.get("attention"),
           "fallbacks": st.get("fallbacks")}
    for k in ("pages", "page_size", "peak_pages_used", "preemptions", "reprefill_tokens", "prefills", "slots", "slot_len"):
        if k in st:
            res[k] = st[k]
    if tr:
        # (decode steps so far, active rows, bucket, steps, ms per step, [pages used]); ~60 points over the run
        res["trace"] = [list(x) for x in tr[:: max(len(tr) // 60, 1)]] + [list(tr[-1])]
        bins: dict = {}
        for row in tr:
            act, n, ms = row[1], row[3], row[4]
            k = "active<=8" if act <= 8 else "active<=64" if act <= 64 else "active>64"
            d = bins.setdefault(k, {"steps": 0, "s": 0.0})
            d["steps"] += n
            d["s"] += n * ms / 1e3
        res["decode_by_active_rows"] = {k: {"steps": v["steps"], "s": round(v["s"], 2),
                                            "ms_per_step": round(1e3 * v["s"] / max(v["steps"], 1), 2)}
                                        for k, v in bins.items()}
    return res


# ---- measurements on the paged decoder ---------------------------------------------------------------------

def fixed_shape(S, eng, checks: bool = True) -> dict:
    """The regression row: 16 x 8, 256-token prompts, 512 new tokens at fixed length (no stop); with checks,
    also the engine's log-probs against HF's forward and the memory hand-off."""
    from runtime.rollout.base import SamplingParams
    F = S["fixed"]
    reqs = requests(S, F["prompts"], F["samples"], F["prompt_len"], rollout=0, seed=0)
    sp = SamplingParams(temperature=1.0, max_new_tokens=F["new"])
    eos = eng.eos_token_ids
    eng.eos_token_ids = set()
    try:
        t0 = time.perf_counter()
        eng.generate(reqs, sp)  # compile + graph capture
        sync(S)
        warm = time.perf_counter() - t0
        times = []
        for _ in range(F["reps"]):
            dt, out = H.timed(S, lambda: eng.generate(reqs, sp))
            times.append(dt)
        assert all(len(r.response_ids) == F["new"] for r in out)
        st = dict(eng.decoder.stats)
        t = statistics.median(times)
        res = {"rows": len(reqs), "prompt_len": F["prompt_len"], "new_tokens": F["new"], "warmup_s": round(warm, 1),
               "s_per_generate": [round(x, 3) for x in times], "tok_s": round(len(reqs) * F["new"] / t),
               "ms_per_decode_step": round(1e3 * st["decode_s"] / max(st["decode_steps"], 1), 3),
               "prefill_s": round(st["prefill_s"], 3), "chunks_queued_ahead": st.get("queued_ahead")}
        if not checks:
            return res
        # the engine's log-probs of its sampled tokens against HF's forward (teacher-forced) on the same weights
        diffs = []
        for r in out[:: max(len(out) // 16, 1)]:
            ref = eng.logprobs_of(r.prompt_ids, r.response_ids)
            diffs += [abs(a - b) for a, b in zip(ref, r.response_logprobs)]
        res["engine_vs_hf_forward_logprobs"] = {"tokens": len(diffs), "max_abs_diff": round(max(diffs), 5),
                                                "mean_abs_diff": round(sum(diffs) / len(diffs), 5)}
        # the memory hand-off: release (pool + graphs), resume (pool), then the same generate (graphs re-captured)
        torch = _torch()
        alloc = (lambda: torch.cuda.memory_reserved()) if S["device"] == "cuda" else (lambda: 0)
        before = alloc()
        t0 = time.perf_counter()
        eng.release_memory()
        sync(S)
        t_rel = time.perf_counter() - t0
        released = alloc()
        t0 = time.perf_counter()
        eng.resume_memory()
        sync(S)
        t_res = time.perf_counter() - t0
        t0 = time.perf_counter()
        eng.generate(reqs, sp)
        sync(S)
        t_first = time.perf_counter() - t0
        res["handoff"] = {"release_s": round(t_rel, 3), "resume_s": round(t_res, 3),
                          "generate_after_resume_s": round(t_first, 3), "generate_warm_s": round(t, 3),
                          "recapture_s": round(max(t_first - t, 0.0), 3),
                          "total_cost_s": round(t_rel + t_res + max(t_first - t, 0.0), 3),
                          "reserved_GiB_before": round(before / 2**30, 2),
                          "reserved_GiB_released": round(released / 2**30, 2)}
        return res
    finally:
        eng.eos_token_ids = eos


def _place_rows(dec, rows: int, prompt_len: int, own_len: int, group: int) -> list[int]:
    """Put rows [0, rows) mid-generation: `group` rows share a prompt of `prompt_len` tokens, each has made
    `own_len` tokens; pages come from the pool (returned, to give back)."""
    torch = _torch()
    from runtime.rollout.kv_pages import pages_for
    P = dec.page_size
    held = []
    dec._ensure_rows(pages_for(prompt_len, P), pages_for(own_len + dec.sync_every, P))  # no rollout may have run yet
    dec.table.zero_()
    for buf in (dec.pos, dec.plen, dec.live, dec.spos):
        buf.zero_()
    entries = []
    for g0 in range(0, rows, group):
        prompt = dec.pool.alloc(pages_for(prompt_len, P))
        held += prompt
        for s in range(g0, min(g0 + group, rows)):
            own = dec.pool.alloc(pages_for(own_len + dec.sync_every, P))
            held += own
            entries += [(s, c, p) for c, p in enumerate(prompt)]
            entries += [(s, dec.prefix_cols + c, p) for c, p in enumerate(own)]
    e = torch.tensor(entries, dtype=torch.long, device=dec.device)
    dec.table[e[:, 0], e[:, 1]] = e[:, 2].to(torch.int32)
    if dec.cascade:  # the group table the engine writes before each chunk
        dec.set_groups(list(range(rows)), [s // group for s in range(rows)], next(x for x in dec._buckets() if x >= rows),
                       prompt_len)
    dec.live[:rows] = 1
    dec.plen[:rows] = prompt_len
    dec.pos[:rows] = prompt_len + own_len
    dec.spos[:rows] = own_len + 1
    return held


def _clear_rows(dec, held: list[int]) -> None:
    dec.pool.release(held)
    dec.table.zero_()
    for buf in (dec.pos, dec.plen, dec.live, dec.spos):
        buf.zero_()


def step_latency(S, eng, rows: int, own_len: int, group: int, steps: int = 16, profile: bool = False,
                 profile_top: int = 10) -> dict:
    """ms per decode step (graph replay where graphs are on) for `rows` rows at `own_len` own tokens after a
    shared prompt; with profile, the kernel time of 8 eager steps by category."""
    torch = _torch()
    from runtime.rollout.base import SamplingParams
    from runtime.rollout.decode_attention import split_tokens_for
    dec = eng.decoder
    sp = SamplingParams(temperature=1.0, max_new_tokens=S["max_new"])
    step_fn, skey, _ = dec._sampler(sp)
    b = next(x for x in dec._buckets() if x >= rows)
    out = {"rows": rows, "bucket": b, "context": S["prompt_len"] + own_len}
    with torch.inference_mode():
        held = _place_rows(dec, rows, S["prompt_len"], own_len, group)
        try:
            dec._chunk_split_tokens = split_tokens_for(rows, dec.nkv, S["prompt_len"] + own_len + steps, dec.device)
            dec.settle_compiled(((("step", skey), step_fn),))  # the kernels the engine's generate runs
            dec.chunk_i.zero_()
            dec._run_step(b, step_fn, skey)  # capture this shape's graph if new
            dec.chunk_i.zero_()
            sync(S)
            t0 = time.perf_counter()
            for _ in range(steps - 1):
                dec._run_step(b, step_fn, skey)
            sync(S)
            out["ms_per_step"] = round((time.perf_counter() - t0) / (steps - 1) * 1e3, 3)
            out["split_tokens"] = dec._chunk_split_tokens
            if dec.cascade:
                out["prompt_split_tokens"] = dec._chunk_prompt_split_tokens
            if profile and S["device"] == "cuda":
                from bench.gpu_grpo import kernel_profile
                _clear_rows(dec, held)
                held = _place_rows(dec, rows, S["prompt_len"], own_len, group)
                dec.chunk_i.zero_()
                out["profile_eager_8_steps"] = kernel_profile(S, lambda: [dec._step(b, step_fn) for _ in range(8)],
                                                               top=profile_top)
        finally:
            _clear_rows(dec, held)
    return out


def hbm_bandwidth(S) -> float | None:
    """GB/s of a device-to-device copy of 2 GiB (read + write counted)."""
    if S["device"] != "cuda":
        return None
    torch = _torch()
    a = torch.empty(2**30, dtype=torch.int16, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    sync(S)
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    sync(S)
    bw = 2 * a.numel() * 2 * 10 / (time.perf_counter() - t0) / 1e9
    del a, b
    torch.cuda.empty_cache()
    return round(bw, 1)


def attention_ab(S) -> dict:
    """The paged Triton kernel against FlexAttention's paged path (torch's experimental PagedAttention) on the
    same work: 64 rows of 4096 private tokens in pages (128 tokens for Flex: its page must be its KV block),
    one query token per row, CUDA-graph / compiled timing."""
    torch = _torch()
    from runtime.rollout.decode_attention import paged_decode_attention
    rows, L, nh, nkv, hd = 64, 4096, S["heads"], S["kv_heads"], S["head_dim"]
    scale, dev = hd ** -0.5, "cuda"
    out = {"rows": rows, "tokens_per_row": L}

    def timed(fn, reps: int = 20) -> float:
        for _ in range(3):
            fn()
        sync(S)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync(S)
        return (time.perf_counter() - t0) / reps * 1e3

    kv_gb = rows * L * nkv * hd * 2 * 2 / 1e9
    q = torch.randn(rows, nh, hd, device=dev, dtype=torch.bfloat16)
    # ours: 16-token pages, shuffled
    P = S["page_size"]
    n_pages = rows * L // P + 1
    k = torch.randn(n_pages, P, nkv, hd, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    perm = torch.randperm(n_pages - 1, device=dev) + 1
    table = perm.view(rows, L // P).to(torch.int32).contiguous()
    zero = torch.zeros(rows, dtype=torch.long, device=dev)
    own = torch.full((rows,), L, dtype=torch.long, device=dev)
    g = torch.cuda.CUDAGraph()
    paged_decode_attention(q, k, v, table, zero, own, 0, scale)
    sync(S)
    with torch.cuda.graph(g):
        ours = paged_decode_attention(q, k, v, table, zero, own, 0, scale)
    ms = timed(g.replay)
    out["triton_paged"] = {"ms": round(ms, 3), "GBps": round(kv_gb / ms * 1e3)}
    ref = ours.float().clone()
    del k, v
    try:
        from torch.nn.attention.experimental._paged_attention import PagedAttention
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        FP = 128
        pages = rows * L // FP
        pa = PagedAttention(pages, FP, rows, device=dev)
        for b in range(rows):
            pa.reserve(torch.tensor(b, device=dev), torch.tensor(L, device=dev))
        kf = torch.randn(1, nkv, pages * FP, hd, device=dev, dtype=torch.bfloat16)
        vf = torch.randn_like(kf)
        lens = torch.full((rows,), L, device=dev)

        def causal_len(b, h, q_idx, kv_idx):
            return kv_idx < lens[b]

        logical = create_block_mask(causal_len, rows, None, 1, L, device=dev, BLOCK_SIZE=FP)
        bm = pa.convert_logical_block_mask(logical)
        flex = torch.compile(flex_attention)
        qf = q[:, :, None, :]

        def run():
            return flex(qf, kf, vf, block_mask=bm, scale=scale, enable_gqa=True)

        t0 = time.perf_counter()
        run()
        sync(S)
        out["flex_compile_s"] = round(time.perf_counter() - t0, 1)
        ms = timed(run)
        out["flex_paged"] = {"ms": round(ms, 3), "GBps": round(kv_gb / ms * 1e3)}
    except Exception as e:  # noqa: BLE001 - experimental API: record why it did not run
        out["flex_paged"] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
    out["triton_finite"] = bool(torch.isfinite(ref).all())
    torch.cuda.empty_cache()
    return out


# ---- sections -------------------------------------------------------------------------------------------------

def sec_paged(S, W: Path) -> dict:
    torch = _torch()
    res: dict = {"name": "paged", "setup": make_model(S, W)}
    if S["device"] == "cuda":
        res["cuda_context_GiB"] = cuda_context_gib()
    lengths = schedule(S)
    rows = len(lengths)
    t0 = time.time()
    eng = engine(S, W, "paged", S["kv_gib"], rows)
    res["load_s"] = round(time.time() - t0, 1)
    extras = os.environ.get("ROLLOUT_BENCH_EXTRAS", "1") != "0"  # 0: the two rows only (a short GPU call)
    res["realistic"] = run_schedule(S, eng, lengths)
    # kept if the rest is cut off
    H.append_result(Path(os.environ.get("ROLLOUT_BENCH_OUT", W)), {**res, "name": "paged_realistic_only", "status": "partial"})
    res["fixed_512"] = fixed_shape(S, eng)
    # the same engine waiting for every chunk's tokens before it queues the next (what queueing ahead saves)
    eng.decoder.overlap_chunks = False
    res["fixed_512_waiting_every_chunk"] = fixed_shape(S, eng, checks=False)
    if os.environ.get("ROLLOUT_BENCH_OVERLAP_AB") == "1":
        res["realistic_waiting_every_chunk"] = {k: v for k, v in run_schedule(S, eng, lengths).items() if k != "trace"}
    eng.decoder.overlap_chunks = True
    if not extras:
        eng.shutdown()
        return res
    mean_len = sum(lengths) / len(lengths)
    group = S["samples"]
    longest = max(lengths)
    # per-step latency at batch 8 along the longest request's growth (the tail floor), and a full-batch profile
    res["step_latency_batch8"] = [step_latency(S, eng, 8, own, 1) for own in
                                  sorted({16, longest // 3, 2 * longest // 3, longest - 32})]
    res["step_mid_rollout"] = step_latency(S, eng, min(rows, 128), int(mean_len), group, profile=True)
    eng.shutdown()
    del eng
    if S["device"] == "cuda":
        torch.cuda.empty_cache()
        res["hbm_GBps"] = hbm_bandwidth(S)
    return res


def sec_capped(S, W: Path) -> dict:
    """On the GPU under the gpu-cap tool (GPU_CAP_GIB set by the driver), the pool at its default size; on CPU a
    pool of 20 pages, so that rows are preempted."""
    make_model(S, W)
    lengths = schedule(S)
    kv = None if S["device"] == "cuda" else S["kv_gib"] / 52  # 20 pages: one request fits, a few contend
    res = {"name": "capped", "gpu_cap_GiB": os.environ.get("GPU_CAP_GIB"), "kv_gib_setting": kv}
    if S["device"] == "cuda":
        torch = _torch()
        res["mem_get_info_GiB"] = [round(x / 2**30, 2) for x in torch.cuda.mem_get_info()]
    eng = engine(S, W, "paged", kv, len(lengths))
    res["realistic"] = run_schedule(S, eng, lengths)
    eng.shutdown()
    return res


def sec_kernels(S, W: Path) -> dict:
    """The paged Triton kernel against FlexAttention's paged path (GPU only; last: it may not get the time)."""
    return {"name": "kernels", "attention_ab": attention_ab(S) if S["device"] == "cuda" else None}


def sec_cascade(S, W: Path) -> dict:
    """Cascade attention off and on in one engine (the same weights, pool and schedule): see the module doc."""
    torch = _torch()
    res: dict = {"name": "cascade", "setup": make_model(S, W)}
    lengths = schedule(S)
    rows = len(lengths)
    eng = engine(S, W, "paged", S["kv_gib"], rows)
    dec = eng.decoder
    res["group_rows"] = dec.group_rows
    longest, mean_len = max(lengths), int(sum(lengths) / len(lengths))
    points = {"start": (rows, S["min_len"], S["samples"]), "middle": (min(rows, 128), mean_len, S["samples"]),
              "tail": (8, longest - 32, 1)}
    for mode in ("off", "on"):
        dec.cascade = mode == "on"
        dec.graphs.clear()
        out: dict = {"realistic": run_schedule(S, eng, lengths)}
        H.append_result(Path(os.environ.get("ROLLOUT_BENCH_OUT", W)),
                        {**res, mode: out, "name": f"cascade_{mode}_realistic_only", "status": "partial"})
        out["steps"] = {k: step_latency(S, eng, *v, profile=k == "middle") for k, v in points.items()}
        if mode == "off":
            res["step_latency_batch8"] = [step_latency(S, eng, 8, own, 1) for own in
                                          sorted({16, longest // 3, 2 * longest // 3, longest - 32})]
        out["fixed_512"] = fixed_shape(S, eng)
        res[mode] = out
    eng.shutdown()
    del eng, dec
    if S["device"] == "cuda":
        torch.cuda.empty_cache()
        res["hbm_GBps"] = hbm_bandwidth(S)
    off, on = res["off"]["realistic"], res["on"]["realistic"]
    assert on["attention"].endswith("_cascade") and not off["attention"].endswith("_cascade")
    res["on_vs_off_tok_s"] = round(on["tok_s"] / off["tok_s"], 3)
    res["step_ms_on_vs_off"] = {k: [res[m]["steps"][k].get("ms_per_step") for m in ("off", "on")] for k in points}
    return res


FUNCS = {"paged": sec_paged, "capped": sec_capped, "kernels": sec_kernels, "cascade": sec_cascade}


def cuda_context_gib() -> float:
    """Device memory in use that the caching allocator does not hold (the CUDA context and libraries)."""
    torch = _torch()
    torch.zeros(1, device="cuda")
    free, total = torch.cuda.mem_get_info()
    return round((total - free - torch.cuda.memory_reserved()) / 2**30, 2)


# ---- summary ----------------------------------------------------------------------------------------------------

def tail_aware_floor(S, lengths: list[int], step_lat: list[dict], hbm_GBps: float | None) -> dict:
    """max(the longest request's steps x the per-step latency at batch 8 along its growth; the bytes every step
    must read / HBM bandwidth). Bytes: the weights once per step of the longest request, and for each token the
    K/V of its context: its own earlier tokens, and its prompt read once per group (the samples share it)."""
    longest = max(lengths)
    out = {"longest": longest}
    if step_lat:
        pts = sorted((d["context"] - S["prompt_len"], d["ms_per_step"]) for d in step_lat if "ms_per_step" in d)
        # trapezoid over the longest request's own length: the sum of its step latencies
        tail_ms = 0.0
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            tail_ms += (x1 - x0) * (y0 + y1) / 2
        tail_ms += pts[0][0] * pts[0][1] + (longest - pts[-1][0]) * pts[-1][1]
        out["tail_s"] = round(tail_ms / 1e3, 2)
        out["tail_s_at_full_context"] = round(longest * pts[-1][1] / 1e3, 2)
    kv_tok = kv_bytes_per_token(S)
    kv_bytes = sum(L * (L - 1) / 2 + L * S["prompt_len"] / S["samples"] for L in lengths) * kv_tok
    out["kv_read_TB"] = round(kv_bytes / 1e12, 2)
    out["weights_read_TB"] = round(longest * weight_bytes(S) / 1e12, 2)
    if hbm_GBps:
        out["bandwidth_s"] = round((kv_bytes + longest * weight_bytes(S)) / (hbm_GBps * 1e9), 2)
    parts = [out.get("tail_s"), out.get("bandwidth_s")]
    parts = [p for p in parts if p is not None]
    if parts:
        out["floor_s"] = max(parts)
        out["floor_tok_s"] = round(sum(lengths) / out["floor_s"])
    return out


def summarize(S, res: dict, info: dict) -> dict:
    lengths = schedule(S)
    if (res.get("paged") or {}).get("status") == "ok":
        res.pop("paged_realistic_only", None)  # the partial record of a section that went on to finish
    elif "paged_realistic_only" in res:
        res["paged"] = res.pop("paged_realistic_only")
    if (res.get("cascade") or {}).get("status") == "ok":  # its partial records, kept in case it was cut off
        for mode in ("off", "on"):
            res.pop(f"cascade_{mode}_realistic_only", None)
    pg, cp, cs = (res.get(k) or {} for k in ("paged", "capped", "cascade"))
    pr, cr = pg.get("realistic") or {}, cp.get("realistic") or {}
    floor = tail_aware_floor(S, lengths, pg.get("step_latency_batch8") or [], pg.get("hbm_GBps"))
    ratios, targets = {}, {}
    if pr.get("tok_s") and S["device"] == "cuda" and pr["new_tokens"] == FIXED_SLOT_TOK_S["new_tokens"]:
        ratios["paged_vs_fixed_slot_recorded"] = round(pr["tok_s"] / FIXED_SLOT_TOK_S["tok_s"], 2)
        targets["paged>=2x_fixed_slot"] = ratios["paged_vs_fixed_slot_recorded"] >= 2
    if pr.get("s") and floor.get("floor_s"):
        ratios["paged_vs_floor"] = round(pr["s"] / floor["floor_s"], 2)
        targets["paged<=1.5x_floor"] = ratios["paged_vs_floor"] <= 1.5
    if cr.get("tok_s") and pr.get("tok_s"):
        ratios["capped_vs_uncapped"] = round(cr["tok_s"] / pr["tok_s"], 2)
    if cs.get("status") == "ok":
        cf = tail_aware_floor(S, lengths, cs.get("step_latency_batch8") or [], cs.get("hbm_GBps"))
        if cf.get("floor_s"):
            for mode in ("off", "on"):
                ratios[f"cascade_{mode}_vs_floor"] = round(cs[mode]["realistic"]["s"] / cf["floor_s"], 2)
            targets["cascade_on<=1.25x_floor"] = ratios["cascade_on_vs_floor"] <= 1.25
        ratios["cascade_on_vs_off_tok_s"] = cs["on_vs_off_tok_s"]
    fx = (pg.get("fixed_512") or {}).get("tok_s")
    if fx:
        targets["fixed_512>=30500"] = fx >= 30500
    return {**H.summary_head("rollout_bench", info), "shapes": S,
            "schedule": {"n": len(lengths), "total": sum(lengths), "mean": round(sum(lengths) / len(lengths), 1),
                         "p50": sorted(lengths)[len(lengths) // 2], "p90": sorted(lengths)[int(0.9 * len(lengths))],
                         "max": max(lengths), "at_cap": sum(x == S["max_new"] for x in lengths)},
            "floor": floor, "ratios": ratios, "targets_met": targets if S["device"] == "cuda" else None,
            "sections": res}


def print_table(summary: dict) -> None:
    s = summary["sections"]

    def real(name, key):
        return ((s.get(name) or {}).get("realistic") or {}).get(key, "-")

    pg = s.get("paged") or {}
    rows = [("schedule (n / mean / p90 / max / at cap)", "{n} / {mean} / {p90} / {max} / {at_cap}".format(**summary["schedule"])),
            ("paged: tok/s / s / steps / preemptions / peak pages", f'{real("paged", "tok_s")} / {real("paged", "s")} / '
             f'{real("paged", "decode_steps")} / {real("paged", "preemptions")} / {real("paged", "peak_pages_used")}'),
            ("fixed-slot (recorded)", f'{FIXED_SLOT_TOK_S["tok_s"]} tok/s ({FIXED_SLOT_TOK_S["file"]})'),
            ("capped paged: tok/s / s / pages / peak GiB", f'{real("capped", "tok_s")} / {real("capped", "s")} / '
             f'{real("capped", "pages")} / {real("capped", "peak_mem_GiB")}'),
            ("peak GiB paged", real("paged", "peak_mem_GiB")),
            ("fixed 512 shape on paged: tok/s", (pg.get("fixed_512") or {}).get("tok_s", "-")),
            ("  the same, waiting for every chunk", (pg.get("fixed_512_waiting_every_chunk") or {}).get("tok_s", "-")),
            ("realistic waiting for every chunk: tok/s", (pg.get("realistic_waiting_every_chunk") or {}).get("tok_s", "-")),
            ("cascade off / on: tok/s", " / ".join(str(((s.get("cascade") or {}).get(m) or {}).get("realistic", {})
                                                        .get("tok_s", "-")) for m in ("off", "on"))),
            ("cascade off / on: ms per step (start, middle, tail)", json.dumps((s.get("cascade") or {})
                                                                               .get("step_ms_on_vs_off"))),
            ("hand-off (release/resume/recapture s)", json.dumps((pg.get("fixed_512") or {}).get("handoff"))),
            ("floor", json.dumps(summary["floor"])),
            ("ratios", json.dumps(summary["ratios"])), ("targets", json.dumps(summary["targets_met"]))]
    H.print_pairs(rows + H.failed_rows(s, 300))


# ---- driver -----------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = H.parser(__doc__, "rollout_bench", 455.0, sections=SECTIONS, sections_default=",".join(SECTIONS))
    ap.add_argument("--gpu-cap-dir", default=str(ROOT / ".gpucap"), help="the gpu-cap tool (its sitecustomize.py)")
    ap.add_argument("--overlap-ab", action="store_true",
                    help="paged: also the realistic schedule waiting for every chunk before queueing the next")
    a = ap.parse_args(argv)
    S = dict(SHAPES["cpu" if a.cpu else "gpu"])
    if a.overlap_ab:
        os.environ["ROLLOUT_BENCH_OVERLAP_AB"] = "1"
    out, W = H.start(a, "rollout_bench")
    if a.cpu:
        _torch().set_num_threads(1)
    os.environ["ROLLOUT_BENCH_OUT"] = str(out)
    if a.section:
        return H.section_exit(H.run_section(a.section, S, W, out, FUNCS[a.section]))
    t_start = time.time()
    H.clear_results(out)
    sections = H.sections_of(a, SECTIONS, known=FUNCS)  # the cascade section only when asked for
    if a.cpu:
        for name in sections:
            H.run_section(name, S, W, out, FUNCS[name])
    else:
        def env_of(name: str) -> dict:
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            if name == "capped":  # under the card's cap less the CUDA context the paged section measured
                ctx = (H.read_results(out).get("paged") or {}).get("cuda_context_GiB") or 0.6
                env["GPU_CAP_GIB"] = str(round(S["cap_gib"] - ctx, 2))
                env["PYTHONPATH"] = os.pathsep.join([a.gpu_cap_dir, env["PYTHONPATH"]])
            return env
        max_s = {**SECTION_MAX_S, "paged": SECTION_MAX_S["paged"] + (120 if a.overlap_ab else 0)}
        H.run_sections_in_processes(Path(__file__), sections, W, out, a.deadline, max_s, dict.fromkeys(sections, 30),
                                    env_of=env_of)
    summary = summarize(S, H.read_results(out), H.env_info(S))
    summary["total_s"] = round(time.time() - t_start, 1)
    return H.finish(summary, out, "rollout_bench", a.results_dir, a.cpu, print_table)


if __name__ == "__main__":
    sys.exit(main())
