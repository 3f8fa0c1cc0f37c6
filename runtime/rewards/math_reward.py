"""`math` reward: the response's final answer graded against the label by math-verify (1.0 / 0.0).

Which text is the final answer: `answers.final_answers` (the later of the last box and the last
`Answer:` line, or a complete "answer is" sentence after it that names a value; an unclosed last box
states nothing), after the last `</think>` when there is one (`answers.answer_region`: thinking that
never closed states nothing, and a sample that ran out of tokens states an answer only after a
`</think>`). A statement cut off by the end of the sample states nothing: the finish reason says so when
the caller passes it, else a text ending mid-sentence does (one ending with an end-of-turn marker was
ended by the model: `answers.without_end_of_turn`).
Several final answers (docs/grading.md): a hedge, distinct answers offered as alternatives ("either
\\boxed{44} or \\boxed{45}"), states nothing, so scores 0 whatever the label; math-verify says whether
they are distinct (`\\boxed{\\frac12} or equivalently \\boxed{0.5}` is one answer). A retraction states
what it ends on; a negated answer (`not 42`, `\\neq 42`) states no value.
How it is read: `parse_answer` cleans it (`answers.clean_answer`) and gives it to math-verify as LaTeX,
the way a box's content is read, because math-verify reads LaTeX only inside delimiters: a bare
`2^{10}` as plain text is the number 2.
"""

from __future__ import annotations

import re

from math_verify import parse, verify

from runtime.rewards.answers import (CUT_OFF, FinalAnswer, answer_region, clean_answer, final_answers,
                                     has_math_delimiters, is_prose, last_boxed, without_end_of_turn)
from runtime.rewards.timeout import bounded
from runtime.rewards.verify_timeouts import math_verify_timeout as _math_verify_timeout

FAIL_VALUE = 0.0
RULE_VERSION = "math-4"  # bump when a change can turn a score; recorded beside every eval (catalog.grader_record)

_LATEX_MARKUP = re.compile(r"[\\^{}$]")


def _parse_latex(text: str) -> list:
    return parse("\\boxed{" + text + "}", parsing_timeout=_math_verify_timeout())


def parse_answer(text: str) -> list:
    """math-verify's reading of an answer's text: cleaned, then as LaTeX (as if boxed). Text that
    still holds `$`/`\\(` delimiters or words (`42, because 6*7`) goes to math-verify as written,
    which picks the formulas (or the last number) out of it."""
    cleaned = clean_answer(text)
    if not cleaned:
        return []
    if has_math_delimiters(cleaned) or is_prose(cleaned):
        return parse(cleaned, parsing_timeout=_math_verify_timeout())
    return _parse_latex(cleaned)


def parse_label(label: str) -> list:
    """A ground-truth label read like an answer (`0.5`, `\\frac{1}{2}`, `$1{,}000$`, `\\boxed{3}`)."""
    label = str(label).strip()
    boxed = last_boxed(label)
    return parse_answer(boxed if boxed is not None else label)


def answers_match(gold: list, predicted: list) -> bool:
    if not gold or not predicted:
        return False
    return bool(verify(gold, predicted, timeout_seconds=_math_verify_timeout()))


def answer_equals_label(answer_text: str, label: str) -> bool:
    """Whether an answer's text has the label's value (math-verify equality after clean-up)."""
    return answers_match(parse_label(label), parse_answer(answer_text))


def extract_answer(response: str, finish_reason: str | None = None) -> list:
    """Parsed final answer of a response (empty when it states none), by the module docstring;
    finish_reason: why the sample ended ("stop", "length", "abort"), None when not known."""
    response, finish_reason = without_end_of_turn(response, finish_reason)
    graded = answer_region(response, finish_reason)
    if graded is None:
        return []
    answer, alternatives = final_answers(graded, cut_off=None if finish_reason is None else finish_reason in CUT_OFF)
    if answer is None:
        return []
    parsed = _parse_final(answer)
    if any(not answers_match(parsed, _parse_final(other)) for other in alternatives):
        return []  # a hedge: distinct answers offered as alternatives state none
    return parsed


def _parse_final(answer: FinalAnswer) -> list:
    if answer.source == "whole_response" and not _LATEX_MARKUP.search(answer.text):
        # one line of plain text (`so the total is 42`, a tiny model's `7`): math-verify's own reading
        return parse(answer.text.replace("\u2212", "-"), parsing_timeout=_math_verify_timeout())
    return parse_answer(answer.text)


def grade(response: str, label: str, finish_reason: str | None = None) -> bool:
    """Whether the response's final answer equals the label (math-verify), here and now, without a time
    bound (`math_reward` and `is_correct` are bounded)."""
    return answers_match(parse_label(label), extract_answer(response, finish_reason))


@bounded
def math_reward(response: str, label: str, metadata: dict | None = None, *, finish_reason: str | None = None) -> float:
    """1.0 when the final answer equals the label, else 0.0; a direct call returns within
    `timeout.DIRECT_CALL_TIMEOUT_S` (0.0 when cut off, e.g. on a power tower sympy would evaluate)."""
    return 1.0 if grade(response, label, finish_reason) else 0.0


def is_correct(response: str, label: str, finish_reason: str | None = None) -> bool:
    """Whether the response's final answer equals the label (math-verify), bounded in time as
    `math_reward` is (a check that cannot finish is wrong). Evaluation uses this, whatever reward trained
    the model."""
    return math_reward(response, label, finish_reason=finish_reason) > 0
