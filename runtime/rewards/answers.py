"""Finding a response's final answer and cleaning its text, before any math is parsed.

Pure string work shared by every built-in reward: where the answer is (a box, an `Answer:` line, an
"answer is" sentence), whether it was cut off, and the clean-up that makes `\\$42`, `7 dollars`,
`1{,}000` or `\\boxed 7.` read as the number they state.

Cut off: the engine says why a sample ended (its finish reason: "stop", or "length" / "abort" when it was
cut off). Without it (a direct call) a text that ends mid-sentence (`ends_mid_sentence`: "... the
number of such pairs is 46, and the") counts as cut off. A cut-off statement states nothing: an
`Answer:` line, an "answer is" sentence or a one-line response that runs to the cut, an unclosed box;
a complete box, line or sentence before the cut still stands.
"""

from __future__ import annotations

import re
from typing import NamedTuple

_BOX = "\\boxed"
_SENTENCE_PUNCTUATION = ".,;:!?"

# `Answer:` as DAPO's prompt asks for it (any case, markdown bold around it allowed).
ANSWER_LINE = re.compile(r"answer\s*:", re.IGNORECASE)
# "the answer is ...", "final answer is: ..."
_ANSWER_PHRASE = re.compile(r"\banswer\s+is\b\s*:?", re.IGNORECASE)
# The end of a sentence: a period, then a space or the end (not the point of 0.5).
_SENTENCE_END = re.compile(r"\.(?:\s|$)")
# Finish reasons of a sample that was cut off (`runtime.rollout.base.SampleResult.finish_reason`).
CUT_OFF = ("length", "abort")


class FinalAnswer(NamedTuple):
    """The text a response states as its answer, and where it was found.

    source: "box" (the last \\boxed), "answer_line" (the last `Answer:` line), "answer_phrase" (the
    last "answer is" sentence) or "whole_response" (a one-line response that is read whole).
    """

    text: str
    source: str


def box_contents(text: str) -> tuple[int, str | None] | None:
    """(position, content) of the last \\boxed in text, content None when that box is unclosed;
    None when there is no box. Both `\\boxed{...}` (braces balanced) and `\\boxed x` are boxes; the
    space form's token loses trailing sentence punctuation (`\\boxed 7.` states 7)."""
    start = text.rfind(_BOX)
    if start < 0:
        return None
    i = start + len(_BOX)
    if text.startswith(" ", i):
        token = re.match(r" +([^\s$]+)", text[i:])
        content = token.group(1).rstrip(_SENTENCE_PUNCTUATION) if token else ""
        return start, content or None
    if not text.startswith("{", i):
        return start, None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return start, text[i + 1 : j]
    return start, None


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed; None if there is none or it is unclosed (a truncated response:
    the model had moved past any earlier box, so an earlier one never stands in for it)."""
    found = box_contents(text)
    return None if found is None else found[1]


def after_think(response: str) -> str | None:
    """The part after the last `</think>`; the whole response when no thinking was opened;
    None when `<think>` was opened and never closed."""
    if "</think>" in response:
        return response.rsplit("</think>", 1)[1]
    if "<think>" in response:
        return None
    return response


def answer_region(response: str, finish_reason: str | None = None) -> str | None:
    """The part of a response that can state its final answer: `after_think`'s, except that a sample cut
    off (finish reason in `CUT_OFF`) states one only after a `</think>`: without it, all it wrote is
    thinking that never ended (a template may open `<think>` in the prompt) or an answer never concluded."""
    if finish_reason in CUT_OFF and "</think>" not in response:
        return None
    return after_think(response)


# A text ends mid-sentence when its last character continues what came before it ...
_CONTINUING_END = re.compile(r"[,;:=+\-/(\[{^_&<>\\]$")
# ... or its last word is one a sentence does not end with
_CONTINUING_WORDS = frozenset(
    "a an the and or but so then thus hence therefore of to in on at by for with from as into than that which "
    "who whose where when while if since because is are was were be been being has have had we it its this "
    "these those their our each every let plus minus times over divided not no also".split())
# or it stops right after a LaTeX command that still needs its argument
_CONTINUING_COMMANDS = frozenset(
    "frac dfrac tfrac sqrt binom cdot times div pm mp le leq ge geq ne neq approx equiv to left text textbf "
    "mathrm boxed".split())


def ends_mid_sentence(text: str) -> bool:
    """Whether a text stops inside a sentence, as one cut off does: after a comma, an operator or an
    opening bracket, after a word a sentence does not end with ("... is 46, and the"), after a LaTeX
    command still waiting for its argument, or inside a brace or `\\(...\\)` (`\\frac{1}{2`). A text that
    ends after a number, a closed formula or a sentence's end reads as complete."""
    s = text.rstrip()
    if not s:
        return False
    if _CONTINUING_END.search(s):
        return True
    command = re.search(r"\\([A-Za-z]+)$", s)
    if command is not None:
        return command.group(1) in _CONTINUING_COMMANDS
    word = re.search(r"(?<![A-Za-z\\])([A-Za-z]+)$", s)
    if word is not None and word.group(1).lower() in _CONTINUING_WORDS:
        return True
    # (not a lone `$`: it may be a dollar sign)
    last_line = s.replace("\\{", "").replace("\\}", "").rsplit("\n", 1)[-1]
    return last_line.count("{") > last_line.count("}") or s.count("\\(") > s.count("\\)") \
        or s.count("\\[") > s.count("\\]")


def _line_end(text: str, start: int) -> int:
    end = text.find("\n", start)
    return len(text) if end < 0 else end


