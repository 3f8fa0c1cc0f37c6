"""Peak GPU memory of a config (default the Qwen3-0.6B DAPO recipe), measured term by term against
``runtime/plan/memory.py``'s plan, and the trainer's throughput at the recipe's lengths (issue 17).

    python bench/memory_check.py                                    # the 80 GiB recipe on this GPU
    GPU_CAP_GIB=23.39 PYTHONPATH=.gpucap:$PYTHONPATH python bench/memory_check.py \
        --config configs/qwen3-0.6b-dapo-24gb.yaml                  # the 24 GB card (cap = 24 - CUDA context)
    python bench/memory_check.py --reuse --throughput               # + trainer alone: unpacked mb 1 vs packed
    python bench/memory_check.py --device cpu                       # smoke: tiny model on CPU, same code paths
    python bench/memory_check.py --from-json R.json --out R2.json   # re-compare a run with the current plan

What runs, in one process, as ``cluster.backend: local`` builds a run: a random model of the config's
shape (bench/gpu_grpo.py's setup, child process); the plan's choices applied (``plan_choices``: the KV
pool the run would write into its frozen config); the trainer (``MegatronTrainer`` with the config's
sections); the engine (BuiltinEngine with the factory's settings and the pool); a weight sync; the
trainer's state offloaded (``cluster.offload_trainer_state``); one rollout's generate (the first call's
rows, prompts at ``max_prompt_len``, ``max_new_tokens``, cut short by stop tokens: the pool is allocated
up front, so the peak does not depend on the steps run); the state reloaded; a first step of full-length
samples filling one micro-batch (Adam's state appears); a whole optimizer step of the global batch at the
recipe's lengths (log-normal responses, 1/16 at the cap); with ``--throughput``, the engine shut down,
the same step with today's layout (unpacked, micro-batch 1) and packed (``--throughput-budget`` tokens).

Printed: the plan first (so a failure still yields it), then estimate vs measured term by term and the
totals. JSON goes to ``--out`` (default ``bench/results/memory_check_<device>_<date>.json``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

import gpu_grpo  # its setup section builds the random model and its torch_dist copy
import harness as H
from gpu_grpo import _torch
from harness import ROOT, Meter

GIB = 2**30
DEFAULT_CONFIG = ROOT / "configs" / "qwen3-0.6b-dapo.yaml"
# CPU smoke: the shipped config shrunk to the tiny model (same sections, same code paths)
CPU_OVERRIDES = ["data.max_prompt_len=12", "rollout.max_new_tokens=8", "rollout.rollout_batch_size=2",
                 "rollout.n_samples_per_prompt=2", "train.global_batch_size=4", "train.micro_batch_size=2",
                 "model.dtype=float32"]


def gib(x):
    return None if x is None else round(x / GIB, 3)


def _diff(a, b):
    return None if a is None or b is None else a - b


def _oom_types():
    torch = _torch()
    return tuple(t for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None),
                             MemoryError) if t is not None)


# ---- the model and the config -----------------------------------------------------------------------

def shapes(device: str) -> dict:
    """gpu_grpo's shapes (GPU: Qwen3-0.6B's) with a small data set for its setup section."""
    S = dict(gpu_grpo.SHAPES["gpu" if device == "cuda" else "cpu"])
    S.update(prompt_len=8, prompts=2, rollouts=1)  # setup prepares a few short prompts; ours are synthetic
    return S


def hf_config_of(S):
    """The HF config gpu_grpo's setup writes (checked against the saved one after setup)."""
    from transformers import Qwen3Config
    cfg = Qwen3Config(vocab_size=S["vocab"], hidden_size=S["hidden"], intermediate_size=S["ffn"],
                      num_hidden_layers=S["layers"], num_attention_heads=S["heads"], num_key_value_heads=S["kv_heads"],
                      head_dim=S["head_dim"], hidden_act="silu", max_position_embeddings=40960, rms_norm_eps=1e-6,
                      tie_word_embeddings=True, attention_bias=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    cfg.architectures = ["Qwen3ForCausalLM"]
    return cfg


def load_cfg(path: str, overrides: list[str], device: str):
    from runtime.config import load_config
    extra = (CPU_OVERRIDES if device == "cpu" else []) + [f"cluster.device={device}", "cluster.backend=local"]
    return load_config(path, extra + list(overrides))


def estimate(cfg, hf_config, gpu_gib: float, device: str, micro_batch: int | None = None) -> dict:
    from runtime.plan.memory import estimate_for_config
    if micro_batch is not None and micro_batch != cfg.train.micro_batch_size:
        cfg = cfg.model_copy(deep=True)
        cfg.train.micro_batch_size = micro_batch
    return estimate_for_config(cfg, hf_config, gpu_mem_gb=gpu_gib, device=device)


def _short_device(name: str) -> str:
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Za-z]*)\b", name)
    return m.group(1) if m else re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_") or "gpu"


