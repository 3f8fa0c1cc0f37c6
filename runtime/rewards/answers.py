"""Finding a response's final answer and cleaning its text, before any math is parsed.

Pure string work shared by every built-in reward: where the answer is (a box, an `Answer:` line, an
"answer is" sentence), whether it was cut off, and the clean-up that makes `\\$42`, `7 dollars`,
`45 km/h`, `1{,}000`, `0.\\overline{3}`, `1e3` or `\\boxed 7.` read as the number they state.

Several statements (`final_answers`): the last one is the answer, and an "answer is" sentence after a
box counts as one when it names a value (a retraction states what it ends on). The statements just
before it that it is offered beside, joined by "or" (`either \\boxed{44} or \\boxed{45}`), are its
alternatives: distinct ones make a hedge, which states nothing (`math_reward` asks math-verify whether
they are distinct). A statement the response takes back right after it (`\\boxed{42}, but that is
wrong`) or one that only says what the value is not (`not 42`, `\\neq 42`) states nothing.

Cut off: the engine says why a sample ended (its finish reason: "stop", or "length" / "abort" when it was
cut off). Without it (a direct call) a text that ends mid-sentence (`ends_mid_sentence`: "... the
number of such pairs is 46, and the") counts as cut off, and one that ends with an end-of-turn marker
(`<|im_end|>`) as ended by the model. A cut-off statement states nothing: an `Answer:` line, an "answer
is" sentence or a one-line response that runs to the cut, an unclosed box; a complete box, line or
sentence before the cut still stands.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import NamedTuple

_BOX = "\\boxed"
_SENTENCE_PUNCTUATION = ".,;:!?"

# `Answer:` as DAPO's prompt asks for it (any case, markdown bold around it allowed).
ANSWER_LINE = re.compile(r"answer\s*:", re.IGNORECASE)
# "the answer is ...", "final answer is: ...", "the answer should be ...", "the correct value is ..."
_ANSWER_PHRASE = re.compile(r"\b(?:answer|(?:correct|right|true)\s+(?:value|result|number|total|count))"
                            r"\s+(?:is|should\s+be|must\s+be|would\s+be)\b\s*:?", re.IGNORECASE)
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


def _box_at(text: str, start: int) -> tuple[str | None, int]:
    """(content, end) of the box whose `\\boxed` starts at `start`; content None when it is unclosed
    (then end is the text's end)."""
    i = start + len(_BOX)
    if text.startswith(" ", i):
        token = re.match(r" +([^\s$]+)", text[i:])
        content = token.group(1).rstrip(_SENTENCE_PUNCTUATION) if token else ""
        return content or None, i + (token.end() if token else 0)
    if not text.startswith("{", i):
        return None, len(text)
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j], j + 1
    return None, len(text)


def box_contents(text: str) -> tuple[int, str | None] | None:
    """(position, content) of the last \\boxed in text, content None when that box is unclosed;
    None when there is no box. Both `\\boxed{...}` (braces balanced) and `\\boxed x` are boxes; the
    space form's token loses trailing sentence punctuation (`\\boxed 7.` states 7)."""
    start = text.rfind(_BOX)
    if start < 0:
        return None
    return start, _box_at(text, start)[0]


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


# End-of-turn markers left in a text decoded with its special tokens (`42<|im_end|>`, `</s>`).
_END_OF_TURN = re.compile(r"(?:<\|[A-Za-z_]+\|>|<｜[^｜<>\n]{1,40}｜>|</s>|<eos>|<end_of_turn>)$")


def without_end_of_turn(response: str, finish_reason: str | None) -> tuple[str, str | None]:
    """The response without the end-of-turn markers it ends with, and its finish reason: a text that
    ends with one was ended by the model, so without a finish reason it is "stop" (not cut off)."""
    stripped = response.rstrip()
    marker = _END_OF_TURN.search(stripped)
    if marker is None:
        return response, finish_reason
    while marker is not None:  # (a search anchored at the end, not `\s*` before it: a space run costs its length)
        stripped = stripped[:marker.start()].rstrip()
        marker = _END_OF_TURN.search(stripped)
    return stripped, finish_reason if finish_reason is not None else "stop"


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


