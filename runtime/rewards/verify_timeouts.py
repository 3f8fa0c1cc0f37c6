"""math-verify's own per-call timeouts, off unless a process turns them on.

They use SIGALRM, which only the main thread may set. The reward worker processes (`timeout.py`) turn
them on as a second bound under the caller's deadline; elsewhere they stay off, so grading in a process
has no wall-clock effect of its own.
"""
from __future__ import annotations

import threading

MATH_VERIFY_TIMEOUT_S = 5
_seconds: int | None = None


def set_math_verify_timeout(seconds: int | None) -> None:
    """Turn math-verify's own per-call timeouts on (seconds) or off (None) in this process."""
    global _seconds
    _seconds = seconds


def math_verify_timeout() -> int | None:
    """The timeout to give math-verify's calls here: None off the main thread (no SIGALRM there)."""
    return _seconds if threading.current_thread() is threading.main_thread() else None
