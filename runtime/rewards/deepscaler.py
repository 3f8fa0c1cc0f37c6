"""`deepscaler` reward, as DeepScaleR trains: the last \\boxed{} after `</think>`, graded like the
`math` reward's answers (1.0 / 0.0).

Format: only a box counts (an `Answer:` line does not); a response that opened `<think>` and never
closed it scores 0. Truncation: an unclosed last box scores 0 (no earlier box stands in for it).
Leniency: the box's content is cleaned and compared by math-verify, as in `math`.
With the finish reason: a sample that ran out of tokens without a `</think>` scores 0
(`answers.answer_region`); a closed box is complete whatever was cut after it.
"""

from __future__ import annotations

from runtime.rewards.answers import answer_region, last_boxed, without_end_of_turn
from runtime.rewards.math_reward import answer_equals_label
from runtime.rewards.timeout import bounded

FAIL_VALUE = 0.0
RULE_VERSION = "deepscaler-4"


@bounded
def deepscaler_reward(response: str, label: str, metadata: dict | None = None, *,
                      finish_reason: str | None = None) -> float:
    graded = answer_region(*without_end_of_turn(response, finish_reason))
    if graded is None:
        return 0.0
    boxed = last_boxed(graded)
    if boxed is None:
        return 0.0
    return 1.0 if answer_equals_label(boxed, label) else 0.0
