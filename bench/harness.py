"""What every GPU scenario under bench/ runs on: one place for the machinery, so a scenario file holds only what
it measures (its sections, its summary, its table).

- the call: `parser` (the flags every scenario shares), `start` (OUT and the work dir made, `prepare_env`)
- sections under deadlines: `run_section` (one section in this process, its result line appended at once),
  `run_sections_in_processes` (each section a process of its own under what is left of the deadline: a crash or
  a hang costs only that section), `run_in_turn` (one section after another, each told its budget),
  `section_budget` (what a section process has left)
- results: OUT/results.jsonl (a line per section) read by `read_results`, merged over calls by `merge_results`;
  the summary (`summary_head`, `save_summary`: OUT/<bench>.json and a copy named by device and date) and
  `exit_code` (a failed section fails the CPU smoke)
- machine facts: `env_info`, `gpu_ids`, `gpu_models`, `gpu_apps`, `gpu_gib`, `Meter`, peak memory, `timed`
- tensors: `checkpoint_tensors`, `compare_tensors`, `tensor_fingerprints`, `compare_fingerprints`
- what a run left: `rollout_rows`, `prefect_task_times`, `model_versions` (MLflow as it serves them)
- a setup and the train stage over it: `fresh_setup`, `copy_tokenizer`, `word_rows`, `write_prompts`, `run_dir_over`,
  `setup_inputs`, `samples_batch`, `engine_warm_up`
- printing: `print_pairs` (a label and its value), `print_columns` (a table), `failed_rows`

On the GPU machine, what `grpoflow run` needs beyond the image travels as one carry (bench/gpu_carry.py):
    [ -d /tmp/site/ray ] || python3 bench/gpu_carry.py install; export PYTHONPATH=/tmp/site:$PYTHONPATH
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
for _p in (ROOT, BENCH):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))


# ---- the call ------------------------------------------------------------------------------------------

def parser(doc: str, bench: str, deadline: float | None, *, cpu_help: str = "tiny shapes on CPU (CI smoke)",
           sections: tuple | None = None, sections_default: str | None = None, section: bool = True,
           results_dir: bool = True, merge: str | None = None,
           deadline_help: str = "seconds for the whole call") -> argparse.ArgumentParser:
    """The flags every scenario shares: --cpu, --sections, --section (one section, in this process), --work,
    --out, --results-dir, --deadline and, where the scenario merges calls, --merge."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help=cpu_help)
    if sections is not None:
        ap.add_argument("--sections", default=sections_default, help=f"comma list of {sections}")
    if section:
        ap.add_argument("--section", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--work", default=None, help="scratch dir (model, checkpoints)")
    ap.add_argument("--out", default=os.environ.get("OUT") or f"/tmp/{bench}_out")
    if results_dir:
        ap.add_argument("--results-dir", default=None, help="also copy the summary JSON here (e.g. bench/results)")
    ap.add_argument("--deadline", type=float, default=deadline, help=deadline_help)
    if merge:
        ap.add_argument("--merge", nargs="+", default=None, help=merge)
    return ap


def places(a, bench: str, work_stem: str | None = None) -> tuple[Path, Path]:
    """OUT and the work dir (default /tmp/<work_stem or bench_work>, _cpu in CPU mode), both made."""
    out = Path(a.out)
    work = Path(a.work or (f"/tmp/{work_stem or bench + '_work'}" + ("_cpu" if a.cpu else "")))
    for d in (out, work):
        d.mkdir(parents=True, exist_ok=True)
    return out, work


def start(a, bench: str, work_stem: str | None = None) -> tuple[Path, Path]:
    """OUT and the work dir made, the environment prepared (`prepare_env`). On a GPU a scenario still running 15 s past
    its --deadline prints every thread's stack to stderr (a GPU call cut by its limit then still says where it was: a
    deadline is checked only between a scenario's parts)."""
    out, work = places(a, bench, work_stem)
    prepare_env()
    if getattr(a, "deadline", None) and not getattr(a, "cpu", False) and not getattr(a, "merge", None):
        import faulthandler  # a GPU call's process (CPU smokes and merges run in pytest's too, its stderr captured)
        try:
            faulthandler.dump_traceback_later(a.deadline + 15, exit=False)
        except (OSError, ValueError):  # io.UnsupportedOperation: a stderr without a file descriptor
            pass
    return out, work


def clear_results(out: Path) -> None:
    """A new call's results start empty (what an earlier call left in OUT is not this call's)."""
    (out / "results.jsonl").unlink(missing_ok=True)


def prepare_env() -> None:
    """Offline, quiet tokenizers, and this repo importable by section processes."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


def sections_of(a, default, known=None) -> list[str]:
    """--sections, else `default`; with `known`, a name not among them ends the call in one line."""
    names = [x for x in (a.sections.split(",") if a.sections else default) if x]
    if unknown := [x for x in names if known is not None and x not in known]:
        raise SystemExit(f"--sections: no section {', '.join(unknown)} in this bench (its sections: {', '.join(known)}; "
                         f"retired ones: bench/README.md)")
    return names


def section_budget(a) -> float:
    """In a section's process: one CPU thread in CPU mode; the seconds its caller left it (SECTION_BUDGET_S)."""
    if a.cpu:
        import torch
        torch.set_num_threads(1)
    return float(os.environ.get("SECTION_BUDGET_S", a.deadline))


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---- sections under deadlines --------------------------------------------------------------------------

def append_result(out: Path, rec: dict) -> None:
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(rec, default=str) + "\n")


