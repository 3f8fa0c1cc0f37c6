"""`dapo` reward, as DAPO trains: +1.0 if the last `Answer:` line in the final 300 characters states
the label, else -1.0.

Format: only an `Answer:` line counts (a box elsewhere does not), and only in the last WINDOW_CHARS
characters, which keeps an answer stated early in a long rambling response from counting.
Truncation: a box on that line left unclosed states nothing (-1); nor does a line inside thinking that
never closed, a sample that ran out of tokens without a `</think>` (`answers.answer_region`), or a line
that runs to where the sample was cut off (the finish reason "length" / "abort"; without one, a text
ending mid-sentence: `answers.ends_mid_sentence`).
Leniency: the line's text is cleaned the way DAPO's reference normalises answers (`\\$`, unit words,
`\\text{}`, thousands separators, degree and percent signs dropped); it matches when its canonical
string equals the label's, or else when math-verify finds them equal (as the `math` reward does).
"""

from __future__ import annotations

import re

from runtime.rewards.answers import (ANSWER_LINE, CUT_OFF, answer_region, box_contents, clean_answer,
                                     ends_mid_sentence, without_end_of_turn)
from runtime.rewards.math_reward import answer_equals_label
from runtime.rewards.timeout import bounded

FAIL_VALUE = -1.0
RULE_VERSION = "dapo-4"
WINDOW_CHARS = 300

_LINE = re.compile(ANSWER_LINE.pattern + r"\s*([^\n]+)", re.IGNORECASE)
_SPACING = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ")


def normalize_answer(answer: str) -> str:
    """Canonical string form of a short answer: `answers.clean_answer`, the box's content, without
    spacing macros or whitespace, with \\dfrac and \\tfrac as \\frac."""
    s = answer.strip()
    found = box_contents(s)
    if found is not None and found[1] is not None:
        s = found[1]
    s = clean_answer(s)
    for token in _SPACING:
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return "".join(s.split())


def dapo_answer(response: str, finish_reason: str | None = None) -> str | None:
    """The text of the last `Answer:` line of the last WINDOW_CHARS characters; None without one, when
    a box on it is unclosed, no answer region (`answers.answer_region`), or the line runs to the cut."""
    response, finish_reason = without_end_of_turn(response, finish_reason)
    if answer_region(response, finish_reason) is None:
        return None
    window = response[-WINDOW_CHARS:]
    matches = list(_LINE.finditer(window))
    if not matches:
        return None
    text = matches[-1].group(1).strip()
    found = box_contents(text)
    if found is not None:
        return found[1]
    cut = ends_mid_sentence(response) if finish_reason is None else finish_reason in CUT_OFF
    if cut and matches[-1].end() == len(window):
        return None
    return text


@bounded
def dapo_reward(response: str, label: str, metadata: dict | None = None, *, finish_reason: str | None = None) -> float:
    answer = dapo_answer(response, finish_reason)
    if answer is None or not normalize_answer(answer):
        return -1.0
    if normalize_answer(answer) == normalize_answer(str(label)) or answer_equals_label(answer, str(label)):
        return 1.0
    return -1.0