# A short stretch between two statements that offers the second as an alternative to the first: it opens
# with "or" (`either \boxed{44} or \boxed{45}`, `\boxed{7}, or possibly \boxed{8}`, `\boxed{44}. Or maybe`).
_ALTERNATIVE = re.compile(r"[\s$.,;:()\[\]}*]*(?:\\(?:text|mathrm)\{\s*)?or\b", re.IGNORECASE)
_ALTERNATIVE_GAP_CHARS = 80
# The response taking back the statement just made (`\boxed{42}, but that was wrong`), within a few words of it.
_RETRACTION = re.compile(
    r"\b(?:that|this|it|which)(?:'s|\s+is|\s+was)\s+(?:wrong|incorrect|not\s+(?:right|correct)|a\s+mistake"
    r"|an\s+error)(?![\w-])(?!\s*\?)|\bscratch\s+that\b|\bI\s+(?:made\s+(?:a\s+mistake|an\s+error)|was\s+wrong)\b",
    re.IGNORECASE)
_RETRACTION_REACH_CHARS = 40
# ... or said of the statement itself, right after it (`\boxed{42} is wrong`; not `..., 41, is wrong`)
_RETRACTED_RIGHT_AFTER = re.compile(r"[\s$)]*(?:is|was)\s+(?:wrong|incorrect)\b(?!\s*\?)", re.IGNORECASE)
_SENTENCE_REACH_CHARS = 300  # how far back a supposition ("if ...") is looked for
_LAST_STATEMENTS = 16
# A sentence that supposes an answer rather than stating it ("if the answer is 41, then ...").
_HYPOTHETICAL = re.compile(r"\b(?:if|suppose|supposing|assume|assuming|whether|unless)\b", re.IGNORECASE)
# An answer that says what the value is not: `not 42`, `\neq 42`, `≠ 42` (`not possible` is words, not that).
_NEGATION = re.compile(r"^(?:not\s+(?=[-\d$\\(.])|\\neq?(?![A-Za-z])|≠|!=)", re.IGNORECASE)
# A contrast after the value (`42, not 24`, `42 (not 24)`, `42 rather than 24`) or before it (`not 24 but 42`).
_CONTRAST_AFTER = re.compile(r"(?:,\s*(?:and\s+)?not\b|\(\s*not\b|\brather\s+than\b|\binstead\s+of\b).*$",
                             re.IGNORECASE | re.DOTALL)
_CONTRAST_BEFORE = re.compile(r"^\s*not\b[^,;]*?,?\s*\bbut\s+", re.IGNORECASE)


class _Statement(NamedTuple):
    start: int
    end: int
    answer: FinalAnswer | None  # None: it states nothing (an unclosed box, a line cut off, a negated value)


def stated_text(text: str) -> str | None:
    """What an answer's text states as the value: without a contrast (`42, not 24` states 42; `not 24 but
    42` states 42); None when it only says what the value is not (`not 42`, `\\neq 42`)."""
    text = _CONTRAST_BEFORE.sub("", _CONTRAST_AFTER.sub("", text))
    cleaned = clean_answer(text)
    if not cleaned or _NEGATION.match(cleaned):
        return None
    return text.strip()


def _stated(text: str | None, source: str) -> FinalAnswer | None:
    text = None if text is None else stated_text(text)
    return None if text is None else FinalAnswer(text, source)


# Words that may come between "answer is" and the value it names ("the answer is actually 24").
_LEADING_ADVERBS = re.compile(r"^(?:(?:actually|really|indeed|in\s+fact|therefore|thus|then|clearly|definitely"
                              r"|simply|just|now)\b[\s,]*)+", re.IGNORECASE)
# A text that opens with a value: a number, a formula, `x = ...`, a choice letter alone.
_OPENS_WITH_VALUE = re.compile(r"(?:[-($]|\\[(\[])*\s*(?:\d|\.\d|\\[A-Za-z]|[π∞]|[A-Za-z]\s*=)|\(?[A-Za-z]\)?$")


