"""The GPU benchmark's CPU mode (tiny shapes, same code paths) and the engine's fast decode path.

`bench/gpu_grpo.py --cpu` runs every section of the H100 benchmark on a tiny model: the fast
engine path against the slow HF path, the trainer (chunked output layer) against full logits and
against the engine, and the real train stage.

The scripts' CPU runs are marked `bench`: `make bench-smoke` runs them (before a GPU call), `make test` leaves them
out (they check the measuring tools, ~8 min, not the product); the merge and harness checks here stay in it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]


def _cpu_bench(script: str, tmp_path, *args: str, timeout: int = 600) -> dict:
    """Run bench/<script>.py on CPU into tmp_path/out; its summary (<script>.json)."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / f"{script}.py"), "--cpu", "--out", str(out),
                           "--work", str(tmp_path / "work"), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / f"{script}.json").read_text())


@pytest.mark.bench
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


@pytest.mark.bench
def test_rollout_bench_cpu_mode_runs(tmp_path):
    summary = _cpu_bench("rollout_bench", tmp_path, "--sections", "paged,capped,kernels,cascade")
    assert summary["benchmark"] == "rollout_bench" and summary["device"] == "cpu" and summary["date"]
    sec = summary["sections"]
    assert {k for k, v in sec.items() if v["status"] == "ok"} == set(sec) == {"paged", "capped", "kernels", "cascade"}
    # cascade attention off and on in one engine: the schedule's tokens both ways, HF's log-probs (fp32)
    cascade = sec["cascade"]
    assert [cascade[m]["realistic"]["attention"] for m in ("off", "on")] == ["sdpa_paged_reference",
                                                                             "sdpa_paged_reference_cascade"]
    for m in ("off", "on"):
        assert cascade[m]["realistic"]["new_tokens"] == summary["schedule"]["total"]
        assert cascade[m]["fixed_512"]["engine_vs_hf_forward_logprobs"]["max_abs_diff"] < 1e-5
        assert all(cascade[m]["steps"][k]["ms_per_step"] > 0 for k in ("start", "middle", "tail"))
    assert summary["ratios"]["cascade_on_vs_off_tok_s"] > 0
    sched = summary["schedule"]
    paged, capped = (sec[k]["realistic"] for k in ("paged", "capped"))
    # the forced stops make every engine produce exactly the schedule's tokens
    assert paged["new_tokens"] == capped["new_tokens"] == sched["total"]
    assert paged["attention"] == "sdpa_paged_reference" and paged["preemptions"] == 0
    assert capped["preemptions"] > 0 and capped["pages"] < paged["pages"]  # the small pool preempts and still finishes
    assert paged["trace"] and sec["paged"]["fixed_512"]["tok_s"] > 0 and sec["paged"]["fixed_512"]["handoff"]
    assert summary["floor"]["floor_s"] > 0


@pytest.mark.bench
def test_partial_rollout_bench_cpu_mode_runs(tmp_path):
    summary = _cpu_bench("partial_rollout", tmp_path)
    assert summary["benchmark"] == "partial_rollout" and summary["device"] == "cpu" and summary["ratios"]
    off, on = (summary["sections"][k]["steady"] for k in ("off", "on"))
    # off discards what it over-sampled; on carries it over, and only staleness drops could waste tokens
    assert off["never_trained_tokens"] > 0 and on["never_trained_tokens"] == 0 and on["stale_dropped_groups"] == 0
    assert on["tokens_reused"] > 0 and on["trained_tok_s"] > 0 and off["trained_tok_s"] > 0
    for mode in ("off", "on"):
        sec = summary["sections"][mode]
        # the engine warmed inside the session's hand-off, as a rollout generates: the trainer's state offloaded
        # (nothing moves on a CPU, but it was asked), the KV pool made for the warm-up and freed after it
        warm = sec["warmup_handoff"]
        assert warm["offload"] == {"bytes": 0.0, "seconds": 0.0} and warm["reload"] is not None
        assert warm["kv_pool_GiB_during"] > 0 and warm["kv_pool_GiB_after"] == 0
        assert all({"generate_time_s", "train_time_s", "weight_sync_s", "preemptions", "peak_allocated_GiB",
                    "peak_reserved_GiB"} <= set(r) for r in sec["rollouts"])
        assert sec["plan"]["card_gib"] is None  # on a CPU no card; the GPU sizing is checked below


