"""`dapo` reward, as DAPO trains: +1.0 if the last `Answer:` line in the final 300 characters
matches the label, else -1.0.

The window keeps an answer stated early in a long rambling response from counting.
Matching is normalised string equality, then math-verify equality as a fallback.
"""

from __future__ import annotations

import re

from runtime.rewards.math_reward import answers_match, last_boxed, parse_boxed

FAIL_VALUE = -1.0
WINDOW_CHARS = 300

_ANSWER_LINE = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)
_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")
_DROPPED = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "^{\\circ}", "^\\circ", "\\%", "%", "$")


def normalize_answer(answer: str) -> str:
    """Canonical string form of a short answer: no `$`, \\boxed, \\text wrappers, spacing macros,
    degree and percent signs, whitespace, trailing period, or thousands separators."""
    s = answer.strip()
    boxed = last_boxed(s)
    if boxed is not None:
        s = boxed
    s = _WRAPPERS.sub(r"\1", s)
    for token in _DROPPED:
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = "".join(s.split()).rstrip(".")
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    return s


def dapo_answer(response: str) -> str | None:
    """The normalised answer on the last `Answer:` line of the last WINDOW_CHARS characters."""
    matches = _ANSWER_LINE.findall(response[-WINDOW_CHARS:])
    if not matches:
        return None
    return normalize_answer(matches[-1])


def dapo_reward(response: str, label: str, metadata: dict | None = None) -> float:
    predicted = dapo_answer(response)
    if not predicted:
        return -1.0
    gold = normalize_answer(str(label))
    if predicted == gold or answers_match(parse_boxed(gold), parse_boxed(predicted)):
        return 1.0
    return -1.0
