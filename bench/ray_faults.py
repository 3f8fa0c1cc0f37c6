"""A GPU actor dies mid-run under Ray, and the run ends as if nothing happened (issue 37): fault and resume
of `grpoflow run` (Prefect + Ray + MLflow) per layout, each recovered run compared with an unbroken one.

    python bench/ray_faults.py --cpu                        # the wiring on CPU: Ray on CPU, gloo (by hand, 7 min here)
    python bench/ray_faults.py --layouts colocated --cases unbroken-a,unbroken-b --out $OUT   # a GPU call
    python bench/ray_faults.py --merge OUT1 OUT2 ... --results-dir bench/results           # one JSON of the calls

Cases, each a `python -m cli.main run` of its own (its own storage root, Prefect API database, Ray cluster
and MLflow store), 2 chunks of 1 rollout with an eval and a registered version after each:
- `unbroken-a`, `unbroken-b`: the same config twice. a is the reference every other case is compared with;
  b against a is the noise floor of this path (on CPU: bitwise).
- `engine-kill`: the Ray actor holding an engine SIGKILLed mid-rollout, in rollout 1 (chunk 2): every
  process of the run sees GRPOFLOW_TEST_PAUSE_AT=decode-chunk-K#3 (runtime/testing/moments.py): the engine
  that reaches the K-th decode chunk of its third generate call (rollout 0, the eval after it, rollout 1)
  writes `<label>.reached` with its pid and waits; the bench checks that the pid carries this run's
  marker, `os.kill(pid, SIGKILL)`, then lets the others go. The chunk task meets ActorDiedError, retries,
  and rebuilds the actors from checkpoints/latest (tasks/common.py, runtime/grpo/session.py).
- `trainer-kill`: the same at `train-grads-accumulated#2`: a trainer rank in rollout 1's update, every
  micro-batch's backward done, its gradients neither reduced over the DP group nor applied.
- `driver-kill`: the `grpoflow run` process itself SIGKILLed (its pid only, not its group) at the engine's
  moment, mid-chunk; what outlives it is recorded (and then killed by pid), then
  `python -m cli.main resume RUN_ID --root ROOT` finishes the run.
Each case compiles as on a fresh node: Inductor's and Triton's caches of its own (`compile_caches`; the resume's
apart from its run's). Ray workers sit in process groups of their own (pgid = pid; gcs_server and the raylet share
the driver's), so GRPOFLOW_TEST_KILL_AT's killpg would end just the worker too; the pause file keeps the kill in the
bench, by pid, after the event.

Each recovered run against unbroken-a: the final checkpoint (every model and optimizer tensor: bitwise, else max
|delta| per tensor), the MLflow metric points and the values that do not measure time, the registered versions, the
MLflow run FINISHED, the lease released, no temp names left, the Prefect tasks that retried; nothing of the run left
(no process whose environment carries GRPOFLOW_BENCH_FAULT_RUN, at most 90 s; on GPUs no nvidia-smi compute app);
and each trainer rank's step trace (bench/grad_trace.py), which says where a run that ends off the reference first left it (`first_step_difference`).
Every unbroken-a also writes OUT/references.json (facts, step trace, the sha256 of every final tensor,
per layout and --set group): `--references FILE` on another machine of the same GPU model and torch compares with it
by digest; `--merge` of calls that each ran unbroken-a compares the later ones with the first (`unbroken-a again`).
An unbroken run's wall: ~40 s starting the CLI (Prefect, Ray), the conversion, ~40 s building the actors, ~14 s per
checkpoint (model and optimizer, ~8 GB), the engine's warm-up and the trainer's compiles in rollout 0, ~10 s generating
per rollout; a kill case's section 1.45-1.56 x that. Before each case the time left under --deadline is checked
against this call's unbroken wall x COST; a case that would not fit is SKIPPED with the reason. `--set train.deterministic=false` keys its own
reference, and `nondeterminism.settings_cost` compares its steady step with every plain unbroken run on the same GPUs.

Shapes (GPU): ray_pipeline's random Qwen3-0.6B-shaped model and recipe at 8 prompts x 8 samples, 256-token prompts,
<= 2048 new tokens at the keyed schedule (bench/keyed_lengths); layouts as ray_pipeline's. How to run it on the GPU
machine (one case a call, the carry of bench/gpu_carry.py), the measurements and their results files:
bench/README.md, `ray_faults.py`.
"""
from __future__ import annotations

import argparse
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

import grad_trace  # fingerprints of every step's parameters and gradients
import harness as H
import ray_pipeline as rp  # the setup, the layouts' configs, the keyed-length hook
from harness import (ROOT, checkpoint_tensors, compare_fingerprints, compare_tensors, gpu_apps, gpu_ids,
                     gpu_models, tensor_fingerprints, torch_version)