def test_partial_rollout_bench_sizes_the_24gb_plan_from_its_config(tmp_path):
    """The GPU run's config as the bench builds it (on the CPU: the plan is arithmetic on the model's shape):
    the 24 GB config keeps its memory settings and takes its KV pool from the plan for cluster.gpu_memory_gb
    (17.75 GiB, as measured under the 23.39 GiB cap in issue 33), not from the device's total memory."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_grpo
        import partial_rollout as pr
    finally:
        sys.path.remove(str(ROOT / "bench"))
    from transformers import Qwen3Config

    m = gpu_grpo.SHAPES["gpu"]
    Qwen3Config(vocab_size=m["vocab"], hidden_size=m["hidden"], intermediate_size=m["ffn"], num_hidden_layers=m["layers"],
                num_attention_heads=m["heads"], num_key_value_heads=m["kv_heads"], head_dim=m["head_dim"],
                tie_word_embeddings=True).save_pretrained(tmp_path / "hf")
    config = ROOT / "configs" / "qwen3-0.6b-dapo-24gb.yaml"
    sets = pr.default_sets(False, config)
    assert sets == [] and pr.default_sets(False, pr.RECIPE) == pr.GPU_SETS  # the 24 GB config's own packing
    cfg, plan = pr.bench_config(pr.shapes(False), tmp_path, True, sets, config)
    assert (plan["card_gib"], plan["card_from"]) == (24.0, "cluster.gpu_memory_gb")
    assert cfg.rollout.kv_cache_gb == plan["kv_cache_gb"] == 17.75 and cfg.rollout.partial
    assert plan["fits"] and plan["offload"] and plan["total"] <= 24.0
    assert cfg.train.max_tokens_per_micro_batch == 18432 and cfg.train.recompute == "full"
    assert cfg.cluster.backend == "local" and cfg.cluster.gpu_memory_gb == 24


@pytest.mark.bench
def test_lora_bench_cpu_mode_runs(tmp_path):
    """bench/lora_grpo.py on a 2-layer GLM4: the base built by megatron and saved as torch_dist (no HF weights),
    the train stage with LoRA and the engine on the trainer's base, rollouts at the keyed lengths."""
    summary = _cpu_bench("lora_grpo", tmp_path, "--rollouts", "2")  # the second one is the steady one
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

@pytest.mark.bench
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


@pytest.mark.bench
def test_ray_pipeline_bench_cpu_mode_runs(tmp_path):
    """`grpoflow run` under Ray as the GPU bench drives it (keyed lengths forced in the actors by the bench's
    hook), the same rollouts under the local backend, and the weight path under Ray."""
    summary = _cpu_bench("ray_pipeline", tmp_path)
    sec = summary["sections"]
    assert {k for k, v in sec.items() if v["status"] == "ok"} == {"setup", "ray-colocated", "local-colocated",
                                                                  "sync-colocated"}
    ray_run = sec["ray-colocated"]
    assert ray_run["rc"] == 0 and [r["rollout"] for r in ray_run["rollouts"]] == [0, 1]
    tasks = {t["task"]: t for t in ray_run["prefect_tasks"]}
    assert {"train-chunk-0-1", "train-chunk-1-2", "evaluate-1", "evaluate-2", "register-1", "register-2"} <= set(tasks)
    assert all(t["state"] == "Completed" and t["s"] is not None for t in tasks.values())
    assert [v["version"] for v in ray_run["registry"]] == [1, 2] and all(v["source_exists"] for v in ray_run["registry"])
    # the hook reached the Ray actors: the same samples as the in-process local run, every one at its keyed length
    row = summary["layouts"]["colocated"]
    assert row["same_samples_as_local"] is True
    assert 0 < ray_run["rollouts"][0]["response_len_mean"] < 24  # keyed lengths (median 10), not the 40-token cap
    sync = row["sync"]
    assert set(sync) == {"ray"} and sync["ray"]["transport"] == "host"  # CPU: no CUDA IPC
    assert sync["ray"]["logprob_gap"]["max"] == 0.0  # fp32: exact


# ---- bench/glm9b_host_optimizer.py: GLM-Z1-9B with the optimizer on the host (issue 36) ---------------------

