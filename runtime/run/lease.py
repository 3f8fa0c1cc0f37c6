"""One writer per run: a lease file in the run directory, kept fresh by a heartbeat.

A second `run` / `resume` / scheduled run of a live run is refused with one line. A lease whose
holder is gone — its heartbeat older than the timeout, or its process dead on this host — is taken
over, so a run killed by SIGKILL or a lost node can be resumed at once.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid

from runtime import forced_exit, storage
from runtime.errors import UserError
from runtime.run.directory import RunDir, resume_command

log = logging.getLogger(__name__)


class RunBusyError(UserError):
    pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lease_holder(rd: RunDir, timeout_s: float | None = None) -> tuple[dict | None, str | None]:
    """Who holds the run's lease: its record (pid, host, heartbeat; None when there is no lease) and
    why it is stale (None while the holder is alive), by the same rules ``acquire`` applies."""
    lease = RunLease(rd, timeout_s=timeout_s)
    holder = lease._holder()
    return holder, (lease._stale(holder) if holder is not None else None)


class RunLease:
    """``started_with`` (a new run's ``{"config": path, "overrides": [...]}``, secrets masked) is kept in the
    lease: until the run's config is frozen, it is the only record of how the run was started."""

    def __init__(self, rd: RunDir, *, timeout_s: float | None = None, heartbeat_s: float | None = None,
                 started_with: dict | None = None):
        self.rd = rd
        self.started_with = started_with
        self.path = rd.sub("lease.json")
        self.timeout_s = float(timeout_s or os.environ.get("GRPOFLOW_LEASE_TIMEOUT_S", 120))
        self.heartbeat_s = float(heartbeat_s or min(10.0, self.timeout_s / 4))
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> dict:
        record = {"token": self.token, "pid": os.getpid(), "host": socket.gethostname(), "heartbeat": time.time()}
        return {**record, "started_with": self.started_with} if self.started_with else record

    def _holder(self) -> dict | None:
        try:
            return json.loads(storage.read_text(self.path))
        except (FileNotFoundError, ValueError):
            return None

    def _stale(self, holder: dict) -> str | None:
        age = time.time() - float(holder.get("heartbeat", 0))
        if age > self.timeout_s:
            return f"heartbeat {age:.0f} s old"
        if holder.get("host") == socket.gethostname() and not _pid_alive(int(holder.get("pid", -1))):
            return f"pid {holder.get('pid')} is gone"
        return None

    def acquire(self) -> "RunLease":
        holder = self._holder()
        if holder is not None and holder.get("token") != self.token:
            why = self._stale(holder)
            if why is None:
                age = time.time() - float(holder.get("heartbeat", 0))
                raise RunBusyError(
                    f"run '{self.rd.run_id}' is being written by pid {holder.get('pid')} on {holder.get('host')} "
                    f"(heartbeat {age:.0f} s ago); wait for it to finish or stop it — a lease silent for "
                    f"{self.timeout_s:.0f} s is taken over")
            log.warning("taking over the lease of run %s (%s)", self.rd.run_id, why)
        storage.write_json_atomic(self.path, self._record())
        # Two takers racing: the last rename wins; the loser sees someone else's token and backs off.
        time.sleep(0.05)
        if (self._holder() or {}).get("token") != self.token:
            raise RunBusyError(f"run '{self.rd.run_id}' was taken by another process at the same moment; retry later")
        self._thread = threading.Thread(target=self._beat, name="grpoflow-lease", daemon=True)
        self._thread.start()
        # A forced exit (the Ray cluster lost) still releases the lease and says how to continue.
        self._exit_hook = forced_exit.on_forced_exit(self.release)
        forced_exit.resume_hint.append(f"resume it with `{resume_command(self.rd.run_id, self.rd.root)}`")
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            holder = self._holder()
            if holder is not None and holder.get("token") != self.token:
                log.error("lost the lease of run %s to pid %s", self.rd.run_id, holder.get("pid"))
                return
            storage.write_json_atomic(self.path, self._record())

    def release(self) -> None:
        if getattr(self, "_exit_hook", None) is not None:
            forced_exit.forget(self._exit_hook)
            forced_exit.resume_hint.clear()
            self._exit_hook = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if (self._holder() or {}).get("token") == self.token:
            fs, path = storage.fs_for(self.path)
            fs.rm(path)

    def __enter__(self) -> "RunLease":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
