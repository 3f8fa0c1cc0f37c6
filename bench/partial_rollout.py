"""Partial rollout on the recipe's rollout (issue 21): the real train stage with `rollout.partial` off and on.

    python bench/partial_rollout.py --sections setup,off --out $OUT    # H100, one call (< 10 min)
    python bench/partial_rollout.py --sections setup,on --out $OUT     # H100, the other call
    python bench/partial_rollout.py --merge OUT1 OUT2 --results-dir bench/results   # one JSON from both
    python bench/partial_rollout.py --cpu                              # CI smoke: tiny shapes, same code paths
    # the 24 GB card (issue 33): its config, the allocator capped as on that card (../shared/tools/gpu-cap
    # copied to .gpucap), partial on, ~5 rollouts in one call
    GPU_CAP_GIB=23.39 PYTHONPATH=$PWD/.gpucap:$PYTHONPATH python bench/partial_rollout.py --out $OUT \
        --config configs/qwen3-0.6b-dapo-24gb.yaml --sections setup,on --deadline 585 --results-dir $OUT

What runs: `runtime.grpo.session.TrainSession` (cluster.backend local, trainer and engine colocated) on the
shipped recipe `configs/qwen3-0.6b-dapo.yaml` (32 prompts x 8 samples, dynamic sampling with 1.5x
over-sampling, ~1024-token prompts, at most 8192 new tokens, TIS) on a random-init Qwen3-0.6B shape, bf16,
with the plan's KV pool, packed micro-batches (`--set`, default train.max_tokens_per_micro_batch=24576)
and a reward that costs nothing (bench/trivial_reward.py). `--config` takes another config of the recipe
(configs/qwen3-0.6b-dapo-24gb.yaml: its memory settings kept, no default `--set`). The plan is sized for
`cluster.gpu_memory_gb` where the config sets it (else the device's total memory), as `grpoflow run`
sizes it. Each sample's length comes from the paged-engine
bench's keyed schedule (`rollout_bench.lengths_for_hashes`: log-normal, median 1700, a tail to the cap)
applied to the sample's key: the engine's stop token is forced there, so a continued sample stops at the
same total length as it would have unbroken, and both modes draw lengths from the same distribution.

Before the timed rollouts the engine is warmed (compile, graphs) on short requests, inside the session's
memory hand-off as a rollout generates (`TrainSession.engine_turn`: the trainer's state offloaded, the KV
pool made, then freed and the state reloaded). `off`: every rollout
is alike (no buffer): all count, and a second call from `--first-rollout` adds more of them (other keyed
lengths). `on`: rollout 0 starts with an empty buffer and is reported but not counted. Per rollout: step time and its parts, trained response tokens, the engine's slot use
(row-steps / (decode steps x rows), the GPU busy fraction of a rollout's decode), tokens generated and
tokens generated but never trained (`off`: the complete extra groups over-sampling discards; `on`: groups
dropped as stale), preemptions, and the peak GPU memory (allocated, reserved) against the plan's. A rollout
is started while the median step so far still fits the section's time; each one finished is kept in
OUT/<section>.progress.json, so a section cut at its time limit keeps the rollouts it finished.
Results: OUT/results.jsonl, OUT/partial_rollout.json (summary; with --results-dir a copy named by device,
date and, for another config or a capped allocator, both).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import gpu_grpo  # the random model and its torch_dist copy
import harness as H
import rollout_bench  # the keyed length schedule
from harness import ROOT

RECIPE = ROOT / "configs" / "qwen3-0.6b-dapo.yaml"
SECTIONS = ("setup", "off", "on")
SECTION_MAX_S = {"setup": 150, "off": 600, "on": 600}
GPU_SETS = ["train.max_tokens_per_micro_batch=24576"]
CPU_SETS = ["data.max_prompt_len=40", "rollout.max_new_tokens=40", "rollout.rollout_batch_size=4",
            "rollout.n_samples_per_prompt=2", "train.global_batch_size=8", "train.micro_batch_size=4",
            "model.dtype=float32", "rollout.decode_path=paged", "rollout.kv_cache_gb=0.01",
            "cluster.offload_trainer_state=on"]  # (on the CPU nothing moves, but the hand-off calls it as on a GPU)


def shapes(cpu: bool) -> dict:
    """The engine bench's schedule (lengths) with the recipe's sizes; the model is gpu_grpo's."""
    S = dict(rollout_bench.SHAPES["cpu" if cpu else "gpu"])
    S["model"] = dict(gpu_grpo.SHAPES["cpu" if cpu else "gpu"], prompt_len=8, prompts=2, rollouts=1)
    S["rows"] = 64 if cpu else 400  # prompts in the data set (each rollout draws ~ 48 on the H100)
    S["timed_rollouts"] = {"off": 1 if cpu else 5, "on": 2 if cpu else 6}  # CPU: on's warm-up and one that carries
    S["on_warmup"] = 1  # rollout 0 starts with an empty buffer; from rollout 1 on it carries what the last left
    return S