@pytest.mark.bench
def test_glm9b_host_optimizer_bench_cpu_mode_runs(tmp_path):
    """A tiny GLM4 through every section: the bf16 model built on the device into HF and torch_dist, the real
    train stage of configs/glm-z1-9b-dapo-2xh100.yaml (TP 2 ranks and 2 engines as processes, the optimizer on
    the host, the keyed lengths forced in the engine processes, memory sampled in each), and save -> resume ->
    next update with the optimizer on the host (that a host checkpoint loads into megatron's optimizer on the device
    is tests/test_host_optimizer.py's)."""
    summary = _cpu_bench("glm9b_host_optimizer", tmp_path, timeout=900)
    sec = summary["sections"]
    assert {k for k, v in sec.items() if v["status"] == "ok"} == set(sec) == {"setup", "stage", "resume"}
    assert sec["setup"]["bf16_probe"]["logprob_absdiff_mean"] < 1e-2  # megatron's copy is the HF model
    st = sec["stage"]
    assert len(st["rollouts"]) >= 2 and st["steady"]["step_time_s"] > 0
    for r in st["rollouts"]:
        assert r["optimizer_step_s"] > 0 and r["optimizer_host_adam_s"] > 0 and r["weight_sync_s"] > 0
        # each sample stops at its keyed length (or earlier, at a sampled stop token): forced in the engines
        assert 0 < r["train_tokens"] <= r["scheduled_tokens"] and r["response_len_max"] <= r["scheduled_max"]
        assert r["train_rollout_logp_absdiff"] < 0.1
    mem = st["memory"]
    assert {"trainer0", "trainer1", "engine0", "engine1"} <= set(mem["processes"])
    assert all(p["rss_hwm"] > 0 for p in mem["processes"].values())
    assert mem["plan"]["host"]["mode"] == "host" and mem["host_node_peak_used_GiB"] > 0
    r = sec["resume"]
    assert r["ok"], r
    # the unbroken trainer's own reload and 3rd update (the GPU's noise floor) is exact on CPU
    assert r["rerun"]["masters_at_load_bitwise"] and r["rerun"]["next_update_max_abs_diff"] == 0
    host = r["resumed_host"]
    assert host["masters_at_load_bitwise"] and host["next_update_max_abs_diff"] <= r["bound_per_update"]
    assert host["vs_rerun_max_abs_diff"] <= r["bound_per_update"]


