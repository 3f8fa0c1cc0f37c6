"""`SGLangEngine`: `rollout.engine: sglang` behind the RolloutEngine interface - a pool of SGLang servers
(engine_pool.py) fed over SGLang's HTTP API (http_protocol.py) and kept on the trainer's weights
(weight_sync.py).

The API is synchronous: a private asyncio loop in a daemon thread runs the HTTP traffic (httpx), and
every public method takes one lock, so calls from several threads are served one after another.
`generate` sends one request per sample, returns one result per request in request order, retries a
failed request (same seed) on whichever server is ready, or raises. Partial rollout's continued samples
and `until` (stop once enough groups are complete, abort the rest) are described in partial.py.

Memory (colocate mode, `cluster.colocate`): the servers start with `--enable-memory-saver`;
`release_memory()` frees their GPU memory (weights, KV cache, CUDA graphs) for training and `resume_memory()`
takes it back. `generate`, `logprobs_of` and the weight updates take it back by themselves when it is
released (an update resumes the weights first and the rest after the new weights are in). Released weights
are lost (SGLang keeps no copy), so a resume with no update loads the current version from disk again.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import threading
import weakref
from pathlib import Path

import torch

from runtime.config import GrpoConfig
from runtime.errors import ConfigError, ModelError, TransientError
from runtime.rollout.base import GroupsDone, RolloutEngine, SampleRequest, SampleResult, SamplingParams
from runtime.rollout.sglang.engine_pool import EnginePool
from runtime.rollout.sglang.http_protocol import Aborted, EngineFault, SGLangError, abort_payload, parse_generated
from runtime.rollout.sglang.partial import Continuation, GroupsWatch, ModelTokens
from runtime.rollout.sglang.routes import RouteLayout
from runtime.rollout.sglang.server_process import DEAD, READY, Server, kill_all
from runtime.rollout.sglang.settings import INSTALL_HINT, SGLangSettings, check_sglang_installed
from runtime.rollout.sglang.weight_sync import EngineWeights

log = logging.getLogger(__name__)
ABORT_TIMEOUT_S = 30.0  # one /abort_request; SGLang answers it at once


class _LoopThread:
    """One private asyncio loop in a daemon thread: the sync API submits coroutines to it."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="grpoflow-sglang-client", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self, last=None) -> None:
        """Cancel whatever still runs (a caller blocked in run() gets CancelledError), run `last`, stop."""
        if self.loop.is_closed():
            return

        async def _wind_down():
            me = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not me]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if last is not None:
                await last()

        try:
            asyncio.run_coroutine_threadsafe(_wind_down(), self.loop).result(timeout=30)
        except Exception:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()


