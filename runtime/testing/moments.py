"""Named moments of a run, where a test can kill the process or copy the storage root.

`moment("checkpoint-manifest-written")` does nothing unless the environment arms it:

- ``GRPOFLOW_TEST_KILL_AT=<name>`` or ``<name>#<k>``: SIGKILL this process group the first (k-th) time
  ``<name>`` is reached in this process — a node dying at exactly that point, with no clean-up.
- ``GRPOFLOW_TEST_SNAPSHOT_AT=<name>[#<k>][,...]`` with ``GRPOFLOW_TEST_SNAPSHOT_ROOT`` (the storage root)
  and ``GRPOFLOW_TEST_SNAPSHOT_DIR``: copy the root to ``<dir>/<name>`` when ``<name>`` is reached, so
  a test can restart a run from that boundary without re-running what came before.

- ``GRPOFLOW_TEST_PAUSE_AT=<name>[#<k>][,...]`` with ``GRPOFLOW_TEST_PAUSE_DIR``: on reaching one, write
  ``<dir>/<label>.reached`` (this process's pid and Ray node id; of the first to reach it, where several
  processes do) and wait until ``<dir>/<label>.go`` exists — a test does something to the cluster at exactly
  that point (removes this node), then lets go.

A moment reached many times within one call (a decode chunk) passes its place there as ``index``; it is
then named ``<name>-<index>`` (``decode-chunk-8``: the 8th decode chunk of a generate call), the name made
only when armed. ``decode-chunk-8#3`` is then the 3rd call in this process to reach its 8th chunk.

A pure test/debug switch: it never changes results, and an unarmed moment costs three environment lookups.
"""
from __future__ import annotations

import os
import shutil
import signal
from collections import Counter

_hits: Counter = Counter()


def moment(name: str, index: int | None = None) -> None:
    kill_at = os.environ.get("GRPOFLOW_TEST_KILL_AT")
    snap_at = os.environ.get("GRPOFLOW_TEST_SNAPSHOT_AT")
    pause_at = os.environ.get("GRPOFLOW_TEST_PAUSE_AT")
    if not kill_at and not snap_at and not pause_at:
        return
    if index is not None:
        name = f"{name}-{index}"
    _hits[name] += 1
    if pause_at:
        for want in pause_at.split(","):
            if want in (name if _hits[name] == 1 else None, f"{name}#{_hits[name]}"):
                _pause(want)
    if snap_at:
        wanted = snap_at.split(",")
        label = f"{name}#{_hits[name]}"
        if label in wanted or (_hits[name] == 1 and name in wanted):
            _snapshot(label if label in wanted else name)
    if kill_at:
        want, _, k = kill_at.partition("#")
        if want == name and _hits[name] == int(k or 1):
            os.killpg(os.getpgrp(), signal.SIGKILL)


def _snapshot(name: str) -> None:
    root, dest = os.environ["GRPOFLOW_TEST_SNAPSHOT_ROOT"], os.environ["GRPOFLOW_TEST_SNAPSHOT_DIR"]
    target = os.path.join(dest, name)
    shutil.rmtree(target, ignore_errors=True)
    # The lease names this (live) process: a copy restarted later must not see it as held.
    shutil.copytree(root, target, ignore=shutil.ignore_patterns("lease.json"))


def _pause(label: str) -> None:
    import json
    import sys
    import tempfile
    import time
    where = os.environ["GRPOFLOW_TEST_PAUSE_DIR"]
    node = None
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        node = ray.get_runtime_context().get_node_id()
    safe = label.replace("/", "_").replace(":", "_")
    if os.path.exists(os.path.join(where, f"{safe}.go")):
        return  # paused once already (another process: a rebuilt actor counts its hits afresh)
    # Colocated engines reach the same moment together: each writes a file of its own, and the first to
    # link it under the shared name is the one reported; the others wait for the same `.go`.
    fd, tmp = tempfile.mkstemp(dir=where, prefix=f"{safe}.", suffix=".reached.tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"pid": os.getpid(), "node_id": node}, f)
        try:
            os.link(tmp, os.path.join(where, f"{safe}.reached"))
        except FileExistsError:
            pass
    finally:
        os.unlink(tmp)
    while not os.path.exists(os.path.join(where, f"{safe}.go")):
        time.sleep(0.05)  # waiting for the test's event, not for time to pass
