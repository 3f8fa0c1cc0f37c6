"""Score a batch of responses with a reward function without ever hanging or crashing.

Each item runs in a worker process with its own deadline. An item that raises, returns a non-finite
value, or runs past the deadline gets the reward's failure value and is counted; a worker that ran
late is killed and replaced. Processes rather than threads because a stuck sympy computation (say
9^(9^(9^9))) holds the GIL inside C code and can only be stopped by killing its process; and
math-verify's own SIGALRM timeouts only work in a main thread, which a worker process has.

One pool per process, created on first use, reused across batches (start-up is an interpreter plus
the math-verify import, about a second per worker). Workers are fresh interpreters started with
subprocess, not multiprocessing: nothing is forked from a parent holding torch, Ray or threads, and
unlike multiprocessing's spawn the parent's __main__ (a user's script, a REPL) is never re-imported.

`bounded` gives the built-in rewards the same bound when they are called directly (not through
`score_batch`): outside a reward worker such a call is a batch of one item with `DIRECT_CALL_TIMEOUT_S`,
so no input holds its caller longer; inside a worker (the call `score_batch` made) it runs as it is.
"""

from __future__ import annotations

import atexit
import functools
import logging
import math
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait

from runtime.errors import ConfigError
from runtime.rewards.contract import call_reward, takes_finish_reason

logger = logging.getLogger(__name__)

# A worker that cannot import math-verify within this long (cold disk, overloaded host) is an
# environment problem worth an error, not an endless wait.
WORKER_START_TIMEOUT_S = 120.0
_MAX_CONSECUTIVE_START_FAILURES = 3
# A built-in reward called directly (`bounded`) returns within this long (its failure value if it must be cut off).
DIRECT_CALL_TIMEOUT_S = 10.0
_in_worker = False  # set in a reward worker process: the rewards `bounded` run there as they are


def reward_fail_value(fn: Callable) -> float:
    """The value a failed item gets: the `FAIL_VALUE` of fn's module if it declares one, else 0.0."""
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    return float(getattr(module, "FAIL_VALUE", 0.0))


def _worker_main(conn) -> None:
    # Ctrl-C reaches the whole process group; the parent decides what to do about it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # pay the sympy import before the first deadline; math-verify's own alarms are a second bound
    # here (a slow parse gives a wrong answer instead of a killed worker), under the item deadline
    import math_verify  # noqa: F401

    from runtime.rewards.verify_timeouts import MATH_VERIFY_TIMEOUT_S, set_math_verify_timeout

    set_math_verify_timeout(MATH_VERIFY_TIMEOUT_S)
    global _in_worker
    _in_worker = True

    conn.send(("ready", None))
    loaded: dict[bytes, tuple[Callable, bool]] = {}
    while True:
        try:
            fn_blob, path, response, label, metadata, finish_reason = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if path is not None:
            sys.path[:] = path
        entry = loaded.get(fn_blob)
        if entry is None:
            try:
                fn = pickle.loads(fn_blob)
            except BaseException as e:
                conn.send(("load_error", f"{type(e).__name__}: {e}"))
                continue
            entry = (fn, takes_finish_reason(fn))
            loaded = {fn_blob: entry}
        fn, takes = entry
        try:
            conn.send(("ok", float(call_reward(fn, response, label, metadata, finish_reason, takes=takes))))
        except BaseException as e:  # SystemExit from user code included: the worker must survive it
            conn.send(("error", f"{type(e).__name__}: {e}"[:500]))


# The child learns sys.path from its first message, so only the standard library is needed before.
_BOOTSTRAP = (
    "import sys\n"
    "from multiprocessing.connection import Connection\n"
    "conn = Connection(int(sys.argv[1]))\n"
    "sys.path[:] = conn.recv()\n"
    "from runtime.rewards.timeout import _worker_main\n"
    "_worker_main(conn)\n"
)


class _Worker:
    def __init__(self):
        parent_sock, child_sock = socket.socketpair()
        self.process = subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP, str(child_sock.fileno())],
            pass_fds=(child_sock.fileno(),),
            stdin=subprocess.DEVNULL,
        )
        child_sock.close()
        self.conn = Connection(parent_sock.detach())
        self.synced_path = tuple(sys.path)
        self.conn.send(list(self.synced_path))
        self.ready = False
        self.item: int | None = None
        self.deadline = 0.0

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(5)
        self.conn.close()


