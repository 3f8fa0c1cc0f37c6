"""`math` reward: the response's final answer graded against the label by math-verify (1.0 / 0.0).

Which text is the final answer: `answers.final_answer` (the later of the last box and the last
`Answer:` line; an unclosed last box states nothing), after the last `</think>` when there is one.
How it is read: `parse_answer` cleans it (`answers.clean_answer`) and gives it to math-verify as LaTeX,
the way a box's content is read, because math-verify reads LaTeX only inside delimiters: a bare
`2^{10}` as plain text is the number 2.
"""

from __future__ import annotations

import re
import threading

from math_verify import parse, verify

from runtime.rewards.answers import after_think, clean_answer, final_answer, has_math_delimiters, is_prose, last_boxed

FAIL_VALUE = 0.0
RULE_VERSION = "math-2"  # bump when a change can turn a score; recorded beside every eval (catalog.grader_record)

# math-verify's own timeouts use SIGALRM, which only the main thread may set. They are off unless a
# process turns them on (the reward worker processes of timeout.py do, as a second bound under the
# caller's deadline): a direct call is then free of wall-clock effects and scores the same on any host.
MATH_VERIFY_TIMEOUT_S = 5
_math_verify_timeout_s: int | None = None

_LATEX_MARKUP = re.compile(r"[\\^{}$]")


def set_math_verify_timeout(seconds: int | None) -> None:
    """Turn math-verify's own per-call timeouts on (seconds) or off (None) in this process."""
    global _math_verify_timeout_s
    _math_verify_timeout_s = seconds


def _math_verify_timeout() -> int | None:
    return _math_verify_timeout_s if threading.current_thread() is threading.main_thread() else None


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


def extract_answer(response: str) -> list:
    """Parsed final answer of a response (empty when it states none), by the module docstring."""
    graded = after_think(response)
    # thinking left open (cut off): a box or Answer: line in it still states an answer
    answer = final_answer(graded) if graded is not None else final_answer(response, finished=False)
    if answer is None:
        return []
    if answer.source == "whole_response" and not _LATEX_MARKUP.search(answer.text):
        # one line of plain text (`so the total is 42`, a tiny model's `7`): math-verify's own reading
        return parse(answer.text.replace("\u2212", "-"), parsing_timeout=_math_verify_timeout())
    return parse_answer(answer.text)


def is_correct(response: str, label: str) -> bool:
    """Whether the response's final answer equals the label (math-verify). Evaluation uses this,
    whatever reward trained the model."""
    return answers_match(parse_label(label), extract_answer(response))


def math_reward(response: str, label: str, metadata: dict | None = None) -> float:
    return 1.0 if is_correct(response, label) else 0.0
