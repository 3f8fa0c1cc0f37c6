"""One rollout's samples, kept as prompt groups from generation to the trainer."""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from runtime.algo import group_advantages
from runtime.rollout.base import SampleResult
from runtime.trainer.batch import TrainBatch


@dataclass
class Group:
    """The n samples of one prompt and their rewards."""

    prompt: dict  # the prepared dataset row ("prompt", "label", "metadata") plus "prompt_ids"
    samples: list[SampleResult]
    rewards: list[float] = field(default_factory=list)

    @property
    def informative(self) -> bool:
        """Rewards that differ: a group whose samples all scored the same has zero advantage."""
        return bool(self.rewards) and max(self.rewards) != min(self.rewards)


@dataclass
class RolloutBatch:
    """What one rollout produced: the groups to train on and everything generated to get them."""

    groups: list[Group]  # exactly rollout.rollout_batch_size, in prompt order
    generated: list[Group]  # every group generated (dynamic sampling draws extra prompts)
    cursor: dict  # the data cursor after the prompts this rollout drew
    dropped: int = 0  # uninformative groups filtered out by dynamic sampling
    reward_failures: int = 0  # rewards that raised or timed out (scored as the reward's fail value)
    generate_s: float = 0.0
    reward_s: float = 0.0

    @property
    def samples(self) -> list[SampleResult]:
        return [s for g in self.groups for s in g.samples]

    @property
    def rewards(self) -> list[float]:
        return [r for g in self.groups for r in g.rewards]


def advantages(batch: RolloutBatch, n_samples: int, normalize_std: bool) -> list[float]:
    """GRPO's group-relative advantage of every sample, group-major."""
    return group_advantages(torch.tensor(batch.rewards, dtype=torch.float32), n_samples,
                            normalize_std=normalize_std).tolist()


def to_train_batch(batch: RolloutBatch, advantages: list[float]) -> TrainBatch:
    samples = batch.samples
    return TrainBatch(tokens=[list(s.prompt_ids) + list(s.response_ids) for s in samples],
                      prompt_lens=[len(s.prompt_ids) for s in samples], advantages=list(advantages),
                      loss_masks=[s.effective_loss_mask() for s in samples],
                      rollout_logprobs=[list(s.response_logprobs) for s in samples])


def rollout_metrics(rollout_id: int, batch: RolloutBatch, train: dict, *, weight_sync_s: float,
                    step_time_s: float) -> dict:
    """The per-rollout metrics the table, MLflow and the report show."""
    rewards, samples = batch.rewards, batch.samples
    lens = [len(s.response_ids) for s in samples]
    generated_tokens = sum(len(s.response_ids) for g in batch.generated for s in g.samples)
    all_rewards = [r for g in batch.generated for r in g.rewards]
    return {
        "rollout": rollout_id,
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "reward_mean_all": statistics.fmean(all_rewards),
        "response_len_mean": statistics.fmean(lens),
        "response_len_max": max(lens),
        "truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
        "rollout_tok_s": generated_tokens / max(batch.generate_s, 1e-9),
        "rollout_time_s": batch.generate_s + batch.reward_s,
        "generate_time_s": batch.generate_s,
        "reward_time_s": batch.reward_s,
        "weight_sync_s": weight_sync_s,
        "groups_dropped": batch.dropped,
        "reward_failures": batch.reward_failures,
        **train,
        "train_tok_s": train["train_tokens"] / max(train["train_time_s"], 1e-9),
        "step_time_s": step_time_s,
    }
