"""Rollout: the engine interface, keyed sampling, the built-in HF engine and custom rollout functions."""

from runtime.rollout.base import GroupsDone, RolloutEngine, SampleRequest, SampleResult, SamplingParams
from runtime.rollout.custom import (
    default_rollout,
    load_custom_rollout,
    turn_key,
    validate_rollout_output,
)

__all__ = [
    "BuiltinEngine",
    "GroupsDone",
    "RolloutEngine",
    "SampleRequest",
    "SampleResult",
    "SamplingParams",
    "default_rollout",
    "load_custom_rollout",
    "turn_key",
    "validate_rollout_output",
]


def __getattr__(name: str):
    # BuiltinEngine pulls in transformers (seconds to import); load it only when asked for.
    if name == "BuiltinEngine":
        from runtime.rollout.builtin import BuiltinEngine

        return BuiltinEngine
    raise AttributeError(f"module 'runtime.rollout' has no attribute {name!r}")
