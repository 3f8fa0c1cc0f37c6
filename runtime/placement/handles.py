"""Typed handles on the trainer ranks and the rollout engines, whatever group holds them.

The loop calls named methods here; each runs the actor method of the same name and signature on
every member of the group (tests/test_architecture.py checks the signatures match). A trainer method
returns rank 0's result: the ranks hold one model, so their answers agree.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, TypeVar

from runtime.placement.groups import ActorGroup, Pending

if TYPE_CHECKING:
    import torch

    from runtime.rollout.base import GroupsDone, SampleRequest, SampleResult, SamplingParams
    from runtime.trainer.batch import TrainBatch

F = TypeVar("F", bound=Callable[..., Any])


def forwards(method: F) -> F:
    """Mark a handle method as running the actor method of the same name (checked by tests)."""
    method.forwards_to_actor = True  # type: ignore[attr-defined]
    return method


class TrainerHandle:
    """Every rank of the policy trainer (runtime/trainer/megatron_trainer.py:MegatronTrainer)."""

    def __init__(self, group: ActorGroup):
        self.group = group

    # -- lifecycle -----------------------------------------------------------------------------
    @forwards
    def ping(self) -> bool:
        return all(self.group.call("ping"))

    @forwards
    def pid(self) -> int:
        return self.group.call("pid")[0]

    def kill(self) -> None:
        self.group.kill()

    # -- training ------------------------------------------------------------------------------
    @forwards
    def train(self, batch: TrainBatch) -> dict[str, Any]:
        return self.group.call("train", batch)[0]

    @forwards
    def compute_logprobs(self, batch: TrainBatch, which: str = "policy") -> list[list[float]]:
        return self.group.call("compute_logprobs", batch, which)[0]

    @forwards
    def save(self, path: str) -> None:
        self.group.call("save", path)

    @forwards
    def save_begin(self, path: str, background: bool = True) -> dict[str, float]:
        """Every rank plans the save and copies its state to the host; the slowest rank's stall and each of its
        parts' slowest (``plan_s``, ``host_copy_s``, ``pin_s``, ``reload_s``)."""
        began = self.group.call("save_begin", path, background)
        return {k: max(b.get(k, 0.0) for b in began) for k in began[0]}

    @forwards
    def save_done(self) -> bool:
        """Whether every rank's files of the save under way are written."""
        return all(self.group.call("save_done"))

    @forwards
    def save_finish(self) -> dict[str, Any]:
        """Every rank's files written and the save finalized: every file written (size, sha256) and the slowest
        rank's write and hash seconds."""
        done = self.group.call("save_finish")
        return {"files": {k: v for d in done for k, v in d["files"].items()},
                "write_s": max(d["write_s"] for d in done), "hash_s": max(d["hash_s"] for d in done)}

    @forwards
    def load(self, path: str) -> None:
        self.group.call("load", path)

    # -- memory hand-off with a colocated engine -------------------------------------------------
    @forwards
    def offload_state(self, force: bool = False) -> dict[str, float]:
        return self.group.call("offload_state", force)[0]

    @forwards
    def reload_state(self) -> dict[str, float]:
        return self.group.call("reload_state")[0]

    # -- weights to the engines ----------------------------------------------------------------
    @forwards
    def hf_weights(self, to_cpu: bool = True) -> dict[str, torch.Tensor]:
        return self.group.call("hf_weights", to_cpu)[0]

    @forwards
    def share_next_weight_unit(self, expert_shards: int = 1) -> list:
        """Every rank's next unit of `engine_weights` as CUDA IPC handles (cuda_ipc.SharedTensors), in rank order;
        [None, ...] after the last. ``expert_shards``: of the experts, each rank's GPU's engine shard's only."""
        return self.group.call("share_next_weight_unit", expert_shards)

    @forwards
    def release_shared_weights(self, end: bool = False) -> None:
        self.group.call("release_shared_weights", end)

    @forwards
    def engine_weights(self, to_cpu: bool = True) -> dict[str, torch.Tensor]:
        return self.group.call("engine_weights", to_cpu)[0]

    @forwards
    def shared_base(self) -> dict[str, torch.Tensor]:
        """The trainer's frozen base tensors themselves: only for an engine in the same process (LocalGroup)."""
        return self.group.call("shared_base")[0]

    @forwards
    def weight_sync_address(self) -> tuple[str, int]:
        return self.group.call("weight_sync_address")[0]

    @forwards
    def weights_metadata(self) -> list:
        return self.group.call("weights_metadata")[0]

    @forwards
    def init_weight_sync(self, host: str, port: int, world_size: int, group_name: str) -> Pending:
        """Starts the join and returns at once: it completes only when the engines join too."""
        return self.group.submit("init_weight_sync", host, port, world_size, group_name)

    @forwards
    def broadcast_weights(self) -> Pending:
        """Starts rank 0's broadcast and returns at once: it runs while the engines receive."""
        return self.group.submit("broadcast_weights")


