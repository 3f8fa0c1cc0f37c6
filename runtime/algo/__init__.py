"""GRPO's pure tensor functions: advantages, losses, KL, dynamic sampling. No I/O, no state."""

from runtime.algo.advantages import group_advantages
from runtime.algo.dynamic_sampling import fill_batch, filter_groups
from runtime.algo.kl import KL_KINDS, kl_penalty
from runtime.algo.losses import LOSS_AGGS, aggregate, entropy_from_logits, grpo_loss, masked_mean, policy_loss

__all__ = [
    "KL_KINDS",
    "LOSS_AGGS",
    "aggregate",
    "entropy_from_logits",
    "fill_batch",
    "filter_groups",
    "grpo_loss",
    "group_advantages",
    "kl_penalty",
    "masked_mean",
    "policy_loss",
]
