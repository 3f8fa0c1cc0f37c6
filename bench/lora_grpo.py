"""LoRA GRPO on one GPU (issue 35): the real train stage with `train.lora`, one copy of the base shared by the
trainer and the built-in engine, peak memory against the plan term by term, step time and its parts, and the
adapter sync.

    # GLM-Z1-9B's shape on the 32 GB card (configs/glm-z1-9b-dapo-lora-32gb.yaml), one H100 call (< 10 min)
    GPU_CAP_GIB=31.4 PYTHONPATH=.gpucap:/tmp/site:$PYTHONPATH python3 bench/lora_grpo.py --model glm --out $OUT
    # Qwen3-0.6B with LoRA on the 24 GB card (configs/qwen3-0.6b-dapo-24gb.yaml + partial rollout, as the
    # full-parameter 24 GB run of 2026-11-25), one H100 call; --lora off runs that full-parameter baseline
    GPU_CAP_GIB=23.39 PYTHONPATH=.gpucap:/tmp/site:$PYTHONPATH python3 bench/lora_grpo.py --model qwen --out $OUT
    python3 bench/lora_grpo.py --cpu                     # CI smoke: a 2-layer GLM4, same code paths
    # the seed's 16 x 8 across two calls through the adapter checkpoint, then one summary
    ... --model glm --prompts 16 --chunks --rollouts 1 --out OUT1; ... --chunks --sections stage --out OUT2
    python3 bench/lora_grpo.py --merge OUT1 OUT2 --results-dir bench/results

Setup (its own process): the model's config.json (runtime/models/known_configs), the tiny tokenizer, and the base
built by megatron straight into bf16 on the GPU with random init (normal 0.02, norms 1, biases 0) and saved as
`torch_dist` - no HF weights, no fp32 copy, no conversion (the engine reads the trainer's tensors, so the run
needs none); prompts of the recipe's 1024 tokens. Stage (another process): `runtime.grpo.session.TrainSession`
(cluster.backend local, colocated: the engine decodes with the trainer's base) on the config pointed at these,
the plan's KV pool for the capped card, a reward that costs nothing (bench/trivial_reward.py), each sample
stopped at its keyed length (bench/rollout_bench.py's log-normal schedule, median 1700, a tail to 8192; as
bench/partial_rollout.py does), `--rollouts` rollouts or as many as the deadline leaves room for.

GLM: the seed's 16 prompts x 8 samples take ~80 s of generation and ~90 s of training per rollout on the H100,
too much beside the 17.5 GiB base's build, save and load for two rollouts in one 10-minute call, so the default
is 8 prompts x 8 samples (`--prompts 16` for the seed's batch); the memory terms do not depend on it (the KV
pool, the micro-batch of 9216 tokens and the state are the same).

Measured per phase with the allocator's statistics: the trainer's weights (base + adapters), gradients and
optimizer state as built, what building the engine allocated, the KV pool, the rollout's working set (peak -
allocated before generating), the training step's (peak - allocated before training), the overhead (CUDA
context + reserved beyond allocated); each against `runtime/plan/memory.py`'s term. Results: OUT/results.jsonl,
OUT/lora_grpo.json (with --results-dir a copy named by device, model and date).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import harness as H
import rollout_bench  # the keyed length schedule
from harness import ROOT

GIB = 2**30
KNOWN = ROOT / "runtime" / "models" / "known_configs"
MODES = {
    "glm": dict(config="configs/glm-z1-9b-dapo-lora-32gb.yaml", hf="GLM-4-9B-0414.json", prompts=8,
                sets=[]),
    # as the full-parameter 24 GB run of 2026-11-25 (DESIGN.md): the recipe with partial rollout
    "qwen": dict(config="configs/qwen3-0.6b-dapo-24gb.yaml", hf="Qwen3-0.6B.json", prompts=None,
                 sets=["rollout.partial=true"]),
}
LORA_SETS = ["train.lora.enabled=true"]  # the GLM config has it on already; the Qwen one gets rank 32 etc.
CPU = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           head_dim=16, vocab_size=512)
CPU_SETS = ["data.max_prompt_len=24", "rollout.max_new_tokens=40", "rollout.rollout_batch_size=2",
            "rollout.n_samples_per_prompt=2", "train.global_batch_size=4", "train.max_tokens_per_micro_batch=128",
            "model.dtype=float32", "rollout.kv_cache_gb=0.01", "train.lora.rank=4"]
SECTIONS = ("setup", "stage")
SECTION_MAX_S = {"setup": 240, "stage": 540}


def schedule(cpu: bool, mode: dict) -> dict:
    """The keyed length schedule (rollout_bench's) and the sizes of this run."""
    S = dict(rollout_bench.SHAPES["cpu" if cpu else "gpu"])
    S.update(prompt_len=12 if cpu else 1024, rows=16 if cpu else 400, device="cpu" if cpu else "cuda",
             dtype="float32" if cpu else "bfloat16")
    return S


def hf_config_of(mode: dict, cpu: bool, tok_dir: Path):
    """The model's config (the shipped config.json; a 2-layer one on CPU) with the tiny tokenizer's ids."""
    from transformers import AutoConfig, AutoTokenizer
    raw = json.loads((KNOWN / mode["hf"]).read_text())
    raw = {k: v for k, v in raw.items() if k not in ("architectures", "torch_dtype", "transformers_version")}
    if cpu:
        raw.update(CPU)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    model_type = raw.pop("model_type")
    raw.update(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
               dtype="float32" if cpu else "bfloat16")
    cfg = AutoConfig.for_model(model_type, **raw)
    cfg.architectures = [{"glm4": "Glm4ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[model_type]]
    return cfg, tok


def sec_setup(S, W: Path, mode: dict) -> dict:
    """config.json + tokenizer (no weights), the base as torch_dist built on the device, prompts."""
    import random

    import torch
    from transformers import GenerationConfig

    from runtime.mcore.convert import save_model_torch_dist
    from runtime.mcore.env import build_gpt_model
    from runtime.models.tiny import _WORDS
    t0 = time.time()
    H.fresh_setup(W)
    hf_config, tok = hf_config_of(mode, S["device"] == "cpu", W / "tok")
    (W / "hf").mkdir(parents=True)
    hf_config.save_pretrained(W / "hf")
    H.copy_tokenizer(W)
    GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, do_sample=True).save_pretrained(W / "hf")
    dtype = torch.bfloat16 if S["device"] == "cuda" else torch.float32
    t1 = time.time()
    model = build_gpt_model(hf_config, dtype=dtype, device=S["device"], init_weights=True)
    H.sync(S)
    built = {"params": sum(p.numel() for p in model.parameters()), "build_s": round(time.time() - t1, 1),
             "peak_GiB": H.peak_gib(S)}
    t2 = time.time()
    save_model_torch_dist(model, W / "td")
    built["save_s"] = round(time.time() - t2, 1)
    built["torch_dist_GiB"] = round(sum(f.stat().st_size for f in (W / "td").rglob("*") if f.is_file()) / GIB, 2)
    del model
    rng = random.Random(35)
    rows = []
    for i in range(S["rows"]):
        text = ""
        while len(tok(text)["input_ids"]) < S["prompt_len"]:
            text += " ".join(rng.choice(_WORDS) for _ in range(64)) + " "
        rows.append({"prompt": tok.decode(tok(text)["input_ids"][:S["prompt_len"]]), "label": str(i % 10)})
    prep = H.write_prompts(W, "prompts", rows, tok, max_prompt_len=S["prompt_len"])
    return {"name": "setup", "model_type": hf_config.model_type, "base": built, "prompts": prep.get("rows"),
            "s": round(time.time() - t0, 1)}


def bench_config(S, W: Path, mode: dict, sets: list[str]):
    """The mode's config pointed at the built model and prompts, on this machine, with the plan's KV pool."""
    import yaml

    from runtime.config import config_with_overrides
    from runtime.plan.memory import plan_choices
    tree = yaml.safe_load((ROOT / mode["config"]).read_text())
    tree["name"] = f"bench-lora-{tree['name']}"
    tree["model"]["source"] = str(W / "hf")
    tree["data"] = {**tree["data"], "train": {"source": str(W / "data" / "prompts.jsonl"), "format": "slime"},
                    "eval": {}, "apply_chat_template": False, "max_prompt_len": S["prompt_len"]}
    tree["rollout"].update(reward="bench.trivial_reward:length_mod13")
    tree["eval"] = {"interval": None}
    tree["tracking"] = {"enabled": False}
    tree["cluster"] = {**tree["cluster"], "backend": "local", "device": S["device"], "colocate": True}
    tree["storage"] = {"root": str(W / "root")}
    cfg = config_with_overrides(tree, sets, "bench")
    if S["device"] == "cuda":
        choices = plan_choices(cfg, hf_config_read(W), card_gib(cfg))
        cfg = config_with_overrides(tree, sets + [f"{k}={v}" for k, v in choices.items()], "bench")
    return cfg


def card_gib(cfg) -> float:
    """The card the plan is for: the config's cluster.gpu_memory_gb (32 / 24; its overhead term holds the CUDA
    context), else this GPU. Run under GPU_CAP_GIB = that minus the context (~0.6 GiB) to act as that card."""
    return float(cfg.cluster.gpu_memory_gb) if cfg.cluster.gpu_memory_gb else gpu_gib()


def hf_config_read(W: Path):
    from runtime.models import load_hf_config
    return load_hf_config(str(W / "hf"))


def gpu_gib() -> float:
    """The card as this process sees it: the allocator cap (GPU_CAP_GIB) when set, else the whole GPU."""
    import torch
    cap = os.environ.get("GPU_CAP_GIB")
    return float(cap) if cap else torch.cuda.get_device_properties(0).total_memory / GIB


def sec_stage(S, W: Path, mode: dict, sets: list[str], rollouts: int, budget_s: float, chunks: bool = False) -> dict:
    """`rollouts` rollouts of the train stage. ``chunks``: each one a chunk of its own, checkpointed as the
    pipeline does (TrainSession.run_chunk: the adapters, their optimizer state, the run state), and the run
    continued from its newest checkpoint when an earlier call left one in W: a run split across calls."""
    t_start = time.time()
    import torch

    from partial_rollout import force_keyed_lengths
    from runtime.grpo.session import TrainSession
    from runtime.run import checkpoint
    from runtime.run.directory import RunDir
    from runtime.plan.memory import estimate_for_config
    cuda = S["device"] == "cuda"
    P = H.Meter(S["device"])
    context = None
    if cuda:
        torch.zeros(1, device="cuda")
        free, total = torch.cuda.mem_get_info()
        context = total - free  # the CUDA context (and others), before any tensor of ours
    cfg = bench_config(S, W, mode, sets)
    S["max_new"] = cfg.rollout.max_new_tokens  # the schedule caps at the config's
    hf_config = hf_config_read(W)
    est = estimate_for_config(cfg, hf_config, gpu_mem_gb=card_gib(cfg) if cuda else 80.0, device=S["device"])
    root = Path(cfg.storage.root)
    rd = RunDir(str(root), "bench")
    ckpt = checkpoint.latest(rd) if chunks and Path(rd.path).exists() else None
    if ckpt is None:
        rd = H.run_dir_over(root, "bench", H.setup_inputs(W))
    start = ckpt.rollout if ckpt else 0
    calls = force_keyed_lengths(S)
    res: dict = {"name": "stage", "config": mode["config"], "sets": sets, "lora": cfg.train.lora.model_dump(),
                 "samples_per_rollout": cfg.samples_per_rollout, "kv_cache_gb": cfg.rollout.kv_cache_gb,
                 "gpu_gib": gpu_gib() if cuda else None, "card_gib": card_gib(cfg) if cuda else None,
                 "context": context, "estimate": _est_json(est), "resumed_at": start if ckpt else None}
    P.reset()
    t0 = time.time()
    sess = TrainSession(cfg, rd)
    engine_build: dict = {}
    make_engine = sess.cluster.engine

    def engine(*a, **k):  # what building the engine allocates (the shared base: the adapters' buffers only)
        before = P.now()
        e = make_engine(*a, **k)
        engine_build.update(before=before, after=P.now())
        return e
    sess.cluster.engine = engine
    sess.ensure_at(ckpt)
    built = P.now()
    tr = sess.trainer.group.members[0]  # local backend: the trainer object in this process
    eng = sess.engine.group.members[0]
    res["build"] = {"s": round(time.time() - t0, 1), "allocated": built.get("allocated"),
                    "peak": P.peaks().get("peak"), "shares_base": eng.health()["shares_base"],
                    "trainer": _trainer_bytes(tr), "engine_allocated": _delta(engine_build),
                    "adapter_buffers": eng.decoder.adapters.nbytes() if eng.decoder.adapters else 0}
    t0 = time.time()
    with H.engine_warm_up(sess, S["prompt_len"]):
        pass
    res["engine_warmup_s"] = round(time.time() - t0, 1)
    phase: dict = {}
    _wrap(sess, P, phase)
    res["rollouts"] = []
    last = 0.0
    for rid in range(start, start + rollouts):
        if rid > start and time.time() - t_start + 1.1 * last > budget_s:
            res["stopped_early"] = f"no time for rollout {rid} within {budget_s:.0f} s"
            break
        n_calls = len(calls)
        phase.clear()
        m = sess.run_chunk(rid, rid + 1)["metrics"][0] if chunks else sess.rollout(rid)
        last = m["step_time_s"]
        dec = calls[n_calls:]
        row = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in m.items()
               if k in ("rollout", "step_time_s", "generate_time_s", "reward_time_s", "train_time_s", "weight_sync_s",
                        "train_tokens", "train_tok_s", "rollout_tok_s", "response_len_mean", "response_len_max",
                        "train_rollout_logp_absdiff", "grad_norm", "groups_dropped")}
        row.update({k: v for k, v in phase.items()})
        row["adapter_sync_bytes"] = res["build"]["adapter_buffers"]
        row["engine_tokens"] = sum(c["new_tokens"] or 0 for c in dec)
        row["preemptions"] = sum(c["preemptions"] or 0 for c in dec)
        row["prefill_pack_max"] = max((c.get("prefill_pack_max") or 0 for c in dec), default=0)  # tokens
        res["rollouts"].append(row)
        print("ROLLOUT", json.dumps(row, default=str), flush=True)
    res["trainer_after"] = _trainer_bytes(tr)  # Adam's moments exist now
    res["compare"] = compare(est, res)
    sess.close()
    return res


def _wrap(sess, P: H.Meter, phase: dict) -> None:
    """Record the memory and time of the rollout's phases: generation (collect), the state's round trip, the update."""
    collect, handle = sess.collector.collect, sess.trainer

    def timed(name, fn):
        def run(*a, **k):
            before = P.now()
            P.reset()
            t0 = time.time()
            out = fn(*a, **k)
            phase[name] = {"s": round(time.time() - t0, 3), **{f"{k}_before": v for k, v in before.items()}, **P.peaks()}
            if name == "generate":  # the KV pool is allocated now; the loop releases it right after
                phase[name]["kv_cache"] = sess.engine.group.members[0].decoder.kv_cache_bytes()
                phase["logp_gap"] = _logp_gap(sess, out)
            return out
        return run
    sess.collector.collect = timed("generate", collect)
    handle.train = timed("train", handle.train)
    handle.offload_state = timed("offload", handle.offload_state)
    handle.reload_state = timed("reload", handle.reload_state)


def _logp_gap(sess, batch, n: int = 4) -> dict:
    """Engine vs trainer log-probs of the sampled tokens of the rollout's first n samples, on the same weights
    (before the update). The last token of each is left out: a forced stop (the keyed length) replaces the
    sampled token by the stop id but keeps the sampled token's log-prob, so there the two differ by design."""
    from runtime.trainer.batch import TrainBatch
    samples = [s for s in batch.samples if len(s.response_ids) > 1][:n]
    if not samples:
        return {}
    tb = TrainBatch(tokens=[list(s.prompt_ids) + list(s.response_ids[:-1]) for s in samples],
                    prompt_lens=[len(s.prompt_ids) for s in samples], advantages=[0.0] * len(samples),
                    loss_masks=[[1] * (len(s.response_ids) - 1) for s in samples],
                    rollout_logprobs=[list(s.response_logprobs[:-1]) for s in samples])
    import torch
    try:
        ours = sess.trainer.compute_logprobs(tb)
    except (MemoryError, torch.OutOfMemoryError) as e:  # beside the KV pool there may be no room: say so
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    diffs = [abs(a - b) for got, s in zip(ours, samples) for a, b in zip(got, s.response_logprobs[:-1])]
    return {"samples": len(samples), "tokens": len(diffs), "max": round(max(diffs), 5),
            "mean": round(sum(diffs) / len(diffs), 6)}


def _trainer_bytes(tr) -> dict:
    """What the trainer holds: its parameters (the frozen base and the adapters), DDP's gradient buffers, the
    optimizer's fp32 masters (Adam's moments appear at the first step)."""
    from runtime.trainer import lora
    base = sum(p.numel() * p.element_size() for n, p in tr.model.named_parameters() if not lora.is_adapter(n))
    adapters = sum(p.numel() * p.element_size() for n, p in tr.model.named_parameters() if lora.is_adapter(n))
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in tr.ddp.buffers)
    return {"base": base, "adapters": adapters, "grads": grads, "optimizer": _optimizer_bytes(tr)}