RUN = "fault"
MARK = "GRPOFLOW_BENCH_FAULT_RUN"  # every process of a bench run inherits it: what is left is found by it
CASES = ("unbroken-a", "unbroken-b", "engine-kill", "trainer-kill", "driver-kill")
FAULTS = {  # case: (whose moment, the moment, who is killed)
    "engine-kill": ("engine", "decode-chunk-{k}#3", "paused"),
    "trainer-kill": ("trainer", "train-grads-accumulated#2", "paused"),
    "driver-kill": ("engine", "decode-chunk-{k}#3", "driver"),
}
# how long a case takes against an unbroken run of the same call (for skipping what cannot fit)
COST = {"unbroken-a": 1.0, "unbroken-b": 1.0, "engine-kill": 1.6, "trainer-kill": 1.6, "driver-kill": 1.9}
FAULT_SETS = {"gpu": ["rollout.rollout_batch_size=8", "rollout.n_samples_per_prompt=8", "train.global_batch_size=64",
                      "rollout.max_new_tokens=2048", *rp.GPU_SETS],
              "cpu": list(rp.CPU_SETS)}
TIMING_KEYS = ("_s", "_tok_s", "time", "seconds")  # metrics that measure time: not compared between runs
GONE_WAIT_S = 90.0


def shapes(cpu: bool) -> dict:
    S = rp.shapes(cpu)
    if not cpu:  # the keyed schedule scaled to a 2048-token cap; shorter prompts and eval
        S.update(max_new=2048, median=round(1700 * 2048 / 8192), prompt_len=256, eval_max_new=256)
    # the engine's moment: the K-th decode chunk (of sync_every=16 steps) of rollout 1; the eval before it
    # must reach it too (GPU: the random model rarely stops before 256 tokens; CPU: its 16-token eval is one chunk)
    S["decode_chunk"] = 1 if cpu else 8
    return S


def fault_config(S, W: Path, layout: str) -> Path:
    import yaml

    from runtime.config import apply_overrides, config_from_dict
    tree = rp.layout_tree(S, W, layout)
    tree["name"] = f"faults-{layout}"
    tree = apply_overrides(tree, FAULT_SETS["cpu" if S["cpu"] else "gpu"])
    config_from_dict(tree, f"faults-{layout}.yaml")
    path = W / f"faults-{layout}.yaml"
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path


def sec_setup(S, W: Path) -> dict:
    r = rp.sec_setup(S, W)
    r["configs"] = [str(fault_config(S, W, lay)) for lay in rp.LAYOUTS]
    return r


# -- processes of a run ------------------------------------------------------------------------------------
def marked(mark: str) -> list[dict]:
    """Live processes whose environment carries this run's marker (zombies excluded: they hold nothing)."""
    want = f"{MARK}={mark}".encode()
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            if want not in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                continue
            state, ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:2]
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if state != "Z":
            out.append({"pid": int(pid), "ppid": int(ppid), "cmd": cmd[:160]})
    return out


def _follows_slowly(p: dict) -> bool:
    """Ray's workers, binaries and scripts (wherever Ray is installed: site-packages here, /tmp/site on the GPU
    machine), and inductor's compile workers: they look for their parent once a minute (torch's watchdog), so
    after a SIGKILL they linger up to 60 s (2 x H200: 64 of them at 48 s)."""
    return (p["cmd"].startswith("ray::") or re.search(r"/ray/(core|autoscaler|dashboard|_private)/", p["cmd"]) is not None
            or _is_compile_worker(p))


def _is_compile_worker(p: dict) -> bool:
    return "torch/_inductor/compile_worker" in p["cmd"]


def wait_gone(mark: str, timeout_s: float = GONE_WAIT_S, settle_s: float = 30.0) -> tuple[list[dict], float]:
    """Wait until no process of the run is left (each dies of its own: Ray's fate-sharing, an actor's owner
    gone), or until only processes other than Ray's and inductor's are left and the same ones have stayed for
    settle_s (orphans that will not go; `_follows_slowly` get the whole timeout_s: under load Ray's agents took
    over 30 s to follow a killed driver); returns what is left and how long it took."""
    t0 = time.monotonic()
    left, since = marked(mark), time.monotonic()
    while left and time.monotonic() - t0 < timeout_s and (any(map(_follows_slowly, left))
                                                          or time.monotonic() - since < settle_s):
        time.sleep(0.2)
        now = marked(mark)
        if {p["pid"] for p in now} != {p["pid"] for p in left}:
            since = time.monotonic()
        left = now
    return left, round(time.monotonic() - t0, 1)


def kill_pids(procs: list[dict]) -> list[int]:
    killed = []
    for p in procs:
        try:
            os.kill(p["pid"], signal.SIGKILL)
            killed.append(p["pid"])
        except OSError:
            pass
    return killed


def wait_for_file(path: Path, proc: subprocess.Popen, deadline: float) -> dict:
    while not path.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended (exit {proc.returncode}) before reaching {path.name}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} not reached in time")
        time.sleep(0.1)  # waiting for the paused process's file, not for time to pass
    return json.loads(path.read_text())


def compile_caches(where: Path) -> dict:
    """Inductor's and Triton's caches of one case (as on a fresh node): a case compared with the reference never
    reuses the kernels, or the configurations timed, of another case's processes."""
    return {"TORCHINDUCTOR_CACHE_DIR": str(where / "inductor"), "TRITON_CACHE_DIR": str(where / "triton")}


