"""DAPO dynamic sampling: drop prompt groups whose samples all got the same reward.

Such a group has zero advantage for every sample, so it adds tokens to the batch but no gradient.
The rollout loop over-samples prompts and fills the batch with the first groups that pass, in prompt
order, so that which groups are kept depends only on the rewards, never on timing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def filter_groups(rewards: torch.Tensor, n_samples: int) -> torch.Tensor:
    """Boolean keep-mask over groups (flat group-major rewards): True where the rewards differ."""
    if rewards.dim() != 1 or n_samples < 1 or rewards.numel() % n_samples != 0:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {n_samples}")
    grouped = rewards.reshape(-1, n_samples)
    return grouped.amax(dim=1) != grouped.amin(dim=1)


def fill_batch(
    candidate_group_ids: Sequence[int], group_rewards: Sequence[Sequence[float]], needed: int
) -> tuple[list[int], int]:
    """Keep the first `needed` candidate groups whose rewards are not all equal, in the given order.

    Returns (kept_ids, dropped_count). dropped_count counts the groups filtered out before the batch
    was full; candidates after that point are neither kept nor counted (the caller's surplus). Fewer
    than `needed` ids come back when the candidates run out: the caller samples more prompts.
    """
    if len(candidate_group_ids) != len(group_rewards):
        raise ValueError(f"{len(candidate_group_ids)} group ids but {len(group_rewards)} reward lists")
    if needed < 0:
        raise ValueError(f"needed must be >= 0, got {needed}")
    kept: list[int] = []
    dropped = 0
    for group_id, rewards in zip(candidate_group_ids, group_rewards):
        if len(kept) == needed:
            break
        if len(rewards) == 0:
            raise ValueError(f"group {group_id} has no rewards")
        if max(rewards) != min(rewards):
            kept.append(group_id)
        else:
            dropped += 1
    return kept, dropped