def run_section(name: str, S, W: Path, out: Path, fn) -> dict:
    """Run one section (fn(S, W)), append its result line to OUT/results.jsonl."""
    t0 = time.time()
    try:
        r = fn(S, W)
        r.setdefault("status", "ok")  # a section that measured up to a failure says FAILED itself
    except Exception as e:  # noqa: BLE001 - one section's failure is recorded, the rest still run
        traceback.print_exc()
        r = {"name": name, "status": "FAILED", "error": f"{type(e).__name__}: {e}"[:2000]}
    r["section_s"] = round(time.time() - t0, 1)
    append_result(out, r)
    print("RESULT", json.dumps(r, default=str), flush=True)
    return r


def section_exit(r: dict) -> int:
    return 0 if r["status"] == "ok" else 1


def read_results(out: Path) -> dict:
    res = {}
    if (out / "results.jsonl").exists():
        for line in open(out / "results.jsonl"):
            try:
                r = json.loads(line)
                res[r["name"]] = r
            except Exception:  # noqa: BLE001
                pass
    return res


def run_sections_in_processes(script: Path, sections: list[str], W: Path, out: Path, deadline: float,
                              max_s: dict, min_s: dict | None = None, extra_args: tuple = (), env_of=None) -> None:
    """Each section as `script --section NAME` in its own process under what is left of `deadline` (a
    crash or a hang costs only that section); a section that wrote no result is recorded as FAILED, one
    with too little time left as SKIPPED. Output goes to out/log.txt; `env_of(name)`: a section's environment."""
    t_start = time.time()
    for name in sections:
        left = deadline - (time.time() - t_start)
        limit = int(min(max_s.get(name, 120), left))
        if limit < max(20, (min_s or {}).get(name, 0)):
            append_result(out, {"name": name, "status": "SKIPPED", "error": "no time left in this run"})
            continue
        print(f"=== {name} (limit {limit}s) at {time.time() - t_start:.0f}s", flush=True)
        cmd = [sys.executable, str(Path(script).resolve()), "--section", name, "--work", str(W), "--out", str(out),
               *extra_args]
        with open(out / "log.txt", "a") as log:
            log.write(f"\n===== {name} =====\n")
            log.flush()
            try:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=limit,
                                    env=env_of(name) if env_of else None, start_new_session=True).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        if name not in read_results(out):
            append_result(out, {"name": name, "status": "FAILED", "error": f"section process ended with {rc} (see log.txt)"})
        print(f"=== {name} rc={rc} at {time.time() - t_start:.0f}s", flush=True)