def group_dir(W: Path, layout: str, sets: list[str]) -> Path:
    """A layout's runs and kept reference for one ``--set`` group: a cost run under another setting neither
    deletes nor replaces the plain group's reference (its own folder, named by its settings)."""
    name = "+".join([layout, *(re.sub(r"[^A-Za-z0-9._=-]", "_", x) for x in sets)])
    return W / "faults" / name


class CaseRun:
    """One case's processes: the environment they share, its logs, its time limit."""

    def __init__(self, S, W: Path, layout: str, case: str, limit_s: float, sets: list[str]):
        self.S, self.layout, self.case, self.sets = S, layout, case, sets
        self.dir = group_dir(W, layout, sets) / case
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        self.root = self.dir / "root"
        self.pauses = self.dir / "pauses"
        self.pauses.mkdir()
        self.mark = f"{layout}-{case}-{uuid.uuid4().hex[:8]}"
        self.cfg = W / f"faults-{layout}.yaml"
        self.deadline = time.monotonic() + limit_s
        env = rp.hook_env(S)
        env.update({MARK: self.mark, "PREFECT_HOME": str(self.dir / "prefect"), "PYTHONUNBUFFERED": "1",
                    grad_trace.ENV: str(self.dir / "grad_trace"), **compile_caches(self.dir / "caches-run")})
        env.setdefault("HF_HUB_OFFLINE", "1")
        for k in ("GRPOFLOW_TEST_KILL_AT", "GRPOFLOW_TEST_SNAPSHOT_AT", "GRPOFLOW_TEST_PAUSE_AT"):
            env.pop(k, None)
        self.env = env

    def start(self, argv: list[str], log: str, extra_env: dict | None = None) -> subprocess.Popen:
        # a session of its own: a time-out ends the whole tree, never the bench
        return subprocess.Popen([sys.executable, "-m", "cli.main", *argv], cwd=ROOT, env={**self.env, **(extra_env or {})},
                                stdout=(self.dir / log).open("w"), stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, proc: subprocess.Popen) -> int | str:
        try:
            return proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.end_all(proc)
            return "timeout"

    def end_all(self, proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait()
        kill_pids(marked(self.mark))

    def run_argv(self) -> list[str]:
        return ["run", str(self.cfg), "--run-id", RUN,
                *sum((["--set", x] for x in [f"storage.root={self.root}", *self.sets]), [])]

    def tail(self, log: str, n: int = 3000) -> str:
        p = self.dir / log
        return p.read_text(errors="replace")[-n:] if p.exists() else ""


class CaseFailed(RuntimeError):
    """A case that did not end as it should, with what it had found so far."""

    def __init__(self, message: str, partial: dict):
        super().__init__(message)
        self.partial = partial


def run_case(S, W: Path, layout: str, case: str, limit_s: float, sets: list[str]) -> dict:
    c = CaseRun(S, W, layout, case, limit_s, sets)
    res: dict = {"name": f"{layout}:{case}", "layout": layout, "case": case, "limit_s": round(limit_s), "sets": sets}
    t0 = time.monotonic()
    fault = FAULTS.get(case)
    extra = {}
    if fault:
        label = fault[1].format(k=S["decode_chunk"])
        extra = {"GRPOFLOW_TEST_PAUSE_AT": label, "GRPOFLOW_TEST_PAUSE_DIR": str(c.pauses)}
        res["fault"] = {"moment": label, "in": fault[0], "killed": fault[2]}
    proc = c.start(c.run_argv(), "run.log", extra)
    if fault:
        try:
            reached = wait_for_file(c.pauses / f"{label}.reached", proc, c.deadline)
        except (RuntimeError, TimeoutError) as e:
            c.end_all(proc)
            raise CaseFailed(f"{e}\n{c.tail('run.log')}", res) from None
        f = res["fault"]
        f["reached_at_s"] = round(time.monotonic() - t0, 1)
        f["paused_pid"], f["paused_node"] = reached["pid"], reached.get("node_id")
        victim = proc.pid if fault[2] == "driver" else reached["pid"]
        if not any(p["pid"] == victim for p in marked(c.mark)):
            c.end_all(proc)
            raise CaseFailed(f"pid {victim} does not carry this run's marker: not killed", res)
        os.kill(victim, signal.SIGKILL)
        f["victim_pid"] = victim
        (c.pauses / f"{label}.go").touch()  # the other paused processes (a second engine or rank) go on
    rc = c.wait(proc)
    res["run"] = {"rc": rc, "wall_s": round(time.monotonic() - t0, 1)}
    if case == "driver-kill" and rc != "timeout":
        left, took = wait_gone(c.mark)
        # what outlives the driver, and whether it holds GPU memory; then gone, so the resume starts clean
        res["after_driver_kill"] = {"waited_s": took, "left": left, "gpu_apps": gpu_apps(),
                                    "killed_by_bench": kill_pids(left)}
        t1 = time.monotonic()
        # the resume as on another node: nothing the killed run compiled is there to reuse
        resumed = c.start(["resume", RUN, "--root", str(c.root)], "resume.log", compile_caches(c.dir / "caches-resume"))
        res["resume"] = {"rc": c.wait(resumed), "wall_s": round(time.monotonic() - t1, 1)}
        ok = res["resume"]["rc"] == 0
    else:
        ok = rc == 0
    res["wall_s"] = round(time.monotonic() - t0, 1)
    left, took = wait_gone(c.mark)
    res["left_behind"] = left
    res["left_gone_after_s"] = took
    kill_pids(left)
    res["gpu_apps_after"] = gpu_apps()
    if not ok:
        res["log_tail"] = c.tail("resume.log" if case == "driver-kill" and "resume" in res else "run.log")
        raise CaseFailed(f"{case}: the run did not finish (exit {res.get('resume', res['run'])['rc']})", res)
    res["facts"] = run_facts(c.root, f"bench-{layout}", Path(c.env["PREFECT_HOME"]))
    # the fault struck where meant: the chunk of rollout 1 retried (an actor killed) or left running (the driver)
    facts = res["facts"]
    res["interrupted_tasks"] = sorted(set(facts["retried_tasks"]) | {t["task"] for t in facts["prefect_tasks"]
                                                                     if t["state"] == "Running"})
    res["struck_where_meant"] = None if not fault else res["interrupted_tasks"] == ["train-chunk-1-2"]
    logs = "\n".join(c.tail(log, 10**9) for log in ("run.log", "resume.log"))
    res["rebuild_logged"] = "rebuilding from the latest checkpoint" in logs
    res["grad_trace"] = str(c.dir / "grad_trace")
    res["root"] = str(c.root)
    return res


# -- what a finished run left ------------------------------------------------------------------------------
def run_facts(root: Path, model: str, prefect_home: Path) -> dict:
    from mlflow.tracking import MlflowClient

    from runtime.run import checkpoint
    from runtime.run.directory import RunDir
    from runtime.run.leftovers import temp_leftovers
    rd = RunDir(str(root), RUN)
    final = checkpoint.latest(rd)
    doc = json.loads(Path(rd.sub("tracking.json")).read_text())
    client = MlflowClient(doc["tracking_uri"], registry_uri=doc["tracking_uri"])
    run = client.get_run(doc["mlflow_run_id"])
    history = {k: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, k))
               for k in run.data.metrics}
    versions = [{"version": int(v.version), "rollout": int(v.tags.get("grpoflow.rollout", -1)),
                 "source": os.path.relpath(src, root), "source_exists": Path(src).exists()}
                for v, src in H.model_versions(client, model)]
    try:
        best = int(client.get_registered_model(model).aliases["best"])
    except Exception:  # noqa: BLE001 - no alias: recorded as None
        best = None
    tasks = H.prefect_task_times(prefect_home)
    return {"final_rollout": final.rollout if final else None, "final_checkpoint": final.path if final else None,
            "lease_held": Path(rd.sub("lease.json")).exists(),
            "temp_leftovers": [str(p) for p in temp_leftovers(rd)],
            "mlflow_status": run.info.status, "mlflow_runs": len(client.search_runs([run.info.experiment_id])),
            "metric_points": {k: [s for s, _ in h] for k, h in sorted(history.items())},
            "metric_values": {k: [v for _, v in h] for k, h in sorted(history.items())},
            "registry": versions,
            "best_rollout": next((v["rollout"] for v in versions if v["version"] == best), None),
            "rollouts": H.rollout_rows(Path(rd.path)),
            "prefect_tasks": tasks,
            "retried_tasks": sorted(t["task"] for t in tasks if (t["run_count"] or 0) > 1)}