def _optimizer_bytes(tr) -> int:
    out, seen = 0, {p.untyped_storage().data_ptr() for p in tr.model.parameters()}
    opt = tr.optimizer.chained_optimizers[0] if hasattr(tr.optimizer, "chained_optimizers") else tr.optimizer
    for group in getattr(opt, "fp32_from_float16_groups", None) or []:
        for p in group:
            if p.untyped_storage().data_ptr() not in seen:
                out += p.numel() * p.element_size()
    inner = getattr(opt, "optimizer", opt)
    for state in inner.state.values():
        out += sum(v.numel() * v.element_size() for v in state.values() if hasattr(v, "numel") and v.numel() > 1)
    return out


def _delta(d: dict):
    a, b = d.get("before", {}).get("allocated"), d.get("after", {}).get("allocated")
    return None if a is None or b is None else b - a


def _est_json(est: dict) -> dict:
    keep = ("weights", "grads", "optimizer", "activations", "engine_weights", "kv_cache", "rollout_activations",
            "overhead", "total", "at_rollout", "at_training", "adapter_weights", "act_lora", "fits", "kv_slots",
            "shared_base", "lora", "gpu_mem_gb")
    return {k: est.get(k) for k in keep}


def compare(est: dict, res: dict) -> dict:
    """The plan's terms against what was measured (bytes; ratio = estimate / measured), from the last rollout."""
    b = est["bytes"]
    tr = res.get("trainer_after") or res["build"]["trainer"]
    rows = res["rollouts"]
    last = rows[-1] if rows else {}
    gen, train = last.get("generate", {}), last.get("train", {})
    act = train["peak"] - train["allocated_before"] if "peak" in train else None
    extra = gen["peak"] - gen["allocated_before"] if "peak" in gen else None
    peaks = [(r.get("generate", {}).get("peak_reserved"), r.get("train", {}).get("peak_reserved")) for r in rows]
    peak_reserved = max((x for pair in peaks for x in pair if x is not None), default=None)
    peak_alloc = max((r.get(ph, {}).get("peak") or 0 for r in rows for ph in ("generate", "train")), default=None)
    ctx = res.get("context")
    terms = [("weights", b["weights"], tr["base"] + tr["adapters"], "trainer parameters: frozen base + adapters"),
             ("gradients", b["grads"], tr["grads"], "DDP gradient buffers (the adapters')"),
             ("optimizer", b["optimizer"], tr["optimizer"], "fp32 masters + Adam moments, after the last step"),
             ("activations", max(b["activations"], 0), act, "training step: peak - allocated before"),
             ("engine weights", b["engine_weights"], res["build"]["engine_allocated"], "allocated by building the engine"),
             ("KV cache", b["kv_cache"], gen.get("kv_cache"), "the decoder's pool"),
             ("rollout extra", b["rollout_activations"], extra, "generate: peak - allocated before (pool included before)"),
             ("overhead", b["overhead"], (ctx + peak_reserved - peak_alloc) if ctx is not None and peak_reserved else None,
              "CUDA context + peak reserved - peak allocated")]
    out = [{"term": n, "estimate_GiB": round(e / GIB, 3), "measured_GiB": None if m is None else round(m / GIB, 3),
            "ratio": round(e / m, 3) if m else None,
            "within_10pct": None if not m else abs(e / m - 1) <= 0.1, "measured_how": how} for n, e, m, how in terms]
    total = {"estimate_GiB": round(b["total"] / GIB, 2),
             "measured_peak_allocated_GiB": None if not peak_alloc else round(peak_alloc / GIB, 2),
             "measured_peak_reserved_plus_context_GiB": round((peak_reserved + ctx) / GIB, 2)
             if peak_reserved and ctx is not None else None}
    return {"terms": out, "total": total}