def run_in_turn(script: Path, sections: list[str], W: Path, out: Path, deadline: float, max_s: dict,
                extra_args: tuple = (), stop_at_failure: bool = False) -> None:
    """The sections one after another, each in its own process, told its budget (SECTION_BUDGET_S: its limit or
    what is left of the call); with stop_at_failure a section that failed ends the call (the later build on it)."""
    t_start = time.time()
    for name in sections:
        left = deadline - (time.time() - t_start)
        os.environ["SECTION_BUDGET_S"] = str(int(min(max_s[name], left)))
        run_sections_in_processes(script, [name], W, out, left, max_s, extra_args=extra_args)
        if stop_at_failure and read_results(out).get(name, {}).get("status") != "ok":
            break


def set_args(sets) -> tuple:
    return tuple(x for s in sets for x in ("--set", s))


# ---- results and summaries -----------------------------------------------------------------------------

def merge_results(dirs: list[str], keep: str = "last") -> dict:
    """The sections of several calls' OUT dirs. keep: "last" (a later call's section replaces an earlier one's),
    "ok" (a later one replaces it only where it is ok), "both" (a name met again is kept as name@folder)."""
    res: dict = {}
    for d in dirs:
        for name, r in read_results(Path(d)).items():
            if keep == "both":
                res[name if name not in res else f"{name}@{Path(d).name}"] = r
            elif keep == "last" or r.get("status") == "ok" or name not in res:
                res[name] = r
    return res


def merged_env(dirs: list[str], bench: str) -> dict | None:
    """The machine the merged calls ran on (the first call's summary that says), not the one merging them."""
    for d in dirs:
        p = Path(d) / f"{bench}.json"
        if p.exists() and (env := json.loads(p.read_text()).get("env")):
            return env
    return None


def summary_head(bench: str, info: dict) -> dict:
    return {"benchmark": bench, "date": utc_now(), "device": info.get("gpu", "cpu"), "env": info}


def save_summary(summary: dict, out: Path, bench: str, results_dir: str | None, cpu: bool, name: str | None = None) -> None:
    """<out>/<bench>.json, and with results_dir a copy named by device and date, or `name` (the CPU smoke: one
    fixed name)."""
    text = json.dumps(summary, indent=1, default=str)
    (out / f"{bench}.json").write_text(text)
    if results_dir:
        dev = summary["device"].replace(" ", "_")
        name = name or (f"{bench}_{dev}_{summary['date'][:10]}.json" if not cpu else f"{bench}_cpu_smoke.json")
        Path(results_dir).mkdir(parents=True, exist_ok=True)
        (Path(results_dir) / name).write_text(text)


def run_into(summary: dict, run, t_start: float) -> None:
    """summary["result"] = run(), or the error that stopped it (what was measured is lost, the reason is kept);
    summary["total_s"] since t_start."""
    try:
        summary["result"] = run()
    except Exception as e:  # noqa: BLE001
        import traceback
        traceback.print_exc()
        summary["error"] = f"{type(e).__name__}: {e}"[:2000]
    summary["total_s"] = round(time.time() - t_start, 1)


def exit_code(summary: dict, cpu: bool) -> int:
    """A failed section fails the CPU smoke; on a GPU the summary says which failed and why."""
    return 1 if cpu and any(r.get("status") != "ok" for r in summary["sections"].values()) else 0


def finish(summary: dict, out: Path, bench: str, results_dir: str | None, cpu: bool, print_table) -> int:
    save_summary(summary, out, bench, results_dir, cpu)
    print_table(summary)
    return exit_code(summary, cpu)


# ---- printing ------------------------------------------------------------------------------------------

