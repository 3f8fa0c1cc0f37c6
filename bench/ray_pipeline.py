"""The product as users run it, on GPUs (issue 34): `grpoflow run` with Prefect, Ray and MLflow, per layout.

    python bench/ray_pipeline.py --sections setup,ray-colocated,local-colocated --out $OUT      # 2 GPUs, one call
    python bench/ray_pipeline.py --sections ray-split,sync-colocated,sync-split --out $OUT      # the next call
    python bench/ray_pipeline.py --merge OUT1 OUT2 --results-dir bench/results                # one JSON of both
    python bench/ray_pipeline.py --cpu                   # CI smoke: tiny shapes, Ray on CPU (tests/test_bench_smoke.py)

What runs:
- `setup`: a random Qwen3-0.6B-shaped HF model (bf16) with a locally trained tokenizer, a train set of 400
  prompts of 1024 tokens and an eval set of 8 (slime jsonl), and one config per layout: the shipped recipe
  (configs/qwen3-0.6b-dapo.yaml: 32 prompts x 8 samples, dynamic sampling with 1.5x over-sampling, <= 8192
  new tokens, TIS) pointed at them, 2 rollouts in 2 chunks, an eval and a registered version after each,
  `cluster.backend: ray`, packed micro-batches, the zero-cost reward (bench/trivial_reward.py), MLflow on.
- `ray-<layout>`: `python -m cli.main run CONFIG` as a user runs it (its own Prefect API, Ray cluster and
  MLflow store), with every sample stopped at the paged-engine bench's keyed length (bench/keyed_lengths/:
  a sitecustomize that Ray's actors inherit; rollout_bench.lengths_for_hashes: log-normal, median 1700, a
  tail to 8192). Read back: the stages' and Prefect tasks' wall times, per rollout generate / reward / train
  / weight sync / checkpoint, the registered versions as MLflow serves them.
- `cli-one-gpu`: the same `grpoflow run` on one GPU with the default local backend (trainer and engine in the
  driver, after the driver's own conversion), what most users run.
- `local-<layout>`: the same two rollouts in `TrainSession` with `cluster.backend: local` on the same
  machine, from the converted checkpoint of the Ray run: the overhead of Prefect + Ray + MLflow per step.
- `sync-<layout>`: the weight path under Ray against the local backend: one small rollout, then the engine's
  log-probs of its own samples against the trainer's (the update went through the path under test), and the
  time of a push by the layout's path (colocated: CUDA IPC between the actors sharing a GPU; split: NCCL
  broadcast), and, colocated, by the host / object-store path CUDA IPC replaced.

Layouts on 2 GPUs: `colocated` (trainer DP 2, one engine per GPU sharing it), `split` (trainer on GPU 0,
the engine on GPU 1). Results: OUT/results.jsonl, OUT/ray_pipeline.json (with --results-dir a copy named by
device and date). On the GPU machine this needs Ray, Prefect, MLflow and their dependencies carried
(bench/gpu_carry.py).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import gpu_grpo  # the random model
import harness as H
import rollout_bench  # the keyed length schedule
from harness import BENCH, ROLLOUT_KEYS, ROOT, prefect_task_times, rollout_rows

RECIPE = ROOT / "configs" / "qwen3-0.6b-dapo.yaml"
HOOK = BENCH / "keyed_lengths"
SECTIONS = ("setup", "ray-colocated", "local-colocated", "ray-split", "local-split", "sync-colocated", "sync-split",
            "cli-one-gpu")
SECTION_MAX_S = {"setup": 120, "ray-colocated": 420, "ray-split": 480, "local-colocated": 300, "local-split": 360,
                 "sync-colocated": 240, "sync-split": 300, "cli-one-gpu": 480}
LAYOUTS = {
    "colocated": {"gpu": {"colocate": True, "trainer_gpus": 2, "rollout_gpus": 2},
                  "cpu": {"colocate": True, "trainer_gpus": 0, "rollout_gpus": 0}},
    "split": {"gpu": {"colocate": False, "trainer_gpus": 1, "rollout_gpus": 1},
              "cpu": {"colocate": False, "trainer_gpus": 0, "rollout_gpus": 0}},
    # what most users run: one GPU, the default local backend (the trainer and the engine in the driver)
    "one-gpu": {"gpu": {"backend": "local", "colocate": True, "trainer_gpus": 1, "rollout_gpus": 1},
                "cpu": {"backend": "local", "colocate": True, "trainer_gpus": 0, "rollout_gpus": 0}},
}
GPU_SETS = ["train.max_tokens_per_micro_batch=24576"]
CPU_SETS = ["data.max_prompt_len=40", "rollout.max_new_tokens=40", "rollout.rollout_batch_size=4",
            "rollout.n_samples_per_prompt=2", "train.global_batch_size=8", "train.micro_batch_size=4",
            "model.dtype=float32", "rollout.decode_path=paged", "rollout.kv_cache_gb=0.01", "eval.n_samples_per_prompt=2",
            "eval.pass_k=[1]"]
# The sync sections' small rollout: its own lengths (not the keyed schedule's cap), so nothing is forced
SYNC_SETS = {"gpu": ["rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=8", "train.global_batch_size=32",
                     "rollout.max_new_tokens=256", "rollout.dynamic_sampling=false", "rollout.over_sampling_factor=1.0",
                     "train.max_tokens_per_micro_batch=16384"],
             "cpu": ["rollout.max_new_tokens=24", "rollout.dynamic_sampling=false", "rollout.over_sampling_factor=1.0"]}
# The backends a sync section compares. The CPU smoke runs the Ray one only: the local backend's iteration is the
# same code, its transport (as_is) is tests/test_weight_transport.py's, and its rollouts run in local-colocated
SYNC_BACKENDS = {"gpu": ("local", "ray"), "cpu": ("ray",)}


def shapes(cpu: bool) -> dict:
    S = dict(rollout_bench.SHAPES["cpu" if cpu else "gpu"])  # the keyed schedule: max_new, median, sigma, min_len
    S["model"] = dict(gpu_grpo.SHAPES["cpu" if cpu else "gpu"], prompt_len=8, prompts=2, rollouts=1)
    S["rows"] = 64 if cpu else 400
    S["eval_rows"] = 4 if cpu else 8
    S["eval_max_new"] = 16 if cpu else 1024
    S["cpu"] = cpu
    return S


def schedule(S) -> dict:
    return {k: S[k] for k in ("max_new", "median", "sigma", "min_len")}


def hook_env(S, env: dict | None = None) -> dict:
    """The environment under which every process forces the keyed lengths (bench/keyed_lengths)."""
    env = dict(os.environ if env is None else env)
    env["GRPOFLOW_BENCH_KEYED_LENGTHS"] = json.dumps(schedule(S))
    env["PYTHONPATH"] = os.pathsep.join([str(HOOK), str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                                 if p and p not in (str(HOOK), str(ROOT))])
    return env


# -- setup --------------------------------------------------------------------------------------------
def sec_setup(S, W: Path) -> dict:
    """The random model, the data sets and one config per layout."""
    import random

    from transformers import AutoTokenizer

    t0 = time.time()
    r = gpu_grpo.sec_setup(S["model"], W, convert=False)  # the pipeline converts
    tok = AutoTokenizer.from_pretrained(W / "hf")
    rng = random.Random(34)
    (W / "data").mkdir(parents=True, exist_ok=True)
    for stem, n, off in (("train", S["rows"], 0), ("eval", S["eval_rows"], 7)):
        with open(W / "data" / f"{stem}.jsonl", "w") as f:
            for row in H.word_rows(tok, rng, n, S["prompt_len"], S["prompt_len"] + 8, off):
                f.write(json.dumps(row) + "\n")
    for layout in LAYOUTS:
        (W / f"{layout}.yaml").write_text(layout_config_yaml(S, W, layout))
    return {"name": "setup", "model": r, "rows": S["rows"], "eval_rows": S["eval_rows"], "s": round(time.time() - t0, 1)}


def layout_tree(S, W: Path, layout: str) -> dict:
    import yaml
    tree = yaml.safe_load(RECIPE.read_text())
    tree["name"] = f"bench-{layout}"
    tree["model"] = {"source": str(W / "hf"), "dtype": "bfloat16"}
    tree["data"] = {**tree["data"], "apply_chat_template": False, "max_prompt_len": 2 * S["prompt_len"],
                    "train": {"source": str(W / "data" / "train.jsonl"), "format": "slime"},
                    "eval": {"held-out": {"source": str(W / "data" / "eval.jsonl"), "format": "slime"}}}
    tree["rollout"]["reward"] = "bench.trivial_reward:length_mod13"
    tree["train"].update(num_rollout=2)
    tree["checkpoint"] = {"interval": 1, "keep_last": 2}
    tree["eval"] = {"interval": 1, "n_samples_per_prompt": 2, "pass_k": [1, 2], "max_new_tokens": S["eval_max_new"],
                    "temperature": 1.0}
    tree["tracking"] = {"registered_model": f"bench-{layout}"}
    tree["cluster"] = {"backend": "ray", "device": "cpu" if S["cpu"] else "cuda",
                       **LAYOUTS[layout]["cpu" if S["cpu"] else "gpu"]}
    tree["storage"] = {"root": str(W / f"root-{layout}")}
    return tree


def layout_config_yaml(S, W: Path, layout: str) -> str:
    import yaml

    from runtime.config import apply_overrides, config_from_dict
    tree = apply_overrides(layout_tree(S, W, layout), CPU_SETS if S["cpu"] else GPU_SETS)
    config_from_dict(tree, f"{layout}.yaml")  # valid before anything runs
    return yaml.safe_dump(tree, sort_keys=False)


# -- the CLI under Ray --------------------------------------------------------------------------------
def sec_ray(S, W: Path, layout: str, extra_sets: list[str] = ()) -> dict:
    """`grpoflow run` of the layout's config, as a user runs it, in a process of its own."""
    cfg_path = W / f"{layout}.yaml"
    root = W / f"root-{layout}"
    shutil.rmtree(root, ignore_errors=True)
    env = hook_env(S)
    env["PREFECT_HOME"] = str(W / f"prefect-{layout}")  # a fresh Prefect API database: this run's task runs only
    shutil.rmtree(env["PREFECT_HOME"], ignore_errors=True)
    env.setdefault("HF_HUB_OFFLINE", "1")
    run_id = f"bench-{layout}"
    cmd = [sys.executable, "-m", "cli.main", "run", str(cfg_path), "--run-id", run_id]
    for s in extra_sets:
        cmd += ["--set", s]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.time() - t0
    (W / f"cli-{layout}.log").write_text(proc.stdout + "\n----- stderr -----\n" + proc.stderr)
    res = {"name": _cli_section(layout), "layout": layout, "rc": proc.returncode, "cli_wall_s": round(wall, 1),
           "stdout_tail": proc.stdout[-3000:]}
    if proc.returncode != 0:
        res["stderr_tail"] = proc.stderr[-4000:]
        raise RuntimeError(f"grpoflow run exited {proc.returncode}: {proc.stderr[-1500:]}")
    rd = root / "runs" / run_id
    res["frozen_kv_cache_gb"] = _frozen(rd).get("rollout", {}).get("kv_cache_gb")
    res["stages_s"] = {st: json.loads((rd / "stages" / f"{st}.json").read_text())["result"].get("seconds")
                       for st in ("fetch", "prepare", "convert") if (rd / "stages" / f"{st}.json").exists()}
    res["prefect_tasks"] = prefect_task_times(Path(env["PREFECT_HOME"]))
    res["rollouts"] = rollout_rows(rd)
    res["registry"] = registry_versions(rd, f"bench-{layout}")
    res["evals"] = {p.stem: json.loads(p.read_text()) for p in sorted((rd / "eval").glob("rollout_*.json"))}
    return res


