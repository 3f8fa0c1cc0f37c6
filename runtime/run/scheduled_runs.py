"""The runs of one schedule, read from `<storage.root>/runs/`: which run comes next, and does it resume?

A scheduled deployment names its runs `<prefix>-<UTC timestamp>` (`tiny-nightly-20261122T030000Z`).
When it fires again it looks at the *previous* run of the same prefix: if that run is unfinished
(killed, failed, or still short of `train.num_rollout`) it is resumed under its own run id; otherwise
a new run id is made. Nothing here asks an orchestrator: the run directories are the record.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from datetime import datetime, timezone

import yaml

from runtime import storage
from runtime.errors import ConfigError, UserError
from runtime.run.directory import RunDir

log = logging.getLogger(__name__)

STAMP = "%Y%m%dT%H%M%SZ"
_STAMP_RE = r"\d{8}T\d{6}Z(?:-\d+)?"  # a second run in the same second gets `-2`, `-3`, ...
_PREFIX_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class NextRun:
    run_id: str
    resume: bool  # True: an unfinished earlier run, continue it from its frozen config
    reason: str   # one line for the log


def check_prefix(prefix: str) -> str:
    if not _PREFIX_RE.fullmatch(prefix or ""):
        raise ConfigError(f"run prefix {prefix!r}: use letters, digits, '.', '_' and '-' (it starts every run id)")
    return prefix


def safe_prefix(name: str) -> str:
    """A run-id prefix made from a free-form name (a deployment name may hold spaces or slashes)."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-._")
    return cleaned or "grpo"


def _stamp_key(run_id: str, prefix: str) -> tuple[str, int]:
    rest = run_id[len(prefix) + 1:]
    stamp, _, n = rest.partition("-")
    return stamp, int(n or 1)


def runs_of(root: str, prefix: str) -> list[str]:
    """Run ids under `<root>/runs/` named `<prefix>-<timestamp>[-n]` that hold a frozen config, oldest first."""
    check_prefix(prefix)
    pattern = re.compile(re.escape(prefix) + "-" + _STAMP_RE)
    base = storage.join(root, "runs")
    fs, path = storage.fs_for(base)
    try:
        entries = fs.ls(path, detail=False)
    except FileNotFoundError:
        return []
    ids = [str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries]
    ids = [i for i in ids if pattern.fullmatch(i) and storage.exists(RunDir(root, i).config)]
    return sorted(ids, key=lambda i: _stamp_key(i, prefix))


def new_run_id(root: str, prefix: str, now: datetime | None = None) -> str:
    """`<prefix>-<UTC timestamp>`, with `-2`, `-3`, ... when that directory exists already."""
    check_prefix(prefix)
    stamp = (now or datetime.now(timezone.utc)).astimezone(timezone.utc).strftime(STAMP)
    run_id, n = f"{prefix}-{stamp}", 1
    while storage.exists(RunDir(root, run_id).path):
        n += 1
        run_id = f"{prefix}-{stamp}-{n}"
    return run_id


def run_state(rd: RunDir) -> str:
    """'finished', 'unfinished', or 'unreadable: <why>' for one run directory."""
    from runtime.run.frozen_config import finished, frozen_config
    try:
        cfg = frozen_config(rd)
    except UserError as err:
        return f"unreadable: {err}"
    return "finished" if finished(cfg, rd) else "unfinished"


def _frozen_name(rd: RunDir) -> str | None:
    from runtime.config import load_yaml
    try:
        tree = load_yaml(storage.read_text(rd.config)) or {}
    except (OSError, yaml.YAMLError):
        return None
    return tree.get("name") if isinstance(tree, dict) else None


def next_run(root: str, prefix: str, *, name: str | None = None, resume_unfinished: bool = True,
             now: datetime | None = None) -> NextRun:
    """The run a scheduled firing should work on: the previous run of `prefix` (whose frozen config is
    named `name`, when given) if it is unfinished and `resume_unfinished`, else a new
    `<prefix>-<timestamp>` run id."""
    previous = runs_of(root, prefix)
    if name is not None:
        previous = [i for i in previous if _frozen_name(RunDir(root, i)) == name]
    if previous and resume_unfinished:
        last = previous[-1]
        state = run_state(RunDir(root, last))
        if state == "unfinished":
            return NextRun(last, True, f"previous run {last} is unfinished: resuming it")
        if state.startswith("unreadable"):
            log.warning("previous run %s cannot be resumed (%s); starting a new run", last, state)
        why = f"previous run {last} is {state.split(':')[0]}"
    elif previous:
        why = f"resume_unfinished is off (previous run {previous[-1]} is not looked at)"
    else:
        why = f"no earlier run named {prefix}-<timestamp> under {storage.join(root, 'runs')}"
    run_id = new_run_id(root, prefix, now)
    return NextRun(run_id, False, f"{why}: starting new run {run_id}")
