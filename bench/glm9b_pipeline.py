"""GLM-Z1-9B through `grpoflow run` on four GPUs (issue 57 item 7): checkpoints beside the next chunk, the disk;
Qwen3-30B-A3B the same way with `--family qwen3_moe` (issue 60 item 6: configs/qwen3-30b-a3b-dapo-4xh200.yaml).

    python bench/gpu_carry.py install && export PYTHONPATH=/tmp/site:$PYTHONPATH      # Ray, Prefect, MLflow, ...
    python bench/glm9b_pipeline.py --sections setup --out $OUT                        # nvidia-h200-x4 (~35 s)
    python bench/glm9b_pipeline.py --sections full --deadline 580 --out $OUT          # the next call (~100 s to the
                                                                                      # step, ~114 s the step, ~190 s
                                                                                      # the 105 GiB write)
    python bench/glm9b_pipeline.py --layers 4 --sections setup,unbroken,kill --out $OUT
    python bench/glm9b_pipeline.py --cpu                                              # smoke: a tiny GLM4, CPU
    python bench/glm9b_pipeline.py --family qwen3_moe --layers 12 --sections setup,unbroken,kill --out $OUT
    python bench/glm9b_pipeline.py --family qwen3_moe --cpu                           # smoke: a tiny Qwen3-MoE, CPU

Sections (each a `grpoflow run` process as a user runs it, under Ray, with Prefect and MLflow):
  setup     a random model of the family's config (runtime/models/known_configs; `--layers N` keeps N layers at full
            width and vocabulary), built in bf16 on GPU 0 and saved as HF safetensors with the tiny tokenizer; a train
            set of 1024-token prompts and an eval set (slime jsonl)
  full      the family's config (glm4: configs/glm-z1-9b-dapo-4xh200.yaml) pointed at them: one chunk of `--rollouts` rollouts whose samples stop at
            the keyed schedule's lengths (log-normal, median 1700, a tail to 8192: bench/keyed_lengths), its checkpoint
            written in the background and made durable before the run ends; no eval. Read back: the step split, the
            stall the loop saw and the write's and hash's seconds, the stages' seconds (convert), the run directory's
            bytes sampled every second (its peak) against `grpoflow validate`'s disk row
  unbroken  2 chunks of one rollout, a checkpoint, an eval, an HF export and a registered version after each
  kill      the same run SIGKILLed at a moment inside the first chunk's background checkpoint write (`--kill-at`),
            then `grpoflow resume`: its final checkpoint's tensors, metric points and values and registered
            versions against `unbroken`'s (bench/ray_faults.py's comparisons)
Results: OUT/results.jsonl (one line per section) and OUT/glm9b_pipeline.json; with --results-dir a copy named by
device and date.
"""
from __future__ import annotations

import argparse
import importlib
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
for _p in (ROOT, BENCH):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import harness as H  # noqa: E402  (checkpoint tensors and their comparison, run read-backs)
import ray_faults as rf  # noqa: E402  (processes by marker, run facts and their comparison)
import ray_pipeline as rp  # noqa: E402  (the keyed-length hook, read-backs of a run directory)

CONFIG = ROOT / "configs" / "glm-z1-9b-dapo-4xh200.yaml"
GLM4_9B = json.loads((ROOT / "runtime" / "models" / "known_configs" / "GLM-4-9B-0414.json").read_text())
QWEN3_30B_A3B = json.loads((ROOT / "runtime" / "models" / "known_configs" / "Qwen3-30B-A3B.json").read_text())


def _builder(module: str):
    def build(cfg, device, dtype):  # the family's GPU builder (random init in bf16, no fp32 copy of the weights)
        return importlib.import_module(module).build(cfg, device, dtype)
    return build