def _measures_time(metric: str) -> bool:
    return any(metric.endswith(t) or t in metric for t in TIMING_KEYS)


def compare_facts(f: dict, ref: dict) -> dict:
    values = [k for k in ref["metric_values"] if not _measures_time(k)
              and f["metric_values"].get(k) != ref["metric_values"][k]]
    return {"same_metric_points": f["metric_points"] == ref["metric_points"],
            "metric_values_differ": values,
            "same_registry": [(v["rollout"], v["source"]) for v in f["registry"]]
            == [(v["rollout"], v["source"]) for v in ref["registry"]] and all(v["source_exists"] for v in f["registry"]),
            "same_best": f["best_rollout"] == ref["best_rollout"],
            "same_lengths_and_rewards": [(r.get("response_len_mean"), r.get("reward_mean")) for r in f["rollouts"]]
            == [(r.get("response_len_mean"), r.get("reward_mean")) for r in ref["rollouts"]],
            "ended_clean": f["final_rollout"] == ref["final_rollout"] and not f["lease_held"]
            and not f["temp_leftovers"] and f["mlflow_status"] == "FINISHED" and f["mlflow_runs"] == 1}


# -- the reference (unbroken-a) and the cases --------------------------------------------------------------
class References:
    """unbroken-a per layout: its facts and final tensors, from this call or from an earlier call on this
    same machine (its work folder kept while the machine stays warm); or, without one, a reference carried from
    another machine of the same GPU model and torch (``--references``: what an earlier call wrote to
    ``OUT/references.json``), whose final tensors are compared by their fingerprints, and its step trace as
    it was recorded there."""

    def __init__(self, W: Path, sets: list[str], carried: Path | None = None, export: Path | None = None):
        self.W, self.sets, self.carried, self.export = W, sets, carried, export
        self._tensors: dict[str, dict] = {}

    def path(self, layout: str) -> Path:
        return group_dir(self.W, layout, self.sets) / "reference.json"

    def key(self, layout: str) -> str:
        return group_dir(Path(), layout, self.sets).name

    def get(self, layout: str) -> dict | None:
        p = self.path(layout)
        if not p.exists():
            return self.get_carried(layout)
        ref = json.loads(p.read_text())
        if ref.get("gpus") != gpu_ids() or ref.get("sets") != self.sets or not Path(ref["facts"]["final_checkpoint"]).exists():
            return self.get_carried(layout)
        return ref

    def get_carried(self, layout: str) -> dict | None:
        """The carried reference of this layout and --set group, if it was made on GPUs of this model with this torch."""
        if self.carried is None:
            return None
        ref = json.loads(Path(self.carried).read_text()).get(self.key(layout))
        if ref is None or ref["gpu_models"] != gpu_models() or ref["torch"] != torch_version():
            return None
        return {**ref, "carried": True}

    def put(self, layout: str, res: dict) -> None:
        # everything sec_case compares a case with: the facts, the step trace, the root (the final checkpoint)
        self.path(layout).write_text(json.dumps({"gpus": res["gpus"], "sets": self.sets, "facts": res["facts"],
                                                 "wall_s": res["wall_s"], "grad_trace": res["grad_trace"],
                                                 "root": res["root"]}))
        self._tensors.pop(layout, None)
        if self.export is not None:  # the same, without the files, for a call on another machine
            doc = json.loads(self.export.read_text()) if self.export.exists() else {}
            doc[self.key(layout)] = {
                "layout": layout, "sets": self.sets, "gpu_models": gpu_models(), "torch": torch_version(),
                "gpus": res["gpus"], "facts": res["facts"], "wall_s": res["wall_s"],
                "checkpoint_fingerprints": tensor_fingerprints(self.tensors(layout)),
                "grad_trace": grad_trace.to_lines(grad_trace.read(Path(res["grad_trace"])))}
            self.export.write_text(json.dumps(doc))

    def tensors(self, layout: str) -> dict:
        if layout not in self._tensors:
            self._tensors[layout] = checkpoint_tensors(self.get(layout)["facts"]["final_checkpoint"])
        return self._tensors[layout]


