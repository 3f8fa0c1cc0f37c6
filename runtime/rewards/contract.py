"""How a reward function is called: `fn(response, label, metadata=None)`, and the finish reason for those that take it.

A reward function (built-in or a user's `module:function`) is called with the response's text, the row's
label and the row's metadata. The engine also knows why the sample ended (`SampleResult.finish_reason`:
"stop" when the model ended it, "length" when it hit `max_new_tokens`, "abort" when a partial rollout cut
it); a function that declares a `finish_reason` parameter (or `**kwargs`) gets it as a keyword, so rewards
written for the three-argument form keep working unchanged.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable

RewardFn = Callable[..., float]  # fn(response: str, label: str, metadata: dict | None = None, *, finish_reason=None)


def takes_finish_reason(fn: Callable) -> bool:
    """Whether `fn` accepts a `finish_reason` keyword (a parameter of that name, or `**kwargs`)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or a callable without a signature: the plain form
        return False
    return any(p.kind is p.VAR_KEYWORD or (p.name == "finish_reason" and p.kind in (p.POSITIONAL_OR_KEYWORD,
                                                                                     p.KEYWORD_ONLY))
               for p in params)


def call_reward(fn: RewardFn, response: str, label: str, metadata: dict | None = None,
                finish_reason: str | None = None, *, takes: bool | None = None) -> float:
    """`fn(response, label, metadata)`, with `finish_reason=` when known and `fn` takes it (`takes`: that
    answer already worked out by a caller that calls `fn` many times)."""
    if finish_reason is not None and (takes_finish_reason(fn) if takes is None else takes):
        return fn(response, label, metadata, finish_reason=finish_reason)
    return fn(response, label, metadata)


__all__ = ["RewardFn", "call_reward", "takes_finish_reason"]