def merge(dirs: list[str]) -> dict:
    """One summary of a run's calls (--chunks): every call's rollouts in order, the plan compared with the last
    call's phases (its first training step finds Adam's moments loaded, as a steady step does)."""
    calls = [json.loads((Path(d) / "lora_grpo.json").read_text()) for d in dirs]
    stages = [c["sections"]["stage"] for c in calls if (c["sections"].get("stage") or {}).get("status") == "ok"]
    if not stages:
        raise SystemExit("lora_grpo --merge: no call with a finished stage in " + ", ".join(dirs))
    stage = {**stages[-1], "rollouts": [r for st in stages for r in st["rollouts"]],
             "calls": [{"resumed_at": st.get("resumed_at"), "rollouts": [r["rollout"] for r in st["rollouts"]],
                        "section_s": st.get("section_s")} for st in stages]}
    return {**calls[-1], "sections": {**calls[0]["sections"], **calls[-1]["sections"], "stage": stage},
            "total_s": sum(c["total_s"] for c in calls)}


def print_table(summary: dict) -> None:
    st = summary["sections"].get("stage") or {}
    if st.get("status") != "ok":
        print("stage:", st.get("status"), str(st.get("error", ""))[:300])
        return
    print(f"{summary['model']}: {st['samples_per_rollout']} samples/rollout, LoRA rank {st['lora']['rank']}, "
          f"shared base {st['build']['shares_base']}, KV pool {st['kv_cache_gb']} GiB")
    print(f"  {'term':<15}{'plan':>8}{'measured':>10}{'ratio':>7}")
    for t in st["compare"]["terms"]:
        m = "-" if t["measured_GiB"] is None else f"{t['measured_GiB']:.2f}"
        r = "-" if t["ratio"] is None else f"{t['ratio']:.2f}"
        print(f"  {t['term']:<15}{t['estimate_GiB']:>8.2f}{m:>10}{r:>7}   {t['measured_how']}")
    print("  total", json.dumps(st["compare"]["total"]))
    for r in st["rollouts"]:
        print(f"  rollout {r['rollout']}: step {r['step_time_s']:.1f} s = generate {r['generate_time_s']:.1f} + train "
              f"{r['train_time_s']:.1f} + sync {r['weight_sync_s']:.3f} (+ offload/reload "
              f"{(r.get('offload') or {}).get('s', 0)}/{(r.get('reload') or {}).get('s', 0)}); {r['rollout_tok_s']:.0f} "
              f"gen tok/s, {r['train_tok_s']:.0f} train tok/s; engine-vs-trainer |dlogp| {r.get('logp_gap')}")


