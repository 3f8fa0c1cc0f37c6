"""Rule-based rewards: fn(response, label, metadata=None) -> float, and bounded-time batch scoring."""

from runtime.rewards.dapo import dapo_reward
from runtime.rewards.deepscaler import deepscaler_reward
from runtime.rewards.math_reward import is_correct, math_reward
from runtime.rewards.catalog import BUILTIN_REWARDS, get_reward_fn
from runtime.rewards.timeout import reward_fail_value, score_batch, shutdown_pool

__all__ = [
    "BUILTIN_REWARDS",
    "dapo_reward",
    "deepscaler_reward",
    "get_reward_fn",
    "is_correct",
    "math_reward",
    "reward_fail_value",
    "score_batch",
    "shutdown_pool",
]
