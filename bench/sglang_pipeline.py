"""`grpoflow run` with `rollout.engine: sglang` under Ray, as a user runs it (issue 58 item 3).

    # one GPU (SGLang's site in /tmp/sglang-site, grpoflow's deps in /tmp/site: bench/sglang_carry.py, gpu_carry.py)
    PYTHONPATH=/tmp/site:$PWD python3 bench/sglang_pipeline.py --sections setup,colocated --deadline 570 --out $OUT
    PYTHONPATH=/tmp/site:$PWD python3 bench/sglang_pipeline.py --sections kill --deadline 570 --out $OUT   # warm
    # two GPUs (trainer GPU 0, server GPU 1, NCCL broadcast)
    PYTHONPATH=/tmp/site:$PWD python3 bench/sglang_pipeline.py --sections setup,split --deadline 570 --out $OUT
    # here: the same sections on CPU against tests/sglang_standin.py (2 loaded cores: 90 + 350 + 200 s)
    python bench/sglang_pipeline.py --standin --sections setup,colocated,kill,split --deadline 900

Sections (each a `python -m cli.main run` process with its own Prefect API, Ray cluster and MLflow store):
  setup      a random tiny Qwen3 (bf16 on the GPU: 4 layers, 4 heads of 128, 2 KV heads: the attention kernels of
             Qwen3-0.6B's head shape) saved as HF with the tiny tokenizer; a train and an eval set (slime jsonl);
             one config per layout: the Qwen3-0.6B recipe pointed at them, `rollout.engine: sglang`, 2 chunks of
             one rollout, an eval, a checkpoint and a registered version after each, the zero-cost reward
  colocated  one GPU, trainer and server sharing it (`cluster.colocate`: the server runs with
             `--enable-memory-saver`, released around training, resumed for generation). Read back: exit code,
             rollouts, evals, the registered versions as MLflow serves them, what the server logs say of the
             memory saver and weight versions. Its facts and final tensors are the kill section's reference
  kill       the same config SIGKILLed (the driver, `grpoflow run`) while its trainer is paused inside the second
             chunk's training (`train-grads-accumulated#2`, runtime/testing/moments.py; rollout 1 generated, not
             applied), what outlives the driver recorded (and killed: an SGLang server runs in a session of its
             own), then `grpoflow resume`. Compared with `colocated`: metric points and (non-timing) values,
             per-rollout response lengths and rewards, registered versions (rollout, source), best alias,
             clean end; and the final checkpoint's tensors (bitwise, else the largest difference). SGLang's
             sampling is seeded and deterministic (`rollout.sglang.deterministic`, the default): the resumed
             rollout 1 must draw the samples the unbroken run drew
  split      two GPUs: trainer on GPU 0, server on GPU 1 (`colocate: false`), `cluster.weight_sync: broadcast`
             (NCCL; gloo with --standin): exit 0, evals, registered versions
Results: OUT/results.jsonl (a line per section as it ends) and OUT/sglang_pipeline.json; with --results-dir a copy
named by device and date.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
for _p in (ROOT, BENCH):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import harness as H  # noqa: E402  (tensors and their comparison, run read-backs)
import ray_faults as rf  # noqa: E402  (processes by marker, run facts and their comparison)
from sglang_real import SERVER_SITE, launch_prefix  # noqa: E402  (the server from its own site, the flags)

RECIPE = ROOT / "configs" / "qwen3-0.6b-dapo.yaml"
STANDIN = ROOT / "tests" / "sglang_standin.py"
SECTIONS = ("setup", "colocated", "kill", "split")
KILL_AT = "train-grads-accumulated#2"  # the trainer inside rollout 1's update: chunk 2 running, its samples drawn
LAYOUTS = {  # the cluster section of each layout: on GPUs, and with --standin on the CPU
    "colocated": {"gpu": {"colocate": True, "trainer_gpus": 1, "rollout_gpus": 1},
                  "cpu": {"colocate": True, "trainer_gpus": 0, "rollout_gpus": 0}},
    "split": {"gpu": {"colocate": False, "trainer_gpus": 1, "rollout_gpus": 1, "weight_sync": "broadcast"},
              "cpu": {"colocate": False, "trainer_gpus": 0, "rollout_gpus": 0, "weight_sync": "broadcast"}},
}
SHAPES = {
    "gpu": dict(model=dict(hidden=512, layers=4, heads=4, kv_heads=2, head_dim=128, ffn=1024, vocab=4096,
                           dtype="bfloat16", device="cuda"),
                prompt_len=64, rows=64, eval_rows=8, prompts=4, samples=8, max_new=256, eval_max_new=128,
                mem_fraction={"colocated": 0.4, "split": 0.6}, device="cuda",
                sets=["train.micro_batch_size=8", "train.max_tokens_per_micro_batch=null"]),
    "cpu": dict(model=dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=512,
                           dtype="float32", device="cpu"),
                prompt_len=12, rows=32, eval_rows=4, prompts=2, samples=2, max_new=16, eval_max_new=8,
                mem_fraction={"colocated": 0.4, "split": 0.4}, device="cpu",
                sets=["model.dtype=float32", "train.micro_batch_size=4", "train.max_tokens_per_micro_batch=null",
                      "cluster.gpu_memory_gb=null", "cluster.host_memory_gb=null", "storage.disk_gb=null"]),
}


# ---- setup ----------------------------------------------------------------------------------------------

def sec_setup(S, W: Path, a) -> dict:
    import random

    from transformers import AutoTokenizer

    from rollout_bench import make_model
    t0 = time.time()
    for d in ("tok", "hf", "data"):
        shutil.rmtree(W / d, ignore_errors=True)
    model = make_model(S["model"], W)
    tok = AutoTokenizer.from_pretrained(W / "hf")
    rng = random.Random(58)
    (W / "data").mkdir()
    for stem, n, off in (("train", S["rows"], 0), ("eval", S["eval_rows"], 7)):
        with open(W / "data" / f"{stem}.jsonl", "w") as f:
            for row in H.word_rows(tok, rng, n, S["prompt_len"], S["prompt_len"] + 8, off):
                f.write(json.dumps(row) + "\n")
    for layout in LAYOUTS:
        (W / f"{layout}.yaml").write_text(config_yaml(S, W, layout, a))
    return {"name": "setup", "model": model, "configs": [str(W / f"{lay}.yaml") for lay in LAYOUTS],
            "s": round(time.time() - t0, 1)}


def server_launch(S, W: Path, layout: str, a) -> list[str]:
    if a.standin:  # the stand-in takes grpoflow's flags only; its calls are kept for the read-back
        return ["{python}", str(STANDIN), "--calls-file", str(W / f"standin-calls-{layout}.jsonl")]
    return launch_prefix(a.site) + list(a.server_flag)


def config_tree(S, W: Path, layout: str, a) -> dict:
    import yaml
    tree = yaml.safe_load(RECIPE.read_text())
    tree["name"] = f"sglang-{layout}"
    tree["model"] = {"source": str(W / "hf"), "dtype": S["model"]["dtype"]}
    tree["data"] = {**tree["data"], "apply_chat_template": False, "max_prompt_len": 2 * S["prompt_len"],
                    "train": {"source": str(W / "data" / "train.jsonl"), "format": "slime"},
                    "eval": {"held-out": {"source": str(W / "data" / "eval.jsonl"), "format": "slime"}}}
    tree["rollout"].update(
        engine="sglang", reward="bench.trivial_reward:length_mod13", rollout_batch_size=S["prompts"],
        n_samples_per_prompt=S["samples"], max_new_tokens=S["max_new"], dynamic_sampling=False,
        over_sampling_factor=1.0,
        sglang={"launch": server_launch(S, W, layout, a), "mem_fraction": S["mem_fraction"][layout], "startup_timeout_s": 600,
                "scratch_dir": str(W / f"scratch-{layout}"), "deterministic": True})
    tree["train"].update(num_rollout=2, global_batch_size=S["prompts"] * S["samples"])
    tree["checkpoint"] = {"interval": 1, "keep_last": 2}
    tree["eval"] = {"interval": 1, "n_samples_per_prompt": 2, "pass_k": [1, 2], "max_new_tokens": S["eval_max_new"],
                    "temperature": 1.0}
    tree["tracking"] = {"registered_model": f"bench-sglang-{layout}"}
    tree["cluster"] = {"backend": "ray", "device": S["device"], **LAYOUTS[layout]["gpu" if S["device"] == "cuda" else "cpu"]}
    tree["storage"] = {"root": str(W / f"root-{layout}")}
    return tree


def config_yaml(S, W: Path, layout: str, a) -> str:
    import yaml

    from runtime.config import apply_overrides, config_from_dict
    tree = apply_overrides(config_tree(S, W, layout, a), S["sets"] + list(a.set))
    config_from_dict(tree, f"{layout}.yaml")  # valid before anything runs
    return yaml.safe_dump(tree, sort_keys=False)


# ---- a run --------------------------------------------------------------------------------------------

def run_env(W: Path, case: str, mark: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                      if p and p != str(ROOT)])
    env.update({rf.MARK: mark, "PREFECT_HOME": str(W / f"prefect-{case}"), "PYTHONUNBUFFERED": "1",
                "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    for k in ("GRPOFLOW_TEST_KILL_AT", "GRPOFLOW_TEST_SNAPSHOT_AT", "GRPOFLOW_TEST_PAUSE_AT"):
        env.pop(k, None)
    shutil.rmtree(env["PREFECT_HOME"], ignore_errors=True)
    return env


def sec_run(S, W: Path, case: str, deadline: float) -> dict:
    """`grpoflow run` of the case's layout (kill: the colocated one, killed and resumed), read back."""
    layout = "colocated" if case == "kill" else case
    root = W / f"root-{case}"
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(W / f"scratch-{layout}", ignore_errors=True)
    (W / f"standin-calls-{layout}.jsonl").unlink(missing_ok=True)
    mark = f"sglang-{case}-{uuid.uuid4().hex[:8]}"
    env = run_env(W, case, mark)
    res: dict = {"name": case, "layout": layout}
    argv = [sys.executable, "-m", "cli.main", "run", str(W / f"{layout}.yaml"), "--run-id", rf.RUN,
            "--set", f"storage.root={root}"]
    pauses = W / f"pauses-{case}"
    shutil.rmtree(pauses, ignore_errors=True)
    pauses.mkdir()
    extra = {"GRPOFLOW_TEST_PAUSE_AT": KILL_AT, "GRPOFLOW_TEST_PAUSE_DIR": str(pauses)} if case == "kill" else {}
    t0 = time.monotonic()
    log_path = W / f"{case}.log"
    log = log_path.open("w")
    proc = subprocess.Popen(argv, cwd=ROOT, env={**env, **extra}, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        if case == "kill":
            reached = rf.wait_for_file(pauses / f"{KILL_AT}.reached", proc, deadline)
            res["killed_at_s"] = round(time.monotonic() - t0, 1)
            res["paused_pid"] = reached["pid"]
            os.kill(proc.pid, signal.SIGKILL)
            (pauses / f"{KILL_AT}.go").touch()
            proc.wait()
            # Ray's workers follow their dead driver; an SGLang server (a session of its own) may not
            left, took = rf.wait_gone(mark, timeout_s=30.0, settle_s=10.0)  # what stays longer: killed, listed
            res["after_kill"] = {"waited_s": took, "left": left, "sglang_servers_left": [
                p["pid"] for p in left if "sglang" in p["cmd"]], "gpu_apps": H.gpu_apps(),
                "killed_by_bench": rf.kill_pids(left)}
            res["resumed_at_s"] = round(time.monotonic() - t0, 1)
            proc = subprocess.Popen([sys.executable, "-m", "cli.main", "resume", rf.RUN, "--root", str(root)], cwd=ROOT,
                                    env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except (subprocess.TimeoutExpired, RuntimeError, TimeoutError) as e:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        rc = f"stopped: {type(e).__name__}: {e}"[:300]
    finally:
        log.close()
        res["left_at_end"] = rf.marked(mark)
        rf.kill_pids(res["left_at_end"])
    res["rc"], res["wall_s"] = rc, round(time.monotonic() - t0, 1)
    rd = root / "runs" / rf.RUN
    res["rollouts"] = H.rollout_rows(rd)
    res["evals"] = {p.stem: json.loads(p.read_text()) for p in sorted((rd / "eval").glob("rollout_*.json"))}
    res["server"] = server_facts(W / f"scratch-{layout}", W / f"standin-calls-{layout}.jsonl")
    res["log_tail"] = log_path.read_text(errors="replace")[-4000:]
    if rc == 0:
        res["facts"] = rf.run_facts(root, f"bench-sglang-{layout}", Path(env["PREFECT_HOME"]))
        res["checks"] = run_checks(res)
    return res


def server_facts(scratch: Path, calls: Path) -> dict:
    """What the servers' logs say: launches (with their flags), and, with the stand-in, the calls it served."""
    logs = sorted(scratch.rglob("engine-*.log"))
    text = "\n".join(p.read_text(errors="replace") for p in logs)
    launches = re.findall(r"==== grpoflow: launching engine (\d+) \(restart (\d+)\): (.*)", text)
    out = {"logs": [str(p) for p in logs], "launches": len(launches),
           "memory_saver": bool(launches) and all("--enable-memory-saver" in cmd for _, _, cmd in launches),
           "deterministic": bool(launches) and all("--enable-deterministic-inference" in cmd for _, _, cmd in launches),
           # the HTTP routes the server logged (SGLang's access log, where on)
           "routes_logged": {r: text.count(r) for r in ("/release_memory_occupation", "/resume_memory_occupation",
                                                          "/update_weights_from_disk", "/update_weights_from_distributed",
                                                          "/init_weights_update_group", "/generate")}}
    if calls.exists():
        paths = [json.loads(ln)["path"] for ln in calls.read_text().splitlines() if ln.strip()]
        out["standin_calls"] = {p: paths.count(p) for p in sorted(set(paths))}
    return out


def run_checks(res: dict) -> dict:
    facts = res["facts"]
    versions = facts["registry"]
    chunks = sorted(t["task"] for t in facts["prefect_tasks"] if t["task"].startswith("train-chunk"))
    return {"exit_0": res["rc"] == 0, "chunks": len(set(chunks)), "rollouts": len(res["rollouts"]),
            "evals": len(res["evals"]), "registered_versions": [(v["version"], v["rollout"]) for v in versions],
            "versions_sources_exist": all(v["source_exists"] for v in versions) and len(versions) >= 2,
            "ended_clean": not facts["lease_held"] and not facts["temp_leftovers"] and facts["mlflow_status"] == "FINISHED"}


def final_tensors(root: Path) -> dict:
    from runtime.run import checkpoint
    from runtime.run.directory import RunDir
    return H.checkpoint_tensors(checkpoint.latest(RunDir(str(root), rf.RUN)).path)


def compare_kill(W: Path, res: dict) -> dict:
    """The killed-and-resumed run against the unbroken colocated one of this work folder."""
    ref_path = W / "colocated-facts.json"
    if not ref_path.exists():
        return {"skipped": "no colocated run in this work folder to compare with (run --sections colocated first)"}
    try:
        ref = json.loads(ref_path.read_text())
        out = rf.compare_facts(res["facts"], ref)
        out["rewards"] = {"kill": [r.get("reward_mean") for r in res["facts"]["rollouts"]],
                          "unbroken": [r.get("reward_mean") for r in ref["rollouts"]]}
        out["tensors"] = H.compare_tensors(final_tensors(W / "root-kill"), final_tensors(W / "root-colocated"))
        return out
    except Exception:  # noqa: BLE001 - what could not be compared is reported
        return {"error": traceback.format_exc()[-2000:]}


# ---- the call --------------------------------------------------------------------------------------------

def summary_of(results: list[dict], a) -> dict:
    return {"bench": "sglang_pipeline", "date": datetime.date.today().isoformat(), "device": _device(a),
            "standin": a.standin, "sections": results}


def print_table(results: list[dict]) -> None:
    rows = []
    for r in results:
        if r["name"] == "setup":
            rows.append(("setup", r.get("error", "").splitlines()[-1:] or f"{r.get('s')} s"))
            continue
        c = r.get("checks", {})
        line = (f"rc {r.get('rc')}, {r.get('wall_s')} s, chunks {c.get('chunks')}, evals {c.get('evals')}, "
                f"versions {c.get('registered_versions')}, clean {c.get('ended_clean')}, "
                f"memory saver {r.get('server', {}).get('memory_saver')}")
        if r["name"] == "kill":
            k, cmp = r.get("after_kill", {}), r.get("against_unbroken", {})
            line += (f"; killed at {r.get('killed_at_s')} s, left {len(k.get('left', []))} "
                     f"(sglang {k.get('sglang_servers_left')}); vs unbroken: points {cmp.get('same_metric_points')}, "
                     f"values differ {cmp.get('metric_values_differ')}, lengths+rewards "
                     f"{cmp.get('same_lengths_and_rewards')}, registry {cmp.get('same_registry')}, tensors "
                     f"{(cmp.get('tensors') or {}).get('bitwise', (cmp.get('tensors') or {}))}")
        if "error" in r:
            line = "ERROR " + r["error"].strip().splitlines()[-1][:200]
        rows.append((r["name"], line))
    width = max(len(n) for n, _ in rows) if rows else 0
    for n, line in rows:
        print(f"{n:<{width}}  {line}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", default="setup,colocated")
    ap.add_argument("--standin", action="store_true", help="CPU, tests/sglang_standin.py as the server")
    ap.add_argument("--site", default=SERVER_SITE, help="SGLang's own site-packages (bench/sglang_carry.py)")
    ap.add_argument("--server-flag", action="append", default=[], help="one more sglang.launch_server arg")
    ap.add_argument("--deadline", type=float, default=570.0, help="seconds for the whole call")
    ap.add_argument("--work", default=None)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/sglang_pipeline_out"))
    ap.add_argument("--results-dir", default=None)
    ap.add_argument("--set", action="append", default=[], help="more config overrides for every layout")
    a = ap.parse_args(argv)
    S = SHAPES["cpu" if a.standin else "gpu"]
    W = Path(a.work or ("/tmp/sglang_pipeline_work" + ("_standin" if a.standin else "")))
    out = Path(a.out)
    W.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    names = [x for x in a.sections.split(",") if x]
    if unknown := [x for x in names if x not in SECTIONS]:
        raise SystemExit(f"--sections: no section {', '.join(unknown)} (its sections: {', '.join(SECTIONS)})")
    deadline = time.monotonic() + a.deadline
    results = []
    for name in names:
        t0 = time.monotonic()
        try:
            if name == "setup":
                r = sec_setup(S, W, a)
            elif not (W / "colocated.yaml").exists():
                r = {"name": name, "error": f"no setup in {W}: run --sections setup first (same --work)"}
            elif name == "split" and S["device"] == "cuda" and _gpus() < 2:
                r = {"name": name, "skipped": f"needs 2 GPUs, this machine has {_gpus()}"}
            else:
                r = sec_run(S, W, name, deadline)
                if name == "colocated" and "facts" in r:  # the kill section's reference, kept while the machine is
                    (W / "colocated-facts.json").write_text(json.dumps(r["facts"]))
                if name == "kill" and "facts" in r:
                    r["against_unbroken"] = compare_kill(W, r)
        except Exception:  # noqa: BLE001 - the section's row says what broke
            r = {"name": name, "error": traceback.format_exc()[-3000:]}
        r["section_s"] = round(time.monotonic() - t0, 1)
        results.append(r)
        H.append_result(out, r)
        print("RESULT", json.dumps({k: v for k, v in r.items() if k not in ("log_tail", "facts")}, default=str)[:3000],
              flush=True)
        (out / "sglang_pipeline.json").write_text(json.dumps(summary_of(results, a), indent=1, default=str))
    summary = summary_of(results, a)
    if a.results_dir:
        tag = "standin" if a.standin else f"{summary['device'].replace(' ', '_')}_{summary['date']}"
        shutil.copyfile(out / "sglang_pipeline.json", Path(a.results_dir) / f"sglang_pipeline_{tag}.json")
    print_table(results)
    ok = all("error" not in r and r.get("rc", 0) == 0 for r in results)
    return 0 if ok else 1


def _gpus() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _device(a) -> str:
    if a.standin:
        return "cpu (stand-in server)"
    n = _gpus()
    if n:
        import torch
        return f"{n}x{torch.cuda.get_device_name(0)}"
    return "cpu"


if __name__ == "__main__":
    sys.exit(main())