# ---- measurement ------------------------------------------------------------------------------------

def _synthetic_batch(n: int, prompt: int, response: int, vocab: int, seed: int):
    torch = _torch()
    from runtime.trainer.batch import TrainBatch
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(3, vocab, (n, prompt + response), generator=g).tolist()
    lp = -float(torch.log(torch.tensor(float(vocab))))
    return TrainBatch(tokens=toks, prompt_lens=[prompt] * n, advantages=[1.0 if i % 2 else -1.0 for i in range(n)],
                      loss_masks=[[1] * response] * n, rollout_logprobs=[[lp] * response] * n)


def _train_once(M: Meter, tr, batch, mb: int) -> dict:
    """One trainer.train call: allocated before/after, peak (allocated and reserved), time; OOM recorded."""
    if mb is not None:
        tr.train_cfg.micro_batch_size = mb
    M.reset()
    before = M.allocated()
    t0 = time.time()
    tokens = sum(len(t) for t in batch.tokens)
    rec = {"samples": len(batch), "micro_batch": tr.train_cfg.micro_batch_size, "tokens": tokens,
           "max_tokens_per_micro_batch": tr.train_cfg.max_tokens_per_micro_batch}
    try:
        out = tr.train(batch)
        M.sync()
        rec.update(ok=True, loss=out.get("loss"), grad_norm=out.get("grad_norm"))
    except _oom_types() as e:
        rec.update(ok=False, oom=True, error=f"{type(e).__name__}: {str(e)[:400]}")
    dt = time.time() - t0
    rec.update(seconds=round(dt, 2), tokens_per_s=round(tokens / dt) if rec["ok"] else None,
               allocated_before=before, allocated_after=M.allocated(), peak=M.peak(), peak_reserved=M.peak_reserved())
    if not rec["ok"]:
        # an OOM inside the compiled log-prob math switches it to eager for good (logprobs._call): undo
        # that, so the next measurement runs the production (compiled) path again
        from runtime.trainer import logprobs
        logprobs._FNS.clear()
        M.cleanup()
        rec["allocated_after_cleanup"] = M.allocated()
    return rec


def _profile_step(tr, batch, budget: int, top: int = 25) -> dict:
    """Where a packed step's GPU time goes: torch.profiler's kernels by CUDA time (one call, 32 samples)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    tr.train_cfg.max_tokens_per_micro_batch = budget
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        tr.train(batch)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA] or list(prof.key_averages())
    total = sum(e.self_device_time_total for e in events) or 1
    rows = sorted(events, key=lambda e: -e.self_device_time_total)[:top]
    out = {"budget": budget, "tokens": sum(len(t) for t in batch.tokens), "gpu_ms": round(total / 1e3, 1),
           "top": [{"name": e.key[:90], "ms": round(e.self_device_time_total / 1e3, 1),
                    "share": round(e.self_device_time_total / total, 3), "calls": e.count} for e in rows]}
    for r in out["top"][:12]:
        print(f"  {r['share']:6.1%} {r['ms']:9.1f} ms  {r['calls']:6d}  {r['name']}", flush=True)
    return out


def optimizer_state_bytes(tr) -> tuple[int, int]:
    """(fp32 master copies, Adam moments) held by megatron's optimizer(s), from the tensors themselves."""
    model_ids = {id(p) for p in tr.model.parameters()}
    opts = getattr(tr.optimizer, "chained_optimizers", None) or [tr.optimizer]
    master = moments = 0
    for opt in opts:
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) not in model_ids:
                    master += p.numel() * p.element_size()
        inner = getattr(opt, "optimizer", opt)
        for st in getattr(inner, "state", {}).values():
            for k, v in st.items():
                if k != "step" and hasattr(v, "numel"):
                    moments += v.numel() * v.element_size()
    return master, moments