def test_grad_trace_fingerprints_tell_one_ulp_and_place_the_first_difference():
    """bench/grad_trace.py (ray_faults' step-by-step comparison): a fingerprint is the same for the same bits (another
    tensor, bf16 too), changes for one ulp or two swapped values, and the first difference is found in a step's
    order (parameters, a rank's gradients, the reduced ones), not in the dictionary's."""
    import torch
    sys.path.insert(0, str(ROOT / "bench"))
    import grad_trace as gt

    g = torch.Generator().manual_seed(0)
    for t in (torch.randn(5000, generator=g), torch.randn(70, 3, generator=g).bfloat16()):
        same = t.clone()
        ulp = t.clone()
        ulp.view(-1)[17] = torch.nextafter(ulp.view(-1)[17], torch.tensor(10.0, dtype=t.dtype))
        swapped = t.clone()
        swapped.view(-1)[[1, 2]] = t.view(-1)[[2, 1]]
        assert gt.fingerprint(same) == gt.fingerprint(t)
        assert gt.fingerprint(ulp) != gt.fingerprint(t) and gt.fingerprint(swapped) != gt.fingerprint(t)
    ref = {("params", 0, 0, 0): {"w": "1:1"}, ("grads-local", 0, 0, 0): {"w": "2:2"},
           ("grads-reduced", 1, 0, 0): {"w": "9:9"}, ("grads-local", 1, 0, 0): {"w": "3:3", "k": "4:4"},
           ("params", 1, 0, 0): {"w": "5:5", "k": "6:6"}}
    run = {**ref, ("grads-reduced", 1, 0, 0): {"w": "9:8"}, ("grads-local", 1, 0, 0): {"w": "3:3", "k": "4:5"}}
    assert gt.first_difference(ref, ref) == {"compared": 5, "first": None}
    first = gt.first_difference(run, ref)["first"]
    assert (first["step"], first["stage"], first["parameters"]) == (1, "grads-local", ["k"])
    assert first["differ_at_that_step"] == {"params/dp0/tp0": 0, "grads-local/dp0/tp0": 1, "grads-reduced/dp0/tp0": 1}
    # what a rank trained on, sample by sample: the same tokens with one log-prob an ulp apart is the engine's
    from runtime.trainer.batch import TrainBatch
    batch = TrainBatch(tokens=[[1, 2, 3], [1, 2, 4]], prompt_lens=[1, 1], advantages=[0.5, -0.5],
                       loss_masks=[[1, 1], [1, 1]], rollout_logprobs=[[-0.25, -1.5], [-0.75, -2.0]])
    nudged = TrainBatch(**{**batch.__dict__, "rollout_logprobs": [[-0.25, -1.5], [-0.75, float(torch.nextafter(
        torch.tensor(-2.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)))]]})
    run[("batch", 1, 0, 0)], ref[("batch", 1, 0, 0)] = gt.batch_digests(nudged), gt.batch_digests(batch)
    first = gt.first_difference(run, ref)["first"]
    assert (first["step"], first["stage"], first["parameters"]) == (1, "batch", ["rollout_logprobs/1"])
    # the engine's generate calls (named, not numbered) are compared apart: what differs, grouped
    call = {"weights/w": "1:1", "state/graphs": "0", "schedule/chunks": "9", "tokens/0": "a", "logprobs/0": "b"}
    ref[("engine", "rollout1-from0.0-n8-max16", 0, 0)] = call
    run[("engine", "rollout1-from0.0-n8-max16", 0, 0)] = {**call, "state/graphs": "7", "logprobs/0": "c"}
    assert gt.first_difference(run, ref)["first"]["stage"] == "batch"
    assert gt.engine_difference(run, ref) == {"rollout1-from0.0-n8-max16": {
        "state": {"graphs": ("7", "0")}, "logprobs": 1, "samples_apart": [0], "apart_within_first": {1: 0, 16: 0, 256: 0}}}
    assert gt.engine_difference(ref, ref) == {"rollout1-from0.0-n8-max16": "same"}
    # the draws as the engine recorded them: which samples part, and within which of their first 1, 16, 256 log-probs
    from types import SimpleNamespace
    engine = SimpleNamespace(decoder=SimpleNamespace(stats={"chunks": 9}))
    lps = [[-0.5] * 300, [-0.25] * 40, [-1.0] * 3]
    moved = [list(lps[0]), list(lps[1]), list(lps[2])]
    moved[0][200], moved[1][0] = -0.5000001, -0.2500001
    for trace, drawn in ((ref, lps), (run, moved)):
        trace[("engine", "rollout2-from0.0-n3-max300", 0, 0)] = gt._engine_call_end(
            engine, [SimpleNamespace(response_ids=[7] * len(x), response_logprobs=x) for x in drawn])
    assert gt.engine_difference(run, ref)["rollout2-from0.0-n3-max300"] == {
        "logprobs": 2, "samples_apart": [0, 1], "apart_within_first": {1: 1, 16: 1, 256: 2}}


def test_ray_faults_keeps_a_reference_per_set_group(tmp_path):
    """ray_faults' `References`: the unbroken-a a later case of the call reads back (its root still found), and a
    cost run under another setting on the same warm machine keys a reference of its own beside the plain one."""
    sys.path.insert(0, str(ROOT / "bench"))
    import ray_faults as rf

    ref = tmp_path / "ref"
    ref.mkdir()
    refs = rf.References(tmp_path / "work", sets=[])
    refs.path("colocated").parent.mkdir(parents=True)
    refs.put("colocated", {"gpus": rf.gpu_ids(), "facts": {"final_checkpoint": str(ref)}, "wall_s": 1.0,
                           "grad_trace": "trace", "root": str(ref / "root")})
    assert refs.get("colocated")["root"] == str(ref / "root")
    # a cost run under another setting, on the same warm machine: its own reference, the plain one still there
    other = rf.References(tmp_path / "work", sets=["train.deterministic=false"])
    assert other.get("colocated") is None and other.path("colocated") != refs.path("colocated")
    assert rf.group_dir(tmp_path / "work", "colocated", other.sets) != rf.group_dir(tmp_path / "work", "colocated", [])
    other.path("colocated").parent.mkdir(parents=True)
    other.put("colocated", {"gpus": rf.gpu_ids(), "facts": {"final_checkpoint": str(ref)}, "wall_s": 2.0,
                            "grad_trace": "trace", "root": str(ref / "root")})
    assert refs.get("colocated")["wall_s"] == 1.0 and other.get("colocated")["wall_s"] == 2.0