def sec_setup(S, W: Path) -> dict:
    """The random model (gpu_grpo's setup) and a data set of prompts of `prompt_len` tokens."""
    import random

    from transformers import AutoTokenizer
    t0 = time.time()
    r = gpu_grpo.sec_setup(S["model"], W)
    tok = AutoTokenizer.from_pretrained(W / "hf")
    rows = H.word_rows(tok, random.Random(21), S["rows"], S["prompt_len"], S["prompt_len"] + 8)
    prep = H.write_prompts(W, "prompts", rows, tok, max_prompt_len=2 * S["prompt_len"])
    return {"name": "setup", "model": r, "prompts": prep.get("rows"), "s": round(time.time() - t0, 1)}


def default_sets(cpu: bool, config: Path) -> list[str]:
    """The `--set` overrides when none are given: the CPU smoke's shapes; the recipe's packing on a GPU;
    nothing for another config (its own memory settings are what is measured)."""
    if cpu:
        return CPU_SETS
    return GPU_SETS if config.resolve() == RECIPE.resolve() else []


def plan_card(S, cfg) -> dict:
    """The GPU memory the plan is sized for: `cluster.gpu_memory_gb` where the config sets it (what
    `grpoflow run` plans with), else the device's total memory (as an allocator cap reports it)."""
    if cfg.cluster.gpu_memory_gb is not None:
        return {"card_gib": float(cfg.cluster.gpu_memory_gb), "card_from": "cluster.gpu_memory_gb"}
    if S["device"] != "cuda":
        return {"card_gib": None, "card_from": None}
    import torch
    return {"card_gib": round(torch.cuda.mem_get_info(0)[1] / 2**30, 2), "card_from": "the device's total memory"}


def bench_config(S, W: Path, partial: bool, sets: list[str], config: Path = RECIPE):
    """The config, pointed at the random model and data, on this machine (one process: trainer and engine
    colocated; the config's gpu_memory_gb and offload setting kept), with the plan's KV pool. Returns the
    config and the plan (`plan_card`, and on a GPU the plan's estimate in GiB)."""
    import yaml

    from runtime.config import config_with_overrides
    from runtime.models import load_hf_config
    from runtime.plan.memory import estimate_for_config, plan_choices
    tree = yaml.safe_load(Path(config).read_text())
    tree["name"] = f"bench-partial-{'on' if partial else 'off'}"
    tree["model"]["source"] = str(W / "hf")
    tree["data"] = {**tree["data"], "train": {"source": str(W / "data" / "prompts.jsonl"), "format": "slime"},
                    "eval": {}, "apply_chat_template": False, "max_prompt_len": 2 * S["prompt_len"]}
    tree["rollout"].update(reward="bench.trivial_reward:length_mod13", partial=partial)
    tree["eval"] = {"interval": None}
    tree["tracking"] = {"enabled": False}
    memory = {k: v for k, v in (tree.get("cluster") or {}).items() if k in ("gpu_memory_gb", "offload_trainer_state")}
    tree["cluster"] = {"backend": "local", "device": S["device"], "colocate": True, **memory}
    tree["storage"] = {"root": str(W / f"root-{'on' if partial else 'off'}")}
    cfg = config_with_overrides(tree, sets, "bench")
    plan = {"config": str(config), **plan_card(S, cfg)}
    if S["device"] == "cuda":
        hf = load_hf_config(str(W / "hf"))
        choices = plan_choices(cfg, hf, plan["card_gib"])
        cfg = config_with_overrides(tree, sets + [f"{k}={v}" for k, v in choices.items()], "bench")
        est = estimate_for_config(cfg, hf, gpu_mem_gb=plan["card_gib"])
        plan.update({k: round(est[k], 2) for k in ("kv_cache", "at_rollout", "at_training", "total")}, fits=est["fits"],
                    offload=est["offload"])
    plan["kv_cache_gb"] = cfg.rollout.kv_cache_gb
    return cfg, plan


