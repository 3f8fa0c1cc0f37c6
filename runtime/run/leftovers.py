"""Temp files and directories of a writer that was killed, removed when the next writer starts.

Every atomic write in a run directory goes through a temp name beside its target: ``.<name>.tmp-<hex>``
(directories: fetched model, converted checkpoint, checkpoints, exports), ``.<name>.old-<hex>`` (the
previous copy while a directory is replaced), ``.<name>.<random>.tmp`` (single files). A writer killed
in between leaves them; nothing ever reads them, so the next holder of the run's lease deletes them.
"""
from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

from runtime import storage
from runtime.run.directory import RunDir

log = logging.getLogger("grpoflow.leftovers")

_TEMP_NAME = re.compile(r"\..+\.(tmp-[0-9a-f]{8}|old-[0-9a-f]{8}|[A-Za-z0-9_]{8}\.tmp)")
_OWN = re.compile(r"\.lease\.json\..*\.tmp")  # our own lease's heartbeat may be writing one right now


def temp_leftovers(rd: RunDir) -> list[Path]:
    """Temp names under the run directory (a remote run directory has none: uploads are never renamed)."""
    if rd.remote or not Path(rd.path).is_dir():
        return []
    found = []
    for p in Path(rd.path).rglob(".*"):
        if _TEMP_NAME.fullmatch(p.name) and not _OWN.fullmatch(p.name):
            if not any(_TEMP_NAME.fullmatch(parent.name) for parent in p.relative_to(rd.path).parents if parent.name):
                found.append(p)
    return found


def remove_temp_leftovers(rd: RunDir) -> int:
    """Delete them; call only while holding the run's lease (no other writer can be mid-write)."""
    gone = temp_leftovers(rd)
    for p in gone:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    if gone:
        log.info("removed %d temp leftovers of a killed writer in %s", len(gone), storage.join(rd.path))
    return len(gone)