def test_ray_faults_costs_a_setting_against_every_plain_unbroken_run_on_the_same_gpus():
    """`settings_cost` across merged calls: each call's own unbroken-a counts beside unbroken-b, a run on other GPUs
    does not, and the cost is the steady (last rollout's) step against the plain mean."""
    sys.path.insert(0, str(ROOT / "bench"))
    import ray_faults as rf

    def run(name, step, train, gpus=("g0", "g1"), sets=()):
        return {"name": name, "status": "ok", "gpus": list(gpus), "sets": list(sets),
                "facts": {"metric_values": {"step_time_s": [50.0, step], "train_time_s": [20.0, train]}}}

    res = {"setup": {"name": "setup", "status": "ok"}, "colocated:unbroken-a": run("colocated:unbroken-a", 7.0, 1.2),
           "colocated:unbroken-b": run("colocated:unbroken-b", 6.8, 1.0),
           "colocated:unbroken-a@4": run("colocated:unbroken-a@4", 6.9, 1.1),
           "colocated:unbroken-a@9": run("colocated:unbroken-a@9", 1.0, 0.1, gpus=("h0", "h1")),
           "colocated:engine-kill": run("colocated:engine-kill", 30.0, 10.0),
           "colocated:unbroken-a@3": run("colocated:unbroken-a@3", 6.21, 0.88, sets=["train.deterministic=false"])}
    got = rf.settings_cost(res)["colocated [train.deterministic=false]"]
    assert (got["runs"], got["plain_runs"], got["plain_steady_step_s"]) == (1, 3, 6.9)
    assert got["step_cost_pct"] == -10.0 and got["plain_steady_train_s"] == 1.1 and got["train_cost_pct"] == -20.0


def test_ray_faults_carries_a_reference_to_another_machine_by_digests(tmp_path, monkeypatch):
    """A reference from another machine (OUT/references.json): its tensors by sha256 (one bf16 ulp, or -0.0 for 0.0,
    is a difference), its step trace as JSON lines read back as recorded; taken only for this --set group on GPUs
    of the same model with the same torch."""
    import torch
    sys.path.insert(0, str(ROOT / "bench"))
    import grad_trace
    import ray_faults as rf

    w = torch.randn(64, generator=torch.Generator().manual_seed(0)).bfloat16()
    moved = w.clone()
    moved.view(torch.int16)[3] += 1  # one bf16 ulp
    state = {"model.w": w, "optimizer.m": torch.zeros(8)}
    fps = rf.tensor_fingerprints(state)
    assert rf.compare_fingerprints(rf.tensor_fingerprints({k: v.clone() for k, v in state.items()}), fps)["bitwise"]
    other = rf.compare_fingerprints(rf.tensor_fingerprints({"model.w": moved, "optimizer.m": -torch.zeros(8)}), fps)
    assert not other["bitwise"] and other["differ_count"] == 2 and other["max_abs_delta"] is None
    trace = {("params", 0, 0, 0): {"w": "1:2"}, ("grads-local", 1, 1, 0): {"w": "3:4"}}
    assert grad_trace.from_lines(json.loads(json.dumps(grad_trace.to_lines(trace)))) == trace

    carried = tmp_path / "references.json"
    entry = {"gpu_models": ["H"], "torch": rf.torch_version(), "checkpoint_fingerprints": fps, "wall_s": 3.0}
    carried.write_text(json.dumps({"colocated": entry, "colocated+train.deterministic=false": {**entry, "wall_s": 4.0}}))
    monkeypatch.setattr(rf, "gpu_models", lambda: ["H"])
    monkeypatch.setattr(rf, "gpu_ids", lambda: ["uuid-here"])
    plain = rf.References(tmp_path / "work", sets=[], carried=carried)
    assert plain.get("colocated")["carried"] and plain.get("colocated")["wall_s"] == 3.0
    assert plain.get("split") is None
    assert rf.References(tmp_path / "work", ["train.deterministic=false"], carried=carried).get("colocated")["wall_s"] == 4.0
    monkeypatch.setattr(rf, "gpu_models", lambda: ["another GPU"])
    assert plain.get("colocated") is None


