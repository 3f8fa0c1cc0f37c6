"""`grpoflow runs`: every run under a storage root and where it stands, read from its run directory.

A run is *running* while a live process holds its lease, *finished* when its latest checkpoint is at
``train.num_rollout`` and every eval point has its result, and otherwise *stopped* — at the first data
stage without its marker, at the rollout of its latest checkpoint, or at a missing eval. Nothing here
asks Prefect or MLflow: the run directory is the record (local or S3 alike).
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass

import yaml

from runtime import storage
from runtime.run.directory import RunDir, resume_command

DATA_STAGES = ("fetch", "convert", "prepare")


@dataclass(frozen=True)
class RunStatus:
    run_id: str
    config_name: str
    state: str        # finished | running | stopped | unreadable
    detail: str       # who holds the lease / where it stopped / what is unreadable
    checkpoint: int | None  # rollouts of the latest complete checkpoint
    best_eval: str    # "copy avg@4 0.625 at 40" or "-"
    resume: str       # the command that continues it, or "-"

    def state_text(self) -> str:
        return f"{self.state} ({self.detail})" if self.detail else self.state


def run_ids(root: str) -> list[str]:
    """Names of the run directories under ``<root>/runs/``, sorted."""
    storage.check_no_link_loop(root, "--root")
    fs, path = storage.fs_for(storage.join(root, "runs"))
    with storage.s3_errors(root):
        try:
            entries = fs.ls(path, detail=True)
        except FileNotFoundError:
            return []
    names = [str(e["name"]).rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory"]
    return sorted(n for n in names if not n.startswith("."))


def _latest_rollout(rd: RunDir) -> int | None:
    """The rollout ``checkpoints/latest`` points at, when that checkpoint's manifest (written last) exists.
    The cheap check: ``grpoflow resume`` verifies every file before it trains from it."""
    try:
        n = int(storage.read_json(rd.latest)["rollout"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None
    return n if storage.exists(storage.join(rd.checkpoint(n), "manifest.json")) else None


def _evals(rd: RunDir) -> dict[int, dict]:
    """rollout -> {set: metrics} of every eval result in the run directory."""
    fs, path = storage.fs_for(rd.sub("eval"))
    with storage.s3_errors(rd.path):
        try:
            names = [str(n).rsplit("/", 1)[-1] for n in fs.ls(path, detail=False)]
        except FileNotFoundError:
            return {}
    out = {}
    for name in names:
        m = re.fullmatch(r"rollout_(\d+)\.json", name)
        if m:
            try:
                out[int(m.group(1))] = storage.read_json(rd.eval_result(int(m.group(1))))["sets"]
            except (ValueError, KeyError, FileNotFoundError):
                continue
    return out


def best_eval(evals: dict[int, dict], first_set: str | None, n_samples: int) -> str:
    """The best headline metric (avg@n of the first eval set) over the eval points, as one phrase."""
    key = f"avg@{n_samples}"
    scored = [(sets[first_set][key], rollout) for rollout, sets in evals.items()
              if first_set in sets and isinstance(sets[first_set].get(key), (int, float))]
    if not scored:
        return "-"
    value, rollout = max(scored, key=lambda vr: (vr[0], -vr[1]))  # a tie: the earlier point
    return f"{first_set} {key} {value:.3f} at {rollout}"


def run_status(root: str, run_id: str, *, lease_timeout_s: float | None = None) -> RunStatus:
    from runtime.config import config_from_dict, load_yaml
    from runtime.errors import UserError
    from runtime.run.lease import lease_holder

    rd = RunDir(root, run_id)
    holder, stale = lease_holder(rd, lease_timeout_s)
    running = holder is not None and stale is None
    try:
        from runtime.run.frozen_config import checked_body
        tree = load_yaml(checked_body(storage.read_text(rd.config), rd)) or {}
        cfg = config_from_dict(tree, rd.config)
    except FileNotFoundError:
        if running:
            return RunStatus(run_id, "-", "running", _holder_text(holder), None, "-", "-")
        from runtime.run.frozen_config import rollouts_beyond, start_again_command
        if rollouts_beyond(rd, -1):
            return RunStatus(run_id, "-", "stopped", "its frozen config is missing", _latest_rollout(rd), "-",
                             f"{resume_command(run_id, root)} --config FILE")
        return RunStatus(run_id, "-", "stopped", "before its config was frozen", None, "-",
                         start_again_command(rd, holder))
    except (UserError, yaml.YAMLError) as err:
        return RunStatus(run_id, "-", "unreadable", " ".join(str(err).split())[:160], _latest_rollout(rd), "-",
                         f"{resume_command(run_id, root)} --config FILE")
    total = cfg.train.num_rollout
    at = _latest_rollout(rd)
    evals = _evals(rd)
    best = best_eval(evals, next(iter(cfg.data.eval), None), cfg.eval.n_samples_per_prompt)
    progress = f"rollout {at or 0} of {total}"
    if running:
        return RunStatus(run_id, cfg.name, "running", f"{_holder_text(holder)}; checkpointed {progress}", at, best, "-")
    missing_stage = next((s for s in DATA_STAGES if not storage.exists(rd.stage_marker(s))), None)
    if missing_stage is not None:
        return RunStatus(run_id, cfg.name, "stopped", f"at stage {missing_stage}", at, best, resume_command(run_id, root))
    if at is None or at < total:
        return RunStatus(run_id, cfg.name, "stopped", f"at {progress}", at, best, resume_command(run_id, root))
    missing_eval = [n for n in cfg.eval_points() if n not in evals] if cfg.data.eval else []
    if missing_eval:
        return RunStatus(run_id, cfg.name, "stopped", f"at the eval after rollout {missing_eval[0]}", at, best,
                         resume_command(run_id, root))
    return RunStatus(run_id, cfg.name, "finished", f"{total} rollouts", at, best, "-")


def _holder_text(holder: dict) -> str:
    age = time.time() - float(holder.get("heartbeat", 0))
    return f"pid {holder.get('pid')} on {holder.get('host')}, heartbeat {age:.0f} s ago"


def list_runs(root: str, *, lease_timeout_s: float | None = None) -> list[RunStatus]:
    return [run_status(root, r, lease_timeout_s=lease_timeout_s) for r in run_ids(root)]


def format_runs(runs: list[RunStatus]) -> list[str]:
    """Aligned lines: a header, then one line per run."""
    head = ["RUN", "CONFIG", "STATE", "CHECKPOINT", "BEST EVAL", "RESUME"]
    rows = [[r.run_id, r.config_name, r.state_text(), "-" if r.checkpoint is None else f"rollout_{r.checkpoint}",
             r.best_eval, r.resume] for r in runs]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    return ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [head] + rows]


__all__ = ["RunStatus", "run_ids", "run_status", "list_runs", "format_runs", "best_eval"]
