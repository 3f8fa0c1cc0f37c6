"""The engine's speed features (torch.compile, CUDA graphs, the Triton and flash kernels) and their failures.

Each feature is an optimisation the decoder can do without: the same tokens come out of the plain path.
A failure inside one is raised as `SpeedFeatureFailed` naming it, so the decoder switches that feature
off and redoes the call (`PagedDecoder.steps`). Running out of device memory is never such a failure,
wherever it happens (an allocation inside the compiler or a graph capture included): it passes through
as it is, and the decoder reports the plan's numbers instead of switching anything off.
"""
from __future__ import annotations

from typing import Callable

from runtime.devices import is_out_of_memory

class SpeedFeatureFailed(RuntimeError):
    """`feature` failed with `error` (not an out-of-memory error)."""

    def __init__(self, feature: str, error: BaseException):
        super().__init__(f"{feature}: {type(error).__name__}: {error}")
        self.feature, self.error = feature, error


def as_feature_failure(feature: str, error: BaseException) -> BaseException:
    """What to raise for `error` met inside `feature`: itself when it is out of memory or already named, else
    a `SpeedFeatureFailed`."""
    if isinstance(error, SpeedFeatureFailed) or is_out_of_memory(error):
        return error
    return SpeedFeatureFailed(feature, error)


def guarded(feature: str, fn: Callable) -> Callable:
    """`fn` with its failures named as `feature`'s (`as_feature_failure`)."""

    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - named, or passed on as it is
            failure = as_feature_failure(feature, e)
            if failure is e:
                raise
            raise failure from e

    return call


__all__ = ["SpeedFeatureFailed", "as_feature_failure", "guarded"]
