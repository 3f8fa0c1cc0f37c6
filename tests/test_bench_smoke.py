"""The GPU benchmark's CPU mode (tiny shapes, same code paths) and the engine's fast decode path.

`bench/gpu_grpo.py --cpu` runs every section of the H100 benchmark on a tiny model: the fast
engine path against the slow HF path, the trainer (chunked output layer) against full logits and
against the engine, and the real train stage.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def _cpu_bench(script: str, tmp_path, *args: str, timeout: int = 600) -> dict:
    """Run bench/<script>.py on CPU into tmp_path/out; its summary (<script>.json)."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / f"{script}.py"), "--cpu", "--out", str(out),
                           "--work", str(tmp_path / "work"), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / f"{script}.json").read_text())


def test_gpu_bench_cpu_mode_runs(tmp_path):
    summary = _cpu_bench("gpu_grpo", tmp_path, "--sections", "setup,engine,trainer,stage", timeout=900)
    sec = summary["sections"]
    assert {k for k, v in sec.items() if v["status"] == "ok"} == {"setup", "engine", "trainer", "stage"}
    assert summary["device"] == "cpu" and summary["date"]
    eng = sec["engine"]
    # fp32 on CPU: the fast path draws exactly the slow path's tokens for the same keys
    assert eng["fast_vs_slow"]["rows_identical_frac"] == 1.0
    assert eng["fast_vs_slow"]["logprob_absdiff_max"] < 1e-5
    assert eng["tok_s"] > 0 and eng["stats"]["attention"] == "sdpa_paged_reference"
    tr = sec["trainer"]
    assert tr["chunked_logprobs"] is True
    assert tr["chunked_vs_full_logits_logprobs"]["max_abs_diff"] < 1e-4
    assert tr["engine_vs_trainer_logprobs"]["max_abs_diff"] < 1e-4
    assert tr["tok_s"] > 0
    st = sec["stage"]
    assert st["skipped"] is False and st["step_time_s"] > 0 and st["rollouts"]


def test_rollout_bench_cpu_mode_runs(tmp_path):
    summary = _cpu_bench("rollout_bench", tmp_path)
    assert summary["benchmark"] == "rollout_bench" and summary["device"] == "cpu" and summary["date"]
    sec = summary["sections"]
    assert {k for k, v in sec.items() if v["status"] == "ok"} == set(sec) == {"paged", "capped", "kernels"}
    sched = summary["schedule"]
    paged, capped = (sec[k]["realistic"] for k in ("paged", "capped"))
    # the forced stops make every engine produce exactly the schedule's tokens
    assert paged["new_tokens"] == capped["new_tokens"] == sched["total"]
    assert paged["attention"] == "sdpa_paged_reference" and paged["preemptions"] == 0
    assert capped["preemptions"] > 0 and capped["pages"] < paged["pages"]  # the small pool preempts and still finishes
    assert paged["trace"] and sec["paged"]["fixed_512"]["tok_s"] > 0 and sec["paged"]["fixed_512"]["handoff"]
    assert summary["floor"]["floor_s"] > 0


def test_partial_rollout_bench_cpu_mode_runs(tmp_path):
    summary = _cpu_bench("partial_rollout", tmp_path)
    assert summary["benchmark"] == "partial_rollout" and summary["device"] == "cpu" and summary["ratios"]
    off, on = (summary["sections"][k]["steady"] for k in ("off", "on"))
    # off discards what it over-sampled; on carries it over, and only staleness drops could waste tokens
    assert off["never_trained_tokens"] > 0 and on["never_trained_tokens"] == 0 and on["stale_dropped_groups"] == 0
    assert on["tokens_reused"] > 0 and on["trained_tok_s"] > 0 and off["trained_tok_s"] > 0


def test_lora_bench_cpu_mode_runs(tmp_path):
    """bench/lora_grpo.py on a 2-layer GLM4: the base built by megatron and saved as torch_dist (no HF weights),
    the train stage with LoRA and the engine on the trainer's base, rollouts at the keyed lengths."""
    summary = _cpu_bench("lora_grpo", tmp_path)
    sec = summary["sections"]
    assert {k for k, v in sec.items() if v["status"] == "ok"} == {"setup", "stage"}
    assert sec["setup"]["model_type"] == "glm4" and sec["setup"]["base"]["torch_dist_GiB"] >= 0
    st = sec["stage"]
    assert st["build"]["shares_base"] is True and st["lora"]["enabled"] and len(st["rollouts"]) >= 2
    assert st["build"]["trainer"]["grads"] == st["build"]["trainer"]["adapters"]  # fp32 adapters: grads as large
    for r in st["rollouts"]:
        assert r["logp_gap"]["max"] < 1e-4 and r["adapter_sync_bytes"] == st["build"]["adapter_buffers"] > 0
        assert r["step_time_s"] > 0 and r["train_tokens"] > 0
    assert [t["term"] for t in st["compare"]["terms"]][:3] == ["weights", "gradients", "optimizer"]
    assert st["compare"]["terms"][0]["ratio"] == 1.0  # the frozen base + adapters, as planned


# ---- bench/memory_check.py: the memory estimate against what is allocated -------------------------------

def test_memory_check_cpu_mode_runs(tmp_path):
    out = tmp_path / "memory_check.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "memory_check.py"), "--device", "cpu", "--out", str(out),
                           "--work", str(tmp_path / "work"), "--force-offload"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the estimate is printed before anything is measured
    assert proc.stdout.index("memory per GPU") < proc.stdout.index("random model")
    rep = json.loads(out.read_text())
    assert rep["benchmark"] == "memory_check" and rep["device"] == "cpu" and rep["date"] and rep["status"] == "ok"
    est = rep["estimate"]
    assert {"fits", "total", "bytes", "kv_slots", "decode_path", "reason"} <= set(est)
    cmp = rep["comparison"]
    assert [t["term"] for t in cmp["terms"]] == ["weights", "gradients", "optimizer", "activations", "engine weights",
                                                 "KV cache", "rollout extra", "overhead"]
    assert {"estimate_GiB", "measured_peak_allocated_GiB", "measured_peak_reserved_GiB", "ratio",
            "within_10pct"} <= set(cmp["total"])
    # CPU has no allocator statistics, but the trainer's and engine's tensors are counted exactly
    m, b = rep["measured"], est["bytes"]
    assert m["trainer"]["weights"] == b["weights"] and m["trainer"]["grads"] == b["grads"]
    assert m["trainer"]["optimizer_master"] + m["trainer"]["optimizer_moments"] == b["optimizer"]  # fp32: Adam only
    assert m["engine"]["weights"] == b["engine_weights"]
    assert m["rollout"]["ok"] and m["rollout"]["rows"] == 6  # 2 prompts x 1.5 over-sampling x 2 samples
    assert m["train"]["first_step"]["ok"] and m["train"]["steady_step"]["ok"]
    assert m["train"]["steady_step"]["samples"] == 4  # the config's global batch at the recipe's lengths
    # the state offload's round trip around the rollout (forced on CPU): the same bytes out and back
    off = m["offload"]
    assert off["offload"]["bytes"] == off["reload"]["bytes"] == b["grads"] + b["optimizer"] - b["optimizer_moments"]
