"""Actors without Ray: one spawned process per member, driven over a pipe.

`cluster.backend: local` with several trainer ranks (or a trainer on a GPU of its own) runs each
rank here, the same class a Ray actor would hold. Results come back through torch's pickler, so
CUDA tensors travel as IPC handles (no copy) and CPU tensors through shared memory.
"""
from __future__ import annotations

import importlib
import os
import pickle
import time
import traceback
import weakref
from multiprocessing.connection import wait
from typing import Any

import torch.multiprocessing as mp

from runtime.errors import TransientError


class ProcessDiedError(TransientError):
    """A member process exited; the chunk is rebuilt from the newest checkpoint on retry."""


class RemoteError(RuntimeError):
    """An exception raised in a member that could not be sent back as itself."""


def _portable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - unpicklable exception types come back as text
        return RemoteError(f"{type(exc).__name__}: {exc}\n{''.join(traceback.format_exception(exc))}")


def _serve(conn, target: str, kwargs: dict, env: dict[str, str]) -> None:
    os.environ.update(env)
    module, _, name = target.partition(":")
    try:
        obj = getattr(importlib.import_module(module), name)(**kwargs)
        conn.send(("ok", os.getpid()))
    except BaseException as exc:  # noqa: BLE001 - reported to the driver, which raises it
        conn.send(("err", _portable(exc)))
        return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the driver is gone
            return
        if msg is None:
            return
        method, args, kw = msg
        try:
            reply = ("ok", getattr(obj, method)(*args, **kw))
        except BaseException as exc:  # noqa: BLE001
            reply = ("err", _portable(exc))
        try:
            conn.send(reply)
        except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable result
            conn.send(("err", _portable(exc)))


class _Member:
    def __init__(self, ctx, target: str, kwargs: dict, env: dict[str, str]):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, target, kwargs, env), daemon=False)
        self.proc.start()
        child.close()
        self.out_of_step = False  # a call it never answered: its pipe no longer pairs calls with replies

    def send(self, msg: tuple) -> None:
        if self.out_of_step:
            raise ProcessDiedError(f"{msg[0]}: process {self.proc.pid} never answered an earlier call (another "
                                   "member failed it): the group must be rebuilt")
        try:
            self.conn.send(msg)
        except (BrokenPipeError, OSError):
            raise ProcessDiedError(f"{msg[0]}: process {self.proc.pid} is gone (code {self.proc.exitcode})") from None

    def recv(self, what: str) -> Any:
        while not self.conn.poll(1.0):
            if not self.proc.is_alive():
                break
        try:
            status, value = self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(5)
            raise ProcessDiedError(f"{what}: process {self.proc.pid} exited (code {self.proc.exitcode})") from None
        if status == "err":
            raise value
        return value

    def stop(self, grace_s: float = 10.0) -> None:
        try:
            if not self.out_of_step:  # else it is still in the call it never answered
                self.conn.send(None)
        except Exception:  # noqa: BLE001 - already gone
            pass
        self.proc.join(grace_s if not self.out_of_step else 0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


class Pending:
    """Calls sent to every member; `get()` collects the results in rank order.

    Replies are taken as they come. When a member fails the call, the others get `error_grace_s` more to answer: a
    member waiting in a collective for the failed one never would (NCCL's own timeout is minutes away). Those are
    then out of step, and the failure is raised; the group's next call raises `ProcessDiedError` (a retry rebuilds it)."""

    def __init__(self, members: list[_Member | None], method: str, error_grace_s: float = 30.0):
        self.members, self.method = members, method  # None: a member that sits the call out
        self.error_grace_s = error_grace_s

    def get(self) -> list[Any]:
        results: list[Any] = [None] * len(self.members)
        errors: dict[int, BaseException] = {}
        waiting = {i: m for i, m in enumerate(self.members) if m is not None}
        failed_at = None
        while waiting:
            ready = set(wait([m.conn for m in waiting.values()] + [m.proc.sentinel for m in waiting.values()],
                             timeout=1.0))
            for i, m in list(waiting.items()):
                if m.conn in ready or m.proc.sentinel in ready:
                    del waiting[i]
                    try:
                        results[i] = m.recv(self.method)
                    except BaseException as exc:  # noqa: BLE001
                        errors[i] = exc
                        failed_at = failed_at or time.monotonic()
            if waiting and failed_at is not None and time.monotonic() - failed_at >= self.error_grace_s:
                for m in waiting.values():
                    m.out_of_step = True
                break
        if errors:
            first = errors[min(errors)]
            if waiting:
                first.add_note(f"{self.method}: member(s) {sorted(waiting)} had not answered {self.error_grace_s:g} s "
                               f"after member {min(errors)} failed (waiting in a collective for it?)")
            raise first
        return results


class SubprocessGroup:
    """`call(method, ...)` runs on every member at once and returns results in rank order."""

    def __init__(self, target: str, member_kwargs: list[dict], member_env: list[dict[str, str]] | None = None,
                 error_grace_s: float = 30.0):
        ctx = mp.get_context("spawn")
        envs = member_env or [{} for _ in member_kwargs]
        self.error_grace_s = error_grace_s
        self.members = [_Member(ctx, target, kw, env) for kw, env in zip(member_kwargs, envs)]
        self._finalizer = weakref.finalize(self, _stop_all, list(self.members))
        self.pids = Pending(self.members, f"starting {target}", error_grace_s).get()

    def submit(self, method: str, *args, **kwargs) -> Pending:
        return self.submit_each(method, [args] * len(self.members), kwargs)

    def submit_each(self, method: str, args: list[tuple | None], kwargs: dict | None = None) -> Pending:
        """`method(*args[i])` on member i, none where args[i] is None."""
        for m, a in zip(self.members, args):
            if a is not None:
                m.send((method, a, kwargs or {}))
        return Pending([m if a is not None else None for m, a in zip(self.members, args)], method, self.error_grace_s)

    def __len__(self) -> int:
        return len(self.members)

    def call(self, method: str, *args, **kwargs) -> list[Any]:
        return self.submit(method, *args, **kwargs).get()

    def kill(self) -> None:
        self._finalizer()
        self.members = []


def _stop_all(members: list[_Member]) -> None:
    for m in members:
        m.stop()
