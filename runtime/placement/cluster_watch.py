"""Watching the Ray cluster's head (its GCS) while a run uses it.

When the whole cluster goes away, a Ray driver waits for its head and then exits hard, from C++,
with neither the run's lease released nor its child processes ended. So we watch the head ourselves:
unreachable for ``GRPOFLOW_CLUSTER_LOST_AFTER_S`` (15 s) — well before Ray gives up — the run ends
through runtime.forced_exit: the lease released, children ended, one ``error:`` line, exit 3. Nothing
is lost: every finished chunk is a checkpoint, and `grpoflow resume` continues on a new cluster.
"""
from __future__ import annotations

import os
import socket
import threading
import time

from runtime.errors import UserError


class ClusterUnreachable(UserError):
    exit_code = 3  # the cluster may come back: nothing is wrong with the run


def _host_port(address: str) -> tuple[str, int] | None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "://" in address:
        return None  # "auto", ray://...: Ray resolves those itself
    return host.strip("[]"), int(port)


def _answers(host: str, port: int, timeout_s: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """One line instead of Ray's endless retries when ``cluster.address`` has no cluster behind it."""
    hp = _host_port(address)
    if hp is None:
        return
    hosts = [hp[0]]
    if hp[0] in ("127.0.0.1", "localhost", "::1"):
        # Ray connects to this host's address instead (canonicalize_bootstrap_address): try that too
        from ray._private.services import get_node_ip_address
        hosts.append(get_node_ip_address())
    if not any(_answers(h, hp[1], timeout_s) for h in hosts):
        raise ClusterUnreachable(f"no Ray cluster answers at cluster.address={address}; start it (`ray start --head` "
                                 f"on that node) or fix cluster.address, then run again")


class ClusterWatch:
    def __init__(self, gcs_address: str, lost_after_s: float | None = None, every_s: float = 1.0):
        self.address = gcs_address
        self.lost_after_s = float(lost_after_s or os.environ.get("GRPOFLOW_CLUSTER_LOST_AFTER_S", 15))
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="grpoflow-cluster-watch", daemon=True)

    @classmethod
    def of_current_cluster(cls) -> "ClusterWatch | None":
        import ray
        address = getattr(ray.get_runtime_context(), "gcs_address", None)
        return cls(address).start() if address and _host_port(address) else None

    def start(self) -> "ClusterWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        host, port = _host_port(self.address)
        last_answer = time.monotonic()
        while not self._stop.wait(self.every_s):
            if _answers(host, port, timeout_s=min(2.0, self.lost_after_s)):
                last_answer = time.monotonic()
            elif time.monotonic() - last_answer > self.lost_after_s and not self._stop.is_set():
                from runtime.forced_exit import forced_exit
                forced_exit(f"lost the Ray cluster: its head at {self.address} has not answered for "
                            f"{self.lost_after_s:.0f} s; the run stopped at its last checkpoint")
