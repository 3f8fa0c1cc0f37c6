"""Training checkpoints: complete state written under a temp name, renamed, verified on load.

`checkpoints/rollout_<N>/` holds `model/` (torch_dist model + optimizer + LR schedule),
`trainer_state.json` (rollouts done, data cursor, metrics of the chunk) and `manifest.json` (every
file with its size and sha256), written last. `checkpoints/latest` names the newest complete one and
is replaced atomically after it. A checkpoint whose manifest does not match is skipped on load.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import storage
from .rundir import RunDir

log = logging.getLogger("grpoflow.checkpoint")
MANIFEST = "manifest.json"
STATE = "trainer_state.json"


@dataclass
class Checkpoint:
    rollout: int
    path: str
    state: dict


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _manifest(root: Path) -> dict:
    files = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            files[str(p.relative_to(root))] = {"size": p.stat().st_size, "sha256": _sha256(p)}
    return {"files": files}


def verify(path: str) -> str | None:
    """None when the checkpoint at `path` is complete and intact, else what is wrong."""
    root = Path(path)
    m = root / MANIFEST
    if not m.is_file():
        return "no manifest (incomplete write)"
    try:
        files = json.loads(m.read_text())["files"]
    except (ValueError, KeyError) as e:
        return f"unreadable manifest ({e})"
    for rel, meta in files.items():
        f = root / rel
        if not f.is_file():
            return f"missing {rel}"
        if f.stat().st_size != meta["size"]:
            return f"{rel} has {f.stat().st_size} bytes, manifest says {meta['size']}"
        if _sha256(f) != meta["sha256"]:
            return f"{rel} checksum mismatch"
    return None


def save(rd: RunDir, rollout: int, write_model: Callable[[str], None], state: dict, keep_last: int) -> str:
    """Write checkpoint `rollout_<rollout>` completely, then point `latest` at it, then prune."""
    base = Path(rd.checkpoints)
    base.mkdir(parents=True, exist_ok=True)
    final = base / f"rollout_{rollout}"
    tmp = base / f".rollout_{rollout}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write_model(str(tmp / "model"))
        storage.write_json_atomic(str(tmp / STATE), {**state, "rollout": rollout})
        storage.write_json_atomic(str(tmp / MANIFEST), _manifest(tmp))
        if final.exists():  # a stale or damaged copy of the same rollout
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    storage.write_json_atomic(rd.latest, {"rollout": rollout, "dir": final.name})
    prune(rd, keep_last)
    return str(final)


def _listed(rd: RunDir) -> list[int]:
    base = Path(rd.checkpoints)
    if not base.is_dir():
        return []
    return sorted((int(m.group(1)) for p in base.iterdir() if (m := re.fullmatch(r"rollout_(\d+)", p.name))),
                  reverse=True)


def prune(rd: RunDir, keep_last: int) -> None:
    latest = _latest_pointer(rd)
    for n in _listed(rd)[keep_last:]:
        if n != latest:
            shutil.rmtree(rd.checkpoint(n), ignore_errors=True)
    for p in Path(rd.checkpoints).glob(".rollout_*.tmp-*"):  # leftovers of a killed writer
        shutil.rmtree(p, ignore_errors=True)


def _latest_pointer(rd: RunDir) -> int | None:
    try:
        return int(storage.read_json(rd.latest)["rollout"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def latest(rd: RunDir) -> Checkpoint | None:
    """The newest intact checkpoint: `latest` if it verifies, else the newest older one that does."""
    pointed = _latest_pointer(rd)
    candidates = _listed(rd)
    if pointed is not None:
        candidates = [pointed] + [n for n in candidates if n < pointed]
    for n in candidates:
        path = rd.checkpoint(n)
        problem = verify(path)
        if problem is None:
            state = json.loads((Path(path) / STATE).read_text())
            return Checkpoint(rollout=n, path=path, state=state)
        log.warning("checkpoint %s is unusable (%s); falling back to an older one", path, problem)
    return None