class SGLangEngine(RolloutEngine):
    """A pool of SGLang servers behind the RolloutEngine interface."""

    @classmethod
    def from_config(cls, cfg: GrpoConfig, model_dir: str) -> "SGLangEngine":
        return cls(SGLangSettings.from_config(cfg), model_dir)

    def __init__(self, settings: SGLangSettings, model_dir: str):
        self.settings = settings
        check_sglang_installed(settings)
        try:
            import httpx  # noqa: F401  (prefect and sglang both bring it)
        except ImportError:
            raise ConfigError(f"the SGLang backend needs httpx, which is not installed: {INSTALL_HINT}") from None
        if not model_dir:
            raise ModelError("SGLangEngine needs model_dir: an HF checkpoint directory (or hub id) SGLang can load")
        self.model_dir = str(model_dir)
        self.model_tokens = ModelTokens.read(self.model_dir)  # to tell a finished carried sample from a cut one
        # rollout.routing_replay: the experts of every token, from servers started to return them (routes.py);
        # None when off, or for a dense model (nothing to record, as in the built-in engine)
        self.route_layout = RouteLayout.read(self.model_dir) if settings.routing_replay else None
        scratch_dir = settings.section.scratch_dir
        self._own_scratch = scratch_dir is None
        base = Path(scratch_dir) if scratch_dir else Path(tempfile.gettempdir())
        base.mkdir(parents=True, exist_ok=True)
        self.scratch = Path(tempfile.mkdtemp(prefix="grpoflow-sglang-", dir=base))
        (self.scratch / "logs").mkdir()
        (self.scratch / "weights").mkdir()
        self._lock = threading.RLock()
        self._start_failed = False
        self._loop = _LoopThread()
        self.pool = EnginePool(settings, self.model_dir, self.scratch,
                               resync=lambda server: self.weights.resync(server),
                               serving_version=lambda: self.weights.version)
        self.weights = EngineWeights(self.pool, self.model_dir, self.scratch, self._loop.run)
        self._finalizer = weakref.finalize(self, kill_all, self.pool.procs, 5.0)  # no server outlives the engine
        try:
            self._loop.run(self._astart())
        except BaseException:
            self._start_failed = True
            self.shutdown()
            raise

    async def _astart(self) -> None:
        await self.pool.start()
        await self.weights.check_startup()
        for server in self.pool.servers:
            server.state = READY

    # ---- RolloutEngine -----------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self.weights.version

    def generate(self, requests: list[SampleRequest], sampling: SamplingParams,
                 until: GroupsDone | None = None) -> list[SampleResult]:
        """One result per request, in request order. A request with `prefix_ids` is continued after them
        (partial.py); with `until`, the requests still running once enough groups are complete are aborted
        and come back with their tokens so far (finish "abort"). For a continued sample `text` is SGLang's
        text of the new tokens only."""
        with self._lock:
            self._check_open()
            if not requests:
                return []
            self._resume_if_released()
            return self._loop.run(self._agenerate(list(requests), sampling, until))

    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        """Write the tensors to disk, load them into every server, verify; then weight_version == version."""
        with self._lock:
            self._check_open()
            self.weights.update_weights(named_tensors, version)

    def health(self) -> dict:
        engines = self.pool.health_rows()
        return {
            "ok": not self.pool.closed and all(e["alive"] and e["state"] == READY for e in engines),
            "engine": "sglang",
            "weight_version": self.weights.version,
            "model_dir": self.model_dir,
            "weights_dir": str(self.weights.weights_dir) if self.weights.weights_dir else None,
            "released": bool(self.pool.released_tags()),
            "records_routes": self.route_layout is not None,  # rollout.routing_replay
            "weight_sync_group": self.weights.sync.name if self.weights.sync else None,
            "engines": engines,
        }

    def shutdown(self) -> None:
        pool = self.pool
        if pool.closed:
            return
        pool.closed = True  # no more launches from here on
        grace = self.settings.supervision.kill_grace_s
        kill_all(pool.procs, grace)
        for server in pool.servers:
            server.state = DEAD
        self._loop.close(last=pool.aclose)
        kill_all(pool.procs, grace)  # anything a restart launched meanwhile
        shutil.rmtree(self.scratch / "weights", ignore_errors=True)
        troubled = any(s.restarts or s.last_fault for s in pool.servers) or self._start_failed
        if self._own_scratch and not troubled:  # keep the server logs of a run that had trouble
            shutil.rmtree(self.scratch, ignore_errors=True)

    def __enter__(self) -> "SGLangEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- memory (colocate mode) ----------------------------------------------------------------

    def release_memory(self) -> None:
        """Colocate mode: free the servers' GPU memory (weights, KV cache, CUDA graphs) for the trainer
        (`/flush_cache`, then `/release_memory_occupation`), each server what it still holds: a release that failed
        part-way is finished by the next call. No-op otherwise, or when every server is released already."""
        with self._lock:
            self._check_open()
            if not self.settings.colocate:
                return
            self._loop.run(self.pool.release_memory())

    def resume_memory(self) -> None:
        """Take the released GPU memory back (`/resume_memory_occupation`, every released tag): call it where
        the loop wants the memory back, e.g. after the trainer gave its own up and before the next rollout,
        so that a failure to get it back shows there. No-op when nothing is released."""
        with self._lock:
            self._check_open()
            self._resume_if_released()

    def _resume_if_released(self) -> None:
        released = self.pool.released_tags()
        if "weights" in released:
            self._loop.run(self.weights.reload())  # released weights come back as uninitialised memory
        elif released:
            self._loop.run(self.pool.resume_memory())

    # ---- extras ------------------------------------------------------------------------------

    @property
    def pids(self) -> list[int | None]:
        return [s.pid for s in self.pool.servers]

    @property
    def urls(self) -> list[str]:
        return [s.url(self.settings.section.host) for s in self.pool.servers]

    def logprobs_of(self, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0) -> list[float]:
        """Teacher-forced log-probs of response_ids after prompt_ids under log_softmax(logits / T), from one server."""
        with self._lock:
            self._check_open()
            if not response_ids:
                return []
            self._resume_if_released()
            return self._loop.run(self._alogprobs_any(list(prompt_ids), list(response_ids), temperature))

    # ---- weight sync over a torch.distributed group (cluster.weight_sync: broadcast) ---------

    def weight_sync_ranks(self) -> int:
        """Ranks the servers take in a weight-sync group: one per TP rank of every server."""
        return self.weights.ranks()

    def init_weight_sync(self, host: str, port: int, rank_offset: int, world_size: int, group_name: str,
                         backend: str | None = None) -> None:
        """Have every server join the group `group_name` hosted at host:port (`/init_weights_update_group`),
        server i as ranks rank_offset + i * tp_size ...; returns once all have joined, which takes the
        trainer's rank 0 joining too (from another process or thread). Servers leave the group they
        were in before (`/destroy_weights_update_group`). Stale servers join like the others: the next
        broadcast brings them to the current weights. `backend`: settings.sync_backend by default."""
        with self._lock:
            self._check_open()
            self.weights.init_weight_sync(host, port, rank_offset, world_size, group_name, backend)

    def weight_sync_ready(self) -> bool:
        """Whether receive_weights can run now: every server is in the current group, as the process that
        joined it, and no broadcast on it failed. False after a restart: form the group again first."""
        with self._lock:
            self._check_open()
            return self.weights.weight_sync_ready()

    def receive_weights(self, metadata, version: int) -> None:
        """Have every server receive the tensors of `metadata` ((name, dtype, shape) in the order trainer
        rank 0 broadcasts them) over the current group (`/update_weights_from_distributed`), verify,
        then weight_version == version. Blocks until the servers have them.

        Refuses at once (SGLangError) when the group cannot carry the broadcast (weight_sync_ready()
        is False). When the broadcast or the check after it fails, no server serves until weights
        reach them again (a new group and a broadcast, or update_weights)."""
        with self._lock:
            self._check_open()
            self.weights.receive_weights(metadata, version)

    # ---- internals ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.pool.closed:
            raise RuntimeError("SGLangEngine was shut down; build a new one")

    async def _agenerate(self, requests: list[SampleRequest], sampling: SamplingParams,
                         until: GroupsDone | None) -> list[SampleResult]:
        expected = str(self.weights.version)
        plans = [Continuation.of(r, sampling, self.model_tokens, self.route_layout) for r in requests]
        watch = GroupsWatch(until, [p.finished is not None for p in plans])
        tasks = [asyncio.ensure_future(self._aone(i, p, sampling, expected, watch)) for i, p in enumerate(plans)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _aone(self, index: int, plan: Continuation, sampling: SamplingParams, expected: str,
                    watch: GroupsWatch) -> SampleResult:
        if plan.finished is not None:
            return plan.as_given()
        pool, attempts = self.pool, self.settings.supervision.max_attempts
        problems: list[str] = []
        for _ in range(attempts):
            if watch.reached:  # enough groups are complete: this one is not (re)sent
                return plan.as_given()
            server = await pool.acquire()
            epoch = server.epoch
            try:
                if watch.reached:  # reached while this one waited for a slot
                    return plan.as_given()
                payload = plan.payload(sampling)
                watch.sending(index, server, payload["rid"])
                body = await pool.post(server, "/generate", payload)
                # once enough groups are complete every abort is one the client asked for (or as good as one):
                # the tokens made so far are this sample's result. Before that, an abort is SGLang's own: retry.
                got = parse_generated(body, expected, abort_ok=watch.reached)
                if got.finish != "abort":
                    await self._abort(watch.complete(index))
                return plan.result(got, server.index)
            except Aborted as exc:
                problems.append(f"engine {server.index}: aborted ({exc})")
            except EngineFault as exc:
                problems.append(f"engine {server.index}: {exc}")
                # checked; restarted in the background and retried elsewhere now, or RequestRejected (a 500 from a
                # healthy server: the request's fault; it ends the call, as a 4xx does)
                await pool.judge(server, epoch, exc)
            finally:
                watch.settled(index)
                await pool.release(server)
        if watch.reached:  # its tries failed, but it is one of the requests no longer needed
            return plan.as_given()
        raise TransientError(f"SGLang request key={plan.request.key} failed {attempts} times: {' | '.join(problems)}")

    async def _abort(self, running: list[tuple[Server, str]]) -> None:
        """POST /abort_request for each (server, rid). A failed abort only costs time: that request runs to its
        end and comes back complete (a dead server fails the request itself, which then comes back cut)."""
        async def one(server: Server, rid: str) -> None:
            try:
                await self.pool.post(server, "/abort_request", abort_payload(rid), timeout=ABORT_TIMEOUT_S)
            except (EngineFault, SGLangError) as exc:
                log.warning("sglang engine %d: /abort_request for %s failed (%s); it runs to its end", server.index,
                            rid, exc)
        await asyncio.gather(*(one(server, rid) for server, rid in running))

    async def _alogprobs_any(self, prompt_ids, response_ids, temperature) -> list[float]:
        pool = self.pool
        for _ in range(self.settings.supervision.max_attempts):
            server = await pool.acquire()
            epoch = server.epoch
            try:
                return await pool.logprobs(server, prompt_ids, response_ids, temperature)
            except EngineFault as exc:
                await pool.judge(server, epoch, exc)
            finally:
                await pool.release(server)
        raise TransientError("SGLang logprobs_of failed on every try")
