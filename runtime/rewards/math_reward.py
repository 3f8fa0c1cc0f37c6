"""`math` reward: the model's final answer graded against the label by math-verify (1.0 / 0.0).

The answer is the last \\boxed{...}; without one, the text after the last `Answer:`; without that, the
whole response (math-verify then takes the last expression it can read).
"""

from __future__ import annotations

import re
import threading

from math_verify import parse, verify

FAIL_VALUE = 0.0

# math-verify's own timeouts use SIGALRM, which only the main thread may set; elsewhere
# (thread pools, async actors) they must be off and the caller bounds the time (see timeout.py).
_MATH_VERIFY_TIMEOUT_S = 5

_ANSWER_MARKER = re.compile(r"answer\s*:", re.IGNORECASE)


def _math_verify_timeout() -> int | None:
    return _MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (braces balanced) or `\\boxed x`; None if absent or unclosed.

    An unclosed last box (a truncated response) gives None rather than an earlier box: the model
    had moved past that answer.
    """
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = start + len("\\boxed")
    if text.startswith(" ", i):
        token = re.match(r" +([^\s$]+)", text[i:])
        return token.group(1) if token else None
    if not text.startswith("{", i):
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def text_after_last_answer_marker(text: str) -> str | None:
    """The rest of the line after the last `Answer:` (any case), stripped; None if there is none."""
    matches = list(_ANSWER_MARKER.finditer(text))
    if not matches:
        return None
    return text[matches[-1].end() :].split("\n", 1)[0].strip()


def parse_label(label: str) -> list:
    """Parse a ground-truth label; bare labels (`0.5`, `\\frac{1}{2}`) are read as boxed LaTeX."""
    label = str(label).strip()
    if "$" not in label and "\\boxed" not in label:
        label = "\\boxed{" + label + "}"
    return parse(label, parsing_timeout=_math_verify_timeout())


def parse_boxed(answer: str) -> list:
    return parse("\\boxed{" + answer + "}", parsing_timeout=_math_verify_timeout())


def answers_match(gold: list, predicted: list) -> bool:
    if not gold or not predicted:
        return False
    return bool(verify(gold, predicted, timeout_seconds=_math_verify_timeout()))


def extract_answer(response: str) -> list:
    """Parsed final answer of a response, by the precedence in the module docstring."""
    boxed = last_boxed(response)
    if boxed is not None:
        return parse_boxed(boxed)
    after_marker = text_after_last_answer_marker(response)
    text = after_marker if after_marker else response
    return parse(text, parsing_timeout=_math_verify_timeout())


def is_correct(response: str, label: str) -> bool:
    """Whether the response's final answer equals the label (math-verify). Evaluation uses this,
    whatever reward trained the model."""
    return answers_match(parse_label(label), extract_answer(response))


def math_reward(response: str, label: str, metadata: dict | None = None) -> float:
    return 1.0 if is_correct(response, label) else 0.0