def _cli_section(layout: str) -> str:
    """The section running `grpoflow run` of a layout: ray-<layout>, or cli-<layout> where the layout's backend
    is the local one."""
    return f"{'cli' if LAYOUTS[layout]['gpu'].get('backend') == 'local' else 'ray'}-{layout}"


def _frozen(rd: Path) -> dict:
    import yaml
    return yaml.safe_load((rd / "config.yaml").read_text())


def registry_versions(rd: Path, model: str) -> list[dict]:
    """The registered versions as the run's MLflow store serves them, and whether each source exists."""
    from mlflow.tracking import MlflowClient

    from runtime.config import config_from_dict
    from runtime.tracking.mlflow_tracker import default_tracking_uri
    uri = default_tracking_uri(config_from_dict(_frozen(rd), "frozen"))
    return [{"version": int(v.version), "source": v.source, "source_exists": Path(src).exists(), "tags": dict(v.tags)}
            for v, src in H.model_versions(MlflowClient(tracking_uri=uri, registry_uri=uri), model)]


# -- the same rollouts under the local backend ----------------------------------------------------------
def local_config(S, W: Path, layout: str, sets: list[str] = ()):
    """The Ray run's frozen config (its plan's KV pool), under `cluster.backend: local`; without a Ray run
    (a call on a fresh machine), the layout's config with the plan's choices, as freezing makes it."""
    import yaml

    from runtime.config import config_with_overrides
    from runtime.run.frozen_config import with_plan_choices
    rd = W / f"root-{layout}" / "runs" / f"bench-{layout}"
    if (rd / "config.yaml").exists():
        tree = _frozen(rd)
    else:
        tree = with_plan_choices(config_with_overrides(yaml.safe_load((W / f"{layout}.yaml").read_text()), [], "bench")
                                 ).model_dump(mode="json")
    tree["storage"] = {"root": str(W / f"local-root-{layout}")}
    tree["tracking"] = {"enabled": False}
    return config_with_overrides(tree, ["cluster.backend=local", *sets], "local"), rd