def failed_rows(sections: dict, width: int = 200, label: str = "{name} {status}") -> list[tuple[str, str]]:
    return [(label.format(name=name, status=sec.get("status")), str(sec.get("error", ""))[:width])
            for name, sec in sections.items() if sec.get("status") != "ok"]


def print_pairs(rows: list[tuple]) -> None:
    width = max(len(r[0]) for r in rows)
    for k, v in rows:
        print(f"{k.ljust(width)}  {v}")


def print_columns(rows: list[tuple]) -> None:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(str(x).ljust(w) for x, w in zip(r, widths)))


# ---- machine facts -------------------------------------------------------------------------------------

def env_info(S) -> dict:
    import platform

    import torch
    info = {"python": platform.python_version(), "torch": torch.__version__, "mode": S["device"]}
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except Exception:  # noqa: BLE001
        pass
    try:
        import megatron.core
        info["megatron_core"] = getattr(megatron.core, "__version__", "?")
    except Exception:  # noqa: BLE001
        pass
    if S["device"] == "cuda" and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sms=p.multi_processor_count, mem_GiB=round(p.total_memory / 2**30, 1))
    return info


def gpu_count(S) -> dict:
    """{"gpus": n} on CUDA (what several-GPU scenarios add to env_info), else nothing."""
    if S["device"] != "cuda":
        return {}
    import torch
    return {"gpus": torch.cuda.device_count()}


def gpu_gib(S) -> float | None:
    """The whole card in GiB (None on CPU)."""
    if S["device"] != "cuda":
        return None
    import torch
    return round(torch.cuda.get_device_properties(0).total_memory / 2**30, 2)


def host_meminfo() -> dict[str, int]:
    out = {}
    for line in open("/proc/meminfo"):
        k, v = line.split(":", 1)
        out[k] = int(v.split()[0]) * 1024
    return out


def sync(S) -> None:
    if S["device"] == "cuda":
        import torch
        torch.cuda.synchronize()


def timed(S, fn) -> tuple[float, object]:
    """fn's seconds between two device syncs (its queued work included), and what it returned."""
    sync(S)
    t0 = time.perf_counter()
    out = fn()
    sync(S)
    return time.perf_counter() - t0, out


def reset_peak(S) -> None:
    if S["device"] == "cuda":
        import torch
        torch.cuda.reset_peak_memory_stats()


def peak_gib(S) -> float:
    if S["device"] != "cuda":
        return 0.0
    import torch
    return round(torch.cuda.max_memory_allocated() / 2**30, 2)


def peak_memory(S) -> dict:
    """The peak GPU memory since the last reset: allocated and reserved (the CUDA context not counted)."""
    if S["device"] != "cuda":
        return {"peak_allocated_GiB": 0.0, "peak_reserved_GiB": 0.0}
    import torch
    return {"peak_allocated_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "peak_reserved_GiB": round(torch.cuda.max_memory_reserved() / 2**30, 2)}


class Meter:
    """Allocator statistics on CUDA; None everywhere on CPU (there the run only checks the code paths)."""

    def __init__(self, device: str):
        import torch
        self.cuda = device == "cuda"
        self.torch = torch

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def allocated(self):
        return self.torch.cuda.memory_allocated() if self.cuda else None

    def reserved(self):
        return self.torch.cuda.memory_reserved() if self.cuda else None

    def peak(self):
        return self.torch.cuda.max_memory_allocated() if self.cuda else None

    def peak_reserved(self):
        return self.torch.cuda.max_memory_reserved() if self.cuda else None

    def reset(self):
        if self.cuda:
            self.sync()
            self.torch.cuda.reset_peak_memory_stats()

    def free_total(self):
        return self.torch.cuda.mem_get_info() if self.cuda else (None, None)

    def now(self) -> dict:
        """Allocated and reserved bytes, after the device's queued work ({} on CPU)."""
        if not self.cuda:
            return {}
        self.sync()
        return {"allocated": self.allocated(), "reserved": self.reserved()}

    def peaks(self) -> dict:
        """The peaks since the last reset ({} on CPU)."""
        if not self.cuda:
            return {}
        self.sync()
        return {"peak": self.peak(), "peak_reserved": self.peak_reserved()}

    def cleanup(self):
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()


_PROBE = ("import json, torch; n = torch.cuda.device_count(); print(json.dumps({'uuids': [str(torch.cuda."
          "get_device_properties(i).uuid) for i in range(n)], 'names': [torch.cuda.get_device_name(i) for i in "
          "range(n)], 'used_GiB': [round((lambda f, t: (t - f) / 2**30)(*torch.cuda.mem_get_info(i)), 2) "
          "for i in range(n)]}))")


def _probe() -> dict | None:
    """The GPUs as a fresh process sees them (without nvidia-smi): this process makes no CUDA context."""
    r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True)
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def _gpu_field(smi_field: str, probe_key: str) -> list[str]:
    """One field per GPU, by nvidia-smi or else a fresh process (no CUDA context here); ["cpu"] without GPUs."""
    if shutil.which("nvidia-smi") is not None:
        r = subprocess.run(["nvidia-smi", f"--query-gpu={smi_field}", "--format=csv,noheader"], capture_output=True,
                           text=True)
        return [line.strip() for line in r.stdout.splitlines() if line.strip()] or ["cpu"]
    import importlib.util
    if importlib.util.find_spec("torch") is None:
        return ["cpu"]
    return (_probe() or {}).get(probe_key) or ["cpu"]