class EngineHandle:
    """The rollout engine(s) (runtime/rollout/base.py:RolloutEngine), one or a data-parallel pool.

    One member (the built-in engine, or SGLangEngine with its own servers): every call goes to it. Several
    (built-in engines, one per rollout GPU): `generate` gives each replica a contiguous share of the requests,
    whole groups each, balanced by count (runtime/rollout/sharding.py), and merges the results back in
    request order. A replica is one engine, or with ``expert_shards`` > 1 that many consecutive engines, each
    holding a shard of the experts (runtime/rollout/expert_shards.py): they are given the same share and step
    together, and the first one's results are the replica's. With `until` the replicas step together
    (start/advance/finish_generation, one check point per round each) and the pool stops at the first round after
    which `until` holds over all of their requests: where it stops depends on the requests, settings, weights and
    the number of replicas, never on timing. Weights, memory calls and the weight-sync group reach every member;
    `logprobs_of` asks the first replica.
    """

    def __init__(self, group: ActorGroup, expert_shards: int = 1):
        self.group = group
        self.shards = int(expert_shards)
        if len(group) % self.shards:
            raise ValueError(f"{len(group)} engines do not make replicas of {self.shards} expert shards")
        self._call: _PoolCall | None = None  # the stepped call under way on a pool

    @property
    def engines(self) -> int:
        return len(self.group)

    @property
    def replicas(self) -> int:
        return len(self.group) // self.shards

    def kill(self) -> None:
        self.group.kill()

    def _each_member(self, per_replica: list) -> list:
        """One argument tuple (or None: no call) per replica, given to every engine of it."""
        return [per_replica[i // self.shards] for i in range(self.engines)]

    def _shares(self, shares: list[range], requests: list[SampleRequest], sampling: SamplingParams) -> list:
        """Each engine's (requests, sampling): its replica's share (None: an empty one, no call)."""
        return self._each_member([(requests[s.start:s.stop], sampling) if s else None for s in shares])

    def _firsts(self, per_member: list) -> list:
        """The replicas' answers: each one's first engine's."""
        return per_member[::self.shards]

    # -- generation ----------------------------------------------------------------------------
    @forwards
    def generate(self, requests: list[SampleRequest], sampling: SamplingParams,
                 until: GroupsDone | None = None) -> list[SampleResult]:
        if self.engines == 1:
            return self.group.call("generate", requests, sampling, until)[0]
        if until is not None:  # the stop must see every engine's progress: step them together
            from runtime.rollout.base import drive_generation
            return drive_generation(self, requests, sampling, until)
        out = self.group.submit_each("generate", self._shares(self._split(requests), requests, sampling)).get()
        return [r for part in self._firsts(out) if part for r in part]

    @forwards
    def start_generation(self, requests: list[SampleRequest], sampling: SamplingParams) -> None:
        if self.engines == 1:
            self.group.call("start_generation", requests, sampling)
            return
        shares = self._split(requests)
        self._call = _PoolCall(shares)
        self.group.submit_each("start_generation", self._shares(shares, requests, sampling)).get()

    @forwards
    def advance_generation(self) -> list[bool] | None:
        if self.engines == 1:
            return self.group.call("advance_generation")[0]
        call = self._pool_call()
        live = [None if call.ended[i] else () for i in range(len(call.shares))]
        answers = self._firsts(self.group.submit_each("advance_generation", self._each_member(live)).get())
        for i, flags in enumerate(answers):
            if live[i] is None:
                continue
            if flags is None:  # that replica's share is finished, every request of it
                call.ended[i], call.done[i] = True, [True] * len(call.shares[i])
            else:
                call.done[i] = list(flags)
        return None if all(call.ended) else [d for flags in call.done for d in flags]

    @forwards
    def finish_generation(self) -> list[SampleResult]:
        if self.engines == 1:
            return self.group.call("finish_generation")[0]
        call, self._call = self._pool_call(), None
        out = self.group.submit_each("finish_generation", self._each_member([() if s else None for s in call.shares]))
        return [r for part in self._firsts(out.get()) if part for r in part]

    def _split(self, requests: list[SampleRequest]) -> list[range]:
        from runtime.rollout.sharding import split_ranges
        return split_ranges(requests, self.replicas)

    def _pool_call(self) -> _PoolCall:
        if self._call is None:
            raise RuntimeError("no generate call under way on the engine pool: start_generation first")
        return self._call

    @forwards
    def logprobs_of(self, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0) -> list[float]:
        first = (prompt_ids, response_ids, temperature)
        return self.group.submit_each("logprobs_of", self._each_member([first] + [None] * (self.replicas - 1))).get()[0]

    @forwards
    def health(self) -> dict:
        each = self.group.call("health")
        if len(each) == 1:
            return each[0]
        return {**each[0], "ok": all(h.get("ok") for h in each),
                "weight_version": min(h["weight_version"] for h in each), "engines": each}

    @forwards
    def release_memory(self) -> None:
        self.group.call("release_memory")

    @forwards
    def resume_memory(self) -> None:
        self.group.call("resume_memory")

    # -- weights from the trainer --------------------------------------------------------------
    @forwards
    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        self.group.call("update_weights", named_tensors, version)

    @forwards
    def update_weights_shared(self, shared: list, version: int) -> None:
        """Engine i reads `shared[i]` (the CUDA IPC handles of the trainer rank on its GPU) in place."""
        self.group.submit_each("update_weights_shared", [(s, version) for s in shared[:self.engines]]).get()

    @forwards
    def weight_sync_ranks(self) -> int:
        return sum(self.group.call("weight_sync_ranks"))

    @forwards
    def init_weight_sync(self, host: str, port: int, rank_offset: int, world_size: int, group_name: str) -> None:
        """Every member joins at once (a join returns only when all ranks have), member i after the ranks
        of the members before it."""
        offsets, at = [], rank_offset
        for ranks in self.group.call("weight_sync_ranks"):
            offsets.append(at)
            at += ranks
        self.group.submit_each("init_weight_sync",
                               [(host, port, off, world_size, group_name) for off in offsets]).get()

    @forwards
    def weight_sync_ready(self) -> bool:
        return all(self.group.call("weight_sync_ready"))

    @forwards
    def receive_weights(self, metadata: list, version: int) -> None:
        self.group.call("receive_weights", metadata, version)


class _PoolCall:
    """A stepped generate call on a pool: each replica's share of the requests, its done flags at its last
    check point, and whether its call has ended (an empty share has nothing to do)."""

    def __init__(self, shares: list[range]):
        self.shares = shares
        self.done = [[False] * len(s) for s in shares]
        self.ended = [not s for s in shares]
