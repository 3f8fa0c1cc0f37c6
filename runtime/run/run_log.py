"""A run's log file: what libraries say (MLflow, Prefect, Ray and its actors, torch.distributed, NCCL, Python
warnings) goes to ``runs/<id>/logs/run.log``; the terminal keeps what the run says to a person — the plan, the
live table, the closing summary, grpoflow's own warnings and the error line.

The redirection is at the file-descriptor level as well as Python's, because much of the chatter never passes
through Python's streams: NCCL and c10d write to fd 2 from C++, spawned trainer ranks and Ray's processes inherit
fds 1 and 2, and Ray's driver forwards its actors' output to ``sys.stdout`` / ``sys.stderr`` as they are at that
moment. Until the run directory is known to be the run's (its lease taken and its config frozen: a refused run
writes nothing there), the log is a temp file; :func:`settle` moves it into the run directory.
"""
from __future__ import annotations

import io
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import TextIO

from runtime.errors import UserError
from runtime.os_errors import os_error_line

# grpoflow's own loggers (named by module)
OWN_LOGGERS = ("runtime", "tasks", "flows", "cli", "deployments")
TAIL_LINES = 20
_FORMAT = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")

_active: "RunLog | None" = None


def terminal_out() -> TextIO:
    """Where the run's own output (the live table) goes: the terminal, however the streams are redirected."""
    return _active.term_out if _active is not None else sys.stdout


def terminal_err() -> TextIO:
    return _active.term_err if _active is not None else sys.stderr


def log_path(rd) -> Path:
    """The run's log file: ``runs/<id>/logs/run.log``; for a remote root, its place under the local state dir."""
    from runtime import storage
    uri = rd.sub("logs", "run.log")
    return storage.staged_path(uri, rd.state_dir) if rd.remote else Path(uri)


class TerminalHandler(logging.StreamHandler):
    """grpoflow's own log records on the terminal, also while a run log holds the process's streams."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = terminal_err()
        super().emit(record)

    def flush(self) -> None:
        self.stream = terminal_err()
        super().flush()


class _Forward(io.TextIOBase):
    """``sys.stdout`` / ``sys.stderr`` while a run log is active: writes go to the log file; whatever kept a
    reference to it (a library's handler made during the run) writes to the original stream after the run."""

    def __init__(self, original: TextIO):
        self.original = original

    def _target(self) -> TextIO:
        return _active.file if _active is not None else self.original

    def write(self, text: str) -> int:
        return self._target().write(text)

    def flush(self) -> None:
        self._target().flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._target().fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._target(), "encoding", "utf-8")


def _terminal_stream(stream: TextIO, fd: int) -> tuple[TextIO, bool]:
    """A stream to the terminal that survives fd ``fd`` being pointed at the log: a dup of it when ``stream``
    writes to it; else ``stream`` itself (a capture of its own, as under pytest). (stream, owned)"""
    try:
        if stream.fileno() == fd:
            stream.flush()
            return os.fdopen(os.dup(fd), "w", buffering=1, encoding=getattr(stream, "encoding", None) or "utf-8",
                             errors="replace"), True
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        pass
    return stream, False