def test_ray_faults_merge_compares_each_calls_unbroken_run_with_the_first_calls_by_digest():
    """--merge of calls that each ran unbroken-a (a fresh machine each): the later ones against the first by their
    exported fingerprints, step trace and facts; that is the layout's noise floor where no unbroken-b ran."""
    import torch
    sys.path.insert(0, str(ROOT / "bench"))
    import ray_faults as rf

    state = {"model.w": torch.arange(8.0), "optimizer.m": torch.ones(4)}
    facts = {"metric_values": {"loss": [0.5, 0.25], "step_time_s": [9.0, 3.0]}, "metric_points": {"loss": [0, 1]},
             "registry": [{"rollout": 1, "source": "s", "source_exists": True}], "best_rollout": 1,
             "rollouts": [{"response_len_mean": 4.0, "reward_mean": 0.5}], "final_rollout": 2, "lease_held": False,
             "temp_leftovers": [], "mlflow_status": "FINISHED", "mlflow_runs": 1}

    def export(gpus, tensors, step_time):
        f = {**facts, "metric_values": {**facts["metric_values"], "step_time_s": [step_time, 3.0]}}
        return {"split": {"layout": "split", "sets": [], "gpus": gpus, "facts": f, "grad_trace": [],
                          "checkpoint_fingerprints": rf.tensor_fingerprints(tensors)}}

    moved = {**state, "optimizer.m": torch.ones(4).nextafter(torch.tensor(2.0))}
    same = rf.summarize({}, None, [export(["g0"], state, 9.0), export(["g1"], state, 7.5)])
    again = same["layouts"]["split"]["unbroken-a again"]
    assert len(again) == 1 and again[0]["bitwise"] and not again[0]["same_machine"] and again[0]["metric_values_differ"] == []
    assert same["nondeterminism"]["noise_floor"]["split"] == {"bitwise": True, "max_abs_delta": None,
                                                              "same_machine_as_reference": False,
                                                              "by": "unbroken-a of two calls"}
    apart = rf.summarize({}, None, [export(["g0"], state, 9.0), export(["g0"], moved, 9.0)])["layouts"]["split"]
    assert not apart["unbroken-a again"][0]["bitwise"] and apart["unbroken-a again"][0]["tensors_differ"] == 1
    assert apart["noise_floor"]["bitwise"] is False and apart["noise_floor"]["same_machine_as_reference"]


# ---- bench/harness.py: the results already in bench/results stay readable ---------------------------------

MERGING = ("glm9b_host_optimizer", "lora_grpo", "partial_rollout", "ray_faults", "ray_pipeline")


def test_every_merge_reads_the_committed_results(tmp_path, capsys):
    """Each script's --merge over an OUT dir rebuilt from a committed summary (results.jsonl and the summary JSON, as
    the call left them): every section of the call is in the one summary, on the call's device. (~12 s)"""
    from unittest import mock

    sys.path.insert(0, str(ROOT / "bench"))
    import importlib
    for script in MERGING:
        calls = [json.loads(p.read_text()) for p in sorted((ROOT / "bench" / "results").glob(f"{script}_*.json"))
                 if not p.name.startswith("ray_faults_references")]
        # the newest whose recorded machine names its GPU (the merged summary's device is read from it)
        call = [c for c in calls if (c.get("env") or {}).get("gpu", "cpu") == c["device"]][-1]
        folder, out = tmp_path / script / "call", tmp_path / script / "out"
        folder.mkdir(parents=True)
        (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in call["sections"].values()))
        (folder / f"{script}.json").write_text(json.dumps(call))
        with mock.patch.dict(os.environ):  # a script's main sets its environment for its section processes
            assert importlib.import_module(script).main(["--merge", str(folder), "--out", str(out)]) == 0, script
        merged = json.loads(next(out.glob("*.json")).read_text())
        assert set(call["sections"]) <= set(merged["sections"]) and merged["device"] == call["device"], script
        assert capsys.readouterr().out, script  # the table printed