def gpu_ids() -> list[str]:
    """This machine's GPUs by UUID, found without a CUDA context in this process, so that `gpu_apps` lists
    only what the runs left; ["cpu"] without GPUs."""
    return _gpu_field("uuid", "uuids")


def gpu_models() -> list[str]:
    """This machine's GPU models (their names), what a reference carried from another machine must match."""
    return _gpu_field("name", "names")


def torch_version() -> str:
    import torch
    return torch.__version__


def gpu_apps() -> list[str] | None:
    """What holds GPU memory after a run: nvidia-smi's compute apps (expected: none); without nvidia-smi,
    the memory in use per GPU as a fresh process sees it (its own context included, ~0.5 GiB); None on CPU."""
    if gpu_ids() == ["cpu"]:
        return None
    if shutil.which("nvidia-smi") is None:
        probe = _probe() or {}
        return [f"GPU {i}: {u} GiB in use, seen by a fresh process" for i, u in enumerate(probe.get("used_GiB", []))]
    r = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader"],
                       capture_output=True, text=True)
    return [line.strip() for line in r.stdout.splitlines() if line.strip()]


# ---- tensors -------------------------------------------------------------------------------------------

def checkpoint_tensors(path: str | Path) -> dict:
    """Every tensor of a torch_dist checkpoint (model and optimizer), read without megatron, in memory."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    try:
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    except ImportError:  # another torch: through a file, as torch's own converter does
        import tempfile

        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        with tempfile.TemporaryDirectory() as d:
            dcp_to_torch_save(str(Path(path) / "model"), f"{d}/all.pt")
            state = torch.load(f"{d}/all.pt", weights_only=False)
    else:
        state: dict = {}
        _load_state_dict(state, storage_reader=FileSystemReader(str(Path(path) / "model")),
                         planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return {k: v for k, v in state.items() if torch.is_tensor(v)}


def tensor_fingerprints(tensors: dict) -> dict:
    """Each tensor's sha256 over its bytes: equal bits, equal digest (what a reference carries to another machine)."""
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    import torch

    def digest(t) -> str:  # hashlib lets go of the GIL on large buffers: the tensors in parallel
        return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
    with ThreadPoolExecutor(max_workers=8) as pool:
        return dict(zip(tensors, pool.map(digest, tensors.values())))