def _states_a_value(text: str) -> bool:
    """Whether an "answer is" sentence's text opens with a value (`24`, `actually 24`, `\\frac{1}{2}`,
    `(B)`) or denies one (`not 42`), rather than judging or bounding the answer (`the answer is correct`,
    `the answer is at least 2`)."""
    cleaned = _LEADING_ADVERBS.sub("", clean_answer(_CONTRAST_AFTER.sub("", text)))
    return bool(_OPENS_WITH_VALUE.match(cleaned) or _NEGATION.match(cleaned))


def _box_and_line_statements(response: str, cut: bool) -> list[_Statement]:
    """The last `_LAST_STATEMENTS` boxes and `Answer:` lines in order (only the final statement and the
    ones offered beside it matter; reading every one would make a long response cost its length squared);
    a box on an `Answer:` line is that line's answer."""
    lines = []
    for match in list(ANSWER_LINE.finditer(response))[-_LAST_STATEMENTS:]:
        end = _line_end(response, match.end())
        text = response[match.end():end].strip()
        if _BOX in text:
            answer = _stated(last_boxed(text), "box")
        elif cut and end == len(response):
            answer = None  # the line runs to the cut
        else:
            answer = _stated(text, "answer_line")
        lines.append(_Statement(match.start(), end, answer))
    boxes = []
    for match in list(re.finditer(re.escape(_BOX), response))[-_LAST_STATEMENTS:]:
        if not any(line.start <= match.start() < line.end for line in lines):
            content, end = _box_at(response, match.start())
            boxes.append(_Statement(match.start(), end, _stated(content, "box")))
    return sorted(lines + boxes, key=lambda s: s.start)


def _phrase_statements(response: str, cut: bool, after: int = 0) -> list[tuple[_Statement, str]]:
    """(statement, its text) for the last `_LAST_STATEMENTS` "answer is" sentences starting at or after
    `after`, except one that supposes an answer ("if the answer is 41"); a sentence that runs to the cut
    states nothing."""
    found = []
    for match in list(_ANSWER_PHRASE.finditer(response, after))[-_LAST_STATEMENTS:]:
        reach = max(after, match.start() - _SENTENCE_REACH_CHARS)
        sentence_start = max(response.rfind(mark, reach, match.start()) for mark in (". ", "\n", "? ", "! "))
        if _HYPOTHETICAL.search(response, max(sentence_start, after), match.start()):
            continue
        start = match.end()
        line = response[start:_line_end(response, start)]
        sentence_end = _SENTENCE_END.search(line)
        stop = start + (sentence_end.start() if sentence_end else len(line))
        if cut and response.find("\n", stop) < 0 and (not response[stop:].strip() or response[stop:] == "."):
            answer = None  # the sentence runs to the cut (`46.` there could have been 46.5)
        else:
            answer = _stated(response[start:stop], "answer_phrase")
        found.append((_Statement(match.start(), stop, answer), response[start:stop]))
    return found


def _final_statements(response: str, cut: bool) -> tuple[list[_Statement], _Statement | None]:
    """(the statements in order, the final one). The final statement is the later of the last box and
    the last `Answer:` line, unless a complete "answer is" sentence after it names another value; without
    a box or a line, the last "answer is" sentence."""
    statements = _box_and_line_statements(response, cut)
    if not statements:
        phrases = [s for s, _ in _phrase_statements(response, cut)]
        return phrases, (phrases[-1] if phrases else None)
    later = [s for s, text in _phrase_statements(response, cut, after=statements[-1].end)
             if s.answer is not None and _states_a_value(text)]
    statements += later
    return statements, statements[-1]