def compare_with(res: dict, ref: dict, ref_tensors=None, run_tensors=None) -> dict:
    """A finished case against a reference: its facts, final tensors (bitwise, else max |delta| per tensor; a carried
    reference: by fingerprint) and step trace."""
    if run_tensors is None:
        run_tensors = checkpoint_tensors(res["facts"]["final_checkpoint"])
    if ref.get("carried"):
        checkpoint = compare_fingerprints(tensor_fingerprints(run_tensors), ref["checkpoint_fingerprints"])
        trace = grad_trace.from_lines(ref["grad_trace"])
    else:
        checkpoint = compare_tensors(run_tensors, ref_tensors)
        trace = grad_trace.read(Path(ref["grad_trace"]))
    run_trace = grad_trace.read(Path(res["grad_trace"]))
    return {**compare_facts(res["facts"], ref["facts"]), "checkpoint": checkpoint,
            # step by step: where the runs' parameters or gradients first differ (bench/grad_trace.py)
            "grad_trace": grad_trace.first_difference(run_trace, trace),
            # each generate call both made: the engine's weights, state, schedule and draws' digests (bench/grad_trace.py)
            "engine_calls": grad_trace.engine_difference(run_trace, trace),
            "reference_machine": "another" if ref.get("carried") else "this"}


def compare_exports(run: dict, reference: dict) -> dict:
    """Two calls' unbroken-a of one layout and --set group as their OUT/references.json keep them (each call's
    machine fresh, or one machine twice): the final tensors by digest, the step trace, the facts."""
    return {**compare_facts(run["facts"], reference["facts"]),
            "checkpoint": compare_fingerprints(run["checkpoint_fingerprints"], reference["checkpoint_fingerprints"]),
            "grad_trace": grad_trace.first_difference(grad_trace.from_lines(run["grad_trace"]),
                                                      grad_trace.from_lines(reference["grad_trace"])),
            "same_machine": run["gpus"] == reference["gpus"]}


def sec_case(S, W: Path, layout: str, case: str, refs: References, limit_s: float, keep_roots: bool) -> dict:
    res = run_case(S, W, layout, case, limit_s, refs.sets)
    res["gpus"] = gpu_ids()
    t0 = time.time()
    if case == "unbroken-a":
        carried = refs.get_carried(layout)
        refs.put(layout, res)
        # against another machine's unbroken-a: whether a reference carried between machines holds bit for bit
        res["vs_reference"] = None
        res["vs_carried"] = compare_with(res, carried, run_tensors=refs.tensors(layout)) if carried else None
    else:
        ref = refs.get(layout)
        res["vs_reference"] = compare_with(res, ref, None if ref.get("carried") else refs.tensors(layout))
    res["compare_s"] = round(time.time() - t0, 1)
    if case != "unbroken-a" and not keep_roots:  # ~8 GB of checkpoints a run on GPUs: the reference's stays
        shutil.rmtree(Path(res["root"]), ignore_errors=True)
    return res