def force_keyed_lengths(S) -> list[dict]:
    """Every paged generate at the recipe's max_new_tokens stops each sample at its keyed length; returns the
    list the decoder's stats of each such call are appended to."""
    from runtime.rollout.paged_decode import PagedDecoder
    calls: list[dict] = []
    plain = PagedDecoder.steps

    def steps(self, prompts, key_hash, sampling, stop_ids, stop_at=None, *rest, **more):  # rest: as the decoder's
        timed = int(sampling.max_new_tokens) == S["max_new"]
        if timed:
            stop_at = rollout_bench.lengths_for_hashes(S, key_hash)
        out = yield from plain(self, prompts, key_hash, sampling, stop_ids, stop_at, *rest, **more)
        if timed:
            calls.append({k: self.stats.get(k) for k in ("decode_steps", "row_steps", "rows", "decode_s",
                                                         "prefill_s", "total_s", "new_tokens", "max_active",
                                                         "preemptions", "reprefill_tokens", "prefill_tokens",
                                                         "prefill_pack_max")})
        return out

    PagedDecoder.steps = steps  # generate and the built-in engine both go through it
    return calls


KEEP = ("rollout", "step_time_s", "rollout_time_s", "generate_time_s", "train_time_s", "train_tokens",
        "weight_sync_s", "response_len_mean", "groups_dropped", "reward_mean", "tis_weight_mean")


