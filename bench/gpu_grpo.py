"""GPU speed of grpoflow's GRPO step: the built-in engine, the megatron trainer and the whole train
stage on one model and shapes, in one run (TRL's GRPOTrainer on the same shapes: the retired `trl` section,
bench/README.md).

    python bench/gpu_grpo.py                 # H100: Qwen3-0.6B-shaped random model, bf16 (< 10 min)
    python bench/gpu_grpo.py --cpu           # CI smoke: tiny shapes on CPU, same code paths (< 30 s)
    python bench/gpu_grpo.py --sections engine,trainer --out /tmp/o

Sections (each its own process on GPU, so a crash or a hang costs only itself):
  setup    random HF model (save_pretrained) + tokenizer, HF -> torch_dist conversion, prepared data
  engine   (a) decode tok/s of the built-in engine at batch 128 (16 prompts x 8 samples, 256-token
           prompts, 512 new tokens at fixed length), with correctness: fast path vs the slow HF path
           (tokens, log-probs), CUDA-graph replay vs eager, compiled vs eager keyed sampler
  trainer  (b) trainer tok/s and MFU for 128 x 768 tokens (bf16, fp32 master weights, flash attention,
           chunked output layer); engine vs trainer log-probs on the same samples
  stage    (c) the real train stage (runtime.grpo.session.TrainSession, cluster.backend local): rollouts of
           16 x 8 x 512, reward, update, weight sync, checkpoint; rollout/train tok/s, step time, peak memory
Realistic lengths (the recipe's keyed length schedule, paged engine) live in bench/rollout_bench.py.
Results: one JSON line per section in OUT/results.jsonl, the summary (device, date, ratios) in
OUT/gpu_grpo.json and, with --results-dir, a copy in bench/results/.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import harness as H
from harness import peak_gib, reset_peak, run_dir_over, sync, write_prompts

# Measured in this environment (shared/anchors, H100, 2026-11-22): the references for the ratios.
ANCHORS = {"hf_generate_tok_s": 3937, "megatron_local_train_tok_s": 35500, "hf_train_tok_s": 46700,
           "trl_s_per_step": 19.5, "copy_GBps": 2967.0, "decode_fa2_prototype_tok_s": 22700}
PEAK_BF16 = 989e12  # H100 SXM dense bf16 (datasheet)

SHAPES = {
    "gpu": dict(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, ffn=3072, vocab=151936,
                prompts=16, samples=8, prompt_len=256, new=512, micro_batch=32, decode_reps=2, train_steps=3,
                rollouts=3, compare_rows=16, compare_new=64, dtype="bfloat16", device="cuda"),
    "cpu": dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=512,
                prompts=2, samples=2, prompt_len=12, new=8, micro_batch=2, decode_reps=1, train_steps=1,
                rollouts=1, compare_rows=4, compare_new=6, dtype="float32", device="cpu"),
}
SECTIONS = ("setup", "engine", "trainer", "stage")
SECTION_MAX_S = {"setup": 150, "engine": 200, "trainer": 180, "stage": 300}


# ---- helpers ------------------------------------------------------------------------------------------

def _torch():
    import torch
    return torch


def dtype_of(S):
    torch = _torch()
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[S["dtype"]]


def n_params(S) -> dict:
    h, L, nh, kv, hd, ff, V = (S[k] for k in ("hidden", "layers", "heads", "kv_heads", "head_dim", "ffn", "vocab"))
    layer = h * (nh + 2 * kv) * hd + nh * hd * h + 3 * h * ff + 2 * h + 2 * hd
    emb = V * h
    return {"total": emb + L * layer + h, "embedding": emb, "non_embedding": L * layer + h}


def kv_bytes_per_token(S) -> int:
    return S["layers"] * 2 * S["kv_heads"] * S["head_dim"] * (2 if S["dtype"] == "bfloat16" else 4)


def prompts_ids(S, n: int, seed: int = 0) -> list[list[int]]:
    torch = _torch()
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, S["vocab"], (n, S["prompt_len"]), generator=g).tolist()


def kernel_profile(S, fn, top: int = 14) -> dict | None:
    """GPU time by kernel over one call of fn (CUDA only): where the time goes, for the bound."""
    if S["device"] != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile
    sync(S)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync(S)
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0)
        if t and t > 0:
            rows.append((e.key, float(t), int(e.count)))
    total = sum(r[1] for r in rows) or 1.0
    cats: dict = {}
    for k, t, _ in rows:
        n = k.lower()
        c = ("attention" if "flash" in n or "fmha" in n or "attention" in n else
             "gemm" if any(x in n for x in ("gemm", "cutlass", "nvjet", "sm90_", "xmma", "cublas")) else
             "triton_fused" if "triton" in n else
             "copy/index" if any(x in n for x in ("copy", "index", "scatter", "gather", "cat")) else
             "reduce/softmax" if any(x in n for x in ("reduce", "softmax", "norm", "logsumexp")) else
             "elementwise" if "elementwise" in n or "vectorized" in n else "other")
        cats[c] = cats.get(c, 0.0) + t
    rows.sort(key=lambda r: -r[1])
    return {"gpu_ms": round(total / 1e3, 2),
            "by_category_pct": {k: round(100 * v / total, 1) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
            "top": [{"kernel": k[:100], "ms": round(t / 1e3, 2), "pct": round(100 * t / total, 1), "count": c}
                    for k, t, c in rows[:top]]}


# ---- sections -----------------------------------------------------------------------------------------

def sec_setup(S, W: Path, convert: bool = True) -> dict:
    """Random HF model + tokenizer, torch_dist conversion (unless `convert` is False), prepared prompts
    (~prompt_len tokens each)."""
    torch = _torch()
    from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    from runtime.mcore.convert import hf_to_torch_dist
    from runtime.models.tiny import _WORDS

    t0 = time.time()
    tok_info = H.fresh_setup(W)
    tok = AutoTokenizer.from_pretrained(W / "tok")
    cfg = Qwen3Config(vocab_size=S["vocab"], hidden_size=S["hidden"], intermediate_size=S["ffn"],
                      num_hidden_layers=S["layers"], num_attention_heads=S["heads"],
                      num_key_value_heads=S["kv_heads"], head_dim=S["head_dim"], hidden_act="silu",
                      max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
                      attention_bias=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                      bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      dtype=S["dtype"])
    cfg.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    with torch.device(S["device"]):
        model = Qwen3ForCausalLM(cfg)
    model = model.to(dtype_of(S))
    model.save_pretrained(W / "hf")
    del model
    H.copy_tokenizer(W)
    GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, do_sample=True,
                     temperature=1.0, top_p=1.0, top_k=0).save_pretrained(W / "hf")
    if S["device"] == "cuda":
        torch.cuda.empty_cache()
    t_model = time.time() - t0
    parity = hf_to_torch_dist(W / "hf", W / "td", tolerance=1e-3) if convert else {}
    t_conv = time.time() - t0 - t_model
    # prompts of ~prompt_len tokens from the tokenizer's words
    import random
    rng = random.Random(0)
    rows = []
    for i in range(max(64, S["prompts"] * (S["rollouts"] + 1))):
        words = []
        while len(tok(" ".join(words))["input_ids"]) < S["prompt_len"]:
            words.append(rng.choice(_WORDS))
        ids = tok(" ".join(words))["input_ids"][: S["prompt_len"]]
        rows.append({"prompt": tok.decode(ids), "label": str(i % 10)})
    prep = write_prompts(W, "train", rows, tok, max_prompt_len=4 * S["prompt_len"])
    return {"name": "setup", "model_s": round(t_model, 1), "convert_s": round(t_conv, 1),
            "parity_max_abs_logit_diff": parity.get("max_abs_logit_diff"), "n_params": n_params(S),
            "tokenizer_vocab": tok_info.get("vocab_size"), "prepared": {k: prep[k] for k in prep if k in ("rows", "dropped")},
            "total_s": round(time.time() - t0, 1)}


def _engine(S, W, **kw):
    from runtime.rollout.builtin import BuiltinEngine
    return BuiltinEngine(str(W / "hf"), device=S["device"], dtype=dtype_of(S),
                         max_batch_size=kw.pop("max_batch_size", S["prompts"] * S["samples"]), **kw)


def _requests(S, n_prompts: int, n_samples: int, rollout: int = 0, seed: int = 0):
    from runtime.rollout.base import SampleRequest
    ids = prompts_ids(S, n_prompts, seed)
    return [SampleRequest(prompt_ids=ids[p], key=(7, rollout, p, j)) for p in range(n_prompts) for j in range(n_samples)]


def _agreement(a, b) -> dict:
    """How far two lists of SampleResults agree: identical responses, common prefixes, log-prob diffs there."""
    same = sum(x.response_ids == y.response_ids for x, y in zip(a, b))
    prefix, total, diffs = 0, 0, []
    for x, y in zip(a, b):
        n = 0
        for s, t in zip(x.response_ids, y.response_ids):
            if s != t:
                break
            n += 1
        prefix += n
        total += max(len(x.response_ids), 1)
        diffs += [abs(p - q) for p, q in zip(x.response_logprobs[:n], y.response_logprobs[:n])]
    return {"rows_identical": f"{same}/{len(a)}", "rows_identical_frac": round(same / max(len(a), 1), 4),
            "common_prefix_frac": round(prefix / max(total, 1), 4),
            "logprob_absdiff_max": max(diffs) if diffs else None,
            "logprob_absdiff_mean": (sum(diffs) / len(diffs)) if diffs else None}


def sec_engine(S, W: Path) -> dict:
    torch = _torch()
    from runtime.rollout.base import SamplingParams
    from runtime.rollout.keyed_sampling import sample_key_hash, sample_next
    from runtime.rollout.decode_model import plain_sample

    res: dict = {"name": "engine"}
    B, P, NEW = S["prompts"] * S["samples"], S["prompt_len"], S["new"]
    t0 = time.time()
    eng = _engine(S, W, decode_path="paged")
    eng.eos_token_ids = set()  # fixed length: no stop token (a random model would hit eos at random)
    res["load_s"] = round(time.time() - t0, 1)
    reqs = _requests(S, S["prompts"], S["samples"])
    sp = SamplingParams(temperature=1.0, max_new_tokens=NEW)
    reset_peak(S)
    t0 = time.time()
    eng.generate(reqs, sp)  # compile + graph capture
    sync(S)
    res["warmup_s"] = round(time.time() - t0, 1)
    res["warmup_stats"] = {k: v for k, v in eng.decoder.stats.items() if k in ("graph_capture_s", "prefill_s", "decode_s")}
    times, stats = [], []
    for _ in range(S["decode_reps"]):
        dt, out = H.timed(S, lambda: eng.generate(reqs, sp))
        times.append(dt)
        stats.append(dict(eng.decoder.stats))
    t = statistics.median(times)
    st = stats[times.index(min(times, key=lambda x: abs(x - t)))]
    assert all(len(r.response_ids) == NEW for r in out)
    npar = n_params(S)
    w_bytes = npar["total"] * (2 if S["dtype"] == "bfloat16" else 4)
    floor_s = sum((w_bytes + B * (P + j) * kv_bytes_per_token(S)) / (ANCHORS["copy_GBps"] * 1e9) for j in range(NEW))
    # the same floor when each group's prompt KV is read once (what the engine does)
    groups = S["prompts"]
    floor_shared_s = sum((w_bytes + (groups * P + B * j) * kv_bytes_per_token(S)) / (ANCHORS["copy_GBps"] * 1e9)
                         for j in range(NEW))
    res.update(batch=B, prompt_len=P, new_tokens=NEW, s_per_generate=[round(x, 3) for x in times],
               tok_s=round(B * NEW / t), decode_only_tok_s=round(B * (NEW - 1) / st["decode_s"]),
               ms_per_decode_step=round(1e3 * st["decode_s"] / max(st["decode_steps"], 1), 3),
               prefill_s=round(st["prefill_s"], 3), bw_floor_tok_s=round(B * NEW / floor_s),
               pct_of_bw_floor=round(100 * (B * NEW / t) / (B * NEW / floor_s), 1),
               bw_floor_shared_prompt_tok_s=round(B * NEW / floor_shared_s),
               pct_of_bw_floor_shared_prompt=round(100 * floor_shared_s / t, 1),
               kv_cache_GiB=round(eng.decoder.kv_cache_bytes() / 2**30, 2), peak_mem_GiB=peak_gib(S),
               stats={k: v for k, v in st.items() if not isinstance(v, float) or True})
    fast_obj = eng.decoder
    # -- correctness: fast path vs slow HF path on the same keys
    creqs = _requests(S, max(S["compare_rows"] // 4, 1), 4, rollout=1, seed=1)
    csp = SamplingParams(temperature=1.0, max_new_tokens=S["compare_new"])
    fast_out = eng.generate(creqs, csp)
    eng.decoder = None
    slow_out = eng.generate(creqs, csp)
    eng.decoder = fast_obj
    res["fast_vs_slow"] = _agreement(fast_out, slow_out)
    if S["device"] == "cuda":  # graph replay vs the same steps run eagerly
        fast_obj.use_graphs = False
        eager_out = eng.generate(creqs, csp)
        fast_obj.use_graphs = True
        res["graphs_vs_eager"] = _agreement(fast_out, eager_out)
    # -- keyed sampler: compiled (used inside the graph) vs eager sample_next on the same logits
    g = torch.Generator(device=S["device"]).manual_seed(3)
    logits = (torch.randn(B, S["vocab"], device=S["device"], generator=g) * 3).to(dtype_of(S))
    kh = sample_key_hash(torch.tensor([r.key for r in reqs], device=S["device"]))
    pos = torch.arange(B, device=S["device"])
    t_ref, lp_ref = sample_next(logits, kh, pos, sp)
    fn = fast_obj._plain if fast_obj.compiled else plain_sample
    t_c, lp_c = fn(logits, kh, pos, 1.0)
    res["sampler_compiled_vs_eager"] = {"compiled": fast_obj.compiled,
                                        "tokens_equal": f"{int((t_ref == t_c).sum())}/{B}",
                                        "logprob_absdiff_max": float((lp_ref - lp_c).abs().max())}
    if fast_obj.compile_error:
        res["compile_error"] = fast_obj.compile_error
    eng.shutdown()
    return res


def trainer_numerics(S) -> dict:
    """train.* settings of the bench's trainer: on CPU the chunked output-layer path is exercised too;
    BENCH_TRAINER_FUSIONS (none, or a comma list such as rope,swiglu) A/Bs the CUDA fusions."""
    out: dict = {"chunked_logprobs": "on"} if S["device"] == "cpu" else {}
    fusions = os.environ.get("BENCH_TRAINER_FUSIONS")
    if fusions:
        out["fusions"] = fusions if fusions in ("auto", "none") else [x.strip() for x in fusions.split(",") if x.strip()]
    return out


def sec_trainer(S, W: Path) -> dict:
    torch = _torch()
    from runtime.rollout.base import SamplingParams
    from runtime.trainer.batch import TrainBatch
    from runtime.trainer.megatron_trainer import MegatronTrainer

    res: dict = {"name": "trainer"}
    B, P, R = S["prompts"] * S["samples"], S["prompt_len"], S["new"]
    SEQ = P + R
    t0 = time.time()
    from runtime.config import AlgorithmSection, TrainSection
    train = TrainSection(lr=1e-6, micro_batch_size=S["micro_batch"], num_rollout=100, num_steps_per_rollout=1,
                         weight_decay=0.0, clip_grad=1.0, **trainer_numerics(S))
    tr = MegatronTrainer(hf_dir=str(W / "hf"), init_checkpoint=str(W / "td"), train=train,
                         algorithm=AlgorithmSection(), temperature=1.0, device=S["device"], dtype=S["dtype"])
    res["load_s"] = round(time.time() - t0, 1)
    res["chunked_logprobs"] = tr._chunked_logprobs_enabled()
    res["core_attention"] = type(tr.model.decoder.layers[0].self_attention.core_attention).__name__
    res["param_dtypes"] = sorted({str(p.dtype) for p in tr.model.parameters()})
    res["optimizer"] = type(tr.optimizer).__name__
    from runtime.mcore.fusions import report as fusion_report
    # which pure-PyTorch fusions the built model runs (train.fusions; BENCH_TRAINER_FUSIONS=none|rope,swiglu,bda,gqa)
    res["fusions"] = fusion_report(tr.model)
    # -- engine vs trainer log-probs on the same weights and samples (before any update)
    # a pool of its own size: the default takes most of the free memory, and the trainer is alive beside it
    eng = _engine(S, W, kv_cache_gb=4.0 if S["device"] == "cuda" else None)
    eng.eos_token_ids = set()
    new = min(R, 128)
    samples = eng.generate(_requests(S, S["prompts"], S["samples"], rollout=2, seed=2),
                           SamplingParams(temperature=1.0, max_new_tokens=new))
    batch = H.samples_batch(samples)
    trainer_lp = tr.compute_logprobs(batch)
    diffs = [abs(a - b) for s, t in zip(samples, trainer_lp) for a, b in zip(s.response_logprobs, t)]
    res["engine_vs_trainer_logprobs"] = {"tokens": len(diffs), "max_abs_diff": max(diffs),
                                         "mean_abs_diff": sum(diffs) / len(diffs),
                                         "engine_path": eng.decode_path}
    if res["chunked_logprobs"]:
        tr.train_cfg.chunked_logprobs = "off"
        plain_lp = tr.compute_logprobs(batch)
        tr.train_cfg.chunked_logprobs = train.chunked_logprobs
        d2 = [abs(a - b) for s, t in zip(plain_lp, trainer_lp) for a, b in zip(s, t)]
        res["chunked_vs_full_logits_logprobs"] = {"max_abs_diff": max(d2), "mean_abs_diff": sum(d2) / len(d2)}
    eng.shutdown()
    del eng
    if S["device"] == "cuda":
        torch.cuda.empty_cache()
    # -- training throughput: B x SEQ tokens per optimizer step
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(3, S["vocab"], (B, SEQ), generator=g).tolist()
    batch = TrainBatch(tokens=toks, prompt_lens=[P] * B, advantages=[1.0 if i % 2 else -1.0 for i in range(B)],
                       loss_masks=[[1] * R] * B, rollout_logprobs=[[-11.0] * R] * B)
    npar = n_params(S)
    L, nh, hd = S["layers"], S["heads"], S["head_dim"]
    attn = 3 * 2 * 2 * L * nh * hd * (SEQ * (SEQ + 1) / 2) * B
    flops_exact = 6 * npar["non_embedding"] * B * SEQ + 6 * npar["embedding"] * B * R + attn
    variants = []
    # micro-batches 16 and 32 on the GPU; the fastest that fits is the headline (an OOM is recorded)
    mbs = [S["micro_batch"] // 2, S["micro_batch"]] \
        if S["device"] == "cuda" and os.environ.get("BENCH_EXTRA", "1") != "0" else [S["micro_batch"]]
    for mb in mbs:
        tr.train_cfg.micro_batch_size = mb
        reset_peak(S)
        try:
            t0 = time.time()
            m = tr.train(batch)
            sync(S)
            warm = time.time() - t0
            times = []
            for _ in range(S["train_steps"]):
                sync(S)
                t0 = time.perf_counter()
                m = tr.train(batch)
                sync(S)
                times.append(time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory at the larger micro-batch
            variants.append({"micro_batch": mb, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            if S["device"] == "cuda":
                torch.cuda.empty_cache()
            continue
        t = statistics.median(times)
        variants.append(dict(micro_batch=mb, warmup_s=round(warm, 2), s_per_step=[round(x, 3) for x in times],
                             tok_s=round(B * SEQ / t), resp_tok_s=round(B * R / t),
                             mfu_6N_pct=round(100 * 6 * npar["total"] * B * SEQ / t / PEAK_BF16, 1),
                             mfu_exact_pct=round(100 * flops_exact / t / PEAK_BF16, 1), peak_mem_GiB=peak_gib(S),
                             grad_norm=m.get("grad_norm"), loss=m.get("loss")))
    best = max((v for v in variants if "tok_s" in v), key=lambda v: v["tok_s"], default=None)
    if best is None:  # every micro-batch failed: keep what was measured before (the log-prob check)
        res.update(variants=variants, error=variants[-1].get("error") if variants else "no variant ran")
        return res
    res.update(seqs=B, seq_len=SEQ, resp_len=R, variants=variants, **{k: best[k] for k in (
        "micro_batch", "s_per_step", "tok_s", "resp_tok_s", "mfu_6N_pct", "mfu_exact_pct", "peak_mem_GiB")})
    tr.train_cfg.micro_batch_size = best["micro_batch"]
    res["profile_one_step"] = kernel_profile(S, lambda: tr.train(batch))
    res["fusions"] = fusion_report(tr.model)  # again: a RoPE compile failure shows only after the first call
    return res


def stage_config(S, W: Path) -> dict:
    B = S["prompts"] * S["samples"]
    return {
        "name": "bench-stage",
        "model": {"source": str(W / "hf"), "dtype": S["dtype"]},
        "data": {"train": {"source": str(W / "data" / "train.jsonl"), "format": "slime"}, "eval": {},
                 "apply_chat_template": False, "max_prompt_len": 4 * S["prompt_len"], "shuffle": False},
        "rollout": {"engine": "builtin", "rollout_batch_size": S["prompts"], "n_samples_per_prompt": S["samples"],
                    "max_new_tokens": S["new"], "temperature": 1.0, "top_p": 1.0,
                    "reward": "bench.trivial_reward:length_mod13"},
        "algorithm": {"eps_clip": 0.2, "eps_clip_high": 0.28, "use_tis": True},
        "train": {"num_rollout": S["rollouts"], "global_batch_size": B, "micro_batch_size": S["micro_batch"],
                  "lr": 1e-6, "weight_decay": 0.1, **trainer_numerics(S)},
        "eval": {"interval": None},
        "checkpoint": {"interval": S["rollouts"], "keep_last": 1},
        "tracking": {"enabled": False},
        "cluster": {"backend": "local", "device": S["device"]},
        "storage": {"root": str(W / "root")},
    }


def sec_stage(S, W: Path) -> dict:
    """(c) the real train stage (TrainSession.run_chunk), backend local: what a user's step costs."""
    torch = _torch()
    from runtime.config import config_from_dict
    from runtime.grpo.session import TrainSession

    res: dict = {"name": "stage"}
    cfg = config_from_dict(stage_config(S, W), "bench")
    rd = run_dir_over(W / "root", "bench", (W / "hf", W / "td", W / "data" / "train.parquet"))
    reset_peak(S)
    t0 = time.time()
    sess = TrainSession(cfg, rd)
    per_rollout = []

    def on_rollout(m):
        sync(S)
        m = dict(m)
        m["peak_mem_GiB_so_far"] = peak_gib(S)
        per_rollout.append(m)
        print("ROLLOUT", json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in m.items()}), flush=True)

    out = sess.run_chunk(0, S["rollouts"], on_rollout=on_rollout)
    sync(S)
    res["chunk_s"] = round(time.time() - t0, 1)
    keep = ("rollout", "step_time_s", "rollout_time_s", "rollout_tok_s", "train_time_s", "train_tok_s", "train_tokens",
            "weight_sync_s", "response_len_mean", "reward_mean", "loss", "grad_norm", "train_rollout_logp_absdiff",
            "peak_mem_GiB_so_far", "tis_weight_mean", "clip_frac")
    res["rollouts"] = [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in m.items() if k in keep}
                       for m in per_rollout]
    steady = per_rollout[1:] or per_rollout
    med = lambda k: round(statistics.median(m[k] for m in steady), 3)  # noqa: E731
    res.update(step_time_s=med("step_time_s"), rollout_tok_s=med("rollout_tok_s"), train_tok_s=med("train_tok_s"),
               rollout_time_s=med("rollout_time_s"), train_time_s=med("train_time_s"),
               weight_sync_s=med("weight_sync_s"), first_step_time_s=round(per_rollout[0]["step_time_s"], 2),
               train_all_tok_s=round(statistics.median((m["train_tokens"] + S["prompts"] * S["samples"] * S["prompt_len"])
                                                       / m["train_time_s"] for m in steady)),
               peak_mem_GiB=peak_gib(S), skipped=out.get("skipped"),
               engine_path=sess.engine.health().get("decode_path"))
    if S["device"] == "cuda":
        res["max_reserved_GiB"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
    sess.close()
    return res


FUNCS = {"setup": sec_setup, "engine": sec_engine, "trainer": sec_trainer, "stage": sec_stage}


def summarize(S: dict, res: dict, info: dict) -> dict:
    def get(sec, key):
        r = res.get(sec) or {}
        return r.get(key) if r.get("status") == "ok" else None

    ratios = {}
    e_tok, tr_tok, step = get("engine", "tok_s"), get("trainer", "tok_s"), get("stage", "step_time_s")
    if e_tok:
        ratios["decode_vs_hf_generate_anchor"] = round(e_tok / ANCHORS["hf_generate_tok_s"], 2)
    if tr_tok:
        ratios["train_vs_megatron_local_anchor"] = round(tr_tok / ANCHORS["megatron_local_train_tok_s"], 2)
    if step and S["device"] == "cuda":
        ratios["step_speedup_vs_trl_anchor"] = round(ANCHORS["trl_s_per_step"] / step, 2)
    targets = {"decode_tok_s>=25000": bool(e_tok and e_tok >= 25000), "train_tok_s>=80000": bool(tr_tok and tr_tok >= 80000),
               "step>=4x_trl": bool(ratios.get("step_speedup_vs_trl_anchor", 0) >= 4)}
    return {**H.summary_head("gpu_grpo", info), "shapes": S, "anchors": ANCHORS, "ratios": ratios,
            "targets_met": targets if S["device"] == "cuda" else None, "sections": res}


def print_table(summary: dict) -> None:
    s = summary["sections"]

    def g(sec, key):
        return (s.get(sec) or {}).get(key, "-")

    rows = [("engine decode tok/s (bs 128, 512 fixed)", g("engine", "tok_s")),
            ("engine decode-only tok/s / ms per step", f'{g("engine", "decode_only_tok_s")} / {g("engine", "ms_per_decode_step")}'),
            ("engine fast vs slow (rows identical)", (g("engine", "fast_vs_slow") or {}).get("rows_identical", "-") if isinstance(g("engine", "fast_vs_slow"), dict) else "-"),
            ("trainer tok/s / MFU(6N) %", f'{g("trainer", "tok_s")} / {g("trainer", "mfu_6N_pct")}'),
            ("engine vs trainer logp max/mean", str(g("trainer", "engine_vs_trainer_logprobs"))),
            ("stage step s / rollout tok/s / train tok/s", f'{g("stage", "step_time_s")} / {g("stage", "rollout_tok_s")} / {g("stage", "train_tok_s")}'),
            ("stage peak GiB", g("stage", "peak_mem_GiB")),
            ("ratios", json.dumps(summary["ratios"]))]
    H.print_pairs(rows + H.failed_rows(s, label="{name} FAILED"))


def main(argv=None) -> int:
    ap = H.parser(__doc__, "gpu_grpo", 570.0, sections=SECTIONS)
    ap.add_argument("--in-process", action="store_true", help="run every section in this process")
    a = ap.parse_args(argv)
    S = dict(SHAPES["cpu" if a.cpu else "gpu"])
    out, W = H.start(a, "gpu_grpo")
    if a.section:
        H.section_budget(a)
        return H.section_exit(H.run_section(a.section, S, W, out, FUNCS[a.section]))
    sections = H.sections_of(a, SECTIONS, known=FUNCS)
    t_start = time.time()
    H.clear_results(out)
    if a.cpu or a.in_process:
        H.section_budget(a)
        for name in sections:
            H.run_section(name, S, W, out, FUNCS[name])
    else:
        H.run_sections_in_processes(Path(__file__), sections, W, out, a.deadline, SECTION_MAX_S)
    summary = summarize(S, H.read_results(out), H.env_info(S))
    summary["total_s"] = round(time.time() - t_start, 1)
    return H.finish(summary, out, "gpu_grpo", a.results_dir, a.cpu, print_table)


if __name__ == "__main__":
    sys.exit(main())