def record(out: Path, name: str, fn) -> dict:
    """Run one case, append its result line to OUT/results.jsonl as soon as it ends (a call cut at its limit
    keeps the cases before), print one line of it."""
    t0 = time.time()
    try:
        r = {**fn(), "status": "ok"}
    except CaseFailed as e:
        r = {**e.partial, "status": "FAILED", "error": str(e)[:2000]}
    except Exception as e:  # noqa: BLE001 - one case's failure is recorded, the next still runs
        traceback.print_exc()
        r = {"name": name, "status": "FAILED", "error": f"{type(e).__name__}: {e}"[:2000]}
    r["section_s"] = round(time.time() - t0, 1)
    H.append_result(out, r)
    print("RESULT", name, r["status"], r["section_s"], "s", r.get("error", "")[:300], flush=True)
    return r


# -- summary -----------------------------------------------------------------------------------------------
def _layout_case(r: dict) -> tuple[str, str]:
    """A result's layout and case (a failed one may carry only its name, "layout:case" or "layout:case@call")."""
    layout, case = r["name"].split("@")[0].split(":")
    return r.get("layout") or layout, r.get("case") or case


def _group(r: dict) -> str:
    """A summary row: the layout, and the run's --set overrides when it had any (each its own reference)."""
    return group_name(_layout_case(r)[0], r.get("sets"))


def group_name(layout: str, sets: list[str] | None) -> str:
    return layout + (f" [{', '.join(sets)}]" if sets else "")


def _steady(facts: dict) -> dict:
    """The last rollout's step and train time (rollout 0 carries the engine's warm-up and the compiles)."""
    mv = facts.get("metric_values") or {}
    return {k: round(mv[m][-1], 3) for k, m in (("steady_step_s", "step_time_s"), ("steady_train_s", "train_time_s"))
            if mv.get(m)}


def _by_digest(vs: dict) -> dict:
    """A run against an unbroken-a of another call (carried, or exported beside it), as a summary row keeps it."""
    return {"bitwise": vs["checkpoint"]["bitwise"], "tensors_differ": vs["checkpoint"]["differ_count"],
            "first_step_difference": vs["grad_trace"]["first"],
            "same_lengths_and_rewards": vs.get("same_lengths_and_rewards"),
            "same_metric_points": vs["same_metric_points"], "metric_values_differ": vs["metric_values_differ"]}


def summarize(res: dict, env: dict | None, exports: list[dict] = ()) -> dict:
    out = {**H.summary_head("ray_faults", env or {}), "env": env, "sections": res, "layouts": {}}
    for r in res.values():
        if ":" not in r.get("name", "") or r.get("status") == "SKIPPED":
            continue
        row = out["layouts"].setdefault(_group(r), {})
        case = _layout_case(r)[1]
        if row.get(case, {}).get("status") == "ok":
            continue  # the same case again (another call's): the first that ran is kept
        if r.get("status") != "ok":
            row[case] = {"status": r.get("status"), "error": str(r.get("error", ""))[:300]}
            continue
        vs = r.get("vs_reference") or {}
        ck, trace = vs.get("checkpoint") or {}, vs.get("grad_trace") or {}
        row[case] = {"status": "ok", "wall_s": r["wall_s"], "gpus": r.get("gpus"), **_steady(r["facts"]),
                     "interrupted_tasks": r["interrupted_tasks"], "struck_where_meant": r["struck_where_meant"],
                     "rebuild_logged": r["rebuild_logged"],
                     "left_behind": len(r["left_behind"]), "gpu_apps_after": r["gpu_apps_after"],
                     **({"bitwise": ck.get("bitwise"), "max_abs_delta": ck.get("max_abs_delta"),
                         "tensors_differ": ck.get("differ_count"),
                         "steps_compared": trace.get("compared"), "first_step_difference": trace.get("first"),
                         **{k: v for k, v in vs.items() if k not in ("checkpoint", "grad_trace")}} if vs else {})}
        if "after_driver_kill" in r:
            row[case]["left_after_driver_kill"] = r["after_driver_kill"]["left"]
        if carried := r.get("vs_carried"):  # this machine's unbroken-a against another machine's
            row[case]["vs_another_machine"] = _by_digest(carried)
    firsts: dict[str, dict] = {}
    for doc in exports:  # each call's unbroken-a after the first call's: the same config run again from nothing
        for ref in doc.values():
            group = group_name(ref["layout"], ref["sets"])
            if group not in firsts:
                firsts[group] = ref
                continue
            vs = compare_exports(ref, firsts[group])
            out["layouts"].setdefault(group, {}).setdefault("unbroken-a again", []).append({
                **_by_digest(vs), "tensors": vs["checkpoint"]["tensors"], "steps_compared": vs["grad_trace"]["compared"],
                "same_machine": vs["same_machine"],
                "same_registry": vs["same_registry"], "same_best": vs["same_best"]})
    for row in out["layouts"].values():
        floor = row.get("unbroken-b") or {}
        again = (row.get("unbroken-a again") or [None])[0]
        if floor.get("status") == "ok":
            row["noise_floor"] = {"bitwise": floor.get("bitwise"), "max_abs_delta": floor.get("max_abs_delta"),
                                  "same_machine_as_reference": floor.get("reference_machine", "this") == "this"}
        elif again:  # without an unbroken-b: another call's unbroken-a, compared by digest
            row["noise_floor"] = {"bitwise": again["bitwise"], "max_abs_delta": None,
                                  "same_machine_as_reference": again["same_machine"], "by": "unbroken-a of two calls"}
    out["nondeterminism"] = {"noise_floor": {g: row.get("noise_floor") for g, row in out["layouts"].items()},
                             "settings_cost": settings_cost(res)}
    return out