# what differs by family: the config, the shape, how it is built, and on the CPU a tiny mixture and a plain layout
FAMILIES = {
    "glm4": dict(config=CONFIG, hf=GLM4_9B, build=_builder("glm4_engine"), arch="Glm4ForCausalLM", tag="glm9b",
                 cpu_model={}, cpu_sets=[]),
    "qwen3_moe": dict(config=ROOT / "configs" / "qwen3-30b-a3b-dapo-4xh200.yaml", hf=QWEN3_30B_A3B,
                      build=_builder("moe_engine"), arch="Qwen3MoeForCausalLM", tag="qwen3moe",
                      cpu_model=dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2),
                      cpu_sets=["train.optimizer_on_host=false", "train.expert_parallel=1", "rollout.expert_shards=1"]),
}
SECTIONS = ("setup", "full", "unbroken", "kill")
KILL_AT = "checkpoint-files-written"  # a moment of the background writer (runtime/run/checkpoint.py)
SHAPES = {
    "gpu": dict(model={}, device="cuda", prompt_len=1000, rows=200, eval_rows=8, prompts=16, samples=8,
                schedule=dict(max_new=8192, median=1700, sigma=0.8, min_len=16), eval_max_new=1024,
                # the kill check's two runs at a shorter spread: they are about the checkpoint, not the tail
                short_schedule=dict(max_new=1024, median=400, sigma=0.8, min_len=16), sets=[]),
    "cpu": dict(model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, vocab_size=512),
                device="cpu", prompt_len=12, rows=32, eval_rows=4, prompts=2, samples=2,
                schedule=dict(max_new=24, median=10, sigma=0.8, min_len=2), eval_max_new=8,
                short_schedule=dict(max_new=24, median=10, sigma=0.8, min_len=2),
                sets=["model.dtype=float32", "rollout.kv_cache_gb=0.01", "data.max_prompt_len=40",
                      "train.tensor_parallel=1", "train.data_parallel=1", "train.distributed_optimizer=false",
                      "cluster.backend=local", "cluster.trainer_gpus=0", "cluster.rollout_gpus=0", "cluster.device=cpu",
                      "cluster.gpu_memory_gb=null", "cluster.host_memory_gb=null", "storage.disk_gb=null",
                      "train.max_tokens_per_micro_batch=null", "train.micro_batch_size=2"]),
}


# ---- setup ----------------------------------------------------------------------------------------------------

