"""Typed handles on the trainer ranks and the rollout engines, whatever group holds them.

The loop calls named methods here; each runs the actor method of the same name and signature on
every member of the group (tests/test_handles.py checks the signatures match). A trainer method
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
    """The rollout engine(s) (runtime/rollout/base.py:RolloutEngine)."""

    def __init__(self, group: ActorGroup):
        self.group = group

    def kill(self) -> None:
        self.group.kill()

    # -- generation ----------------------------------------------------------------------------
    @forwards
    def generate(self, requests: list[SampleRequest], sampling: SamplingParams,
                 until: GroupsDone | None = None) -> list[SampleResult]:
        return self.group.call("generate", requests, sampling, until)[0]

    @forwards
    def start_generation(self, requests: list[SampleRequest], sampling: SamplingParams) -> None:
        self.group.call("start_generation", requests, sampling)

    @forwards
    def advance_generation(self) -> list[bool] | None:
        return self.group.call("advance_generation")[0]

    @forwards
    def finish_generation(self) -> list[SampleResult]:
        return self.group.call("finish_generation")[0]

    @forwards
    def logprobs_of(self, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0) -> list[float]:
        return self.group.call("logprobs_of", prompt_ids, response_ids, temperature)[0]

    @forwards
    def health(self) -> dict:
        return self.group.call("health")[0]

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
    def weight_sync_ranks(self) -> int:
        return self.group.call("weight_sync_ranks")[0]

    @forwards
    def init_weight_sync(self, host: str, port: int, rank_offset: int, world_size: int, group_name: str) -> None:
        self.group.call("init_weight_sync", host, port, rank_offset, world_size, group_name)

    @forwards
    def weight_sync_ready(self) -> bool:
        return all(self.group.call("weight_sync_ready"))

    @forwards
    def receive_weights(self, metadata: list, version: int) -> None:
        self.group.call("receive_weights", metadata, version)