def run_mode(S, W: Path, partial: bool, sets: list[str], budget_s: float, first: int = 0, config: Path = RECIPE,
             progress: Path | None = None) -> dict:
    """Timed rollouts first, first + 1, ... of the train stage in one mode (from a later `first`: more steps
    alike, with other keyed lengths; `on` starts with an empty buffer again), as many of S['timed_rollouts']
    as fit in budget_s (the next is started while the median step so far fits); each finished one is
    written to `progress` (the section's result so far)."""
    t_start = time.time()
    from runtime.grpo.session import TrainSession
    cfg, plan = bench_config(S, W, partial, sets, config)
    root = Path(cfg.storage.root)
    rd = H.run_dir_over(root, "bench", H.setup_inputs(W))
    calls = force_keyed_lengths(S)
    sess = TrainSession(cfg, rd)
    sess.ensure_at(None)
    engine = sess.engine.group.members[0]  # cluster.backend local: the built-in engine in this process
    t0 = time.time()
    with H.engine_warm_up(sess, S["prompt_len"]) as moved:
        pool_during = engine.decoder.kv_cache_bytes()
    res: dict = {"name": "on" if partial else "off", "partial": partial, "setup_s": round(t0 - t_start, 1),
                 "engine_warmup_s": round(time.time() - t0, 1), "plan_kv_cache_gb": cfg.rollout.kv_cache_gb,
                 "plan": plan, "sets": sets, "rollouts": [],
                 "warmup_handoff": {"offload": moved["offload"], "reload": moved["reload"],
                                    "kv_pool_GiB_during": round(pool_during / 2**30, 4),
                                    "kv_pool_GiB_after": round(engine.decoder.kv_cache_bytes() / 2**30, 4)}}
    B = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    step_times: list[float] = []
    for rid in range(first, first + S["timed_rollouts"]["on" if partial else "off"]):
        # the next step's time: the median after the first (which compiles, captures, pins host memory)
        expect = statistics.median(step_times[1:]) if len(step_times) > 1 else (step_times[0] if step_times else 0.0)
        if time.time() - t_start + expect > budget_s:
            res["stopped_early"] = f"no time for rollout {rid} within {budget_s:.0f} s (a step takes ~{expect:.0f} s)"
            break
        n_calls = len(calls)
        H.reset_peak(S)
        m = sess.rollout(rid)
        step_times.append(m["step_time_s"])
        dec = calls[n_calls:]
        row = {k: (round(m[k], 4) if isinstance(m[k], float) else m[k]) for k in KEEP if k in m}
        row.update({k: round(v, 3) if isinstance(v, float) else v for k, v in m.items() if k.startswith("partial_")})
        row["trained_response_tokens"] = round(m["response_len_mean"] * B)
        row["generated_tokens"] = round(m["rollout_tok_s"] * m["generate_time_s"])  # the rollout's own count
        row["engine_tokens"] = sum(c["new_tokens"] or 0 for c in dec)  # incl. a chunk's tokens past a stop
        row["generate_calls"] = len(dec)
        steps = sum(c["decode_steps"] or 0 for c in dec)
        row["slot_use"] = round(sum(c["row_steps"] or 0 for c in dec) / max(1, sum((c["decode_steps"] or 0) * (c["rows"] or 0)
                                                                                  for c in dec)), 3)
        row["decode_steps"] = steps
        row["engine_s"] = round(sum(c["total_s"] or 0 for c in dec), 2)
        row["preemptions"] = sum(c["preemptions"] or 0 for c in dec)
        row["trained_tok_s"] = round(row["trained_response_tokens"] / m["step_time_s"])
        row.update(H.peak_memory(S))
        res["rollouts"].append(row)
        print("ROLLOUT", json.dumps(row), flush=True)
        res["counted_from"] = first + (S["on_warmup"] if partial else 0)
        res["steady"] = steady_of(res)
        res["peak_mem_GiB"] = max(r["peak_allocated_GiB"] for r in res["rollouts"])
        res["peak_reserved_GiB"] = max(r["peak_reserved_GiB"] for r in res["rollouts"])
        if progress is not None:  # what this section has, should it be cut at its time limit
            tmp = progress.with_suffix(".tmp")
            tmp.write_text(json.dumps({**res, "status": "ok", "cut_at_time_limit": True}, default=str))
            tmp.replace(progress)
    res["counted_from"] = first + (S["on_warmup"] if partial else 0)
    res["steady"] = steady_of(res)
    sess.close()
    return res


def steady_of(res: dict) -> dict | None:
    """Totals and medians over the rollouts counted (from `counted_from` on; rollouts merged from several
    calls of the same mode are all counted, each call's own first ones excepted)."""
    steady = [r for r in res["rollouts"] if r.get("counted", r["rollout"] >= res["counted_from"])]
    if not steady:
        return None
    partial = res["partial"]
    total = lambda k: sum(r[k] for r in steady)  # noqa: E731
    med = lambda k: round(statistics.median(r[k] for r in steady), 2)  # noqa: E731
    out = {"rollouts": len(steady), "trained_tok_s": round(total("trained_response_tokens") / total("step_time_s")),
           "step_time_s": med("step_time_s"), "rollout_time_s": med("rollout_time_s"),
           "train_time_s": med("train_time_s"),
           "slot_use": round(sum(r["slot_use"] * r["decode_steps"] for r in steady) / max(1, total("decode_steps")), 3),
           "generated_tokens": total("generated_tokens"), "trained_response_tokens": total("trained_response_tokens"),
           # off: the extra complete groups are dropped once the batch is full; on: only stale groups are
           "never_trained_tokens": (total("partial_stale_tokens") if partial
                                    else total("generated_tokens") - total("trained_response_tokens"))}
    if partial:
        out["tokens_reused"] = total("partial_tokens_reused")
        out["buffered_samples_mean"] = round(statistics.fmean(r["partial_buffered_samples"] for r in steady), 1)
        out["stale_dropped_groups"] = total("partial_stale_dropped")
    return out


