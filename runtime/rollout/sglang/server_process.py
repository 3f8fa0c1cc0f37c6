"""One SGLang server as an operating-system process: its command line, its launch, the wait until it
answers, and its end.

Each server is `python -m sglang.launch_server` (the prefix is `rollout.sglang.launch`, so tests start
the stand-in through this same code) in a session of its own, so that it and the children it starts
(scheduler, detokenizer) end together, and it is SIGKILLed when the thread that launched it ends (SGLang's
children follow their parent); its output goes to `<scratch>/logs/engine-<i>.log`. Start-up
waits for `/health_generate` with a timeout and surfaces the server's own last error line if it exits.
The flags used here are read from SGLang 0.5.23's `sglang/srt/arg_groups/fields/*.py`; a 0.5.17 server took the
same ones on an H200 (bench/sglang_real.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from runtime.config import SGLANG_PORT_STRIDE
from runtime.errors import ModelError, TransientError
from runtime.parent_death import popen_preexec
from runtime.placement.ports import free_port
from runtime.rollout.sglang.routes import SERVER_FLAG as ROUTES_FLAG, RouteLayout
from runtime.rollout.sglang.settings import SGLangSettings

log = logging.getLogger(__name__)

# A server's state, as the pool sees it.
READY, CHECKING, RESTARTING, DEAD, STARTING = "ready", "checking", "restarting", "dead", "starting"
# Up, but serving other weights than the rest (restarted after a broadcast update, or a broadcast
# failed): no requests until an update (disk, or a broadcast on a group it joined) reaches it.
STALE = "stale"


@dataclass
class Server:
    index: int
    port: int
    log_path: Path
    proc: subprocess.Popen | None = None
    state: str = STARTING
    inflight: int = 0
    restarts: int = 0
    epoch: int = 0            # bumped on every (re)start; a fault seen on an older epoch is stale
    last_fault: str = ""
    released: set[str] = field(default_factory=set)  # memory tags this process released (colocate mode)
    fault_task: asyncio.Task | None = field(default=None, repr=False)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def url(self, host: str, path: str = "") -> str:
        return f"http://{host}:{self.port}{path}"


def server_command(settings: SGLangSettings, model_dir: str, server: Server) -> list[str]:
    sec = settings.section
    cmd = settings.launch_prefix() + [
        "--model-path", model_dir,
        "--tp-size", str(sec.tp_size),
        "--mem-fraction-static", str(sec.mem_fraction),
        "--host", sec.host,
        "--port", str(server.port),
        "--weight-version", "0",
    ]
    if settings.random_seed is not None:
        cmd += ["--random-seed", str(settings.random_seed)]
    if sec.num_engines > 1:
        cmd += ["--base-gpu-id", str(server.index * sec.tp_size)]
    if settings.colocate:
        cmd.append("--enable-memory-saver")
    if sec.deterministic:
        cmd.append("--enable-deterministic-inference")
    if settings.routing_replay and RouteLayout.read(model_dir) is not None:  # a dense model has no experts to return
        cmd.append(ROUTES_FLAG)
    return cmd


def server_env() -> dict[str, str]:
    """The server's environment: this process's, with NCCL's cuMem setting made explicit. SGLang sets
    NCCL_CUMEM_ENABLE=0 in its scheduler unless it is set already, while the trainer's NCCL runs with its default
    (1): peers of one weight-sync group that disagree on it hang in the first broadcast."""
    env = dict(os.environ)
    env.setdefault("NCCL_CUMEM_ENABLE", "1")
    return env


def launch_server(settings: SGLangSettings, model_dir: str, server: Server, taken_ports: set[int]) -> subprocess.Popen:
    """Start `server`'s process on its port (a fresh free one unless rollout.sglang.port is set);
    it is STARTING in a new epoch."""
    sec = settings.section
    if sec.port:
        server.port = sec.port + SGLANG_PORT_STRIDE * server.index
    else:  # a fresh free port per launch, distinct from the other servers'
        server.port = free_port(sec.host)
        while server.port in taken_ports:
            server.port = free_port(sec.host)
    cmd = server_command(settings, model_dir, server)
    with open(server.log_path, "ab") as logf:
        logf.write(f"\n==== grpoflow: launching engine {server.index} (restart {server.restarts}): "
                   f"{' '.join(cmd)}\n".encode())
        logf.flush()
        # dies with this process's client thread (launches run on it): a SIGKILLed driver of the local backend
        # otherwise left its servers holding the GPU, and the resumed run out of memory
        server.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       start_new_session=True, cwd=os.getcwd(), env=server_env(),
                                       preexec_fn=popen_preexec())
        # the pid in the log: the server may die before it prints anything itself
        logf.write(f"==== grpoflow: engine {server.index} is pid {server.proc.pid}\n".encode())
    server.epoch += 1
    server.state = STARTING
    server.released = set()  # a fresh process holds all its memory
    log.info("sglang engine %d: pid %d on %s:%d (log %s)", server.index, server.proc.pid, sec.host, server.port,
             server.log_path)
    return server.proc


async def wait_healthy(client, settings: SGLangSettings, model_dir: str, server: Server) -> None:
    """Poll `/health_generate` until it answers 200; ModelError if the process exits first (with its log's
    telling line), TransientError (the process killed) after rollout.sglang.startup_timeout_s."""
    sec, sup = settings.section, settings.supervision
    deadline = time.monotonic() + sec.startup_timeout_s
    while True:
        code = server.proc.poll()
        if code is not None:
            raise ModelError(f"SGLang engine {server.index} exited with code {code} during start-up "
                             f"(model {model_dir}): {log_tail_error(server.log_path)} [full log: {server.log_path}]")
        try:
            r = await client.get(server.url(sec.host, "/health_generate"), timeout=max(sup.health_timeout_s, 1.0))
            if r.status_code == 200:
                return
        except Exception:
            pass
        if time.monotonic() > deadline:
            await asyncio.to_thread(terminate_process, server.proc, sup.kill_grace_s)
            raise TransientError(f"SGLang engine {server.index} was not healthy within {sec.startup_timeout_s:.0f}s "
                                 f"(rollout.sglang.startup_timeout_s); killed it. Last log line: "
                                 f"{log_tail_error(server.log_path)} [full log: {server.log_path}]")
        await asyncio.sleep(sup.health_poll_s)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def terminate_process(proc: subprocess.Popen | None, grace_s: float) -> None:
    """Stop a server we started (its own session, so pgid == pid): SIGTERM, then SIGKILL, then reap.
    Once per process: after that its id may belong to someone else."""
    if proc is None or getattr(proc, "_grpoflow_terminated", False):
        return
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
    _signal_group(proc.pid, signal.SIGKILL)  # children the server left in its group (scheduler, detokenizer)
    proc._grpoflow_terminated = True


def kill_all(procs: list, grace_s: float) -> None:
    for proc in list(procs):
        terminate_process(proc, grace_s)


def log_tail_error(path: Path, max_bytes: int = 16384) -> str:
    """The most telling line at the end of a server log: the last error-looking line, else the last line."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            lines = [ln.strip() for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    if not lines:
        return "(empty log)"
    return _last_error_line(lines) or lines[-1]


def _last_error_line(lines: list[str]) -> str | None:
    """The last line that names an error, past tracebacks' headers and the access log's `"POST ... HTTP/1.1"
    500 Internal Server Error` lines (uvicorn writes them before the traceback of the same request)."""
    for line in reversed(lines):
        if ("Error" in line or "Exception" in line) and not line.startswith("Traceback") and " HTTP/1." not in line:
            return line
    return None


def log_size(path: Path) -> int:
    """How many bytes a server's log has now (0 when it has none)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def log_error_since(path: Path, offset: int, max_bytes: int = 65536) -> str | None:
    """The last error-looking line a server's log gained after `offset` (e.g. the exception behind a 500 that
    SGLang answered as "Internal Server Error"); None when it gained none."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            end = f.tell()
            f.seek(max(offset, end - max_bytes))
            lines = [ln.strip() for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
    except OSError:
        return None
    return _last_error_line(lines)
