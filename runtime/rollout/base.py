"""The rollout engine interface: what the trainer loop needs from whatever generates samples.

Kept small and serialisable (lists of ints and floats, no tensors across the boundary except in
`update_weights`) so the same contract fits the in-process `BuiltinEngine`, a Ray actor wrapping
it, and an SGLang server reached over HTTP.
"""

from __future__ import annotations

import abc
import operator
from dataclasses import dataclass, field
from typing import Literal

import torch

from runtime.errors import ConfigError

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1

# "abort": unfinished, stopped because enough groups were complete (`GroupsDone`); its tokens so far come back
FinishReason = Literal["stop", "length", "abort"]


@dataclass
class SamplingParams:
    """How to draw tokens. The eos token(s) of the model always stop a row, whatever stop_token_ids says.

    temperature 0 means greedy decoding. top_k -1 (or >= vocab) and top_p 1.0 disable filtering.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ConfigError(f"rollout temperature must be >= 0 (0 = greedy), got {self.temperature}: fix rollout.temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"rollout top_p must be in (0, 1], got {self.top_p}: fix rollout.top_p (1.0 disables it)")
        if self.top_k != -1 and self.top_k < 1:
            raise ConfigError(f"rollout top_k must be -1 (off) or >= 1, got {self.top_k}: fix rollout.top_k")
        if self.max_new_tokens < 1:
            raise ConfigError(f"rollout max_new_tokens must be >= 1, got {self.max_new_tokens}: fix rollout.max_new_tokens")
        if any(t < 0 for t in self.stop_token_ids):
            raise ConfigError(f"rollout stop_token_ids must be token ids >= 0, got {self.stop_token_ids}: fix rollout.stop_token_ids")


@dataclass
class SampleRequest:
    """One sample to draw. `key` = (seed, rollout_id, prompt_index, sample_index) fixes its randomness.

    `prefix_ids` / `prefix_logprobs`: response tokens this sample already has (an unfinished sample of an
    earlier call, continued: partial rollout) and the log-probs recorded when they were made. The engine
    continues after them; the result's response starts with them, and `max_new_tokens` caps the whole
    response. Token i of a response is drawn with the noise of (key, i), so a sample stopped after any
    token and continued with the same weights is the sample an unbroken call makes.
    """

    prompt_ids: list[int]
    key: tuple[int, int, int, int]
    prefix_ids: list[int] = field(default_factory=list)
    prefix_logprobs: list[float] = field(default_factory=list)
    # rollout.routing_replay: the routes recorded with the prefix (`SampleResult.routed_experts`), kept as they are
    prefix_routes: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("SampleRequest.prompt_ids is empty: a prompt needs at least one token")
        if len(self.prefix_ids) != len(self.prefix_logprobs):
            raise ValueError(f"SampleRequest.prefix_ids has {len(self.prefix_ids)} tokens but prefix_logprobs "
                             f"{len(self.prefix_logprobs)}: one log-prob per token")
        try:  # operator.index accepts numpy / torch integer scalars, rejects floats
            key = tuple(operator.index(k) for k in self.key)
        except TypeError:
            key = ()
        if len(key) != 4 or not all(_INT64_MIN <= k <= _INT64_MAX for k in key):
            raise ValueError(f"SampleRequest.key must be 4 int64 ints (seed, rollout_id, prompt_index, sample_index), got {self.key!r}")
        self.key = key


@dataclass(frozen=True)
class GroupsDone:
    """Stop generating once `count` groups are complete: the requests of a call are consecutive groups of
    `group_size` (a prompt's samples), and a group is complete when all its samples finished (stop or
    length). Every other request comes back with finish_reason "abort" and its tokens so far. Where the
    built-in engine stops depends only on the requests, the sampling settings and the weights (it checks at
    the end of each decode chunk), never on timing; SGLang's servers are asked to abort the requests still
    running once the client has seen enough complete groups, so there it depends on timing
    (runtime/rollout/sglang/partial.py)."""

    group_size: int
    count: int

    def __post_init__(self) -> None:
        if self.group_size < 1 or self.count < 0:
            raise ValueError(f"GroupsDone needs group_size >= 1 and count >= 0, got {self.group_size}, {self.count}")

    def reached(self, done: list[bool]) -> bool:
        """Whether `count` groups of `done` (one flag per request, in request order) are complete."""
        g = self.group_size
        return sum(all(done[i:i + g]) for i in range(0, len(done), g)) >= self.count


def sample_key(seed: int, slot: int, prompt_index: int, sample_index: int) -> tuple[int, int, int, int]:
    """The key that fixes one sample's randomness. `slot` is the rollout id (>= 0) for training and a
    negative number for an evaluation (runtime/grpo/evaluation.py:eval_slot), so they never collide."""
    return (int(seed), int(slot), int(prompt_index), int(sample_index))


def keyed_requests(prompts_ids: list[list[int]], *, seed: int, slot: int, n: int,
                   first_prompt: int = 0) -> list[list[SampleRequest]]:
    """n requests per prompt, prompt i (counted from `first_prompt`) keyed (seed, slot, i, j): the one
    place training, evaluation and custom rollouts get their keys from."""
    return [[SampleRequest(prompt_ids=list(ids), key=sample_key(seed, slot, first_prompt + i, j)) for j in range(n)]
            for i, ids in enumerate(prompts_ids)]


def routes_dtype(num_experts: int) -> torch.dtype:
    """The dtype recorded expert indices are kept in (`SampleResult.routed_experts`): a byte up to 256 experts,
    else int16."""
    return torch.uint8 if num_experts <= 256 else torch.int16


@dataclass
class SampleResult:
    """A generated response.

    response_ids includes the stop token when finish_reason is "stop" (the policy must learn to
    emit eos), and response_logprobs has one entry per response token.
    loss_mask: per response token, 1 = trained on, 0 = not (tool output in multi-turn rollouts);
    None means all ones. reward: set by a custom rollout that scores its own samples; None means
    the pipeline's reward function scores it.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    text: str
    finish_reason: FinishReason
    loss_mask: list[int] | None = None
    reward: float | None = None
    # rollout.routing_replay on a mixture of experts: the experts each token was routed to, [tokens, MoE layers,
    # top-k] (uint8, int16 past 256 experts) on the host, for every token the engine ran: the prompt's and the
    # response's but its last (never an input). None: not recorded.
    routed_experts: torch.Tensor | None = None

    def effective_loss_mask(self) -> list[int]:
        return list(self.loss_mask) if self.loss_mask is not None else [1] * len(self.response_ids)


