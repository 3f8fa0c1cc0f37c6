"""`deepscaler` reward, as DeepScaleR trains: the last \\boxed{} after `</think>`, graded like the
`math` reward's answers (1.0 / 0.0).

Format: only a box counts (an `Answer:` line does not); a response that opened `<think>` and never
closed it scores 0. Truncation: an unclosed last box scores 0 (no earlier box stands in for it).
Leniency: the box's content is cleaned and compared by math-verify, as in `math`.
"""

from __future__ import annotations

from runtime.rewards.answers import after_think, last_boxed
from runtime.rewards.math_reward import answer_equals_label

FAIL_VALUE = 0.0
RULE_VERSION = "deepscaler-2"


def deepscaler_reward(response: str, label: str, metadata: dict | None = None) -> float:
    graded = after_think(response)
    if graded is None:
        return 0.0
    boxed = last_boxed(graded)
    if boxed is None:
        return 0.0
    return 1.0 if answer_equals_label(boxed, label) else 0.0
