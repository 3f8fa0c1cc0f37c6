"""The last resort when the process cannot go on and cannot unwind (the main thread is blocked inside a
call that will never return, e.g. on a Ray cluster that is gone): run the registered clean-ups,
end this process's children, print one ``error:`` line and exit — before something else kills us
without any of that.
"""
from __future__ import annotations

import os
import threading
from typing import Callable

_cleanups: dict[int, Callable[[], None]] = {}
_lock = threading.Lock()
resume_hint: list[str] = []  # set by whoever knows how to continue (the run's lease)


def on_forced_exit(fn: Callable[[], None]) -> int:
    with _lock:
        key = id(fn)
        _cleanups[key] = fn
    return key


def forget(key: int) -> None:
    with _lock:
        _cleanups.pop(key, None)


def forced_exit(message: str, code: int = 3) -> None:
    with _lock:
        todo = list(_cleanups.values())
    hint = f"; {resume_hint[-1]}" if resume_hint else ""  # before the clean-ups (releasing the lease clears it)
    for fn in todo:
        try:
            fn()
        except Exception:  # noqa: BLE001 - best effort: the exit must happen
            pass
    _end_children()
    from runtime.run.run_log import error_context, terminal_err
    out = terminal_err()  # the terminal, also while the run's log holds stderr
    out.write(error_context() + f"error: {' '.join(message.split())}{hint}\n")
    out.flush()
    os._exit(code)


def _end_children(grace_s: float = 5.0) -> None:
    """Children of this process (an ephemeral Prefect server, trainer processes) would be orphaned."""
    try:
        import psutil
    except ImportError:
        return
    kids = psutil.Process().children(recursive=True)
    for p in kids:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(kids, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