class RewardPool:
    """A fixed number of reward worker processes fed one item at a time."""

    def __init__(self, num_workers: int):
        self.num_workers = max(1, num_workers)
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()

    def _top_up(self) -> None:
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker())

    def _retire(self, worker: _Worker) -> None:
        worker.kill()
        self._workers.remove(worker)

    def close(self) -> None:
        with self._lock:
            for worker in list(self._workers):
                self._retire(worker)

    def run(self, fn_blob: bytes, items: Sequence[tuple], timeout_s: float) -> list[tuple[str, object]]:
        """(status, value or reason) per item; status is ok, error, timeout or died."""
        with self._lock:
            try:
                return self._run(fn_blob, items, timeout_s)
            except BaseException:
                # items still in flight would answer into the next batch: drop those workers
                for worker in [w for w in self._workers if w.item is not None]:
                    self._retire(worker)
                raise
            finally:
                self._top_up()  # replacements start importing while the caller works

    def _run(self, fn_blob: bytes, items: Sequence[tuple], timeout_s: float) -> list[tuple[str, object]]:
        results: list[tuple[str, object] | None] = [None] * len(items)
        next_item = done = start_failures = 0
        last_progress = time.monotonic()
        while done < len(items):
            self._top_up()
            now = time.monotonic()
            path = tuple(sys.path)
            for worker in self._workers:
                if worker.ready and worker.item is None and next_item < len(items):
                    response, label, metadata, finish_reason = items[next_item]
                    sent_path = None if worker.synced_path == path else list(path)
                    try:
                        worker.conn.send((fn_blob, sent_path, response, label, metadata, finish_reason))
                    except (pickle.PicklingError, TypeError, AttributeError) as e:
                        results[next_item] = ("error", f"cannot send item to a worker: {e}")
                        done += 1
                    else:
                        worker.synced_path = path
                        worker.item, worker.deadline = next_item, now + timeout_s
                    next_item += 1
            if done == len(items):
                break

            waiting = {w.conn: w for w in self._workers if not w.ready or w.item is not None}
            deadlines = [w.deadline for w in waiting.values() if w.item is not None]
            wait_s = max(0.0, min(deadlines) - now) if deadlines else WORKER_START_TIMEOUT_S
            for conn in wait(list(waiting), timeout=wait_s):
                worker = waiting[conn]
                try:
                    status, payload = conn.recv()
                except (EOFError, OSError):
                    if worker.item is None:
                        start_failures += 1
                    else:
                        code = worker.process.poll()
                        results[worker.item] = ("died", f"reward worker died (exit code {code})")
                        done += 1
                    self._retire(worker)
                    continue
                last_progress = time.monotonic()
                if status == "ready":
                    worker.ready, start_failures = True, 0
                elif status == "load_error":
                    raise ConfigError(
                        f"rollout.reward: a reward worker process cannot load the reward function ({payload}); "
                        "define it at module level in a module importable from sys.path"
                    )
                else:
                    results[worker.item] = (status, payload)
                    worker.item = None
                    done += 1

            now = time.monotonic()
            for worker in [w for w in self._workers if w.item is not None and now >= w.deadline]:
                results[worker.item] = ("timeout", f"no result within {timeout_s:g} s")
                done += 1
                self._retire(worker)
            if start_failures >= _MAX_CONSECUTIVE_START_FAILURES:
                raise RuntimeError(
                    "reward worker processes exit while starting: check that `runtime` imports in a fresh Python"
                )
            if now - last_progress > WORKER_START_TIMEOUT_S and not any(w.ready for w in self._workers):
                raise RuntimeError(f"no reward worker process became ready within {WORKER_START_TIMEOUT_S:g} s")
        return results  # type: ignore[return-value]


_pool: RewardPool | None = None
_pool_pid: int | None = None
_pool_lock = threading.Lock()


