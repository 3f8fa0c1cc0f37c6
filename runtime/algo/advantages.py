"""Group-relative advantages (GRPO and Dr.GRPO)."""

from __future__ import annotations

import torch

from runtime.errors import ConfigError


def group_advantages(
    rewards: torch.Tensor, n_samples: int, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """One advantage per sample: reward minus its group's mean, divided by the group's std + eps.

    `rewards` is flat and group-major: prompt i's samples are rewards[i*n_samples:(i+1)*n_samples].
    The std is the unbiased (n-1) one, as slime and verl use (`torch.std`), so our numbers match
    theirs. `normalize_std=False` is Dr.GRPO: mean-centred only, which avoids up-weighting
    groups whose rewards barely differ. A group whose rewards are all equal gets zeros.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (n_groups * n_samples), got shape {tuple(rewards.shape)}")
    if n_samples < 2:
        raise ConfigError(
            f"rollout.n_samples_per_prompt={n_samples}: group advantages need at least 2 samples per prompt "
            "(set it to 2 or more)"
        )
    if rewards.numel() % n_samples != 0:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {n_samples}")
    grouped = rewards.reshape(-1, n_samples)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)
