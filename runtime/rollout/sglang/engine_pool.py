"""The servers of one SGLangEngine as a pool: request slots, least-busy choice, fan-out to every server,
their memory, and supervision - a server that fails a request is checked, and restarted and re-synced
when it is dead, hung or serves stale weights.

Requests go one per sample with at most `rollout.sglang.concurrency` in flight per server, each to the
least-busy ready server (client-side balancing rather than `sglang_router`: the client must restart and
re-sync one server at a time, which a router hides). A request that fails on transport, times out or
gets a 5xx triggers one health check of its server (concurrent failures share it; one from before the
last restart is ignored); a server that is dead or does not answer is killed by process group,
relaunched, re-synced to the current weights (the `resync` the engine gives) and only then serves again.
After `rollout.sglang.max_restarts` restarts it is given up ("dead").

Colocate mode's released memory is tracked per server: a fresh process holds all of its memory, so a server restarted
while the pool is released is released again once re-synced, and a resume names to each server only what it released.

A request the server refuses is not a server fault: a 4xx on `/generate`, or a 500 from a server whose check
finds it healthy (SGLang 0.5.17 answers an unknown sampling key with a 500 and stays up), is RequestRejected -
one line naming the endpoint, SGLang's message (for a 500, the error line its log gained) and the fix; the
request is not resent and the server not restarted.

Runs on the engine's private event loop: every method here is called from that loop's thread.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
from pathlib import Path
from typing import Any, Awaitable, Callable

from runtime.errors import ModelError, TransientError
from runtime.rollout.sglang.http_protocol import (
    EngineFault,
    ErrorAnswer,
    SGLangError,
    StaleWeights,
    logprobs_payload,
    parse_logprobs,
    post,
    rejected_request,
)
from runtime.rollout.sglang.server_process import (
    CHECKING,
    DEAD,
    READY,
    RESTARTING,
    STALE,
    Server,
    launch_server,
    log_error_since,
    log_size,
    terminate_process,
    wait_healthy,
)
from runtime.rollout.sglang.settings import SGLangSettings

log = logging.getLogger(__name__)

# Every tag /release_memory_occupation frees when given none (sglang/srt/constants.py GPU_MEMORY_ALL_TYPES, 0.5.17
# and 0.5.23). A resume names the tags it takes back, so it must name each: a tag left paused (the CUDA graphs'
# memory, on an H200 with 0.5.17) gave samples whose log-probs were 0.37 nats off the trainer's after the first update.
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class NeedsWeights(Exception):
    """A restarted server cannot be brought to the current weights by this client (no disk copy)."""


def _log_task_error(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("sglang: engine check/restart failed: %r", task.exception())


class EnginePool:
    def __init__(self, settings: SGLangSettings, model_dir: str, scratch: Path, *,
                 resync: Callable[[Server], Awaitable[int]], serving_version: Callable[[], int]):
        """`resync(server)` brings a freshly restarted server to the weights the others serve and returns
        that version (NeedsWeights when it cannot); `serving_version()` names it in errors."""
        self.settings, self.model_dir, self.scratch = settings, model_dir, scratch
        self._resync, self._serving_version = resync, serving_version
        self.servers = [Server(index=i, port=0, log_path=scratch / "logs" / f"engine-{i}.log")
                        for i in range(settings.section.num_engines)]
        self.procs: list[subprocess.Popen] = []  # every process started, restarts too: all are killed at the end
        self.closed = False                      # no more launches or requests
        # colocate mode: the memory tags the pool keeps released (the trainer holds the GPU); each server's own
        # are `Server.released`, which a launch empties (a fresh server holds all its memory)
        self.released: set[str] = set()

    # ---- start and stop ------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the HTTP client, launch every server, wait until all answer."""
        import httpx
        sec = self.settings.section
        self._client = httpx.AsyncClient(
            trust_env=False,  # never route loopback traffic through an HTTP(S)_PROXY
            timeout=httpx.Timeout(sec.request_timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=sec.concurrency * sec.num_engines + 8 * sec.num_engines,
                                max_keepalive_connections=sec.concurrency * sec.num_engines),
        )
        # health checks each on a connection of their own: SGLang's server (uvicorn) closes a connection after a 500
        # it answered for an uncaught exception, and a check sent on that pooled connection would read the close as
        # the server's death (seen on 0.5.17: a rejected request then restarted the server again and again)
        self._health_client = httpx.AsyncClient(trust_env=False, limits=httpx.Limits(max_keepalive_connections=0))
        self._cond = asyncio.Condition()
        for server in self.servers:
            self.launch(server)
        await asyncio.gather(*(wait_healthy(self._health_client, self.settings, self.model_dir, s)
                               for s in self.servers))

    def launch(self, server: Server) -> None:
        if self.closed:
            raise RuntimeError("SGLangEngine was shut down")
        taken = {s.port for s in self.servers if s is not server}
        self.procs.append(launch_server(self.settings, self.model_dir, server, taken))

    async def aclose(self) -> None:
        for client in (getattr(self, "_client", None), getattr(self, "_health_client", None)):
            if client is not None:
                await client.aclose()

    # ---- HTTP ----------------------------------------------------------------------------------

    async def post(self, server: Server, path: str, body: Any, timeout: float | None = None) -> Any:
        """POST to one server (http_protocol.post); `timeout` defaults to rollout.sglang.request_timeout_s."""
        sec = self.settings.section
        return await post(self._client, server.url(sec.host), path, body,
                          timeout if timeout is not None else sec.request_timeout_s, server.index,
                          log_from=log_size(server.log_path))

    async def logprobs(self, server: Server, prompt_ids: list[int], response_ids: list[int], temperature: float,
                       expected_version: str | None = None) -> list[float]:
        """Teacher-forced log-probs of response_ids after prompt_ids, from one server."""
        out = await self.post(server, "/generate", logprobs_payload(prompt_ids, response_ids, temperature),
                              timeout=min(self.settings.section.request_timeout_s, 120.0))
        return parse_logprobs(out, server.index, response_ids, expected_version)

    # ---- request slots -------------------------------------------------------------------------

    async def acquire(self) -> Server:
        """A slot on the least-busy ready server; waits for one; TransientError when none can come back."""
        async with self._cond:
            while True:
                if self.closed:
                    raise RuntimeError("SGLangEngine was shut down")
                ready = [s for s in self.servers if s.state == READY and s.inflight < self.settings.section.concurrency]
                if ready:
                    server = min(ready, key=lambda x: (x.inflight, x.index))
                    server.inflight += 1
                    return server
                if all(s.state == DEAD for s in self.servers):
                    faults = "; ".join(f"engine {s.index}: {s.last_fault}" for s in self.servers)
                    raise TransientError(f"every SGLang engine is down after {self.settings.section.max_restarts} "
                                         f"restart(s) each ({faults}); logs under {self.scratch / 'logs'}")
                if all(s.state in (DEAD, STALE) for s in self.servers):
                    faults = "; ".join(f"engine {s.index} ({s.state}): {s.last_fault}" for s in self.servers)
                    raise TransientError(f"no SGLang engine serves weight version {self._serving_version()}: {faults}. "
                                         f"Stale engines serve again once weights reach them (a broadcast on a group "
                                         f"formed again, or update_weights)")
                await self._cond.wait()

    async def release(self, server: Server) -> None:
        async with self._cond:
            server.inflight -= 1
            self._cond.notify_all()

    async def set_state(self, server: Server, state: str) -> None:
        async with self._cond:
            server.state = state
            self._cond.notify_all()

    # ---- every server --------------------------------------------------------------------------

    async def all(self, fn) -> list:
        """Run fn(server) on every live server; a server fault restarts that server (which re-syncs it to
        the target weights) instead of failing the whole call."""
        attempts = self.settings.supervision.max_attempts

        async def one(s: Server):
            if s.fault_task is not None and not s.fault_task.done():
                await asyncio.shield(s.fault_task)  # a check or restart from earlier: let it finish first
            for _ in range(attempts):
                if s.state == DEAD:
                    return None
                epoch = s.epoch
                try:
                    return await fn(s)
                except EngineFault as exc:
                    task = self.on_fault(s, epoch, exc)
                    if task is not None:
                        await asyncio.shield(task)
                    if s.epoch != epoch and s.state == READY:
                        return "resynced"  # restarted after the target was set: it loaded the target weights
                    if s.epoch != epoch and s.state == STALE:
                        return None  # restarted, and could not be given the target weights
            raise TransientError(f"SGLang engine {s.index}: gave up after {attempts} tries")
        results = await asyncio.gather(*(one(s) for s in self.servers))
        if all(s.state == DEAD for s in self.servers):
            raise TransientError(f"every SGLang engine is down; logs under {self.scratch / 'logs'}")
        return results

    async def all_post(self, path: str, bodies: dict[int, dict]) -> list:
        """POST to every server at once, for the collective calls every server must take part in: a server
        fault fails the call (and gets the server checked) rather than being retried."""
        async def one(s: Server):
            epoch = s.epoch
            try:
                return await self.post(s, path, bodies[s.index])
            except EngineFault as exc:
                self.on_fault(s, epoch, exc)
                raise TransientError(f"SGLang engine {s.index} {path}: {exc}") from exc
        return await asyncio.gather(*(one(s) for s in self.servers))

    async def settle(self) -> None:
        """Restart the servers whose process has exited, and let the checks and restarts under way finish."""
        for s in self.servers:
            if s.proc is not None and s.proc.poll() is not None:
                self.on_fault(s, s.epoch, EngineFault(f"the server exited with code {s.proc.poll()}"))
        for s in self.servers:
            if s.fault_task is not None and not s.fault_task.done():
                await asyncio.shield(s.fault_task)

    # ---- memory (colocate mode: servers started with --enable-memory-saver) ---------------------

    def released_tags(self) -> set[str]:
        """The memory tags released on the pool (its target) or still released on a live server."""
        return set(self.released).union(*(s.released for s in self.servers if s.state != DEAD))

    async def release_memory(self) -> None:
        """Free every server's weights, KV cache and CUDA graphs (SGLang wants no request running: the cache is
        flushed first). The pool's target is set first: a server restarted meanwhile is released too."""
        self.released = set(MEMORY_TAGS)
        await self.all(lambda s: self._release(s, MEMORY_TAGS))

    async def resume_memory(self, tags: tuple[str, ...] | None = None) -> None:
        """Take back the released memory named by `tags` (None: all that is released) on every server, each only
        the tags it released (SGLang 0.5.17 answers a resume of a tag it holds with a 500). The target is set
        first: a server restarted meanwhile is released only to what stays released."""
        tags = tuple(t for t in MEMORY_TAGS if t in self.released_tags()) if tags is None else tags
        if not tags:
            return
        self.released -= set(tags)
        await self.all(lambda s: self._resume(s, tags))

    async def _release(self, s: Server, tags) -> None:
        mine = [t for t in tags if t not in s.released]
        if not mine:
            return
        await self.post(s, "/flush_cache", None)
        await self.post(s, "/release_memory_occupation", {"tags": mine})
        s.released |= set(mine)

    async def _resume(self, s: Server, tags) -> None:
        mine = [t for t in tags if t in s.released]
        if not mine:
            return
        await self.post(s, "/resume_memory_occupation", {"tags": mine})
        s.released -= set(mine)

    # ---- supervision ---------------------------------------------------------------------------

    async def judge(self, server: Server, epoch: int, exc: EngineFault) -> None:
        """A request on `server` (sent in `epoch`) failed with `exc`: have the server checked (on_fault). A 500
        from a server the check finds healthy, the same process still serving, is the request's fault:
        RequestRejected, named once, neither retried nor restarted for (SGLang 0.5.17 answers an unknown sampling
        key so). Any other fault returns at once: the check or restart goes on in the background."""
        task = self.on_fault(server, epoch, exc)
        if not isinstance(exc, ErrorAnswer) or task is None:
            return
        healthy = await asyncio.shield(task)
        if healthy and server.epoch == epoch:
            cause = log_error_since(server.log_path, exc.log_from) if exc.log_from is not None else None
            detail = exc.detail if cause is None else f"{exc.detail}; its log: {cause}"
            raise rejected_request(server.index, exc.path, 500, detail) from None

    def on_fault(self, server: Server, epoch: int, exc: Exception) -> asyncio.Task | None:
        """A request on `server` (sent in `epoch`) failed: check the server once, restart it if it is down or
        serves stale weights. Concurrent failures share one check; one from before the last restart is
        ignored. Marks the server unavailable at once; returns the task doing the check."""
        s = server
        if s.epoch == epoch and s.state in (READY, STALE) and (s.fault_task is None or s.fault_task.done()):
            prior, s.state = s.state, CHECKING
            s.last_fault = str(exc)
            s.fault_task = asyncio.ensure_future(self._check_or_restart(s, str(exc), isinstance(exc, StaleWeights), prior))
            s.fault_task.add_done_callback(_log_task_error)
        return s.fault_task

    async def _check_or_restart(self, s: Server, reason: str, force: bool, prior: str = READY) -> bool:
        """True: the server answered its health check (and serves on); False: it was restarted."""
        if not force and s.proc is not None and s.proc.poll() is None:
            try:
                r = await self._health_client.get(s.url(self.settings.section.host, "/health_generate"),
                                                  timeout=self.settings.supervision.health_timeout_s)
                if r.status_code == 200:
                    log.warning("sglang engine %d: a request failed (%s) but the engine is healthy", s.index, reason)
                    await self.set_state(s, prior)  # a stale server stays stale
                    return True
                reason = f"{reason}; /health_generate answered {r.status_code}"
            except Exception as exc:  # noqa: BLE001 - any failure of the check is the server's
                reason = f"{reason}; /health_generate failed: {type(exc).__name__}: {exc}"
        await self._restart(s, reason)
        return False

    async def _restart(self, s: Server, reason: str) -> None:
        sec, sup = self.settings.section, self.settings.supervision
        await self.set_state(s, RESTARTING)
        while True:
            log.warning("sglang engine %d (pid %s) is down or not answering (%s); killing it", s.index, s.pid, reason)
            await asyncio.to_thread(terminate_process, s.proc, sup.kill_grace_s)
            if s.restarts >= sec.max_restarts:
                s.last_fault = f"{reason}; no restarts left (rollout.sglang.max_restarts={sec.max_restarts})"
                await self.set_state(s, DEAD)
                return
            s.restarts += 1
            needs: NeedsWeights | None = None
            try:
                self.launch(s)
                await wait_healthy(self._health_client, self.settings, self.model_dir, s)
                try:
                    version = await self._resync(s)
                except NeedsWeights as exc:
                    needs = exc
                # a fresh server holds all its memory (SGLang 0.5.17 cannot start released): while the pool is
                # released (the trainer holds the GPU) it gives back what the others gave before it serves, and
                # takes part in the next resume like them
                await self._release(s, tuple(t for t in MEMORY_TAGS if t in self.released))
            except SGLangError as exc:  # a consistency fault: restarting again will not fix it
                s.last_fault = f"restart {s.restarts}: {exc}"
                log.error("sglang engine %d: %s", s.index, s.last_fault)
                await asyncio.to_thread(terminate_process, s.proc, sup.kill_grace_s)
                await self.set_state(s, DEAD)
                return
            except (ModelError, TransientError, EngineFault) as exc:
                reason = f"restart {s.restarts} failed: {exc}"
                s.last_fault = reason
                continue
            if needs is not None:
                s.last_fault = f"restart {s.restarts}: {needs}"
                log.warning("sglang engine %d restarted (pid %d) but %s: it gets no requests until new weights "
                            "reach it (a broadcast on a group it joined, or update_weights)", s.index, s.pid, needs)
                await self.set_state(s, STALE)
                return
            log.warning("sglang engine %d restarted (pid %d) and serves weight version %d", s.index, s.pid, version)
            await self.set_state(s, READY)
            return

    # ---- reporting -----------------------------------------------------------------------------

    def health_rows(self) -> list[dict]:
        host = self.settings.section.host
        return [{"index": s.index, "url": s.url(host), "pid": s.pid, "state": s.state,
                 "alive": s.proc is not None and s.proc.poll() is None, "restarts": s.restarts,
                 "released": [t for t in MEMORY_TAGS if t in s.released], "last_fault": s.last_fault, "log": str(s.log_path)} for s in self.servers]
