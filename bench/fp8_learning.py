"""FP8 rollouts learn as bf16 ones do (issue 59 item 4): the demo's run twice through `grpoflow run`, one GPU.

    python3 bench/fp8_learning.py --together --out $OUT --results-dir $OUT   # one H200 or H100; 2 x 150 rollouts at once
    python3 bench/fp8_learning.py --cpu                             # smoke: 6 rollouts a setting on the CPU

configs/demo.yaml (the tiny Qwen3 learning the copy task with GRPO: a reward of 0 to ~0.9 in 150 rollouts, eval
avg@4 with it) on the GPU in bf16, once with the engine's linear layers in bf16 and once in FP8
(`rollout.weights_dtype`), from the same weights and seeds, TIS on in both (FP8 turns it on by default; the bf16 run
sets it, so the engines' weights are the one difference). Then `grpoflow report fp8 --against bf16`: the two runs'
reward and eval curves side by side in the FP8 run's HTML report (copied to OUT). Per setting, from the MLflow store
both runs log to: the reward per rollout, the engine-vs-trainer log-prob gap (`train_rollout_logp_absdiff`), the
evals, the run's seconds. JSON in OUT/fp8_learning.json (`--results-dir`: a copy named by device and date).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import harness as H
from harness import ROOT

SETTINGS = ("bf16", "fp8")
DEMO = ROOT / "configs" / "demo.yaml"


def overrides(a, setting: str, root: Path) -> list[str]:
    sets = [f"storage.root={root}", f"rollout.weights_dtype={setting}", "algorithm.use_tis=true",
            f"tracking.registered_model=fp8-learning-{setting}", "checkpoint.keep_last=1"]
    if a.cpu:
        return sets + ["train.num_rollout=6", "eval.interval=3", "checkpoint.interval=3", "model.dtype=bfloat16",
                       "cluster.device=cpu"]
    # Together, each engine's KV pool is capped: left unset it takes 85 % of what is free when it is (re)made.
    kv = ["rollout.kv_cache_gb=8"] if a.together else []
    return sets + kv + [f"train.num_rollout={a.rollouts}", "cluster.device=cuda", "model.dtype=bfloat16"]


def run_one(a, W: Path, setting: str, left: float) -> dict:
    root = W / "root"
    log = W / f"{setting}.log"
    argv = [sys.executable, "-m", "cli.main", "run", str(DEMO), "--run-id", setting]
    for s in overrides(a, setting, root):
        argv += ["--set", s]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PREFECT_HOME": str(W / f"prefect-{setting}"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    t0 = time.monotonic()
    with log.open("w") as f:
        try:
            rc = subprocess.run(argv, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=left).returncode
        except subprocess.TimeoutExpired:
            rc = f"timed out after {left:.0f} s"
    res = {"setting": setting, "rc": rc, "wall_s": round(time.monotonic() - t0, 1)}
    if rc != 0:
        res["log_tail"] = log.read_text(errors="replace")[-3000:]
        return res
    res.update(curves(root, setting))
    return res


def curves(root: Path, run_id: str) -> dict:
    """The run's series as MLflow serves them (what the report draws)."""
    from mlflow.tracking import MlflowClient

    from runtime.run.directory import RunDir
    doc = json.loads(Path(RunDir(str(root), run_id).sub("tracking.json")).read_text())
    client = MlflowClient(doc["tracking_uri"])
    rid = doc["mlflow_run_id"]
    keys = client.get_run(rid).data.metrics
    series = {k: [round(m.value, 4) for m in sorted(client.get_metric_history(rid, k), key=lambda m: m.step)]
              for k in keys if k in ("reward_mean", "train_rollout_logp_absdiff") or k.endswith(("avg_at_4", "pass_at_4"))}
    return {"series": series}


def summarize(runs: dict) -> dict:
    out = {}
    for setting, r in runs.items():
        s = r.get("series", {})
        rewards, gap = s.get("reward_mean", []), s.get("train_rollout_logp_absdiff", [])
        tail = rewards[-max(len(rewards) // 5, 1):]
        evals = {k: v[-1] for k, v in s.items() if k.startswith("eval/") and k.endswith("avg_at_4") and v}
        out[setting] = {"rollouts": len(rewards), "reward_first": rewards[0] if rewards else None,
                        "reward_last_fifth_mean": round(sum(tail) / len(tail), 4) if tail else None,
                        "logp_gap_mean": round(sum(gap) / len(gap), 5) if gap else None,
                        "logp_gap_max": max(gap) if gap else None, "final_evals": evals, "wall_s": r["wall_s"]}
    return out


def main(argv=None) -> int:
    ap = H.parser(__doc__, "fp8_learning", 560.0, section=False)
    ap.add_argument("--rollouts", type=int, default=150, help="train.num_rollout of each run (GPU)")
    ap.add_argument("--together", action="store_true",
                    help="both runs at once on the one GPU (150 rollouts each do not fit one call in turn)")
    a = ap.parse_args(argv)
    out, W = H.start(a, "fp8_learning")
    shutil.rmtree(W / "root", ignore_errors=True)
    t0 = time.monotonic()
    runs = {}
    if a.together:
        from mlflow import MlflowClient

        from runtime.tracking.mlflow_tracker import store_uri_for_root
        # One store for both runs (the report reads them side by side): made and migrated here, before two
        # processes would race to create it.
        (W / "root").mkdir(parents=True)
        MlflowClient(tracking_uri=store_uri_for_root(str(W / "root"))).search_experiments()
        with ThreadPoolExecutor(len(SETTINGS)) as pool:
            done = pool.map(lambda s: run_one(a, W, s, a.deadline - 30), SETTINGS)
            runs = dict(zip(SETTINGS, done))
    for i, setting in enumerate(SETTINGS):
        if setting not in runs:
            left = (a.deadline - (time.monotonic() - t0)) / (len(SETTINGS) - i)  # an even share of what is left
            runs[setting] = run_one(a, W, setting, left)
        print(setting, json.dumps({k: v for k, v in runs[setting].items() if k != "series"})[:600], flush=True)
    summary = {**H.summary_head("fp8_learning", H.env_info({"device": "cpu" if a.cpu else "cuda"})), "runs": runs,
               "table": summarize({k: v for k, v in runs.items() if v["rc"] == 0})}
    if all(r["rc"] == 0 for r in runs.values()):
        rep = subprocess.run([sys.executable, "-m", "cli.main", "report", "fp8", "--root", str(W / "root"),
                              "--against", "bf16"], cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
        summary["report"] = {"rc": rep.returncode, "stdout": rep.stdout[-1000:], "stderr": rep.stderr[-1000:]}
        html = next((ln.split(": ", 1)[1].split(" (")[0] for ln in rep.stdout.splitlines()
                     if ln.startswith("report of run")), None)
        if rep.returncode == 0 and html and Path(html).exists():
            shutil.copy(html, out / "fp8_learning_report.html")
    H.save_summary(summary, out, "fp8_learning", a.results_dir, a.cpu)
    rows = [("setting", "rollouts", "reward first", "reward last fifth", "|dlogp| mean", "|dlogp| max", "evals", "s")]
    for k, t in summary["table"].items():
        rows.append((k, t["rollouts"], t["reward_first"], t["reward_last_fifth_mean"], t["logp_gap_mean"],
                     t["logp_gap_max"], json.dumps(t["final_evals"]), t["wall_s"]))
    H.print_columns(rows)
    return 0 if all(r["rc"] == 0 for r in runs.values()) and summary.get("report", {}).get("rc") == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