def compare_fingerprints(a: dict, b: dict) -> dict:
    """compare_tensors by digest: which tensors differ, not by how much (their values stayed on the other machine)."""
    differ = sorted(k for k in a.keys() & b.keys() if a[k] != b[k])
    return {"same_keys": a.keys() == b.keys(), "tensors": len(a), "bitwise_equal": len(a.keys() & b.keys()) - len(differ),
            "differ": [{"tensor": k, "max_abs_delta": None} for k in differ[:8]], "bitwise": a.keys() == b.keys() and not differ,
            "max_abs_delta": None, "differ_count": len(differ), "by": "sha256"}


def compare_tensors(a: dict, b: dict) -> dict:
    """Bitwise equal, or max |a - b| per tensor: totals for the model's weights and the optimizer's state."""
    import torch
    out = {"same_keys": a.keys() == b.keys(), "tensors": len(a), "bitwise_equal": 0, "differ": []}
    groups = {"model": 0.0, "optimizer": 0.0}
    for k in sorted(a.keys() & b.keys()):
        x, y = a[k], b[k]
        if x.shape == y.shape and torch.equal(x, y):
            out["bitwise_equal"] += 1
            continue
        d = float((x.double() - y.double()).abs().max()) if x.shape == y.shape else float("inf")
        scale = float(y.double().abs().max()) if y.numel() else 0.0
        out["differ"].append({"tensor": k, "max_abs_delta": d, "ref_max_abs": scale})
        g = "optimizer" if "optimizer" in k else "model"
        groups[g] = max(groups[g], d)
    out["bitwise"] = out["same_keys"] and not out["differ"]
    out["max_abs_delta"] = groups
    out["differ_count"] = len(out["differ"])
    out["differ"] = sorted(out["differ"], key=lambda r: -r["max_abs_delta"])[:8]  # the worst, not all
    return out


# ---- what a run left -----------------------------------------------------------------------------------

ROLLOUT_KEYS = ("rollout", "step_time_s", "generate_time_s", "reward_time_s", "train_time_s", "weight_sync_s",
                "checkpoint_s", "rollout_tok_s", "train_tok_s", "train_tokens", "response_len_mean", "reward_mean",
                "train_rollout_logp_absdiff")


def rollout_rows(rd: Path) -> list[dict]:
    """Per rollout, as the run's checkpoints recorded it (trainer_state.json of each chunk)."""
    rows = []
    for ck in sorted((rd / "checkpoints").glob("rollout_*"), key=lambda p: int(p.name.split("_")[1])):
        state = ck / "trainer_state.json"
        if state.exists():
            for m in json.loads(state.read_text()).get("metrics", []):
                rows.append({k: (round(m[k], 4) if isinstance(m[k], float) else m[k]) for k in ROLLOUT_KEYS if k in m})
    return rows


def prefect_task_times(prefect_home: Path) -> list[dict]:
    """Every task run of the flow as Prefect's API recorded it: name, state, wall seconds, how many times it ran."""
    db = prefect_home / "prefect.db"
    if not db.exists():
        return []
    with sqlite3.connect(db) as con:
        rows = con.execute("SELECT name, state_name, start_time, end_time, run_count FROM task_run "
                           "ORDER BY start_time").fetchall()
    out = []
    for name, state, start, end, runs in rows:
        secs = None
        if start and end:
            secs = (datetime.datetime.fromisoformat(end) - datetime.datetime.fromisoformat(start)).total_seconds()
        out.append({"task": name, "state": state, "s": None if secs is None else round(secs, 2), "run_count": runs})
    return out


def model_versions(client, model: str) -> list[tuple]:
    """The registered versions of `model` as the MLflow store serves them, by version: (version, its source's path)."""
    found = [(v, v.source[len("file://"):] if v.source.startswith("file://") else v.source)
             for v in client.search_model_versions(f"name = '{model}'")]
    return sorted(found, key=lambda vs: int(vs[0].version))


# ---- a setup's model, tokenizer and prompts; the train stage over them ---------------------------------

