"""Actor groups: the members of one role (trainer ranks, engines) wherever they run.

A group runs a method on every member and returns the results in rank order; `submit_each` gives each
member arguments of its own (a share of the requests), and a member given None sits the call out. Three kinds share
this protocol: `LocalGroup` (members in this process), `SubprocessGroup` (one spawned process per
member, runtime/placement/subprocess_group.py) and `RayGroup` (Ray actors). Only the typed handles
(runtime/placement/handles.py) call methods on a group by name.
"""
from __future__ import annotations

from typing import Any, Protocol

from runtime.errors import UserError


class Pending(Protocol):
    """Calls in flight on every member; `get()` waits and returns their results in rank order."""

    def get(self) -> list[Any]: ...


class ActorGroup(Protocol):
    def call(self, method: str, *args, **kwargs) -> list[Any]:
        """Run `method` on every member and wait: results in rank order."""

    def submit(self, method: str, *args, **kwargs) -> Pending:
        """Start `method` on every member and return at once."""

    def submit_each(self, method: str, args: list[tuple | None]) -> Pending:
        """Start `method(*args[i])` on member i (none where args[i] is None, its result None) and return at once."""

    def __len__(self) -> int:
        """How many members."""

    def kill(self) -> None:
        """End every member; the group is unusable afterwards."""


class _Done:
    def __init__(self, results: list[Any]):
        self._results = results

    def get(self) -> list[Any]:
        return self._results


class LocalGroup:
    """Members in this process: a call runs them one after another."""

    def __init__(self, members: list[Any]):
        self.members = members

    def call(self, method: str, *args, **kwargs) -> list[Any]:
        return [getattr(m, method)(*args, **kwargs) for m in self.members]

    def submit(self, method: str, *args, **kwargs) -> _Done:
        return _Done(self.call(method, *args, **kwargs))

    def submit_each(self, method: str, args: list[tuple | None]) -> _Done:
        return _Done([None if a is None else getattr(m, method)(*a) for m, a in zip(self.members, args)])

    def __len__(self) -> int:
        return len(self.members)

    def kill(self) -> None:
        # in this process nothing ends with the member: its GPU memory and process groups stay until shut down
        for m in self.members:
            if hasattr(m, "shutdown"):
                m.shutdown()
        self.members = []


class _RayPending:
    def __init__(self, refs):
        self._refs = refs

    def get(self) -> list[Any]:
        import ray
        from ray.exceptions import RayTaskError
        try:
            got = iter(ray.get([r for r in self._refs if r is not None]))
        except RayTaskError as err:
            if isinstance(err.cause, UserError):  # the member's one line, not Ray's text of its traceback
                raise err.cause from None
            raise
        return [None if r is None else next(got) for r in self._refs]


class RayGroup:
    """Ray actors, one per member."""

    def __init__(self, actors: list[Any]):
        self.actors = actors

    def submit(self, method: str, *args, **kwargs) -> _RayPending:
        import ray
        # Put large arguments once in the object store instead of once per actor.
        args = tuple(ray.put(a) if len(self.actors) > 1 and not isinstance(a, (int, float, str, type(None))) else a
                     for a in args)
        return _RayPending([getattr(a, method).remote(*args, **kwargs) for a in self.actors])

    def submit_each(self, method: str, args: list[tuple | None]) -> _RayPending:
        return _RayPending([None if a is None else getattr(actor, method).remote(*a)
                            for actor, a in zip(self.actors, args)])

    def call(self, method: str, *args, **kwargs) -> list[Any]:
        return self.submit(method, *args, **kwargs).get()

    def __len__(self) -> int:
        return len(self.actors)

    def kill(self) -> None:
        import ray
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead is fine
                pass
        self.actors = []
