"""The Prefect API that `grpoflow run` and `resume` talk to when none is configured: a server process that
ends with the run.

Prefect's own ephemeral server is a plain child process: a run killed with SIGKILL (the kernel's OOM
killer, `kill -9`, a scheduler's hard stop) leaves it running, holding a port and a few hundred MB, for
good. This one asks the kernel to end it when its parent dies (Linux's PR_SET_PDEATHSIG; elsewhere it
watches its parent), runs in a session of its own (a Ctrl-C reaches only the run, which then stops it in
order), and gets its socket bound by the run (no other process can take the port in between).
"""
from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from runtime.errors import UserError


def ensure_api(startup_timeout_s: float) -> str | None:
    """Start the run's own server unless a Prefect API is configured (PREFECT_API_URL, a profile, a
    prefect.toml); point Prefect at it and return its URL."""
    import prefect.context
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED
    if PREFECT_API_URL.value():
        _check_answers(PREFECT_API_URL.value())
        return None
    if not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return None  # Prefect's own error: no API and none to start
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        proc = subprocess.Popen([sys.executable, "-m", "cli.prefect_api", str(sock.fileno()), str(os.getpid())],
                                pass_fds=(sock.fileno(),), start_new_session=True, stdout=subprocess.DEVNULL,
                                env={**os.environ, "PREFECT_UI_ENABLED": "0"})  # its errors: on the run's stderr
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/api"
    atexit.register(_stop, proc)
    _wait_healthy(proc, url, startup_timeout_s)
    os.environ["PREFECT_API_URL"] = url
    prefect.context.refresh_global_settings_context()
    return url


def _check_answers(url: str) -> None:
    """A configured server that does not answer: one line, before the run takes its lease."""
    from prefect.client.orchestration import get_client

    from runtime.secrets import redact_uri
    with get_client(sync_client=True) as client:
        problem = client.api_healthcheck()
    if problem is not None:
        raise UserError(f"the Prefect API at {redact_uri(url)} does not answer ({type(problem).__name__}); start "
                        f"that server, fix PREFECT_API_URL, or unset it (the run then starts a Prefect server of "
                        f"its own)")


def _wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float) -> None:
    import httpx
    deadline = time.monotonic() + timeout_s
    with httpx.Client() as client:
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if client.get(f"{url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)  # polling a server that is starting up; the deadline bounds it
    exited = proc.poll()
    _stop(proc)
    why = f"it exited with code {exited}" if exited is not None else f"no answer within {timeout_s:g} s"
    raise UserError(f"the run's Prefect API server did not start ({why}); raise "
                    f"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS or set PREFECT_API_URL to a running Prefect "
                    f"server")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _die_with(parent: int) -> None:
    if sys.platform.startswith("linux"):
        import ctypes
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    else:
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGTERM)
        threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != parent:  # died before the request above took effect
        sys.exit(0)


def _serve(fd: int, parent: int) -> None:
    _die_with(parent)
    import uvicorn
    from prefect.server.api.server import create_app
    app = create_app(ephemeral=True, final=True)
    sock = socket.socket(fileno=fd)  # the family and type are read from the socket itself
    uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="on")).run(sockets=[sock])


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