def fresh_setup(W: Path) -> dict:
    """W's setup folders (tok, hf, td, data) emptied and the tiny tokenizer made in W/tok; what it says of itself."""
    from runtime.models.tiny import build_tiny_qwen3
    for d in ("tok", "hf", "td", "data"):
        shutil.rmtree(W / d, ignore_errors=True)
    return build_tiny_qwen3(W / "tok")


def copy_tokenizer(W: Path) -> None:
    """The tiny tokenizer beside the HF model (W/hf), as a model directory holds its own."""
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (W / "tok" / f).exists():
            shutil.copyfile(W / "tok" / f, W / "hf" / f)


def word_rows(tok, rng, n: int, prompt_len: int, words: int, label_offset: int = 0) -> list[dict]:
    """n prompts of `words` random words from the tiny tokenizer's list, cut to prompt_len tokens; label i % 10."""
    from runtime.models.tiny import _WORDS
    rows = []
    for i in range(n):
        ids = tok(" ".join(rng.choice(_WORDS) for _ in range(words)))["input_ids"][:prompt_len]
        rows.append({"prompt": tok.decode(ids), "label": str((i + label_offset) % 10)})
    return rows



def write_prompts(W: Path, stem: str, rows: list[dict], tok, max_prompt_len: int) -> dict:
    """rows as W/data/<stem>.jsonl, prepared into W/data/<stem>.parquet (slime format); the prepare report."""
    from runtime.inputs.datasets import prepare_dataset
    (W / "data").mkdir(parents=True, exist_ok=True)
    with open(W / "data" / f"{stem}.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return prepare_dataset(str(W / "data" / f"{stem}.jsonl"), str(W / "data" / f"{stem}.parquet"), fmt="slime",
                           tokenizer=tok, apply_chat_template=False, max_prompt_len=max_prompt_len)


def run_dir_over(root: Path, run_id: str, inputs: tuple[Path, Path, Path]):
    """A fresh run directory whose model (HF, torch_dist) and train data are links to what setup built:
    the train stage then skips fetch, convert and prepare."""
    from runtime.run.directory import RunDir
    shutil.rmtree(root, ignore_errors=True)
    rd = RunDir(str(root), run_id)
    for link, target in zip((rd.hf_model, rd.torch_dist, rd.train_data), inputs):
        Path(link).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, link)
    return rd


def setup_inputs(W: Path) -> tuple[Path, Path, Path]:
    """What a setup section built in W: the HF model, its torch_dist copy, the prepared prompts."""
    return W / "hf", W / "td", W / "data" / "prompts.parquet"


def samples_batch(samples, advantages: list[float] | None = None):
    """The engine's samples as a TrainBatch (every response token counted; advantages 0 unless given): what the
    trainer scores against the engine's own log-probs."""
    from runtime.trainer.batch import TrainBatch
    return TrainBatch(tokens=[list(s.prompt_ids) + list(s.response_ids) for s in samples],
                      prompt_lens=[len(s.prompt_ids) for s in samples],
                      advantages=list(advantages) if advantages is not None else [0.0] * len(samples),
                      loss_masks=[[1] * len(s.response_ids) for s in samples],
                      rollout_logprobs=[list(s.response_logprobs) for s in samples])


@contextmanager
def engine_warm_up(sess, prompt_len: int):
    """The session's engine compiled and its first graphs captured on 16 short requests, inside the session's
    memory hand-off as a rollout generates (the trainer's state off the GPU, the KV pool in: beside the trainer's
    state the pool need not fit, and on 2 x H100 GLM-Z1-9B's did not). Yields what the hand-off moved, before the
    pool is released again."""
    from runtime.rollout.base import SampleRequest, SamplingParams
    warm = [SampleRequest(prompt_ids=list(range(3, 3 + prompt_len)), key=(1, 0, i, 0)) for i in range(16)]
    with sess.engine_turn() as moved:
        sess.engine.generate(warm, SamplingParams(temperature=1.0, max_new_tokens=32))
        yield moved