def local_session(S, W: Path, layout: str, sets: list[str] = ()):
    """A TrainSession over a run dir whose inputs link to the Ray run's (model, converted checkpoint, data)."""
    from runtime.grpo.session import TrainSession
    from runtime.run.directory import RunDir
    cfg, ray_rd = local_config(S, W, layout, sets)
    root = Path(cfg.storage.root)
    src = RunDir(str(W / f"root-{layout}"), f"bench-{layout}")
    inputs = (src.hf_model, src.torch_dist, src.train_data)
    if not all(Path(p).exists() for p in inputs):  # no Ray run on this machine: convert and prepare here
        inputs = standalone_inputs(S, W)
    rd = H.run_dir_over(root, "local", inputs)
    return TrainSession(cfg, rd)


def standalone_inputs(S, W: Path) -> tuple[Path, Path, Path]:
    """The setup's model converted and its train set prepared, as the pipeline's stages would."""
    from transformers import AutoTokenizer

    from runtime.inputs.datasets import prepare_dataset
    from runtime.mcore.convert import hf_to_torch_dist
    if not (W / "td").exists():
        hf_to_torch_dist(W / "hf", W / "td", tolerance=1e-3)
    parquet = W / "data" / "train.parquet"
    if not parquet.exists():
        prepare_dataset(str(W / "data" / "train.jsonl"), str(parquet), fmt="slime",
                        tokenizer=AutoTokenizer.from_pretrained(W / "hf"), apply_chat_template=False,
                        max_prompt_len=2 * S["prompt_len"])
    return W / "hf", W / "td", parquet