def _unique_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _recipe_batch(n: int, prompt: int, max_new: int, vocab: int, seed: int, full: int):
    """A step at the recipe's lengths: ``full`` samples at the cap, the rest with reasoning-like response
    lengths (log-normal, median ~1.9k, mean ~2.5k, capped), every prompt at its maximum length."""
    torch = _torch()
    from runtime.trainer.batch import TrainBatch
    g = torch.Generator().manual_seed(seed)
    resp = (torch.randn(n, generator=g) * 0.8 + math.log(max_new * 0.23)).exp().clamp(64, max_new).long().tolist()
    resp[:full] = [max_new] * full
    toks = [torch.randint(3, vocab, (prompt + r,), generator=g).tolist() for r in resp]
    lp = -math.log(vocab)
    return TrainBatch(tokens=toks, prompt_lens=[prompt] * n, advantages=[1.0 if i % 2 else -1.0 for i in range(n)],
                      loss_masks=[[1] * r for r in resp], rollout_logprobs=[[lp] * r for r in resp])


def measure(cfg, S, W: Path, args, est: dict, hf_config, log) -> dict:
    torch = _torch()
    from runtime.plan.memory import first_rollout_rows, offload_enabled
    from runtime.rollout.base import SampleRequest, SamplingParams
    from runtime.rollout.builtin import BuiltinEngine
    from runtime.trainer.megatron_trainer import MegatronTrainer

    dev = args.device
    M = Meter(dev)
    res: dict = {}
    if M.cuda:
        torch.cuda.init()
        torch.zeros(1, device="cuda")  # the context
        free, total = M.free_total()
        res["gpu_total"] = total
        res["context_and_others"] = total - free  # before any tensor of ours: CUDA context + other processes
        res["gpu_cap_gib"] = os.environ.get("GPU_CAP_GIB")
    M.reset()
    dtype = S["dtype"]

    # 1. trainer
    t0 = time.time()
    tr = MegatronTrainer(hf_dir=str(W / "hf"), init_checkpoint=str(W / "td"), train=cfg.train,
                         algorithm=cfg.algorithm, temperature=cfg.rollout.temperature, device=dev, dtype=dtype)
    M.sync()
    master, _ = optimizer_state_bytes(tr)
    res["trainer"] = {
        "build_s": round(time.time() - t0, 1), "allocated": M.allocated(),
        "weights": sum(p.numel() * p.element_size() for p in tr.model.parameters()),
        "grads": sum(p.main_grad.numel() * p.main_grad.element_size()
                     for p in tr.model.parameters() if getattr(p, "main_grad", None) is not None),
        "optimizer_master": master, "chunked_logprobs": tr._chunked_logprobs_enabled(),
        "core_attention": type(tr.model.decoder.layers[0].self_attention.core_attention).__name__,
        "recompute": cfg.train.recompute, "max_tokens_per_micro_batch": cfg.train.max_tokens_per_micro_batch,
        "optimizer": type(tr.optimizer).__name__}
    log(f"trainer built in {res['trainer']['build_s']} s: allocated {gib(M.allocated())} GiB")

    # 2. engine (the factory's settings and the config's KV pool) + weight sync
    t0 = time.time()
    a = M.allocated()
    eng = BuiltinEngine(str(W / "hf"), device=dev, dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype],
                        max_batch_size=max(cfg.samples_per_rollout, 1), kv_cache_gb=cfg.rollout.kv_cache_gb)
    M.sync()
    res["engine"] = {"build_s": round(time.time() - t0, 1), "allocated_delta": _diff(M.allocated(), a),
                     "weights": _unique_bytes(eng.model.parameters()), "decode_path": eng.health()["decode_path"],
                     "max_batch_size": eng.max_batch_size, "kv_cache_gb": cfg.rollout.kv_cache_gb}
    eng.update_weights(tr.hf_weights(to_cpu=False), 1)
    M.sync()

    # 3. the colocated hand-off: the trainer's state off the GPU for the rollout
    offload = offload_enabled(cfg, dev)
    res["offload"] = {"enabled": offload}
    if offload or args.force_offload:
        before = M.allocated()
        res["offload"]["offload"] = tr.offload_state(force=args.force_offload)
        res["offload"]["freed"] = _diff(before, M.allocated())
    free, _ = M.free_total()
    res["before_rollout"] = {"allocated": M.allocated(), "reserved": M.reserved(), "free": free}
    log(f"engine built in {res['engine']['build_s']} s ({res['engine']['decode_path']} decode); offload "
        f"{res['offload']}; before the rollout: allocated {gib(M.allocated())} GiB, free {gib(free)} GiB")

    # 4. one rollout's generate (production KV allocation; decode cut short by stop tokens)
    r = cfg.rollout
    rows = first_rollout_rows(cfg)
    V = S["vocab"]
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(3, V, (rows, cfg.data.max_prompt_len), generator=g).tolist()
    reqs = [SampleRequest(prompt_ids=p, key=(11, 0, i // r.n_samples_per_prompt, i % r.n_samples_per_prompt))
            for i, p in enumerate(prompt_ids)]
    k = max(1, V // max(args.decode_mean, 1))
    sp = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
                        stop_token_ids=list(range(3, 3 + k)))
    M.reset()
    a = M.allocated()
    t0 = time.time()
    rollout: dict = {"rows": rows, "prompt_len": cfg.data.max_prompt_len, "max_new_tokens": r.max_new_tokens,
                     "stop_ids": k}
    try:
        out = eng.generate(reqs, sp)
        M.sync()
        lens = [len(x.response_ids) for x in out]
        rollout.update(ok=True, new_tokens=sum(lens), len_mean=round(sum(lens) / len(lens), 1), len_max=max(lens))
    except _oom_types() as e:
        rollout.update(ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")
    dec = getattr(eng, "decoder", None)
    rollout.update(seconds=round(time.time() - t0, 1), allocated_before=a, allocated_after=M.allocated(),
                   peak=M.peak(), peak_reserved=M.peak_reserved())
    if dec is not None:
        st = dec.stats
        rollout.update(kv_cache=dec.kv_cache_bytes(), slots=getattr(dec, "slots", None),
                       slot_len=getattr(dec, "slot_len", None), pages=st.get("pages"),
                       peak_pages_used=st.get("peak_pages_used"), preemptions=st.get("preemptions"),
                       decode_steps=st.get("decode_steps"), graphs=st.get("graphs"), compiled=st.get("compiled"),
                       cuda_graphs=st.get("cuda_graphs"), attention=st.get("attention"))
        if M.cuda:
            rollout["extra"] = rollout["peak"] - a - rollout["kv_cache"]
    if cfg.cluster.colocate:  # as the loop does: the pool goes back while the trainer trains
        eng.release_memory()
        rollout["allocated_after_release"] = M.allocated()
    res["rollout"] = rollout
    log(f"rollout: {rows} rows in {rollout['seconds']} s, {rollout.get('slots')} slots x {rollout.get('slot_len')} "
        f"tokens, KV {gib(rollout.get('kv_cache'))} GiB, peak {gib(rollout['peak'])} GiB"
        + ("" if rollout["ok"] else f"; FAILED: {rollout['error']}"))

    # 5. back for the update
    if tr.offload.offloaded:
        res["offload"]["reload"] = tr.reload_state()
        log(f"state offload: {res['offload']}")

    # 6. the worst micro-batch: full-length samples filling one micro-batch (first step: Adam's state appears)
    P, R = cfg.data.max_prompt_len, r.max_new_tokens
    seq = P + R
    n_full = min(cfg.train.global_batch_size, cfg.train.max_tokens_per_micro_batch // seq) if cfg.train.max_tokens_per_micro_batch else \
        cfg.train.micro_batch_size
    worst = _train_once(M, tr, _synthetic_batch(n_full, P, R, V, 0), None)
    if worst["ok"] and M.cuda:
        worst["activations"] = worst["peak"] - worst["allocated_before"]
    res["train"] = {"first_step": worst, "activations": worst.get("activations"), "seq_len": seq,
                    "micro_batch": n_full, "adam_state_allocated": _diff(worst["allocated_after"],
                                                                         worst["allocated_before"])}
    log(f"worst micro-batch ({n_full} x {seq} tokens): " + (
        f"{worst['seconds']} s, activations {gib(worst.get('activations'))} GiB, peak {gib(worst['peak'])} GiB"
        if worst["ok"] else f"FAILED ({worst.get('error')})"))
    res["trainer"]["optimizer_moments"] = optimizer_state_bytes(tr)[1]

    # 7. a whole optimizer step at the recipe's lengths (full-length samples included)
    n_step = cfg.train.global_batch_size if not args.step_samples else args.step_samples
    step_batch = _recipe_batch(n_step, P, R, V, seed=7, full=max(1, n_step // 16))
    if worst["ok"]:
        step = _train_once(M, tr, step_batch, None)
        res["train"]["steady_step"] = step
        log(f"whole step ({n_step} samples, {step['tokens']} tokens): " + (
            f"{step['seconds']} s, {step['tokens_per_s']} tok/s, peak {gib(step['peak'])} GiB" if step["ok"]
            else f"FAILED ({step.get('error')})"))

    # 8. trainer throughput at the recipe's lengths, the engine gone: today's layout vs packed
    if args.throughput and worst["ok"]:
        eng.shutdown()
        del eng
        M.cleanup()
        thr = {}
        budgets = [int(b) for b in str(args.throughput_budget).split(",")]
        from runtime.mcore import fusions as mf
        kernels = str(args.throughput_attention).split(",")
        built_norm = mf.report(tr.model)["norm"]
        norms = ([not built_norm] if args.throughput_both_norms else []) + [built_norm]  # as built last: profiled
        rows = ([("unpacked_mb1", 1, None, kernels[0], built_norm)] if not args.packed_only else []) + [
            (f"packed_{b}" + ("" if k == "flash2" else f"_{k}") + ("" if n == built_norm else
             ("_compiled_norm" if n else "_eager_norm")), 1, b, k, n) for k in kernels for n in norms for b in budgets]
        for name, mb, budget, kernel, norm in rows:
            if time.time() - args.t_start > args.deadline:
                thr[name] = {"skipped": "deadline"}
                continue
            tr.train_cfg.max_tokens_per_micro_batch = budget
            _use_packed_attention(tr, kernel)
            mf.use_compiled_norms(tr.model, norm)
            _train_once(M, tr, _recipe_batch(16, P, R, V, seed=3, full=1), mb)  # warm-up (compile at these shapes)
            thr[name] = _train_once(M, tr, step_batch, mb)
            log(f"throughput {name}: {thr[name].get('tokens_per_s')} tok/s ({thr[name]['seconds']} s, peak "
                f"{gib(thr[name]['peak'])} GiB)")
        if args.profile and M.cuda and time.time() - args.t_start < args.deadline:  # the last kernel's
            thr["profile"] = _profile_step(tr, _recipe_batch(32, P, R, V, seed=5, full=2), budgets[-1])
        tr.train_cfg.max_tokens_per_micro_batch = cfg.train.max_tokens_per_micro_batch
        res["throughput"] = thr
    else:
        eng.shutdown()
    M.sync()
    res["final"] = {"allocated": M.allocated(), "reserved": M.reserved()}
    res["points"] = []
    return res


def _use_packed_attention(tr, kernel: str) -> None:
    """Every layer's packed-attention kernel swapped in place (train.packed_attention), so one trainer times
    each kernel on the same weights and batch."""
    from runtime.mcore.env import unwrap_model
    from runtime.mcore.varlen_attention import KERNELS, check_available
    check_available(kernel)
    tr.train_cfg.packed_attention = kernel
    tr.train_cfg.deterministic = kernel != "fa4"  # as a run can use each: fa4 has no deterministic backward
    for layer in unwrap_model(tr.model).decoder.layers:
        layer.self_attention.core_attention.packed_kernel = KERNELS[kernel]


# ---- report ----------------------------------------------------------------------------------------

def compare(est: dict, res: dict) -> dict:
    """Term by term: estimate vs measured (bytes), and the totals' ratio."""
    b = est["bytes"]
    tr, en, ro, t = res.get("trainer", {}), res.get("engine", {}), res.get("rollout", {}), res.get("train", {})
    steps = [x for x in (t.get("first_step"), t.get("steady_step")) if x]
    opt = (tr.get("optimizer_master") or 0) + (tr.get("optimizer_moments") or 0) if tr else None
    peaks = [x["peak"] for x in ([ro] + steps) if x.get("ok") and x.get("peak") is not None]
    peaks_res = [x["peak_reserved"] for x in ([ro] + steps) if x.get("ok") and x.get("peak_reserved") is not None]
    measured_total = max(peaks) if len(peaks) == 1 + len(steps) and steps else None
    ctx = res.get("context_and_others")
    steady = t.get("steady_step") or {}
    # activations: the whole step at the recipe's lengths holds the worst micro-batches (first-fit packs the
    # full-length samples into full budgets); the first step is not used: Adam's moments and its step's
    # temporaries appear in it (reported as first_step_optimizer)
    act = steady["peak"] - steady["allocated_before"] if steady.get("ok") and steady.get("peak") is not None else None
    rows = [
        ("weights", b["weights"], tr.get("weights"), "trainer parameters' bytes"),
        ("gradients", b["grads"], tr.get("grads"), "DDP main_grad buffers"),
        ("optimizer", b["optimizer"], opt, "fp32 master params + Adam state tensors"),
        ("activations", b["activations"], act, "whole step: peak - allocated before"),
        ("engine weights", b["engine_weights"], en.get("allocated_delta") if en.get("allocated_delta") is not None
         else en.get("weights"), "allocated by building the engine (CPU: its tensors' bytes)"),
        ("KV cache", b["kv_cache"], ro.get("kv_cache"), "the engine's decoder.kv_cache_bytes()"),
        ("rollout extra", b["rollout_activations"], ro.get("extra"), "generate peak - before - KV"),
        ("overhead", b["overhead"], (ctx + max(peaks_res) - measured_total) if ctx is not None and measured_total
         and peaks_res else None, "CUDA context + (peak reserved - peak allocated)"),
    ]
    terms = [{"term": n, "estimate_GiB": gib(e), "measured_GiB": gib(m),
              "ratio": round(e / m, 3) if m else None, "measured_how": how} for n, e, m, how in rows]
    est_alloc = b["total"] - b["overhead"]
    total = {"estimate_GiB": gib(b["total"]), "estimate_without_overhead_GiB": gib(est_alloc),
             "measured_peak_allocated_GiB": gib(measured_total),
             "measured_peak_reserved_GiB": gib(max(peaks_res)) if peaks_res else None,
             "measured_peak_reserved_plus_context_GiB": gib(max(peaks_res) + ctx) if peaks_res and ctx else None,
             "ratio": round(est_alloc / measured_total, 3) if measured_total else None}
    total["within_10pct"] = None if total["ratio"] is None else abs(total["ratio"] - 1) <= 0.1
    first = t.get("first_step") or {}
    if first.get("ok") and first.get("peak") is not None:
        total["first_step_optimizer_GiB"] = {
            "moments_made": gib(first["allocated_after"] - first["allocated_before"]),
            "peak_beyond_before": gib(first["peak"] - first["allocated_before"]),
            "estimate_moments_plus_step": gib(b["optimizer_moments"] + 4 * est["params_per_gpu"])}
    return {"micro_batch": est["micro_batch_size"], "max_tokens": est.get("max_tokens"), "terms": terms,
            "total": total,
            "kv_slots": {"estimate": est.get("kv_slots"), "measured": ro.get("slots")},
            "free_at_first_rollout_GiB": {"estimate": gib((est.get("kv") or {}).get("free")),
                                          "measured": gib(res.get("before_rollout", {}).get("free"))}}


def print_table(cmp: dict, est: dict, log) -> None:
    log(f"\nestimate vs measured, micro-batch {cmp['micro_batch']} (GiB):")
    log(f"  {'term':<15}{'estimate':>10}{'measured':>10}{'ratio':>8}   measured as")
    for t in cmp["terms"]:
        m = "-" if t["measured_GiB"] is None else f"{t['measured_GiB']:.2f}"
        r = "-" if t["ratio"] is None else f"{t['ratio']:.2f}"
        log(f"  {t['term']:<15}{t['estimate_GiB']:>10.2f}{m:>10}{r:>8}   {t['measured_how']}")
    tot = cmp["total"]
    m = "-" if tot["measured_peak_allocated_GiB"] is None else f"{tot['measured_peak_allocated_GiB']:.2f}"
    r = "-" if tot["ratio"] is None else f"{tot['ratio']:.3f}"
    log(f"  {'total':<15}{tot['estimate_without_overhead_GiB']:>10.2f}{m:>10}{r:>8}   estimate without overhead vs "
        f"max_memory_allocated (reserved {tot['measured_peak_reserved_GiB']}, + context "
        f"{tot['measured_peak_reserved_plus_context_GiB']}; estimate with overhead {tot['estimate_GiB']})")
    log(f"  KV slots: estimate {cmp['kv_slots']['estimate']}, engine {cmp['kv_slots']['measured']}; "
        f"total within ±10%: {tot['within_10pct']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--config", default=str(DEFAULT_CONFIG))
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override, section.key=value")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/memory_check_<device>_<date>.json)")
    ap.add_argument("--work", default=None, help="scratch dir for the random model (default /tmp/memory_check_<device>)")
    ap.add_argument("--step-samples", type=int, default=0, help="samples of the whole step (default the config's "
                                                                   "global batch)")
    ap.add_argument("--decode-mean", type=int, default=64, help="mean response length of the shortened decode")
    ap.add_argument("--throughput", action="store_true", help="after the step, the trainer alone: today's layout "
                                                              "(unpacked, micro-batch 1) vs packed")
    ap.add_argument("--throughput-budget", default="36864", help="tokens per packed micro-batch there (a list: a sweep)")
    ap.add_argument("--throughput-attention", default="flash2", help="packed-attention kernels to time there "
                    "(train.packed_attention; a list: each budget once per kernel)")
    ap.add_argument("--throughput-both-norms", action="store_true", help="each throughput row also with the RMSNorms "
                    "the other way (train.fusions' norm: compiled or eager)")
    ap.add_argument("--packed-only", action="store_true", help="skip the unpacked baseline row")
    ap.add_argument("--profile", action="store_true", help="profile one packed step (the last budget's) on CUDA")
    ap.add_argument("--force-offload", action="store_true", help="offload the trainer's state even where the "
                                                                 "config would not (CPU smoke)")
    ap.add_argument("--reuse", action="store_true", help="reuse the work dir's model if it is there")
    ap.add_argument("--deadline", type=float, default=400.0, help="seconds after which the throughput rows are skipped")
    ap.add_argument("--from-json", default=None, help="re-compare a measured JSON with the current plan (no GPU)")
    ap.add_argument("--plan-label", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--stage", default=None, help=argparse.SUPPRESS)  # 'setup': the child process
    args = ap.parse_args(argv)
    args.t_start = time.time()
    H.prepare_env()
    S = shapes(args.device)
    W = Path(args.work or f"/tmp/memory_check_{args.device}")
    if args.stage == "setup":
        if args.device == "cpu":
            _torch().set_num_threads(1)
        r = gpu_grpo.sec_setup(S, W)
        print("SETUP", json.dumps(r, default=str), flush=True)
        return 0

    lines: list[str] = []
    if args.from_json:
        return recompare(args, S)

    def log(msg: str = "") -> None:
        print(msg, flush=True)
        lines.append(msg)

    torch = _torch()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu for the smoke mode", file=sys.stderr)
        return 2
    info = H.env_info({"device": args.device})
    date = datetime.datetime.now(datetime.timezone.utc)
    device_name = info.get("gpu", "cpu")
    out = Path(args.out) if args.out else (
        ROOT / "bench" / "results" / f"memory_check_{_short_device(device_name) if args.device == 'cuda' else 'cpu'}_"
                                     f"{date:%Y-%m-%d}.json")
    cfg = load_cfg(args.config, args.overrides, args.device)
    hf_config = hf_config_of(S)
    device_gib = (torch.cuda.get_device_properties(0).total_memory / GIB) if args.device == "cuda" else 80.0
    # the plan's target: the config's cluster.gpu_memory_gb (the 24 GB card), else this GPU
    gpu_gib = cfg.cluster.gpu_memory_gb or device_gib
    from runtime.plan.memory import plan_choices
    choices = plan_choices(cfg, hf_config, gpu_gib)  # what the run writes into its frozen config
    if choices:
        cfg = load_cfg(args.config, list(args.overrides) + [f"{k}={v}" for k, v in choices.items()], args.device)
    report: dict = {"benchmark": "memory_check", "date": date.strftime("%Y-%m-%dT%H:%M:%SZ"), "device": device_name,
                    "env": info, "config": str(args.config), "overrides": args.overrides, "shapes": S,
                    "gpu_mem_GiB": round(gpu_gib, 2), "device_mem_GiB": round(device_gib, 2),
                    "gpu_cap_GiB": os.environ.get("GPU_CAP_GIB"), "plan_choices": choices, "status": "started",
                    "notes": ["The engine's decode is cut short by stop tokens; its KV cache is preallocated at the "
                              "plan's size before the first step, so the peak does not depend on the steps run.",
                              "activations: the worst micro-batch (full-length samples filling the token budget, or "
                              "micro_batch_size of them), peak - allocated before; the whole step runs the global "
                              "batch at the recipe's lengths (log-normal responses, 1/16 at the cap).",
                              "throughput: all tokens (prompt + response) of the whole step / its seconds, trainer "
                              "alone (the engine shut down), after a warm-up step at the same layout."]}

    def dump():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1, default=str))

    est = estimate(cfg, hf_config, gpu_gib, args.device)
    log(f"config {args.config} ({cfg.name}), device {device_name}, GPU memory {gpu_gib:.2f} GiB")
    from runtime.plan.memory import format_estimate
    for line in format_estimate(est).splitlines():
        log(line)
    report["estimate"] = _est_json(est)
    dump()

    # the random model, in a child process (conversion starts its own gloo group)
    t0 = time.time()
    if not (args.reuse and (W / "hf" / "config.json").exists() and (W / "td").exists()):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--stage", "setup", "--device", args.device, "--work", str(W)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if p.returncode != 0:
            report.update(status="FAILED", error="setup: " + (p.stdout[-2000:] + p.stderr[-3000:]))
            dump()
            log(report["error"])
            return 1
    report["setup_s"] = round(time.time() - t0, 1)
    from runtime.plan.memory import param_counts
    from runtime.models import load_hf_config
    saved = load_hf_config(str(W / "hf"))
    assert param_counts(saved) == param_counts(hf_config), "setup wrote another model shape than estimated"
    log(f"random model + torch_dist conversion: {report['setup_s']} s")

    try:
        res = measure(cfg, S, W, args, est, hf_config, log)
    except Exception as e:  # noqa: BLE001 - the estimate is already out; say what broke
        traceback.print_exc()
        report.update(status="FAILED", error=f"{type(e).__name__}: {e}"[:3000])
        dump()
        return 1
    report["measured"] = res
    t = res["train"]
    main_ok = bool(res["rollout"].get("ok") and t["first_step"].get("ok") and t.get("steady_step", {}).get("ok"))
    report["comparison"] = compare(est, res)
    print_table(report["comparison"], est, log)
    if res.get("throughput"):
        report["throughput"] = {k: {"tokens_per_s": v.get("tokens_per_s"), "seconds": v.get("seconds"),
                                    "tokens": v.get("tokens"), "peak_GiB": gib(v.get("peak")), "ok": v.get("ok")}
                                for k, v in res["throughput"].items() if k != "profile"}
        if "profile" in res["throughput"]:
            report["throughput"]["profile"] = res["throughput"]["profile"]
    report["status"] = "ok" if main_ok else "ran out of memory (see measured)"
    report["total_s"] = round(time.time() - args.t_start, 1)
    report["lines"] = lines
    dump()
    log(f"\nJSON: {out}  ({report['total_s']} s)")
    return 0


def recompare(args, S) -> int:
    """The measurements of a saved run against the current plan (same config, overrides and plan choices)."""
    report = json.loads(Path(args.from_json).read_text())
    hf_config = hf_config_of(S)
    overrides = list(report["overrides"]) + [f"{k}={v}" for k, v in (report.get("plan_choices") or {}).items()]
    cfg = load_cfg(report["config"], overrides, args.device)
    est = estimate(cfg, hf_config, report["gpu_mem_GiB"] if report["gpu_mem_GiB"] != round(
        report["device_mem_GiB"], 2) else report["measured"]["gpu_total"] / GIB, args.device)
    report["estimate_at_measurement"] = report.get("estimate")
    report["estimate"] = _est_json(est)
    report["comparison"] = compare(est, report["measured"])
    report.setdefault("notes", []).append(
        f"comparison recomputed with --from-json against the plan at {args.plan_label or 'the current code'}")
    print_table(report["comparison"], est, print)
    out = Path(args.out or args.from_json)
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"JSON: {out}")
    return 0


def _est_json(est: dict) -> dict:
    keep = ("fits", "reason", "total", "weights", "grads", "optimizer", "activations", "kv_cache", "engine_weights",
            "rollout_activations", "overhead", "kv_slots", "kv_slot_len", "kv_max_slots", "decode_path", "attention",
            "logprobs", "micro_batch_size", "seq_len", "fit_micro_batch", "gpu_mem_gb", "params", "bytes", "kv",
            "at_rollout", "at_training", "offload", "kv_released", "kv_chosen", "max_tokens", "recompute")
    return {k: est.get(k) for k in keep}


if __name__ == "__main__":
    sys.exit(main())