class RunLog:
    """The process's output redirected into a run log while a run or resume runs (a context manager)."""

    def __init__(self, run_id: str, command: str, quiet: bool = True, level: str = "INFO"):
        self.run_id, self.command, self.quiet = run_id, command, quiet
        self.level = min(logging.INFO, logging.getLevelName(level))
        self.path: Path | None = None  # the settled log
        self._pending: Path | None = None  # the temp log until settled
        self._pending_size = 0

    # -- lifecycle -------------------------------------------------------------------------------------
    def __enter__(self) -> "RunLog":
        global _active
        fd, name = tempfile.mkstemp(prefix=f"grpoflow-{self.run_id}-", suffix=".log")
        os.close(fd)
        self._pending = Path(name)
        self.file = open(name, "a", buffering=1, encoding="utf-8", errors="replace")  # noqa: SIM115
        self.file.write(self._header())
        self._saved_levels = {n: logging.getLogger(n).level for n in OWN_LOGGERS}
        self._root_level = logging.root.level
        self._handler = logging.StreamHandler(self.file)
        self._handler.setFormatter(_FORMAT)
        self._handler.setLevel(self.level)
        if self.quiet:  # a library's own handler writes to fd 2, which is this file already
            self._handler.addFilter(_not_handled_on_the_way)
        logging.root.addHandler(self._handler)
        logging.root.setLevel(min(self._root_level or logging.WARNING, self.level))
        for n in OWN_LOGGERS:  # INFO into the file; the terminal handler keeps its own level
            logger = logging.getLogger(n)
            if logger.level > self.level or logger.level == logging.NOTSET:
                logger.setLevel(self.level)
        if self.quiet:
            self.term_out, self._own_out = _terminal_stream(sys.stdout, 1)
            self.term_err, self._own_err = _terminal_stream(sys.stderr, 2)
            self._saved_fds = (os.dup(1), os.dup(2))
            self._saved_sys = (sys.stdout, sys.stderr)
            os.dup2(self.file.fileno(), 1)
            os.dup2(self.file.fileno(), 2)
            sys.stdout, sys.stderr = _Forward(sys.stdout), _Forward(sys.stderr)
            logging.captureWarnings(True)
        else:
            self.term_out, self.term_err, self._own_out, self._own_err = sys.stdout, sys.stderr, False, False
        _active = self
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        global _active, _last_path
        self._restore()
        _active = None
        _last_path = self.path
        where = self.path or self._pending
        if self.path is not None and self._pending is not None:
            self._append_late_pending()
        # a mistake, Ctrl-C, or the machine's state said in one line (a full disk, a link loop: runtime/os_errors.py)
        # stays one line; anything else comes with where the log is and its tail
        failed = exc is not None and not isinstance(exc, (UserError, KeyboardInterrupt)) and os_error_line(exc) is None
        if self.path is None and not failed and self._pending is not None:
            self._pending.unlink(missing_ok=True)  # a refused run leaves no log behind
        if failed and self.quiet and where is not None:
            sys.stderr.write(_where_and_tail(where))
            sys.stderr.flush()

    def _restore(self) -> None:
        for stream in (sys.stdout, sys.stderr, self.file):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream of a library
                pass
        if self.quiet:
            logging.captureWarnings(False)
            sys.stdout, sys.stderr = self._saved_sys
            for fd, saved in zip((1, 2), self._saved_fds):
                os.dup2(saved, fd)
                os.close(saved)
            for stream, owned in ((self.term_out, self._own_out), (self.term_err, self._own_err)):
                if owned:
                    stream.close()
        logging.root.removeHandler(self._handler)
        logging.root.setLevel(self._root_level)
        for n, level in self._saved_levels.items():
            logging.getLogger(n).setLevel(level)
        self.file.close()

    # -- moving into the run directory --------------------------------------------------------------
    def settle(self, rd) -> None:
        """Move the log into the run directory (appended to an earlier session's, on resume)."""
        if self.path is not None:
            return
        dest = log_path(rd)
        dest.parent.mkdir(parents=True, exist_ok=True)
        self.file.flush()
        new = open(dest, "a", buffering=1, encoding="utf-8", errors="replace")  # noqa: SIM115
        new.write(self._pending.read_text(encoding="utf-8", errors="replace"))
        new.flush()
        self._pending_size = self._pending.stat().st_size
        if self.quiet:
            os.dup2(new.fileno(), 1)
            os.dup2(new.fileno(), 2)
        self._handler.setStream(new)
        old, self.file, self.path = self.file, new, dest
        old.close()

    def _append_late_pending(self) -> None:
        """What processes started before the move (the run's Prefect server) wrote to the temp log after it."""
        try:
            with open(self._pending, "rb") as f:
                f.seek(self._pending_size)
                late = f.read()
            if late:
                with open(self.path, "ab") as out:
                    out.write(late)
            self._pending.unlink(missing_ok=True)
        except OSError:
            pass

    def _header(self) -> str:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        return f"==== grpoflow {self.command} {self.run_id}: {stamp}, pid {os.getpid()}\n"


def _not_handled_on_the_way(record: logging.LogRecord) -> bool:
    """Whether no other handler on the record's way to the root (Prefect's console handler sits on the root)
    wrote it to the process's stdout or stderr, which is this log already."""
    logger = logging.getLogger(record.name)
    while logger is not None:
        if any(_writes_to_the_log(h, record) for h in logger.handlers):
            return False
        if not logger.propagate:
            break
        logger = logger.parent
    return True


def _writes_to_the_log(handler: logging.Handler, record: logging.LogRecord) -> bool:
    if _active is None or handler is _active._handler or isinstance(handler, TerminalHandler):
        return False
    if record.levelno < handler.level or not isinstance(handler, logging.StreamHandler):
        return False
    stream = handler.stream
    if isinstance(stream, _Forward):
        return True
    try:
        return stream.fileno() in (1, 2, _active.file.fileno())
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return False


def last_path() -> Path | None:
    """The log of the last run this process ran (for its closing summary)."""
    return _last_path


_last_path: Path | None = None


def settle(rd) -> None:
    """The run's log moves into ``rd`` (a no-op where no run log is active, e.g. in a test calling the flow)."""
    if _active is not None:
        _active.settle(rd)


def error_context() -> str:
    """For an error said while a run's log holds the streams (a forced exit): where the log is and its last
    lines, ready to write to the terminal; "" without a run log."""
    if _active is None or not _active.quiet:
        return ""
    _active.file.flush()
    return _where_and_tail(_active.path or _active._pending)


def _where_and_tail(path: Path) -> str:
    lines = _tail(path, TAIL_LINES)
    head = f"the run's log: {path}" + (f"; its last {len(lines)} lines:" if lines else "")
    return "".join(f"{line}\n" for line in [head, *(f"  | {x}" for x in lines)])


def _tail(path: Path, n: int) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()][-n:]
