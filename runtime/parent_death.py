"""A child process that dies with the process that started it (Linux's ``PR_SET_PDEATHSIG``).

A SIGKILLed driver runs no cleanup: what it started in a session of its own (an SGLang server) or through a
process pool would live on, holding its GPU memory, and the resumed run would find the card full. Elsewhere
than Linux nothing is armed and the owners' own shutdown paths are all there is.
"""
from __future__ import annotations

import ctypes
import os
import signal
from typing import Callable

_PR_SET_PDEATHSIG = 1
try:  # resolved here, not in a forked child: dlopen there could wait on a lock another thread held at the fork
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    _prctl = None


def die_with_parent(parent_pid: int) -> None:
    """Called in the child: SIGKILL when the parent ends; exit at once if it already has."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)


def popen_preexec() -> Callable[[], None]:
    """`preexec_fn` for subprocess.Popen. The signal comes when the *thread* that started the child ends, so
    start it from a thread that lives as long as the child should (a client's event-loop thread)."""
    parent = os.getpid()
    return lambda: die_with_parent(parent)
