"""Waiting on an event a test's subprocess makes: a server that answers, a pause marker that appears.

Both are checked every 0.1 s until they happen, until the process that should make them has died (a failure,
said at once with its log), or until a generous deadline: a test waits for the event, never for time to pass."""
from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Callable

POLL_S = 0.1


def _until(happened: Callable[[], bool], proc: subprocess.Popen | None, timeout_s: float, what: str,
           log: Path | None) -> None:
    deadline = time.monotonic() + timeout_s
    tail = (lambda: log.read_text()[-3000:]) if log is not None else (lambda: "")
    while not happened():
        assert proc is None or proc.poll() is None, f"the process exited ({proc.returncode}) before {what}:\n{tail()}"
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s\n{tail()}"
        time.sleep(POLL_S)


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout_s: float = 180, log: Path | None = None) -> None:
    """Until GET `url` answers 200."""
    def answers() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                return reply.status == 200
        except OSError:
            return False
    _until(answers, proc, timeout_s, f"{url} answered", log)


def wait_reached(marker: Path, proc: subprocess.Popen | None = None, timeout_s: float = 900,
                 log: Path | None = None) -> dict:
    """Until a paused process has written `marker` (runtime/testing/moments.py); returns what it wrote."""
    _until(marker.exists, proc, timeout_s, f"{marker.name} was reached", log)
    return json.loads(marker.read_text())