def merge(dirs: list[str]) -> dict:
    """The sections of several calls' OUT dirs; the rollouts of one mode run in several calls are pooled."""
    res: dict = {}
    for d in dirs:
        for name, sec in H.read_results(Path(d)).items():
            for r in sec.get("rollouts", []):  # each call's own warm-up rollouts stay out of the pool's count
                r.setdefault("counted", r["rollout"] >= sec["counted_from"])
            if name in res and name != "setup" and sec.get("status") == "ok" and res[name].get("status") == "ok":
                have = res[name]
                have["rollouts"] = have["rollouts"] + sec["rollouts"]
                have["steady"] = steady_of(have)
            elif name not in res:
                res[name] = sec
    return res


def summarize(S, res: dict, env: dict | None = None) -> dict:
    info = env or {**H.env_info(dict(S["model"])), "gpu_cap_gib": os.environ.get("GPU_CAP_GIB")}
    off, on = ((res.get(k) or {}).get("steady") for k in ("off", "on"))
    ratios = {}
    if off and on:
        ratios = {"trained_tok_s_on_vs_off": round(on["trained_tok_s"] / off["trained_tok_s"], 2),
                  "step_time_on_vs_off": round(on["step_time_s"] / off["step_time_s"], 2),
                  "rollout_time_on_vs_off": round(on["rollout_time_s"] / off["rollout_time_s"], 2)}
    return {**H.summary_head("partial_rollout", info), "shapes": {k: v for k, v in S.items() if k != "model"},
            "ratios": ratios, "targets_met": ({"trained_tok_s>=1.3x": ratios["trained_tok_s_on_vs_off"] >= 1.3}
                                              if ratios and S["device"] == "cuda" else None),
            "sections": res}


def print_table(summary: dict) -> None:
    rows = [("mode", "rollouts", "trained tok/s", "step s", "rollout s", "train s", "slot use", "never trained")]
    for name in ("off", "on"):
        st = (summary["sections"].get(name) or {}).get("steady")
        if st:
            rows.append((name, st["rollouts"], st["trained_tok_s"], st["step_time_s"], st["rollout_time_s"],
                         st["train_time_s"], st["slot_use"], st["never_trained_tokens"]))
        else:
            rows.append((name, "-", "-", "-", "-", "-", "-", str((summary["sections"].get(name) or {}).get("error", "not run"))[:80]))
    H.print_columns(rows)
    print("ratios", json.dumps(summary["ratios"]))
    for name in ("off", "on"):
        sec = summary["sections"].get(name) or {}
        if not sec.get("rollouts"):
            continue
        print(f"\n{name}: per rollout (counted from {sec.get('counted_from')})"
              + (" - cut at the section's time limit" if sec.get("cut_at_time_limit") else ""))
        rows = [("rollout", "step s", "generate s", "train s", "weight sync s", "preemptions", "trained tok/s",
                 "peak alloc GiB", "peak reserved GiB")]
        rows += [(r["rollout"], r["step_time_s"], r.get("generate_time_s"), r.get("train_time_s"), r.get("weight_sync_s"),
                  r["preemptions"], r["trained_tok_s"], r.get("peak_allocated_GiB"), r.get("peak_reserved_GiB"))
                 for r in sec["rollouts"]]
        H.print_columns(rows)
        plan, warm = sec.get("plan") or {}, sec.get("warmup_handoff") or {}
        print(f"plan: {plan.get('config')}, card {plan.get('card_gib')} GiB ({plan.get('card_from')}), KV pool "
              f"{plan.get('kv_cache_gb')} GiB, estimate {plan.get('at_rollout')} GiB generating / {plan.get('at_training')} "
              f"GiB training (peak {plan.get('total')}); measured peak {sec.get('peak_mem_GiB')} GiB allocated, "
              f"{sec.get('peak_reserved_GiB')} GiB reserved (the CUDA context not counted)")
        print(f"engine warm-up in the hand-off: {sec.get('engine_warmup_s')} s, offload {warm.get('offload')}, "
              f"KV pool {warm.get('kv_pool_GiB_during')} GiB while warming, {warm.get('kv_pool_GiB_after')} GiB after")