def sec_setup(S, W: Path, layers: int | None) -> dict:
    import random

    import torch
    from transformers import AutoTokenizer, GenerationConfig

    from runtime.models.tiny import _WORDS, build_tiny_qwen3
    fam = S["family"]
    t0 = time.time()
    for d in ("tok", "hf", "data", *(p.name for p in W.glob("root-*"))):  # a run of another shape: its disk back
        shutil.rmtree(W / d, ignore_errors=True)
    build_tiny_qwen3(W / "tok")
    tok = AutoTokenizer.from_pretrained(W / "tok")
    cfg = dict(fam["hf"], **S["model"], eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if layers:
        cfg["num_hidden_layers"] = layers
    model = fam["build"](cfg, S["device"], torch.bfloat16)
    model.config.architectures = [fam["arch"]]
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(W / "hf", max_shard_size="5GB")
    del model
    if torch.cuda.is_available():  # the run's actors need GPU 0: this process held 18.6 GiB of it at 9B
        torch.cuda.empty_cache()
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (W / "tok" / f).exists():
            shutil.copyfile(W / "tok" / f, W / "hf" / f)
    rng = random.Random(57)
    (W / "data").mkdir()
    for stem, n in (("train", S["rows"]), ("eval", S["eval_rows"])):
        with open(W / "data" / f"{stem}.jsonl", "w") as f:
            for i in range(n):
                ids = tok(" ".join(rng.choice(_WORDS) for _ in range(S["prompt_len"] + 8)))["input_ids"][:S["prompt_len"]]
                f.write(json.dumps({"prompt": tok.decode(ids), "label": str(i % 10)}) + "\n")
    return {"name": "setup", "params": n_params, "layers": cfg["num_hidden_layers"], "hf_GiB": _gib(W / "hf"),
            "s": round(time.time() - t0, 1)}


def _gib(path: Path) -> float:
    return round(_bytes(path) / 2**30, 2)


def _bytes(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(dirpath, f), follow_symlinks=False).st_size
            except OSError:  # written and renamed under us
                pass
    return total


# ---- a run --------------------------------------------------------------------------------------------------

def schedule_of(S, case: str) -> dict:
    return S["schedule"] if case == "full" else S["short_schedule"]


def run_sets(S, W: Path, root: Path, case: str, rollouts: int) -> list[str]:
    evals = case != "full"
    data = {"train": {"source": str(W / "data" / "train.jsonl"), "format": "slime"},
            "eval": {"held-out": {"source": str(W / "data" / "eval.jsonl"), "format": "slime"}} if evals else {}}
    return [f"model.source={W / 'hf'}", f"data={json.dumps({**data, 'apply_chat_template': False, 'max_prompt_len': 1024})}",
            "rollout.reward=bench.trivial_reward:length_mod13", f"rollout.max_new_tokens={schedule_of(S, case)['max_new']}",
            f"rollout.rollout_batch_size={S['prompts']}", f"rollout.n_samples_per_prompt={S['samples']}",
            f"train.global_batch_size={S['prompts'] * S['samples']}", f"train.num_rollout={rollouts}",
            f"checkpoint.interval={rollouts if case == 'full' else 1}",
            f"eval.interval={'null' if not evals else 1}", "eval.n_samples_per_prompt=2", "eval.pass_k=[1,2]",
            f"eval.max_new_tokens={S['eval_max_new']}", f"tracking.registered_model=bench-{S['family']['tag']}-{case}",
            f"storage.root={root}", *S["sets"]]


class DiskSampler(threading.Thread):
    """The run directory's bytes every second: its peak, and when."""

    def __init__(self, root: Path):
        super().__init__(daemon=True)
        self.root, self.peak, self.at, self.t0, self._done = root, 0, 0.0, time.monotonic(), threading.Event()

    def run(self) -> None:
        while not self._done.wait(1.0):
            n = _bytes(self.root)
            if n > self.peak:
                self.peak, self.at = n, time.monotonic() - self.t0

    def stop(self) -> dict:
        self._done.set()
        self.join()
        return {"peak_GiB": round(self.peak / 2**30, 2), "peak_at_s": round(self.at, 1)}


def planned_disk(cfg_path: Path, sets: list[str], env: dict) -> str:
    """`grpoflow validate`'s disk lines for the run."""
    argv = [sys.executable, "-m", "cli.main", "validate", str(cfg_path), *sum((["--set", s] for s in sets), [])]
    p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    lines = (p.stdout + p.stderr).splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith("disk of the run directory")), None)
    if start is None:
        return "\n".join(ln for ln in lines if "disk" in ln.lower())[:2000]  # a refusal names the disk
    end = next((i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith("total")), len(lines) - 1)
    return "\n".join(lines[start:end + 1])


