"""OS errors that are the machine's state, not a bug in grpoflow or a mistake in the config: a full disk, a
path that is a symbolic-link loop. Found anywhere in an exception's chain, or in the text of an exception that
wrapped one on the way (a checkpoint writer's thread, a Ray worker: ``RuntimeError: Worker failure: [Errno 28]
No space left on device``), so that each is said in one line wherever it surfaces."""
from __future__ import annotations

import errno
import re

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_NAMED = DISK_FULL + (errno.ELOOP,)
_IN_TEXT = re.compile(r"\[Errno (\d+)\] ([^:'\"\n]+)(?:: '([^'\n]*)')?")


def os_cause(err: BaseException | None) -> OSError | None:
    """The full-disk or link-loop OSError behind ``err``: itself, one in its cause/context chain, or one named in
    the text of an exception that wrapped it (rebuilt with its errno, words and file name)."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in _NAMED:
            return err
        text = str(err)
        m = _IN_TEXT.search(text)
        if m and int(m.group(1)) in _NAMED:
            return OSError(int(m.group(1)), m.group(2).strip(), m.group(3))
        if "database or disk is full" in text:  # SQLite's SQLITE_FULL (an MLflow or Prefect store), no errno
            return OSError(errno.ENOSPC, "No space left on device (an SQLite store: database or disk is full)")
        err = err.__cause__ or err.__context__
    return None


def os_error_line(err: BaseException, where: str | None = None, resume: str | None = None) -> str | None:
    """One line for a full disk or a link loop behind ``err`` (None for anything else). ``where``: the storage
    root when the error names no file; ``resume``: the command that continues the run."""
    cause = os_cause(err)
    if cause is None:
        return None
    path = cause.filename or where
    at = f" at {path}" if path else ""
    if cause.errno in DISK_FULL:
        then = f"continue with `{resume}`" if resume else "run the command again"
        return (f"the disk is full ({cause.strerror or 'No space left on device'}){at}; free space there and {then} "
                f"- nothing already written is lost (every checkpoint and record is written whole or not at all)")
    return (f"{path or 'a path'} is a symbolic link loop ({cause.strerror or 'Too many levels of symbolic links'}); "
            f"point it (storage.root / --root) at a real directory")