def keep_progress(out: Path, names: list[str]) -> None:
    """A section whose process was cut at its time limit and left rollouts in its progress file: that
    file's result (the rollouts it finished) as the section's. (A section that failed stays failed.)"""
    res = H.read_results(out)
    for name in names:
        progress = out / f"{name}.progress.json"
        cut = (res.get(name) or {}).get("error") == "section process ended with timeout (see log.txt)"
        if cut and progress.exists():
            rec = json.loads(progress.read_text())
            rec["error_of_the_process"] = (res.get(name) or {}).get("error")
            H.append_result(out, rec)


def copy_name(summary: dict, config: Path) -> str:
    """The summary's copy in --results-dir: named by device and date, and by the config and the allocator cap when
    they are not the recipe's and the card's."""
    name = "partial_rollout_" + summary["device"].replace(" ", "_")
    if config.resolve() != RECIPE.resolve():
        name += "_" + config.stem
    if summary["env"].get("gpu_cap_gib"):
        name += f"_cap{summary['env']['gpu_cap_gib']}"
    return f"{name}_{summary['date'][:10]}.json"


def main(argv=None) -> int:
    ap = H.parser(__doc__, "partial_rollout", 570.0, sections=SECTIONS,
                  merge="OUT dirs of earlier calls: one summary of their sections")
    ap.add_argument("--config", default=str(RECIPE), help="the recipe's config to run (default: the 80 GiB recipe)")
    ap.add_argument("--set", dest="sets", action="append", default=None,
                    help="config override (default: the recipe's packing; none for another --config)")
    ap.add_argument("--first-rollout", type=int, default=0, help="the first rollout id (a later one: more steps alike, other keyed lengths)")
    a = ap.parse_args(argv)
    S = shapes(a.cpu)
    config = Path(a.config)
    sets = a.sets if a.sets is not None else default_sets(a.cpu, config)
    out, W = H.start(a, "partial_rollout")
    env = None
    if a.merge:
        res, env = merge(a.merge), H.merged_env(a.merge, "partial_rollout")
    elif a.section:
        left = H.section_budget(a)
        progress = out / f"{a.section}.progress.json"
        fn = {"setup": sec_setup,
              "off": lambda S, W: run_mode(S, W, False, sets, left - 15, a.first_rollout, config, progress),
              "on": lambda S, W: run_mode(S, W, True, sets, left - 15, a.first_rollout, config, progress)}[a.section]
        return H.section_exit(H.run_section(a.section, S, W, out, fn))
    else:
        sections = H.sections_of(a, SECTIONS)
        H.clear_results(out)
        for name in sections:
            (out / f"{name}.progress.json").unlink(missing_ok=True)
        extra = ("--cpu",) if a.cpu else ()
        extra += H.set_args(sets) + ("--first-rollout", str(a.first_rollout), "--config", str(config))
        H.run_in_turn(Path(__file__), sections, W, out, a.deadline, SECTION_MAX_S, extra)
        keep_progress(out, sections)
        res = H.read_results(out)
    summary = summarize(S, res, env)
    H.save_summary(summary, out, "partial_rollout", a.results_dir, a.cpu,
                   name=None if a.cpu else copy_name(summary, config))
    print_table(summary)
    return H.exit_code(summary, a.cpu)


if __name__ == "__main__":
    sys.exit(main())