def settings_cost(res: dict) -> dict:
    """What a --set costs: its unbroken runs' steady step against the plain layout's, on the same GPUs only; every
    unbroken run of the merged calls counts (a call's own unbroken-a beside another call's)."""
    groups: dict[str, list[dict]] = {}
    for r in res.values():
        if ":" in r.get("name", "") and r.get("status") == "ok" and _layout_case(r)[1] in ("unbroken-a", "unbroken-b"):
            if steady := _steady(r["facts"]):
                groups.setdefault(_group(r), []).append({**steady, "gpus": r.get("gpus")})

    def mean(rows: list[dict], key: str) -> float:
        return round(sum(r[key] for r in rows) / len(rows), 3)

    cost = {}
    for g, runs in groups.items():
        plain = [r for r in groups.get(g.split(" [")[0], []) if r["gpus"] == runs[0]["gpus"]]
        if " [" not in g or not plain:
            continue
        step, plain_step = mean(runs, "steady_step_s"), mean(plain, "steady_step_s")
        train, plain_train = mean(runs, "steady_train_s"), mean(plain, "steady_train_s")
        cost[g] = {"runs": len(runs), "plain_runs": len(plain), "steady_step_s": step, "plain_steady_step_s": plain_step,
                   "step_cost_pct": round(100 * (step / plain_step - 1), 1), "steady_train_s": train,
                   "plain_steady_train_s": plain_train, "train_cost_pct": round(100 * (train / plain_train - 1), 1),
                   "each_s": {"runs": [r["steady_step_s"] for r in runs], "plain": [r["steady_step_s"] for r in plain]}}
    return cost


def print_table(summary: dict) -> None:
    print(f"ray_faults on {summary['device']}")
    for lay, row in summary["layouts"].items():
        if not row:
            continue
        print(f"[{lay}]")
        for case in CASES:
            r = row.get(case)
            if not r:
                continue
            if r["status"] != "ok":
                print(f"  {case:13s} {r['status']}: {r.get('error', '')[:200]}")
                continue
            d = r.get("max_abs_delta")
            cmp = ("reference" if r.get("bitwise") is None else "bitwise" if r["bitwise"] else
                   f"{r.get('tensors_differ')} tensors differ (by digest)" if d is None else
                   f"max|d| model {d.get('model'):.3g} optimizer {d.get('optimizer'):.3g} ({r.get('tensors_differ')} tensors)")
            if r.get("reference_machine") == "another":
                cmp += " against another machine's reference"
            print(f"  {case:13s} {r['wall_s']:7.1f} s  final ckpt: {cmp}; points same {r.get('same_metric_points', '-')}; "
                  f"registry same {r.get('same_registry', '-')}; ended clean {r.get('ended_clean', '-')}; "
                  f"interrupted {r['interrupted_tasks']}; left {r['left_behind']}; gpu apps {r['gpu_apps_after']}")
            if r.get("metric_values_differ"):
                print(f"  {'':13s} metric values differ: {r['metric_values_differ']}")
            if r.get("steps_compared") is not None:
                f = r.get("first_step_difference")
                print(f"  {'':13s} step by step ({r['steps_compared']} stages compared): " + (
                    "parameters and gradients equal" if f is None else
                    f"first differ at step {f['step']} {f['stage']} (dp {f['dp']}, tp {f['tp']}), {f['count']} tensors: "
                    f"{f['parameters'][:4]}; tensors differing at that step: "
                    f"{ {k: n for k, n in (f.get('differ_at_that_step') or {}).items() if n} }"))
            for call, what in (r.get("engine_calls") or {}).items():
                print(f"  {'':13s} engine {call}: {what}")
            if left := r.get("left_after_driver_kill"):
                kinds = sorted({"inductor compile worker" if _is_compile_worker(p) else p["cmd"][:60] for p in left})
                print(f"  {'':13s} outlived the driver: {len(left)} processes: {kinds}")
            if v := r.get("vs_another_machine"):
                print(f"  {'':13s} against another machine's unbroken-a: " + (
                    "bitwise" if v["bitwise"] else f"{v['tensors_differ']} tensors differ") +
                    f"; first step difference {v['first_step_difference']}; points same {v['same_metric_points']}")
        for v in row.get("unbroken-a again") or []:
            print(f"  unbroken-a again ({'this' if v['same_machine'] else 'another'} machine, by digest): " + (
                "bitwise" if v["bitwise"] else f"{v['tensors_differ']} of {v['tensors']} tensors differ") +
                f"; first step difference {v['first_step_difference']} ({v['steps_compared']} stages); points same "
                f"{v['same_metric_points']}; metric values differ {v['metric_values_differ']}; registry same "
                f"{v['same_registry']}")
    for g, c in summary["nondeterminism"]["settings_cost"].items():
        print(f"[{g}] steady step {c['steady_step_s']} s vs {c['plain_steady_step_s']} s plain ({c['step_cost_pct']:+.1f} %), "
              f"train {c['steady_train_s']} s vs {c['plain_steady_train_s']} s ({c['train_cost_pct']:+.1f} %); "
              f"{c['runs']} and {c['plain_runs']} runs, same GPUs")