def final_answer(response: str, *, cut_off: bool | None = None) -> FinalAnswer | None:
    """The answer a response states last, by this precedence:

    1. whichever comes later of the last \\boxed and the last `Answer:` line (a box on that line is
       the line's answer); an unclosed last box, or an unclosed box on the winning line, states
       nothing (truncated), and no earlier answer stands in for it;
    2. else the last "answer is" sentence;
    3. else a one-line response, read whole (`42`, `so the total is 42`);
    4. else None: a multi-line response that never states an answer (typically one cut off).

    cut_off: whether the text stops where the sample was cut off (True: it ran out of tokens; False: the
    model ended it; None: not known, and a text that `ends_mid_sentence` counts as cut off). An `Answer:`
    line, an "answer is" sentence or a one-line response that runs to the cut states nothing: the model
    was still writing it (`Answer: 46` cut there could have gone on to 460). A complete box does not
    depend on what follows it.
    """
    cut = ends_mid_sentence(response) if cut_off is None else cut_off
    box = box_contents(response)
    lines = list(ANSWER_LINE.finditer(response))
    line_start = lines[-1].start() if lines else -1
    if box is not None and box[0] > line_start:
        return FinalAnswer(box[1], "box") if box[1] is not None else None
    if lines:
        start = lines[-1].end()
        end = _line_end(response, start)
        text = response[start:end].strip()
        if _BOX in text:
            boxed = last_boxed(text)
            return FinalAnswer(boxed, "box") if boxed is not None else None
        if cut and end == len(response):
            return None  # the line runs to the cut
        return FinalAnswer(text, "answer_line") if clean_answer(text) else None
    phrases = list(_ANSWER_PHRASE.finditer(response))
    if phrases:
        start = phrases[-1].end()
        line = response[start:_line_end(response, start)]
        sentence_end = _SENTENCE_END.search(line)
        stop = start + (sentence_end.start() if sentence_end else len(line))
        rest = response[stop:]
        if cut and "\n" not in rest and (not rest.strip() or rest == "."):
            return None  # the sentence runs to the cut (`46.` there could have been 46.5)
        text = response[start:stop].strip()
        return FinalAnswer(text, "answer_phrase") if clean_answer(text) else None
    whole = response.strip()
    if whole and "\n" not in whole and not cut:
        return FinalAnswer(whole, "whole_response")
    return None


# ---------------------------------------------------------------- cleaning an answer's text

_DELIMITERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))
_WRAPPERS = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
# Between digit groups: {,}  \,  ,\!  \!  \;  \:  \  ~ or a space (1{,}000, 1\,000, 1,\!000, 1 000).
_GROUP_SEPARATOR = re.compile(r"(?<=\d)(?:\{,\}|,\\!|\\[,!;: ]|~| )(?=\d{3}(?!\d))")
_COMMA_GROUPED_NUMBER = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?")
# Unit words an answer may end with (DAPO's reference drops the same kind of words).
_UNIT_WORDS = (
    "square", "sq", "cubic", "units?", "dollars?", "cents?", "cm", "mm", "km", "meters?", "metres?",
    "inch(?:es)?", "feet", "foot", "ft", "yards?", "miles?", "mph", "hours?", "hrs?", "minutes?", "mins?",
    "seconds?", "days?", "weeks?", "months?", "years?", "degrees?", "pounds?", "lbs?", "kg", "grams?",
    "liters?", "litres?", "points?", "ways", "students", "people", "integers", "digits", "edges", "meals",
)
_TRAILING_UNIT = re.compile(r"\s*\b(?:" + "|".join(_UNIT_WORDS) + r")\b\.?(?:\^\{?[23]\}?)?\s*$", re.IGNORECASE)
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")


def _unwrap_delimiters(s: str) -> str:
    for left, right in _DELIMITERS:
        if len(s) > len(left) + len(right) and s.startswith(left) and s.endswith(right):
            inner = s[len(left) : -len(right)]
            if left not in inner:  # `$a$ and $b$` is two formulas, not one
                return inner.strip()
    return s


def clean_answer(text: str) -> str:
    """An answer's text without what does not change its value: markdown emphasis, enclosing math
    delimiters, sentence punctuation, \\text-like wrappers, `\\$`, percent and degree signs, unit
    words, thousands separators; the unicode minus becomes `-`.

    A percent sign is a unit here: `300\\%` states 300 (math-verify alone would also accept 3).
    """
    s = text.replace("\\$", "").strip().replace("\u2212", "-")  # `\$` first: it is no delimiter
    for _ in range(3):  # `**$42$.**`: emphasis, punctuation and delimiters nest in any order
        s = s.strip().strip("*").strip().rstrip(_SENTENCE_PUNCTUATION).strip()
        s = _unwrap_delimiters(s)
    s = _WRAPPERS.sub(r"\1", s)
    s = s.replace("\\%", "").replace("%", "")
    s = _DEGREES.sub("", s)
    while True:
        stripped = _TRAILING_UNIT.sub("", s)
        if stripped == s or not stripped.strip():
            break
        s = stripped
    s = _GROUP_SEPARATOR.sub("", s).strip()
    if _COMMA_GROUPED_NUMBER.match(s):
        s = s.replace(",", "")
    return s.rstrip(_SENTENCE_PUNCTUATION).strip()


def is_prose(text: str) -> bool:
    """Whether cleaned answer text holds words (not only math): three letters in a row outside
    LaTeX commands, e.g. `42 because 6*7`."""
    return re.search(r"[A-Za-z]{3,}", _LATEX_COMMAND.sub(" ", text)) is not None


def has_math_delimiters(text: str) -> bool:
    return "$" in text or "\\(" in text or "\\[" in text