def drive_generation(engine, requests: list[SampleRequest], sampling: SamplingParams,
                     until: GroupsDone | None) -> list[SampleResult]:
    """`generate` through the stepped calls: advance to each check point, stop there once `until` holds.
    One driver for one engine and for a pool of engines stepping together (its flags: all of theirs)."""
    engine.start_generation(requests, sampling)
    while (done := engine.advance_generation()) is not None:
        if until is not None and until.reached(done):
            break
    return engine.finish_generation()


class RolloutEngine(abc.ABC):
    """A policy copy that generates samples and receives weights from the trainer: the whole surface
    the loop reaches through `runtime.placement.handles.EngineHandle`."""

    # -- generation ----------------------------------------------------------------------------
    @abc.abstractmethod
    def generate(self, requests: list[SampleRequest], sampling: SamplingParams,
                 until: GroupsDone | None = None) -> list[SampleResult]:
        """One result per request, in the same order. Each result depends only on its request's
        prompt, prefix, key, the sampling params and the weights - never on the other requests - except
        where `until` cuts it short (finish_reason "abort", the tokens it had)."""

    # A generate call driven from outside, one check point at a time: how a pool of engines stops together
    # (runtime/placement/handles.py:EngineHandle; `until` must see every engine's progress). An engine
    # that cannot stop midway keeps these defaults: its whole call runs at the first advance.
    def start_generation(self, requests: list[SampleRequest], sampling: SamplingParams) -> None:
        """Begin a call of `generate(requests, sampling)` that `advance_generation` drives."""
        self._stepped_call = (list(requests), sampling)

    def advance_generation(self) -> list[bool] | None:
        """Run the call to its next check point and return every request's done flag there (finished:
        stop or length); None once the call has ended (every request finished)."""
        call = getattr(self, "_stepped_call", None)
        if isinstance(call, tuple):
            self._stepped_call = self.generate(*call)
        return None

    def finish_generation(self) -> list[SampleResult]:
        """End the call where it is: one result per request, the unfinished ones as "abort" with their tokens."""
        call = getattr(self, "_stepped_call", None)
        if call is None:
            raise RuntimeError("finish_generation without start_generation")
        self._stepped_call = None
        return self.generate(*call) if isinstance(call, tuple) else call

    @abc.abstractmethod
    def logprobs_of(self, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0) -> list[float]:
        """Teacher-forced log-probs of response_ids after prompt_ids, as `generate` reports them."""

    @abc.abstractmethod
    def health(self) -> dict:
        """A JSON-able dict; at least {"ok": bool, "weight_version": int}."""

    def release_memory(self) -> None:
        """Give back GPU memory while the trainer trains: the built-in engine its KV pool and graphs (weights
        stay), SGLang its KV cache and weights. Engines that hold nothing worth releasing keep this no-op."""

    def resume_memory(self) -> None:
        """Take back what `release_memory` gave, before the next generate (generate also does it when needed)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release the model and its memory; the engine is unusable afterwards. Safe to call twice."""

    # -- weights from the trainer --------------------------------------------------------------
    @abc.abstractmethod
    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        """Copy tensors named as in the HF checkpoint into the engine (with ``train.lora``: the trainer's adapters,
        ``MegatronTrainer.engine_weights``); then weight_version == version. A part of the model updates that part
        (the CUDA IPC path sends a unit at a time, runtime/placement/weight_sync.py)."""

    def update_weights_shared(self, shared, version: int) -> None:
        """`update_weights` from tensors that a process on this engine's GPU shares by CUDA IPC
        (runtime/placement/cuda_ipc.py:SharedTensors): read in place, no copy through host memory."""
        from runtime.placement import cuda_ipc
        self.update_weights(cuda_ipc.open_shared(shared), version)
        torch.cuda.synchronize()  # the copies are done before the sender lets its tensors go

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """The version given to the last update_weights (0 = the weights it was loaded with)."""

    @abc.abstractmethod
    def weight_sync_ranks(self) -> int:
        """How many ranks this engine takes in a weight-sync group (runtime/placement/weight_sync.py)."""

    @abc.abstractmethod
    def init_weight_sync(self, host: str, port: int, rank_offset: int, world_size: int, group_name: str) -> None:
        """Join the group hosted at host:port as ranks rank_offset...; returns once the group is formed."""

    @abc.abstractmethod
    def weight_sync_ready(self) -> bool:
        """Whether receive_weights can run now (false after a restart: join again first)."""

    @abc.abstractmethod
    def receive_weights(self, metadata: list, version: int) -> None:
        """Receive trainer rank 0's broadcast of `metadata`'s tensors; then weight_version == version."""
