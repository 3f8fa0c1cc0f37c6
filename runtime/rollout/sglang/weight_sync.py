"""New weights into every SGLang server, and the check that each serves them.

- `update_weights` writes the tensors as safetensors under the scratch dir and has every server load them
  with `/update_weights_from_disk` (`rollout.sglang.weight_sync: tensor` pushes them with
  `/update_weights_from_tensor` instead, for servers on the trainer's host; the disk copy is still
  written, for re-syncing a restarted server).
- `cluster.weight_sync: broadcast` (runtime/placement/weight_sync.py): `init_weight_sync` has every server
  join a torch.distributed group with trainer rank 0 (`/init_weights_update_group`; server i's ranks
  start at rank_offset + i * tp_size), and `receive_weights` has them take the trainer's broadcast
  (`/update_weights_from_distributed`; each server joins as rank `rank_offset + tp_rank`, receives every
  tensor of an update, one broadcast each in the order named, and only then loads them - SGLang's
  `model_runner.py`). No copy exists on disk then, so a server that restarts cannot be re-synced by this
  client: it stays up but gets no requests ("stale") and the group is broken (`weight_sync_ready()` is
  false; `receive_weights` refuses at once) until the group is formed again with it (`init_weight_sync`,
  then a broadcast) or `update_weights` loads weights from disk into every server. A failed broadcast
  leaves every server stale the same way.
- After every update the servers are probed: each must report the new `weight_version` and the same
  log-probs for fixed tokens; log-probs that did not move are warned about.
- Memory released in colocate mode comes back around a load: the weights first, then the rest (KV cache,
  CUDA graphs) after the new weights are in.

The public methods block (they run their coroutines on the engine's loop through `run`) and are called
under the engine's lock.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from runtime.errors import ConfigError
from runtime.placement.weight_sync import as_metadata
from runtime.rollout.sglang.engine_pool import EnginePool, NeedsWeights
from runtime.rollout.sglang.http_protocol import SGLangError
from runtime.rollout.sglang.server_process import DEAD, READY, STALE, Server

log = logging.getLogger(__name__)

# Fixed tokens whose log-probs show which weights a server serves (ids small enough for any vocab).
PROBE_IDS = (1, 5, 2, 8, 3, 13, 21, 4)
PROBE_TOLERANCE = 0.02  # max |Δ logprob| between servers serving the same weights (bf16 noise)


@dataclass
class SyncGroup:
    """The weight-sync group the servers joined (init_weight_sync)."""

    name: str
    members: dict[int, int]   # server index -> its epoch when it joined; a restart leaves the group
    broken: str = ""          # why it can carry no more broadcasts (a failed one), else ""


class EngineWeights:
    def __init__(self, pool: EnginePool, model_dir: str, scratch: Path, run: Callable):
        self.pool, self.model_dir, self.scratch, self._run = pool, model_dir, scratch, run
        self.version = 0                                   # what every ready server serves
        self._target: tuple[int, Path | None] = (0, None)  # (version, weights dir) a server must serve
        self._target_disk_version = 0                      # the version the target dir holds
        self.weights_dir: Path | None = None               # the disk copy of `version`, if any
        self._probe: list[float] | None = None             # probe log-probs of the current version
        self.sync: SyncGroup | None = None                 # cluster.weight_sync: broadcast

    @property
    def tp_size(self) -> int:
        return self.pool.settings.section.tp_size

    # ---- from the trainer's host: disk or CUDA IPC ---------------------------------------------

    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        """Write the tensors to disk, load them into every server, verify; then self.version == version."""
        version = int(version)
        path = self._write(named_tensors, version)
        previous = self._target, self._target_disk_version
        self._target, self._target_disk_version = (version, path), version
        try:
            if self.pool.settings.section.weight_sync == "tensor":
                route, body = "/update_weights_from_tensor", {"serialized_named_tensors": self._tensor_payload(named_tensors),
                                                              "flush_cache": True, "weight_version": str(version)}
            else:
                route, body = "/update_weights_from_disk", {"model_path": str(path), "weight_version": str(version),
                                                            "flush_cache": True, "abort_all_requests": False}
            self._run(self._load(version, lambda: self.pool.all(lambda s: self.pool.post(s, route, body))))
        except BaseException:
            self._target, self._target_disk_version = previous
            shutil.rmtree(path, ignore_errors=True)
            raise
        old, self.weights_dir, self.version = self.weights_dir, path, version
        if old is not None and old != path:
            shutil.rmtree(old, ignore_errors=True)

    def _write(self, named_tensors: dict[str, torch.Tensor], version: int) -> Path:
        """`<scratch>/weights/v<version>/model.safetensors` (+ the model's config.json), written then renamed."""
        from safetensors.torch import save_file
        if not named_tensors:
            raise ValueError("update_weights: no tensors given")
        final = self.scratch / "weights" / f"v{version:08d}"
        tmp = self.scratch / "weights" / f".v{version:08d}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            seen: set[tuple[int, int]] = set()
            cpu: dict[str, torch.Tensor] = {}
            for name, t in named_tensors.items():
                t = t.detach()
                ident = (t.untyped_storage().data_ptr(), t.storage_offset()) if t.device.type == "cpu" else None
                t = t.to("cpu").contiguous()
                if ident is not None and ident in seen:  # tied weights share storage: safetensors refuses that
                    t = t.clone()
                if ident is not None:
                    seen.add(ident)
                cpu[name] = t
            save_file(cpu, str(tmp / "model.safetensors"), metadata={"format": "pt", "grpoflow_weight_version": str(version)})
            src = Path(self.model_dir) / "config.json"
            if src.is_file():
                shutil.copy2(src, tmp / "config.json")
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def _tensor_payload(self, named_tensors: dict[str, torch.Tensor]) -> list[str]:
        """`serialized_named_tensors` for /update_weights_from_tensor: base64 of torch's ForkingPickler dump
        of [(name, tensor), ...], one copy per TP rank (as sglang's Engine._serialize_tensors_per_rank).
        CUDA tensors travel as IPC handles, so the server must be on this host."""
        import io
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401  (registers the tensor reductions)
        buf = io.BytesIO()
        ForkingPickler(buf).dump([(name, t.detach()) for name, t in named_tensors.items()])
        data = base64.b64encode(buf.getvalue()).decode("ascii")
        return [data] * self.tp_size

    # ---- from trainer rank 0 over a torch.distributed group (cluster.weight_sync: broadcast) -------

    def ranks(self) -> int:
        """Ranks the servers take in a weight-sync group: one per TP rank of every server."""
        return self.pool.settings.section.num_engines * self.tp_size

    def init_weight_sync(self, host: str, port: int, rank_offset: int, world_size: int, group_name: str,
                         backend: str | None = None) -> None:
        """SGLangEngine.init_weight_sync."""
        if int(world_size) < int(rank_offset) + self.ranks():
            raise ConfigError(f"weight-sync group {group_name!r}: world_size {world_size} has no room for "
                              f"{self.ranks()} SGLang rank(s) from rank {rank_offset}")
        bodies = {s.index: {"master_address": host, "master_port": int(port),
                            "rank_offset": int(rank_offset) + s.index * self.tp_size, "world_size": int(world_size),
                            "group_name": group_name, "backend": backend or self.pool.settings.sync_backend}
                  for s in self.pool.servers}
        self._run(self._init_sync(group_name, bodies))

    def weight_sync_ready(self) -> bool:
        self._run(self.pool.settle())
        return not self._sync_problem()

    def receive_weights(self, metadata, version: int) -> None:
        """SGLangEngine.receive_weights."""
        self._run(self.pool.settle())
        problem = self._sync_problem()
        if problem:
            raise SGLangError(f"receive_weights: {problem}; form the group again (init_weight_sync) first")
        version = int(version)
        metadata = as_metadata(metadata)
        body = {"names": [n for n, _, _ in metadata],
                "dtypes": [str(d).removeprefix("torch.") for _, d, _ in metadata],
                "shapes": [list(shape) for _, _, shape in metadata],
                "group_name": self.sync.name, "weight_version": str(version), "flush_cache": True}
        previous = self._target
        self._target = (version, None)  # no copy on disk: a restart now leaves the server stale
        try:
            self._run(self._load(version, lambda: self.pool.all_post(
                "/update_weights_from_distributed", {s.index: body for s in self.pool.servers})))
        except BaseException as exc:
            self._target = previous
            if not self.pool.closed:
                try:
                    self._run(self._broadcast_failed(f"the broadcast of weight version {version} failed: {exc}"))
                except Exception:  # noqa: BLE001 - the first error is the one to report
                    log.exception("sglang: marking the engines stale after a failed broadcast failed")
            raise
        old, self.weights_dir, self.version = self.weights_dir, None, version
        if old is not None:  # an older version: of no use for re-syncing now
            shutil.rmtree(old, ignore_errors=True)

    def _sync_problem(self) -> str:
        """Why the servers cannot receive a broadcast now ("" when they can)."""
        sync = self.sync
        if sync is None:
            return "the engines are in no weight-sync group (init_weight_sync)"
        if sync.broken:
            return f"weight-sync group {sync.name!r} is broken: {sync.broken}"
        for s in self.pool.servers:
            if s.state == DEAD:
                return f"SGLang engine {s.index} of weight-sync group {sync.name!r} is down ({s.last_fault})"
            if sync.members.get(s.index) != s.epoch:
                return f"SGLang engine {s.index} restarted since it joined weight-sync group {sync.name!r}"
        return ""

    async def _init_sync(self, name: str, bodies: dict[int, dict]) -> None:
        pool = self.pool
        await pool.settle()
        old, self.sync = self.sync, None
        if old is not None:  # leave it, where the process that joined it is still there
            await asyncio.gather(*(self._leave(s, old.name) for s in pool.servers
                                   if old.members.get(s.index) == s.epoch and s.state != DEAD))
        down = [s for s in pool.servers if s.state == DEAD]
        if down:
            raise SGLangError(f"SGLang engine(s) {[s.index for s in down]} are down for good "
                              f"({'; '.join(s.last_fault for s in down)}): no weight-sync group of every engine can "
                              f"be formed")
        epochs = {s.index: s.epoch for s in pool.servers}
        await pool.all_post("/init_weights_update_group", bodies)
        self.sync = SyncGroup(name, epochs)

    async def _leave(self, s: Server, name: str) -> None:
        try:
            await self.pool.post(s, "/destroy_weights_update_group", {"group_name": name},
                                 timeout=self.pool.settings.supervision.health_timeout_s)
        except Exception as exc:  # noqa: BLE001 - a group left behind costs memory, not correctness
            log.warning("sglang engine %d: could not leave weight-sync group %r: %s", s.index, name, exc)

    async def _broadcast_failed(self, reason: str) -> None:
        """After a failed broadcast a server may hold part of the new weights (SGLang: "partially
        updated. Please discard the whole weights"): none serves, and the group is done with."""
        if self.sync is not None:
            self.sync.broken = reason
        for s in self.pool.servers:
            if s.state != DEAD:
                s.last_fault = reason
                await self.pool.set_state(s, STALE)

    # ---- loading and checking ------------------------------------------------------------------

    async def _load(self, version: int, send) -> None:
        """Load new weights into every server: resume released weights, `send()`, resume the rest (KV cache,
        CUDA graphs), verify. Stale servers take part, and serve again once the check shows the new weights."""
        pool = self.pool
        stale = {s.index: s.epoch for s in pool.servers if s.state == STALE}
        if "weights" in pool.released_tags():
            await pool.resume_memory(("weights",))
        await send()
        await pool.resume_memory()  # the KV cache and the CUDA graphs' memory
        await self._verify(version)
        for s in pool.servers:
            if s.state == STALE and stale.get(s.index) == s.epoch:
                s.last_fault = ""
                await pool.set_state(s, READY)

    async def reload(self) -> None:
        """Take back released memory whose weights must be loaded again: SGLang's memory saver keeps no copy of
        released weights (no `--enable-weights-cpu-backup`), so resumed weights are whatever the trainer left in
        that memory until loaded. The current version's disk copy (or the model dir at version 0) is loaded
        again, and the probe must give the current version's log-probs again."""
        version, path = self._target
        if version != self._target_disk_version:
            raise SGLangError(f"the SGLang engines' weights were released and weight version {version} came by "
                              f"broadcast, with no copy on disk to load again; set cluster.weight_sync: direct with "
                              f"cluster.colocate")
        source = str(path) if path is not None else self.model_dir
        before = self._probe
        await self._load(version, lambda: self.pool.all(lambda s: self.pool.post(
            s, "/update_weights_from_disk", {"model_path": source, "weight_version": str(version),
                                             "flush_cache": True, "abort_all_requests": False})))
        diff = 0.0 if before is None else max(abs(a - b) for a, b in zip(self._probe, before))
        if diff > PROBE_TOLERANCE:
            raise SGLangError(f"SGLang engines reloaded weight version {version} but their probe log-probs differ by "
                              f"{diff:.3g} from before the release")

    async def check_startup(self) -> None:
        """Every freshly started server serves version 0 and the same weights (their probes agree)."""
        probes = await asyncio.gather(*(self._probe_server(s) for s in self.pool.servers))
        self._check_agreement(probes, version=0)
        self._probe = probes[0]

    async def _verify(self, version: int) -> None:
        """Every server reports `version` and the same probe log-probs; warn if they did not move."""
        self._target = (version, self._target[1])
        probes = [p for p in await self.pool.all(self._probe_server) if isinstance(p, list)]
        if not probes:
            return
        self._check_agreement(probes, version)
        if self._probe is not None and version != self.version:
            moved = max(abs(a - b) for a, b in zip(probes[0], self._probe))
            if moved == 0.0:
                log.warning("sglang: the probe log-probs did not change from weight version %d to %d: the update "
                            "may not have reached the engines (or the weights did not change)", self.version, version)
        self._probe = probes[0]

    async def resync(self, s: Server) -> int:
        """Bring a freshly restarted server to the weights the others serve, check its probe, and return
        that version (the pool's `resync`)."""
        version, path = self._target
        if version != self._target_disk_version:
            raise NeedsWeights(f"weight version {version} came by broadcast and has no copy on disk")
        if path is not None:
            await self.pool.post(s, "/update_weights_from_disk",
                                 {"model_path": str(path), "weight_version": str(version), "flush_cache": True})
        probe = await self._probe_server(s)
        if self._probe is not None and self._target[0] == self.version:
            diff = max(abs(a - b) for a, b in zip(probe, self._probe))
            if diff > PROBE_TOLERANCE:
                raise SGLangError(f"SGLang engine {s.index} restarted but does not serve weight version {version}: "
                                  f"probe log-probs differ by {diff:.3g} from the other engines'")
        return version

    async def _probe_server(self, s: Server) -> list[float]:
        return await self.pool.logprobs(s, list(PROBE_IDS[:1]), list(PROBE_IDS[1:]), 1.0,
                                        expected_version=str(self._target[0]))

    def _check_agreement(self, probes: list[list[float]], version: int) -> None:
        for i, p in enumerate(probes[1:], start=1):
            diff = max(abs(a - b) for a, b in zip(p, probes[0]))
            if diff > PROBE_TOLERANCE:
                raise SGLangError(f"SGLang engines 0 and {i} disagree on the probe log-probs at weight version "
                                  f"{version} (max diff {diff:.3g}): they do not serve the same weights")