def get_pool() -> RewardPool:
    """This process's pool (a forked child gets its own, never its parent's workers)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool, _pool_pid = RewardPool(num_workers=min(8, os.cpu_count() or 1)), os.getpid()
        return _pool


def shutdown_pool() -> None:
    global _pool
    with _pool_lock:
        if _pool is not None and _pool_pid == os.getpid():
            _pool.close()
        _pool = None


def score_batch(
    fn: Callable,
    responses: Sequence[str],
    labels: Sequence[str],
    metadatas: Sequence[dict | None] | None = None,
    timeout_s: float = 5.0,
    *,
    fail_value: float | None = None,
    parallel: bool = True,
    finish_reasons: Sequence[str | None] | None = None,
) -> tuple[list[float], int]:
    """Rewards for a batch and the number of items that failed (raised, non-finite, or timed out).

    Failed items get `fail_value`, by default the reward's own (`reward_fail_value`). finish_reasons:
    per response why its sample ended ("stop", "length", "abort"), given to rewards that take it
    (`contract.call_reward`). `parallel=False` runs inline, without a timeout: only for rewards trusted to
    return promptly (a built-in still bounds itself, `bounded`).
    """
    n = len(responses)
    if not n == len(labels) == (len(metadatas) if metadatas is not None else n) \
            == (len(finish_reasons) if finish_reasons is not None else n):
        raise ValueError("responses, labels, metadatas and finish_reasons must have the same length")
    metadatas = metadatas if metadatas is not None else [None] * n
    finish_reasons = finish_reasons if finish_reasons is not None else [None] * n
    fallback = reward_fail_value(fn) if fail_value is None else float(fail_value)
    if not responses:
        return [], 0

    if parallel:
        name = getattr(fn, "__qualname__", repr(fn))
        if getattr(fn, "__module__", None) == "__main__":
            # a worker's __main__ is not the caller's script, so it could not find the function
            raise ConfigError(
                f"rollout.reward: reward function {name} is defined in __main__; "
                "move it to an importable module and name it as module:function"
            )
        try:
            fn_blob = pickle.dumps(fn)
        except Exception as e:
            raise ConfigError(
                f"rollout.reward: reward function {name} cannot be sent to a worker process ({e}); "
                "define it at module level in an importable module"
            ) from e
        outcomes = get_pool().run(fn_blob, list(zip(responses, labels, metadatas, finish_reasons)), timeout_s)
    else:
        outcomes = []
        takes = takes_finish_reason(fn)
        for item in zip(responses, labels, metadatas, finish_reasons):
            try:
                outcomes.append(("ok", float(call_reward(fn, *item, takes=takes))))
            except Exception as e:
                outcomes.append(("error", f"{type(e).__name__}: {e}"))

    rewards: list[float] = []
    failures: list[str] = []
    for status, payload in outcomes:
        if status == "ok" and math.isfinite(payload):
            rewards.append(payload)
        else:
            rewards.append(fallback)
            failures.append(f"{status}: {payload}" if status != "ok" else f"non-finite reward {payload}")
    if failures:
        logger.warning(
            "%d of %d rewards failed and got %g; first: %s", len(failures), len(rewards), fallback, failures[0]
        )
    return rewards, len(failures)


def bounded(fn: Callable) -> Callable:
    """`fn` (a reward at module level) bounded in time for a direct caller: called outside a reward worker
    it runs in one, as a `score_batch` of one item with `DIRECT_CALL_TIMEOUT_S` (its failure value when it
    is cut off: a stuck sympy computation can only be stopped by killing its process); called inside a
    worker (where `score_batch` sent it) it runs as it is, under that call's deadline."""

    @functools.wraps(fn)
    def call(response, label, metadata=None, *, finish_reason=None):
        if _in_worker:
            return fn(response, label, metadata, finish_reason=finish_reason)
        (value,), _ = score_batch(call, [response], [label], [metadata], DIRECT_CALL_TIMEOUT_S,
                                  finish_reasons=[finish_reason])
        return value

    return call


@atexit.register
def _kill_workers_at_exit() -> None:
    # Without the lock: a daemon thread may hold it mid-batch while the interpreter exits.
    if _pool is not None and _pool_pid == os.getpid():
        for worker in list(_pool._workers):
            worker.process.kill()