# -- driver ------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = H.parser(__doc__, "ray_faults", None, cpu_help="tiny shapes, Ray on CPU: the wiring", section=False,
                  merge="OUT dirs of earlier calls: one summary of all",
                  deadline_help="seconds for this call (GPU 560, CPU 1800)")
    ap.add_argument("--layouts", default=None, help=f"comma list of {tuple(rp.LAYOUTS)} (CPU: colocated)")
    ap.add_argument("--cases", default=None, help=f"comma list of {CASES} (CPU: unbroken-a,engine-kill,driver-kill)")
    ap.add_argument("--set", action="append", default=[], help="an override for every run of this call")
    ap.add_argument("--keep-roots", action="store_true", help="keep every case's storage root (GPU: ~16 GB each)")
    ap.add_argument("--references", default=None,
                    help="an earlier call's OUT/references.json: the reference where this machine has none")
    ap.add_argument("--section", default=None, help=argparse.SUPPRESS)  # setup, in a process of its own
    a = ap.parse_args(argv)
    t_start = time.monotonic()
    if a.merge:  # a name met again (each call's own unbroken-a) is kept under name@folder
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        exports = [json.loads(p.read_text()) for d in a.merge if (p := Path(d) / "references.json").exists()]
        summary = summarize(H.merge_results(a.merge, keep="both"), H.merged_env(a.merge, "ray_faults"), exports)
        H.save_summary(summary, out, "ray_faults", a.results_dir, cpu=False)
        print_table(summary)
        return 0
    S = shapes(a.cpu)
    deadline = a.deadline or (1800.0 if a.cpu else 560.0)
    out, W = H.start(a, "ray_faults")
    layouts = (a.layouts or "colocated").split(",")
    cases = (a.cases or ("unbroken-a,engine-kill,driver-kill" if a.cpu else ",".join(CASES))).split(",")
    unknown = [x for x in layouts if x not in rp.LAYOUTS] + [x for x in cases if x not in CASES]
    if unknown:
        ap.error(f"unknown layout or case: {unknown}")
    if a.section == "setup":
        return H.section_exit(H.run_section("setup", S, W, out, lambda S, W: {**sec_setup(S, W), "gpus": gpu_ids()}))
    H.clear_results(out)
    if not (all((W / f"faults-{lay}.yaml").exists() for lay in layouts) and (W / "hf").exists()):
        # in a process of its own: the model is made on the GPU, and this process must hold no CUDA context
        H.run_sections_in_processes(Path(__file__), ["setup"], W, out, 300, {"setup": 300},
                                    extra_args=("--cpu",) if a.cpu else ())
        if H.read_results(out).get("setup", {}).get("status") != "ok":
            print((out / "log.txt").read_text()[-3000:])
            return 1
    refs = References(W, a.set, carried=Path(a.references) if a.references else None, export=out / "references.json")
    walls = []  # this call's unbroken runs: what the next case is measured against
    for lay in layouts:
        todo = list(cases)
        if refs.get(lay) is None and "unbroken-a" not in todo:
            todo.insert(0, "unbroken-a")  # a fault case needs a reference: this machine's or a carried one
        elif refs.get(lay) is not None:
            walls.append(refs.get(lay)["wall_s"])
            if "unbroken-a" in todo and len(todo) > 1 and not refs.get(lay).get("carried"):
                todo.remove("unbroken-a")  # kept from an earlier call on this machine
        for case in todo:
            left = deadline - (time.monotonic() - t_start)
            need = (max(walls) * COST[case]) if walls else 0.0
            if left < max(need, 30.0):
                rec = {"name": f"{lay}:{case}", "status": "SKIPPED",
                       "error": f"needs ~{need:.0f} s (unbroken {max(walls or [0]):.0f} s x {COST[case]}), {left:.0f} s left"}
                H.append_result(out, rec)
                print("SKIPPED", rec, flush=True)
                continue
            if case != "unbroken-a" and refs.get(lay) is None:
                H.append_result(out, {"name": f"{lay}:{case}", "status": "FAILED", "error": "no reference run"})
                continue
            print(f"=== {lay}:{case} ({left:.0f} s left)", flush=True)
            r = record(out, f"{lay}:{case}", lambda lay=lay, case=case, left=left:
                       sec_case(S, W, lay, case, refs, left, a.keep_roots))
            if r["status"] == "ok" and case.startswith("unbroken"):
                walls.append(r["wall_s"])
    summary = summarize(H.read_results(out), H.env_info(S["model"]))
    summary["total_s"] = round(time.monotonic() - t_start, 1)
    return H.finish(summary, out, "ray_faults", a.results_dir, a.cpu, print_table)


if __name__ == "__main__":
    sys.exit(main())