def test_sections_in_processes_record_how_each_ended_and_merge_over_calls(tmp_path):
    """harness.run_sections_in_processes: a section that wrote its line is kept as it wrote it, one whose process
    ended without a line is FAILED with the exit code, one the deadline leaves too little time is SKIPPED unstarted;
    merge_results over two calls keeps the later line, the later ok one, or both (name@folder). (~7 s)"""
    sys.path.insert(0, str(ROOT / "bench"))
    import harness

    script = tmp_path / "sections.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(ROOT / 'bench')!r})\nimport harness\nfrom pathlib import Path\n"
                      "a = sys.argv\nname, out = a[a.index('--section') + 1], Path(a[a.index('--out') + 1])\n"
                      "if name == 'dies':\n    sys.exit(3)\n"
                      "harness.run_section(name, {}, None, out, lambda S, W: {'name': name, 'measured': 1})\n")
    calls = []
    for call, dies in (("call1", "ok"), ("call2", "dies")):
        out = tmp_path / call
        out.mkdir()
        harness.run_sections_in_processes(script, [dies, "late"], tmp_path / "work", out, 600, {"late": 5})
        calls.append(str(out))
    res = harness.read_results(Path(calls[1]))
    assert res["dies"]["status"] == "FAILED" and "ended with 3" in res["dies"]["error"]
    assert res["late"] == {"name": "late", "status": "SKIPPED", "error": "no time left in this run"}
    assert "===== late =====" not in (Path(calls[1]) / "log.txt").read_text()  # never started
    assert harness.read_results(Path(calls[0]))["ok"]["measured"] == 1
    (Path(calls[1]) / "results.jsonl").write_text(
        (Path(calls[1]) / "results.jsonl").read_text().replace('"dies"', '"ok"'))  # the same section failed later
    assert harness.merge_results(calls)["ok"]["status"] == "FAILED"
    assert harness.merge_results(calls, keep="ok")["ok"]["status"] == "ok"
    both = harness.merge_results(calls, keep="both")
    assert both["ok"]["status"] == "ok" and both["ok@call2"]["status"] == "FAILED"


def test_a_retired_section_is_refused_in_one_line(tmp_path):
    """A section retired from a scenario (rollout_bench's sweep, bench/README.md's Retired experiments), asked for as
    an older command line asks: one line naming it, the sections there are and where the retired ones went; exit 1,
    no traceback. (~5 s)"""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "rollout_bench.py"), "--cpu", "--sections", "paged,sweep",
                           "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == ("--sections: no section sweep in this bench (its sections: paged, capped, kernels, cascade; "
                                   "retired ones: bench/README.md)")


@pytest.mark.bench
def test_routing_replay_bench_cpu_mode_runs(tmp_path):
    """bench/routing_replay.py --cpu: the engine's recorded routes replayed by megatron's model leave no token on
    other experts than the engine's (fp32 on the CPU: routing itself agrees too)."""
    out = tmp_path / "routing_replay.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "routing_replay.py"), "--cpu", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["benchmark"] == "routing_replay" and rep["device"] == "cpu" and rep["replay"]["response_tokens"] > 0
    assert rep["replay"]["expert_set_differs_token_layer"] == 0.0 and rep["replay"]["logp_gap_max"] < 1e-4


@pytest.mark.bench
def test_moe_engine_shards_cpu_mode_runs(tmp_path):
    """bench/moe_engine.py --shards: one whole engine against a replica of 2 expert shards (2 processes over gloo)."""
    out = tmp_path / "moe_shards.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "moe_engine.py"), "--cpu", "--shards", "2", "--out",
                           str(out), "--work", str(tmp_path / "work")], cwd=ROOT / "bench", capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())["expert_shards"]
    assert res["same_samples"] == "4/4" and res["max_logprob_gap_where_same"] < 1e-5
    assert res["whole"]["new_tokens"] == res["replica"]["new_tokens"] > 0
    # each shard holds the rest whole and half the experts: less than the whole engine, more than half of it
    assert all(res["whole_weight_bytes"] / 2 < w < res["whole_weight_bytes"] for w in res["shard_weight_bytes"])