def main(argv=None) -> int:
    ap = H.parser(__doc__, "lora_grpo", 540.0, sections=SECTIONS, merge="OUT dirs of the calls of one run: one summary")
    ap.add_argument("--model", choices=sorted(MODES), default="glm")
    ap.add_argument("--lora", choices=("on", "off"), default="on", help="off: the full-parameter baseline")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per rollout (GLM default 8; the seed's 16)")
    ap.add_argument("--rollouts", type=int, default=3, help="at most; at least 2 unless the deadline stops it")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--chunks", action="store_true",
                    help="each rollout checkpointed; the stage continues W's run from its newest checkpoint")
    a = ap.parse_args(argv)
    if a.merge:
        summary = merge(a.merge)
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        H.save_summary(summary, out, f"lora_grpo_{summary['model']}", a.results_dir, False)
        print_table(summary)
        return 0
    mode = MODES[a.model]
    S = schedule(a.cpu, mode)
    sets = list(mode["sets"]) + (LORA_SETS if a.lora == "on" else ["train.lora.enabled=false"])
    prompts = a.prompts or mode["prompts"]
    if prompts:
        sets += [f"rollout.rollout_batch_size={prompts}", f"train.global_batch_size={prompts * 8}"]
    if a.cpu:
        sets += CPU_SETS
    sets += a.sets
    out, W = H.start(a, "lora_grpo", f"lora_grpo_work_{a.model}")
    if a.section:
        left = H.section_budget(a)
        fn = {"setup": lambda S, W: sec_setup(S, W, mode),
              "stage": lambda S, W: sec_stage(S, W, mode, sets, a.rollouts, left - 20, a.chunks)}[a.section]
        return H.section_exit(H.run_section(a.section, S, W, out, fn))
    H.clear_results(out)
    t_start = time.time()
    extra = ("--model", a.model, "--lora", a.lora, "--rollouts", str(a.rollouts)) + (("--cpu",) if a.cpu else ())
    extra += (("--prompts", str(a.prompts)) if a.prompts else ()) + H.set_args(a.sets) + (("--chunks",) if a.chunks else ())
    H.run_in_turn(Path(__file__), H.sections_of(a, SECTIONS), W, out, a.deadline, SECTION_MAX_S, extra)
    info = H.env_info({"device": S["device"]}) if not a.cpu else {"mode": "cpu"}
    summary = {**H.summary_head("lora_grpo", info), "model": a.model, "lora": a.lora,
               "gpu_cap_gib": os.environ.get("GPU_CAP_GIB"), "sets": sets, "total_s": round(time.time() - t_start, 1),
               "sections": H.read_results(out)}
    H.save_summary(summary, out, f"lora_grpo_{a.model}" + ("" if a.lora == "on" else "_full"), a.results_dir, a.cpu)
    (out / "lora_grpo.json").write_text(json.dumps(summary, indent=1, default=str))
    print_table(summary)
    return H.exit_code(summary, a.cpu)


if __name__ == "__main__":
    sys.exit(main())