def final_answers(response: str, *, cut_off: bool | None = None) -> tuple[FinalAnswer | None, list[FinalAnswer]]:
    """`final_answer`'s answer and the answers offered as its alternatives: the statements just before
    it joined to it by "or" (`either \\boxed{44} or \\boxed{45}`, `\\boxed{7}, or possibly \\boxed{8}`);
    whether they differ in value is math-verify's to say (`math_reward`)."""
    cut = ends_mid_sentence(response) if cut_off is None else cut_off
    statements, final = _final_statements(response, cut)
    if final is None:
        whole = response.strip()
        if whole and "\n" not in whole and not cut:
            return _stated(whole, "whole_response"), []
        return None, []
    if final.answer is None:
        return None, []
    retraction = _RETRACTION.search(response, final.end, final.end + 2 * _RETRACTION_REACH_CHARS)
    if (retraction is not None and retraction.start() - final.end <= _RETRACTION_REACH_CHARS) \
            or _RETRACTED_RIGHT_AFTER.match(response, final.end):
        return None, []  # taken back, and nothing stated after it
    alternatives = []
    i = statements.index(final)
    while i > 0:
        gap = response[statements[i - 1].end:statements[i].start]
        if len(gap) > _ALTERNATIVE_GAP_CHARS or not _ALTERNATIVE.match(gap):
            break
        i -= 1
        if statements[i].answer is not None:
            alternatives.append(statements[i].answer)
    return final.answer, alternatives


def final_answer(response: str, *, cut_off: bool | None = None) -> FinalAnswer | None:
    """The answer a response states last, by this precedence:

    1. whichever comes later of the last \\boxed and the last `Answer:` line (a box on that line is
       the line's answer); an unclosed last box, or an unclosed box on the winning line, states
       nothing (truncated), and no earlier answer stands in for it; a complete "answer is" sentence
       after it that names a value replaces it (a retraction states what it ends on: `I first wrote
       \\boxed{42}, but ... the correct answer is 24` states 24);
    2. else the last "answer is" sentence (not one that supposes: "if the answer is 41, ...");
    3. else a one-line response, read whole (`42`, `so the total is 42`);
    4. else None: a multi-line response that never states an answer (typically one cut off).

    A statement states nothing when the response takes it back right after (`\\boxed{42}, but that is
    wrong`) or it names only what the value is not (`not 42`, `\\neq 42`); a contrast after a value is
    not part of it (`42, not 24` states 42). Alternatives offered beside it: `final_answers`.

    cut_off: whether the text stops where the sample was cut off (True: it ran out of tokens; False: the
    model ended it; None: not known, and a text that `ends_mid_sentence` counts as cut off). An `Answer:`
    line, an "answer is" sentence or a one-line response that runs to the cut states nothing: the model
    was still writing it (`Answer: 46` cut there could have gone on to 460). A complete box does not
    depend on what follows it.
    """
    return final_answers(response, cut_off=cut_off)[0]


# ---------------------------------------------------------------- cleaning an answer's text

_DELIMITERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))
_WRAPPERS = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
# Between digit groups: {,}  \,  ,\!  \!  \;  \:  \  ~ or a space (1{,}000, 1\,000, 1,\!000, 1 000).
_GROUP_SEPARATOR = re.compile(r"(?<=\d)(?:\{,\}|,\\!|\\[,!;: ]|~| )(?=\d{3}(?!\d))")
_COMMA_GROUPED_NUMBER = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|[°º]")
# Unit words an answer may end with (DAPO's reference drops the same kind of words).
_UNIT_WORDS = (
    "square", "sq", "cubic", "units?", "dollars?", "cents?", "cm", "mm", "km", "meters?", "metres?",
    "inch(?:es)?", "feet", "foot", "ft", "yards?", "miles?", "mph", "hours?", "hrs?", "minutes?", "mins?",
    "seconds?", "days?", "weeks?", "months?", "years?", "degrees?", "pounds?", "lbs?", "kg", "grams?",
    "liters?", "litres?", "points?", "ways", "students", "people", "integers", "digits", "edges", "meals",
)
_POWER = r"(?:\^\s*\{?-?\d\}?|[²³])?"
_TRAILING_UNIT = re.compile(r"\s*(?:/\s*|\bper\s+)?\b(?:" + "|".join(_UNIT_WORDS) + r")\b\.?" + _POWER + r"\s*$",
                            re.IGNORECASE)