def sec_run(S, W: Path, case: str, rollouts: int, kill_at: str, deadline: float) -> dict:
    root = W / f"root-{case}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    sets = run_sets(S, W, root, case, rollouts)
    mark = f"{S['family']['tag']}-{case}-{uuid.uuid4().hex[:8]}"
    env = rp.hook_env(schedule_of(S, case))
    env.update({rf.MARK: mark, "PREFECT_HOME": str(W / f"prefect-{case}"), "PYTHONUNBUFFERED": "1"})
    env.setdefault("HF_HUB_OFFLINE", "1")
    shutil.rmtree(env["PREFECT_HOME"], ignore_errors=True)
    config = S["family"]["config"]
    res: dict = {"name": case, "rollouts": rollouts, "plan_disk": planned_disk(config, sets, env)}
    argv = [sys.executable, "-m", "cli.main", "run", str(config), "--run-id", rf.RUN, *sum((["--set", s] for s in sets), [])]
    pauses = W / f"pauses-{case}"
    shutil.rmtree(pauses, ignore_errors=True)
    pauses.mkdir()
    extra = {"GRPOFLOW_TEST_PAUSE_AT": kill_at, "GRPOFLOW_TEST_PAUSE_DIR": str(pauses)} if case == "kill" else {}
    disk = DiskSampler(root)
    disk.start()
    t0 = time.monotonic()
    log = (W / f"{case}.log").open("w")
    proc = subprocess.Popen(argv, cwd=ROOT, env={**env, **extra}, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        if case == "kill":
            reached = rf.wait_for_file(pauses / f"{kill_at}.reached", proc, deadline)
            res["killed_at_s"] = round(time.monotonic() - t0, 1)
            res["paused_pid"] = reached["pid"]
            os.kill(proc.pid, signal.SIGKILL)
            (pauses / f"{kill_at}.go").touch()
            proc.wait()
            left, took = rf.wait_gone(mark)
            res["after_kill"] = {"waited_s": took, "left": left, "killed_by_bench": rf.kill_pids(left)}
            res["temp_dirs_left_by_kill"] = sorted(str(p.relative_to(root)) for p in root.rglob("*.tmp-*"))
            proc = subprocess.Popen([sys.executable, "-m", "cli.main", "resume", rf.RUN, "--root", str(root)], cwd=ROOT,
                                    env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except (subprocess.TimeoutExpired, RuntimeError, TimeoutError) as e:
        os.killpg(proc.pid, signal.SIGKILL)
        rc = f"stopped: {type(e).__name__}"
    finally:
        res["disk"] = disk.stop()
        log.close()
        rf.kill_pids(rf.marked(mark))
    res["rc"], res["wall_s"] = rc, round(time.monotonic() - t0, 1)
    rd = root / "runs" / rf.RUN
    res["stages_s"] = {st: json.loads((rd / "stages" / f"{st}.json").read_text())["result"].get("seconds")
                       for st in ("fetch", "prepare", "convert") if (rd / "stages" / f"{st}.json").exists()}
    res["rollout_rows"] = H.rollout_rows(rd)
    res["checkpoint_metrics"] = [{k: v for k, v in m.items() if "checkpoint" in k}
                                 for ck in sorted((rd / "checkpoints").glob("rollout_*/trainer_state.json"))
                                 for m in json.loads(ck.read_text()).get("metrics", [])]
    # each checkpoint's own writer times: the loop's stall (and its parts), the write's and the hash's seconds
    res["checkpoint_writer"] = {ck.parent.name: json.loads(ck.read_text()).get("writer")
                                for ck in sorted((rd / "checkpoints").glob("rollout_*/trainer_state.json"))}
    res["checkpoint_GiB"] = {p.name: _gib(p) for p in sorted((rd / "checkpoints").glob("rollout_*"))}
    res["model_GiB"] = {p.name: _gib(p) for p in sorted((rd / "model").glob("*"))}
    res["exports_GiB"] = {p.name: _gib(p) for p in sorted((rd / "exports").glob("*"))}
    res["log_tail"] = (W / f"{case}.log").read_text(errors="replace")[-4000:]
    if rc == 0 and case != "full":
        res["facts"] = rf.run_facts(root, f"bench-{S['family']['tag']}-{case}", Path(env["PREFECT_HOME"]))
        res["struck"] = case == "kill"
    return res


def final_fingerprints(root: Path) -> dict:
    """sha256 of every tensor of the run's final checkpoint (model and optimizer)."""
    from runtime.run import checkpoint
    from runtime.run.directory import RunDir
    return H.tensor_fingerprints(H.checkpoint_tensors(checkpoint.latest(RunDir(str(root), rf.RUN)).path))


def compare_kill(W: Path, res: dict) -> dict:
    """The killed-and-resumed run against the unbroken one: final tensors (by digest), metrics, registry."""
    out = {}
    try:
        ref = json.loads((W / "unbroken-fingerprints.json").read_text())
        out["tensors"] = H.compare_fingerprints(final_fingerprints(W / "root-kill"), ref)
        ref_facts = json.loads((W / "unbroken-facts.json").read_text())
        out["facts"] = rf.compare_facts(res["facts"], ref_facts)
    except Exception:  # noqa: BLE001 - what could not be compared is reported
        out["error"] = traceback.format_exc()[-2000:]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", default="setup,full")
    ap.add_argument("--layers", type=int, default=None, help="keep this many layers (full width)")
    ap.add_argument("--rollouts", type=int, default=1, help="rollouts of the full section's one chunk")
    ap.add_argument("--kill-at", default=KILL_AT)
    ap.add_argument("--deadline", type=float, default=570.0, help="seconds for the whole call")
    ap.add_argument("--work", default=None, help="default /tmp/<family>-pipeline")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--results-dir", default=None)
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--set", action="append", default=[], help="more config overrides, e.g. cluster.trainer_gpus=1")
    ap.add_argument("--family", choices=tuple(FAMILIES), default="glm4",
                    help="qwen3_moe: Qwen3-30B-A3B's shape and configs/qwen3-30b-a3b-dapo-4xh200.yaml")
    a = ap.parse_args(argv)
    fam = FAMILIES[a.family]
    S = dict(SHAPES["cpu" if a.cpu else "gpu"], family=fam)
    S["model"] = {**S["model"], **(fam["cpu_model"] if a.cpu else {})}
    S["sets"] = S["sets"] + (fam["cpu_sets"] if a.cpu else []) + a.set
    default_work = "/tmp/glm9b-pipeline" if a.family == "glm4" else f"/tmp/{fam['tag']}-pipeline"
    W, out = Path((a.work or default_work) + ("-cpu" if a.cpu else "")), Path(a.out)
    W.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + a.deadline
    results = []
    for name in a.sections.split(","):
        t0 = time.monotonic()
        try:
            if name == "setup":
                r = sec_setup(S, W, a.layers)
            else:
                r = sec_run(S, W, name, a.rollouts if name == "full" else 2, a.kill_at, deadline)
                if name == "unbroken" and "facts" in r:
                    # its final tensors as digests, then its checkpoints go: the disk holds one run's at a time
                    (W / "unbroken-facts.json").write_text(json.dumps(r["facts"]))
                    (W / "unbroken-fingerprints.json").write_text(json.dumps(final_fingerprints(W / "root-unbroken")))
                    shutil.rmtree(W / "root-unbroken" / "runs" / rf.RUN / "checkpoints", ignore_errors=True)
                if name == "kill" and "facts" in r:
                    r["against_unbroken"] = compare_kill(W, r)
        except Exception:  # noqa: BLE001 - the section's row says what broke
            r = {"name": name, "error": traceback.format_exc()[-3000:]}
        r["section_s"] = round(time.monotonic() - t0, 1)
        results.append(r)
        with open(out / "results.jsonl", "a") as f:
            f.write(json.dumps(r) + "\n")
        print(json.dumps({k: v for k, v in r.items() if k not in ("log_tail", "facts")})[:3000], flush=True)
    summary = {"bench": "glm9b_pipeline", "family": a.family, "date": datetime.date.today().isoformat(),
               "layers": a.layers, "device": _device(), "sections": results}
    (out / "glm9b_pipeline.json").write_text(json.dumps(summary, indent=1))
    if a.results_dir:
        tag = f"{summary['device'].replace(' ', '_')}_{summary['date']}" + (f"_layers{a.layers}" if a.layers else "")
        name = "glm9b_pipeline" if a.family == "glm4" else f"{fam['tag']}_pipeline"
        shutil.copyfile(out / "glm9b_pipeline.json", Path(a.results_dir) / f"{name}_{tag}.json")
    return 0 if all("error" not in r and r.get("rc", 0) == 0 for r in results) else 1


def _device() -> str:
    try:
        import torch
        if torch.cuda.is_available():
            return f"{torch.cuda.device_count()}x{torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    return "cpu"


if __name__ == "__main__":
    sys.exit(main())
