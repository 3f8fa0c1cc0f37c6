"""Reward functions by name: built-ins or `package.module:function` (called as `contract.call_reward` says)."""

from __future__ import annotations

import importlib
import importlib.metadata
import sys

from runtime.errors import ConfigError
from runtime.rewards.contract import RewardFn
from runtime.rewards.dapo import dapo_reward
from runtime.rewards.deepscaler import deepscaler_reward
from runtime.rewards.math_reward import math_reward

BUILTIN_REWARDS: dict[str, RewardFn] = {
    "math": math_reward,
    "dapo": dapo_reward,
    "deepscaler": deepscaler_reward,
}

_CHOICES = "use math, dapo, deepscaler or module:function"


def get_reward_fn(name: str) -> RewardFn:
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    module_name, sep, attr_path = name.partition(":")
    if not sep or not module_name or not attr_path:
        raise ConfigError(f"rollout.reward: unknown reward {name!r} ({_CHOICES})")
    try:
        obj = importlib.import_module(module_name)
        for attr in attr_path.split("."):
            obj = getattr(obj, attr)
    except Exception as e:  # any import-time failure of user code is a config problem to report
        raise ConfigError(
            f"rollout.reward: cannot load reward {name!r} ({type(e).__name__}: {e}); {_CHOICES}"
        ) from e
    if not callable(obj):
        raise ConfigError(f"rollout.reward: {name!r} is not a function ({_CHOICES})")
    return obj


def grader_record(fn: RewardFn | str = "math") -> dict[str, str | None]:
    """Which rule scored a number, to keep beside it: the reward's name, its `RULE_VERSION` (None for
    a custom reward that declares none) and the math-verify version installed.

    `fn` is a reward function or a name `get_reward_fn` accepts; evaluation is always `math`.
    """
    if isinstance(fn, str):
        name, fn = fn, get_reward_fn(fn)
    else:
        builtin = [n for n, f in BUILTIN_REWARDS.items() if f is fn]
        name = builtin[0] if builtin else f"{fn.__module__}:{fn.__qualname__}"
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    return {
        "grader": name,
        "rule_version": getattr(module, "RULE_VERSION", None),
        "math_verify_version": importlib.metadata.version("math-verify"),
    }