# Symbols too short to be told from a variable unless they follow a number and a space (`12 m^2`, `5 s`)
# or a slash (`km/h`, `m/s^2`).
_TRAILING_UNIT_SYMBOL = re.compile(r"(?:(?<=\d)(?:\s|\\[,;: ]|~)+|\s*/\s*)(?:m|s|h|g|L|mL|ml|mi|oz)"
                                   + _POWER + r"\s*$")
# Text set after a number (`12\,\text{m}^2`, `5\ \mathrm{km/h}`) is a unit, whatever its words.
_TEXT_UNIT = re.compile(r"(?<=[\d}])(?:\s|\\[,;: ]|~)*(?:/|\\cdot)?\s*\\(?:text|textrm|mathrm|mbox|rm)\s*"
                        r"\{[\s~]*[A-Za-z][A-Za-z\s/.]*\}" + _POWER + r"\s*$")
_TRAILING_SPACING = re.compile(r"(?:\s|\\[,;:! ]|~|\\quad)+$")
# A repeating decimal: 0.\overline{3}, 0.1\overline{6}, 1.\bar{09}.
_REPEATING_DECIMAL = re.compile(r"(-?)(\d*)\.(\d*)\\(?:overline|bar)\s*\{?(\d+)\}?")
# A number in e-notation (1e3, 2.5E-4): not Euler's e.
_E_NOTATION = re.compile(r"(?<![\w.\\{])(\d+(?:\.\d+)?)[eE]([+-]?\d+)(?![\w.])")
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")
_WHITESPACE = re.compile(r"\s+")
_TAIL_CHARS = 120


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
    s = _WHITESPACE.sub(" ", s)  # one space for a run: the trailing patterns below scan runs (time squared)
    for _ in range(3):  # `**$42$.**`: emphasis, punctuation and delimiters nest in any order
        s = s.strip().strip("*").strip().rstrip(_SENTENCE_PUNCTUATION).strip()
        s = _unwrap_delimiters(s)
    s = _drop_trailing(_TEXT_UNIT, s)
    s = _WRAPPERS.sub(r"\1", s)
    s = s.replace("\\%", "").replace("%", "")
    s = _DEGREES.sub("", s)
    while True:
        stripped = _drop_trailing(_TRAILING_UNIT_SYMBOL, _drop_trailing(_TRAILING_UNIT, s))
        if stripped == s:
            break
        s = stripped
    s = _TRAILING_SPACING.sub("", s)
    s = _GROUP_SEPARATOR.sub("", s).strip()
    if _COMMA_GROUPED_NUMBER.match(s):
        s = s.replace(",", "")
    s = _REPEATING_DECIMAL.sub(_as_fraction, s)
    s = _E_NOTATION.sub(r"\1\\times 10^{\2}", s)
    return s.rstrip(_SENTENCE_PUNCTUATION).strip()


def _drop_trailing(pattern: re.Pattern, s: str) -> str:
    """s without what pattern (anchored at the end) matches there, repeatedly, unless nothing would be
    left. Only the last `_TAIL_CHARS` are searched: a unit is short, and a long text costs no more."""
    while True:
        found = pattern.search(s, max(0, len(s) - _TAIL_CHARS))
        if found is None or not s[:found.start()].strip():
            return s
        s = s[:found.start()]


def _as_fraction(repeating: re.Match) -> str:
    sign, whole, fixed, period = repeating.groups()
    value = int(whole or 0) + Fraction(int(fixed or 0), 10 ** len(fixed)) \
        + Fraction(int(period), 10 ** len(fixed) * (10 ** len(period) - 1))
    return f"{sign}\\frac{{{value.numerator}}}{{{value.denominator}}}"


def is_prose(text: str) -> bool:
    """Whether cleaned answer text holds words (not only math): three letters in a row outside
    LaTeX commands, e.g. `42 because 6*7`."""
    return re.search(r"[A-Za-z]{3,}", _LATEX_COMMAND.sub(" ", text)) is not None


def has_math_delimiters(text: str) -> bool:
    return "$" in text or "\\(" in text or "\\[" in text