def sec_local(S, W: Path, layout: str) -> dict:
    """Rollouts 0 and 1 of the Ray run, in TrainSession with the local backend (same config, same samples)."""
    t0 = time.time()
    sess = local_session(S, W, layout)
    sess.ensure_at(None)
    res = {"name": f"local-{layout}", "layout": layout, "build_s": round(time.time() - t0, 1), "rollouts": []}
    for rid in range(2):
        m = sess.rollout(rid)
        res["rollouts"].append({k: (round(m[k], 4) if isinstance(m[k], float) else m[k]) for k in ROLLOUT_KEYS if k in m})
        print("ROLLOUT", json.dumps(res["rollouts"][-1]), flush=True)
    sess.close()
    return res


# -- the weight path ----------------------------------------------------------------------------------
def logprob_gap(sess, n_prompts: int, max_new: int) -> dict:
    """The engine's log-probs of its own samples against the trainer's, on the weights it last received."""
    from runtime.rollout.base import SampleRequest, SamplingParams
    rows, _ = sess.dataset.batch(sess.dataset.initial_cursor(99), n_prompts)
    prompts = [sess.tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    reqs = [SampleRequest(prompt_ids=p, key=(99, 0, i, j)) for i, p in enumerate(prompts) for j in range(2)]
    with sess.engine_turn():  # the GPU handed to the engine, as in a rollout
        samples = sess.engine.generate(reqs, SamplingParams(temperature=sess.cfg.rollout.temperature,
                                                            max_new_tokens=max_new))
    batch = H.samples_batch(samples)
    trainer = sess.trainer.compute_logprobs(batch)
    gaps = [abs(a - b) for s, t in zip(samples, trainer) for a, b in zip(s.response_logprobs, t)]
    return {"tokens": len(gaps), "max": round(max(gaps), 5), "mean": round(sum(gaps) / len(gaps), 6)}


def time_pushes(sess, n: int = 3) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.time()
        sess.weights.push(version=100 + i)
        out.append(round(time.time() - t0, 4))
    return out


def time_host_pushes(sess, n: int = 3) -> list[float]:
    """The path CUDA IPC replaced under Ray: every tensor to host memory, through the object store, back."""
    out = []
    for i in range(n):
        t0 = time.time()
        sess.engine.update_weights(sess.trainer.hf_weights(True), 200 + i)
        out.append(round(time.time() - t0, 4))
    return out


def sec_sync(S, W: Path, layout: str) -> dict:
    """One small rollout under each backend, then the log-prob gap and the push times."""
    res = {"name": f"sync-{layout}", "layout": layout}
    for backend in SYNC_BACKENDS["cpu" if S["cpu"] else "gpu"]:
        sets = SYNC_SETS["cpu" if S["cpu"] else "gpu"] + [f"cluster.backend={backend}"]
        sess = local_session(S, W, layout, sets)
        try:
            t0 = time.time()
            sess.ensure_at(None)
            m = sess.rollout(0)  # an update, pushed by the layout's path
            row = {"build_and_rollout_s": round(time.time() - t0, 1), "transport": sess.weights.mode
                   if sess.weights.mode == "broadcast" else sess.weights.transport,
                   "rollout_weight_sync_s": round(m["weight_sync_s"], 4),
                   "logprob_gap": logprob_gap(sess, 8 if not S["cpu"] else 2, 128 if not S["cpu"] else 8),
                   "push_s": time_pushes(sess)}
            if backend == "ray" and sess.weights.mode == "direct":
                row["host_push_s"] = time_host_pushes(sess)
            res[backend] = row
        finally:
            sess.close()
    return res


def gpu_ids() -> list[str]:
    """The UUIDs of this machine's GPUs: whether two sections (two calls) ran on the same machine."""
    import torch
    if not torch.cuda.is_available():
        return ["cpu"]
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def on_machine(fn):
    def run(S, W):
        return {**fn(S, W), "gpus": gpu_ids()}
    return run


FUNCS = {"setup": sec_setup,
         **{_cli_section(lay): (lambda S, W, lay=lay: sec_ray(S, W, lay)) for lay in LAYOUTS},
         **{f"local-{lay}": (lambda S, W, lay=lay: sec_local(S, W, lay)) for lay in LAYOUTS},
         **{f"sync-{lay}": (lambda S, W, lay=lay: sec_sync(S, W, lay)) for lay in LAYOUTS}}


# -- summary ------------------------------------------------------------------------------------------
def steady(rows: list[dict]) -> dict | None:
    """The second rollout (the first compiles and warms up)."""
    return rows[1] if len(rows) > 1 else None


def summarize(res: dict, env: dict | None) -> dict:
    out = {**H.summary_head("ray_pipeline", env or {}), "env": env, "sections": res, "layouts": {}}
    for lay in LAYOUTS:
        ray_r, loc_r = res.get(_cli_section(lay)) or {}, res.get(f"local-{lay}") or {}
        row: dict = {}
        if ray_r.get("status") == "ok":
            st = steady(ray_r["rollouts"])
            row.update(cli_wall_s=ray_r["cli_wall_s"], stages_s=ray_r["stages_s"], steady_ray=st)
            tasks = ray_r.get("prefect_tasks") or []
            row["train_tasks_s"] = {t["task"]: t["s"] for t in tasks if t["task"].startswith(("train-chunk", "evaluate",
                                                                                                "register", "log-metrics"))}
        if loc_r.get("status") == "ok":
            row["steady_local"] = steady(loc_r["rollouts"])
        if ray_r.get("status") == "ok" and loc_r.get("status") == "ok":
            # keyed sampling: the same rollouts under both backends make the same samples
            pick = lambda rows: [(r["response_len_mean"], r["reward_mean"]) for r in rows]  # noqa: E731
            row["same_samples_as_local"] = pick(ray_r["rollouts"]) == pick(loc_r["rollouts"])
        if row.get("steady_ray") and row.get("steady_local"):
            r, lo = row["steady_ray"]["step_time_s"], row["steady_local"]["step_time_s"]
            if ray_r.get("gpus") and ray_r.get("gpus") == loc_r.get("gpus"):
                row["overhead_pct_of_step"] = round(100 * (r - lo) / lo, 2)
            else:  # another machine (the lease went back between the calls): its speed is another's
                row["overhead_pct_of_step"] = None
                row["overhead_not_comparable"] = f"ray {r} s and local {lo} s ran on different machines"
        sy = res.get(f"sync-{lay}") or {}
        if sy.get("status") == "ok":
            row["sync"] = {b: sy[b] for b in ("local", "ray") if b in sy}
        out["layouts"][lay] = row
    return out


def print_table(summary: dict) -> None:
    print(f"ray_pipeline on {summary['device']}")
    for lay, row in summary["layouts"].items():
        st, lo = row.get("steady_ray") or {}, row.get("steady_local") or {}
        print(f"[{lay}] cli {row.get('cli_wall_s', '-')} s; stages {row.get('stages_s', '-')}")
        for label, r in ((_cli_section(lay).split("-")[0].ljust(5), st), ("local", lo)):
            if r:
                print(f"  {label} step {r.get('step_time_s')} s = generate {r.get('generate_time_s')} + reward "
                      f"{r.get('reward_time_s')} + train {r.get('train_time_s')} + sync {r.get('weight_sync_s')}; "
                      f"checkpoint {r.get('checkpoint_s', '-')}")
        if row.get("overhead_pct_of_step") is not None:
            print(f"  Prefect + Ray + MLflow overhead: {row['overhead_pct_of_step']} % of a step")
        elif row.get("overhead_not_comparable"):
            print(f"  overhead not measured: {row['overhead_not_comparable']}")
        for b, s in (row.get("sync") or {}).items():
            print(f"  sync {b}: {s.get('transport')} push {s.get('push_s')} s"
                  + (f", host path {s['host_push_s']} s" if "host_push_s" in s else "")
                  + f"; logprob gap {s.get('logprob_gap')}")
    for name, sec in summary["sections"].items():
        if sec.get("status") != "ok":
            print(f"{name} {sec.get('status')}: {str(sec.get('error', ''))[:300]}")


def main(argv=None) -> int:
    a = H.parser(__doc__, "ray_pipeline", 580.0, sections=SECTIONS, merge="OUT dirs of earlier calls: one summary of all").parse_args(argv)
    if a.merge:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        summary = summarize(H.merge_results(a.merge), H.merged_env(a.merge, "ray_pipeline"))
        H.save_summary(summary, out, "ray_pipeline", a.results_dir, cpu=False)
        print_table(summary)
        return 0
    S = shapes(a.cpu)
    out, W = H.start(a, "ray_pipeline")
    os.environ.update(hook_env(S))  # every section process and its children force the keyed lengths
    if a.section:
        return H.section_exit(H.run_section(a.section, S, W, out, on_machine(FUNCS[a.section])))
    sections = H.sections_of(a, ("setup", "ray-colocated", "local-colocated", "sync-colocated") if a.cpu else SECTIONS)
    H.clear_results(out)
    # in order; a failed section ends the call (the later ones build on it)
    H.run_in_turn(Path(__file__), sections, W, out, a.deadline, SECTION_MAX_S, ("--cpu",) if a.cpu else (),
                  stop_at_failure=True)
    summary = summarize(H.read_results(out), H.env_info(S["model"]))
    return H.finish(summary, out, "ray_pipeline", a.results_dir, a.cpu, print_table)


if __name__ == "__main__":
    sys.exit(main())
