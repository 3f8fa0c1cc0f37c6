"""`deepscaler` reward, as DeepScaleR trains: the last \\boxed{} after `</think>`, graded by
math-verify (1.0 / 0.0). A response that opened `<think>` but never closed it scores 0."""

from __future__ import annotations

from runtime.rewards.math_reward import answers_match, last_boxed, parse_boxed, parse_label

FAIL_VALUE = 0.0


def deepscaler_reward(response: str, label: str, metadata: dict | None = None) -> float:
    if "</think>" in response:
        response = response.rsplit("</think>", 1)[1]
    elif "<think>" in response:
        return 0.0
    boxed = last_boxed(response)
    if boxed is None:
        return 0.0
    return 1.0 if answers_match(parse_label(label), parse_boxed(boxed)) else 0.0
