"""Rule-based rewards, the reward registry, and time-bounded batch scoring."""

import importlib
import json
import logging
import re
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest

from runtime.errors import ConfigError
from runtime.rewards import (
    dapo_reward,
    deepscaler_reward,
    get_reward_fn,
    is_correct,
    math_reward,
    reward_fail_value,
    score_batch,
)
from runtime.rewards.dapo import normalize_answer
from runtime.rewards.answers import final_answer, last_boxed

CUSTOM_MODULE = "grpoflow_test_custom_reward"
CUSTOM_SOURCE = '''
import time

FAIL_VALUE = -0.5


def length_reward(response, label, metadata=None):
    return float(len(response)) + (metadata or {}).get("bonus", 0.0)


def finish_reward(response, label, metadata=None, *, finish_reason=None):
    return {None: 0.0, "stop": 1.0, "length": 2.0}[finish_reason]


def kwargs_reward(response, label, metadata=None, **kw):
    return 3.0 if kw.get("finish_reason") == "length" else 0.0


def misbehaving_reward(response, label, metadata=None):
    if response == "sleep":
        time.sleep(60)
    if response == "raise":
        raise RuntimeError("boom")
    if response == "nan":
        return float("nan")
    return 1.0
'''


@pytest.fixture(scope="module")
def custom_module(tmp_path_factory):
    directory = tmp_path_factory.mktemp("custom_reward")
    (directory / f"{CUSTOM_MODULE}.py").write_text(CUSTOM_SOURCE)
    sys.path.insert(0, str(directory))
    yield importlib.import_module(CUSTOM_MODULE)
    sys.path.remove(str(directory))
    sys.modules.pop(CUSTOM_MODULE, None)


def plain_reward(response, label, metadata=None):
    return 1.0


# ---------------------------------------------------------------- math


def test_last_boxed_balances_braces_and_takes_the_last():
    assert last_boxed(r"so \boxed{1} then \boxed{\frac{a}{b^{2}}}.") == r"\frac{a}{b^{2}}"
    assert last_boxed(r"thus \boxed 7$") == "7"
    assert last_boxed(r"Hence \boxed 7.") == "7" and last_boxed(r"\boxed 12;") == "12"  # punctuation is not the answer
    assert last_boxed(r"\boxed{3} wait \boxed{\frac{1}{2}") is None  # truncated: no credit for the earlier box
    assert last_boxed("no box") is None


@pytest.mark.parametrize(
    "response, label, expected",
    [
        (r"We get $\boxed{\frac{1}{2}}$.", "0.5", 1.0),
        (r"We get $\boxed{\frac{1}{3}}$.", "0.5", 0.0),
        (r"first \boxed{1}, corrected: \boxed{2}", "2", 1.0),
        (r"first \boxed{1}, corrected: \boxed{2}", "1", 0.0),
        ("The answer is 41? No.\nAnswer: 42", "42", 1.0),
        ("Answer: $42$.", "42", 1.0),
        ("Answer: 41\nsome afterthought 42", "42", 0.0),  # the Answer: line, not the last number
        ("so the total is 42", "42", 1.0),  # no box, no marker: math-verify reads the response
        (r"\boxed{1,000}", "1000", 1.0),
        (r"\boxed{x = 3}", r"3", 1.0),
        ("", "1", 0.0),
    ],
)
def test_math_reward(response, label, expected):
    assert math_reward(response, label) == expected
    assert is_correct(response, label) is (expected == 1.0)


# Issue 62, class 11: which statement is the final answer. A hedge (distinct answers offered as alternatives)
# states none; a retraction states what it ends on; a negated answer states no value. Each case: response,
# label, finish reason, verdict by plain meaning; near-misses beside each rule keep the verdict they had.
FINAL_STATEMENT_CASES = [
    # a hedge
    (r"It is either \boxed{44} or \boxed{45}.", "44", None, False),
    (r"It is either \boxed{44} or \boxed{45}.", "45", None, False),
    (r"The answer is \boxed{7}, or possibly \boxed{8}.", "7", None, False),
    ("The answer is \\boxed{44}.\nOr maybe \\boxed{45}.", "45", "stop", False),
    (r"It's \boxed{44} (or possibly \boxed{45}).", "44", None, False),
    (r"$\boxed{44}$ \text{ or } $\boxed{45}$", "45", None, False),
    (r"So \boxed{3}, or perhaps the answer is 4.", "4", None, False),
    (r"\boxed{44}", "44", None, True),
    (r"Either way, the answer is \boxed{44}.", "44", None, True),
    (r"\boxed{\frac{1}{2}} or equivalently \boxed{0.5}", "0.5", None, True),  # the same value twice
    (r"Case 1 gives \boxed{2}, case 2 gives \boxed{3}; in total \boxed{5}.", "5", None, True),
    (r"\boxed{3} for part one. For part two (odd or even n) it is \boxed{5}.", "5", None, True),  # "or" elsewhere
    (r"\boxed{x = 2 \text{ or } x = -2}", "2, -2", None, True),  # one box: a solution set
    ("Answer: 3 or 4", "3", None, False),  # one answer line: a set, not 3
    # a box, then a different final statement
    ("So \\boxed{42}.\n\nOn reflection, the answer is 24.", "42", None, False),
    ("So \\boxed{42}.\n\nOn reflection, the answer is 24.", "24", None, True),
    ("\\boxed{42}\nTherefore the final answer is $24$.", "42", "stop", False),
    ("Answer: 42\nHmm, the answer is actually 24.", "42", None, False),
    ("\\boxed{42}\n\nHmm, the answer should be 24.", "24", None, True),
    (r"The answer is \boxed{12}. I am confident the answer is correct.", "12", None, True),  # names no value
    ("\\boxed{42}\nCheck: if the answer is 41, then 6 \\times 7 would be 41, which is false.", "42", None, True),
    ("\\boxed{42}. Indeed the answer is 42.", "42", None, True),
    (r"\boxed{5}. Note that the answer is at least 2, as shown above.", "5", None, True),  # a bound, no value
    # a retraction
    (r"I initially wrote \boxed{42}, but that was a mistake: the correct answer is 24.", "42", None, False),
    (r"I initially wrote \boxed{42}, but that was a mistake: the correct answer is 24.", "24", None, True),
    (r"So \boxed{42}, but that is wrong.", "42", None, False),
    (r"I initially wrote \boxed{42}, but I made an error. The correct value is 24.", "42", None, False),
    (r"I initially wrote \boxed{42}, but I made an error. The correct value is 24.", "24", None, True),
    (r"\boxed{42} is wrong; redoing it gives \boxed{24}.", "24", None, True),
    (r"\boxed{42}, my mistake was in step 1 but it is fixed above.", "42", None, True),  # not the answer's
    ("Answer: 42\nScratch that.", "42", "stop", False),
    (r"\boxed{42}. Is that wrong? No: 6 \times 7 = 42.", "42", None, True),  # a question, answered
    (r"\boxed{42}. Step 2 was wrong? No, it holds.", "42", None, True),
    (r"\boxed{42}. The other option, 41, is wrong.", "42", None, True),
    (r"$\boxed{42}$ is wrong.", "42", None, False),
    (r"\boxed{42}. This is a mistake-free count.", "42", None, True),
    ("I thought 41 was a mistake. The answer is 24.", "24", None, True),
    # a negated answer
    ("Answer: not 42", "42", None, False),
    (r"\boxed{\neq 42}", "42", None, False),
    ("The answer is not 42.", "42", None, False),
    (r"Answer: $\ne 42$", "42", "stop", False),
    (r"\boxed{x \neq 42}", "42", None, False),
    ("The answer is not 24 but 42.", "42", None, True),
    ("The answer is 42 (not counting the empty set).", "42", None, True),
]

# Issue 62, class 12: how an answer's text is read (units, repeating decimals, a contrast, e-notation, an
# end-of-turn marker), with near-misses.
READING_CASES = [
    (r"\boxed{12\,\text{m}^2}", "12", None, True),
    (r"\boxed{12\,\text{m}^2}", "13", None, False),
    (r"The area is \boxed{12 \mathrm{~cm}^2}.", "12", None, True),
    ("Answer: 45 km/h", "45", None, True),
    ("Answer: 9.8 m/s^2", "9.8", None, True),
    (r"\boxed{45\ \mathrm{km/h}}", "45", None, True),
    ("Answer: 12 m", "12", "stop", True),
    ("Answer: 30°", "30", None, True),
    (r"\boxed{30°}", "30", None, True),
    ("Answer: 30°", "60", None, False),
    (r"\boxed{2 x}", "2", None, False),  # a letter that is no unit stays a variable
    ("Answer: 5 s", "5", None, True),
    (r"\boxed{0.\overline{3}}", r"\frac{1}{3}", None, True),
    (r"\boxed{0.1\overline{6}}", r"\frac{1}{6}", None, True),
    (r"Answer: $1.\overline{09}$", r"\frac{12}{11}", None, True),
    (r"\boxed{0.\overline{3}}", "0.3", None, False),
    ("Answer: 0.3", r"\frac{1}{3}", None, False),
    ("The answer is 42, not 24.", "42", None, True),
    ("The answer is 42, not 24.", "24", None, False),
    ("Answer: 42 (not 24)", "42", None, True),
    ("Answer: 1e3", "1000", None, True),
    ("Answer: 2.5e-3", "0.0025", None, True),
    ("Answer: 1e3", "e^3", None, False),
    (r"\boxed{e^{3}}", "e^3", None, True),
    ("Answer: 42<|im_end|>", "42", None, True),
    (r"\boxed{42}<|endoftext|>", "42", None, True),
    ("Answer: 4<|im_end|>", "42", None, False),
    ("the count is 46, and the", "46", None, False),  # still cut off mid-sentence
]


@pytest.mark.parametrize("cases", [FINAL_STATEMENT_CASES, READING_CASES], ids=["final_statement", "reading"])
def test_math_reward_by_plain_meaning(cases):
    """Scored as a rollout is (`score_batch`, each with its finish reason)."""
    rewards, failed = score_batch(math_reward, [c[0] for c in cases], [c[1] for c in cases], timeout_s=60,
                                  finish_reasons=[c[2] for c in cases])
    assert failed == 0
    assert [(c[0], c[1]) for c, r in zip(cases, rewards) if (r > 0) != c[3]] == []


def test_final_answer_reads_the_last_statement():
    from runtime.rewards.answers import final_answers

    assert final_answer("\\boxed{42}\nSo the answer is 24.") == ("24", "answer_phrase")
    assert final_answer("The answer is \\boxed{12}. Surely the answer is right.") == ("12", "box")
    assert final_answer("Answer: not 42") is None and final_answer("\\boxed{5}, but that is wrong.") is None
    assert final_answer(r"\boxed{\text{not possible}}") == (r"\text{not possible}", "box")  # words, not a value
    assert final_answer("The answer is 42 rather than 24.") == ("42", "answer_phrase")
    answer, alternatives = final_answers(r"either \boxed{44} or \boxed{45}")
    assert answer == ("45", "box") and alternatives == [("44", "box")]
    assert final_answers(r"first \boxed{44}, then \boxed{45}")[1] == []


def test_dapo_and_deepscaler_read_units_and_end_of_turn_markers():
    assert dapo_reward("Answer: 45 km/h<|im_end|>", "45") == 1.0
    assert dapo_reward("Answer: 46 km/h<|im_end|>", "45") == -1.0
    assert deepscaler_reward(r"</think>\boxed{0.\overline{3}}</s>", r"\frac{1}{3}") == 1.0


def test_math_reward_works_off_the_main_thread():
    # math-verify's SIGALRM timeouts raise ValueError outside the main thread unless turned off
    results = []
    thread = threading.Thread(target=lambda: results.append(math_reward(r"\boxed{\frac{1}{2}}", "0.5")))
    thread.start()
    thread.join()
    assert results == [1.0]


# ---------------------------------------------------------------- dapo


@pytest.mark.parametrize(
    "raw, normalized",
    [(" $42$. ", "42"), (r"\boxed{1,000}", "1000"), (r"\dfrac{1}{2}", r"\frac{1}{2}"), (r"90^\circ", "90"),
     (r"\text{(B)}", "(B)"), (r"\left( 1, 2 \right)", "(1,2)"), ("1,2", "1,2"),
     (r"\$42", "42"), (r"$\$7.50$", "7.50"), ("7 dollars", "7"), ("36 square units", "36"),
     (r"36 \text{ square units}", "36"), (r"1{,}000", "1000"), (r"1\,000", "1000"), ("−5", "-5")],
)
def test_dapo_normalize_answer(raw, normalized):
    assert normalize_answer(raw) == normalized


def test_dapo_reward_plus_minus_one():
    assert dapo_reward("Reasoning...\nAnswer: 42", "42") == 1.0
    assert dapo_reward("Reasoning...\nAnswer: 41", "42") == -1.0
    assert dapo_reward("Reasoning... the answer is 42", "42") == -1.0  # no Answer: line
    assert dapo_reward("Answer: 41\nAnswer: $\\boxed{1,000}$.", "1000") == 1.0  # last line, normalised
    assert dapo_reward("Answer: 0.5", r"\frac{1}{2}") == 1.0  # strings differ; math-verify agrees


def test_dapo_truncated_box_on_the_answer_line_scores_minus_one():
    assert dapo_reward("Answer: \\boxed{9", "9") == -1.0
    assert dapo_reward("Answer: \\boxed{9}", "9") == 1.0
    assert dapo_reward("Answer: \\$42", "42") == 1.0 and dapo_reward("Answer: 7 dollars", "7") == 1.0


def test_final_answer_precedence():
    assert final_answer("Answer: 3\nthen \\boxed{5}") == ("5", "box")
    assert final_answer("\\boxed{5}\nAnswer: 6") == ("6", "answer_line")
    assert final_answer("\\boxed{5} ... \\boxed{6") is None  # truncated: no fallback to 5
    assert final_answer("Answer: 42\n\\boxed{4") is None
    assert final_answer("I think the answer is 2^{10}. Done.\nYes.") == ("2^{10}", "answer_phrase")
    assert final_answer("so the total is 42") == ("so the total is 42", "whole_response")
    assert final_answer("so the total is 42", cut_off=True) is None  # ran out of tokens: still writing it
    assert final_answer("the count is 46, and the") is None  # ends mid-sentence: cut off
    assert final_answer("Step 1: 6 \\times 7 = 42\nStep 2: subtract") is None  # never states an answer


def test_math_verify_alarms_only_where_turned_on(monkeypatch):
    # math-verify's SIGALRM timeouts are off unless a process turns them on (the reward workers do); a
    # direct call of a built-in reward is graded in a worker, so the caller's process sets no alarm
    import signal

    alarms = []
    monkeypatch.setattr(signal, "alarm", lambda seconds: alarms.append(seconds) or 0)
    monkeypatch.setattr(signal, "setitimer", lambda *a: alarms.append(a) or (0.0, 0.0))
    assert is_correct(r"\\boxed{\\frac{1}{2}}", "0.5") and dapo_reward("Answer: 2^{10}", "1024") == 1.0
    from runtime.rewards.verify_timeouts import set_math_verify_timeout

    module = sys.modules["runtime.rewards.math_reward"]  # the package's `math_reward` is the function
    assert module.grade(r"\\boxed{\\frac{1}{2}}", "0.5")  # graded here, unbounded: alarms off
    assert alarms == []
    set_math_verify_timeout(5)
    try:
        assert module.grade(r"\\boxed{\\frac{1}{2}}", "0.5")
    finally:
        set_math_verify_timeout(None)
    assert alarms  # the switch reaches math-verify


def test_dapo_looks_only_at_the_last_300_characters():
    assert dapo_reward("Answer: 42\n" + "x" * 300, "42") == -1.0
    assert dapo_reward("Answer: 42\n" + "x" * 280, "42") == 1.0


# ---------------------------------------------------------------- deepscaler


def test_deepscaler_grades_only_after_think():
    assert deepscaler_reward(r"<think>maybe \boxed{3}</think> So \boxed{4}.", "4") == 1.0
    assert deepscaler_reward(r"<think>maybe \boxed{3}</think> So \boxed{4}.", "3") == 0.0
    assert deepscaler_reward(r"<think>still thinking \boxed{4}", "4") == 0.0  # never closed
    assert deepscaler_reward(r"prompt opened it ... </think> \boxed{\frac{1}{2}}", "0.5") == 1.0
    assert deepscaler_reward("</think> The answer is 4.", "4") == 0.0  # no box
    assert deepscaler_reward(r"no tags, \boxed{4}", "4") == 1.0


# ---------------------------------------------------------------- registry


def test_registry_builtins_and_import_path(custom_module):
    assert get_reward_fn("math") is math_reward
    assert get_reward_fn("dapo") is dapo_reward
    assert get_reward_fn("deepscaler") is deepscaler_reward
    fn = get_reward_fn(f"{CUSTOM_MODULE}:length_reward")
    assert fn("abc", "x", {"bonus": 0.5}) == 3.5


def test_registry_errors_are_one_line_config_errors():
    with pytest.raises(ConfigError) as err:
        get_reward_fn("x")
    assert str(err.value) == "rollout.reward: unknown reward 'x' (use math, dapo, deepscaler or module:function)"
    with pytest.raises(ConfigError, match=r"cannot load reward 'no_such_pkg\.mod:fn' \(ModuleNotFoundError"):
        get_reward_fn("no_such_pkg.mod:fn")
    with pytest.raises(ConfigError, match=r"cannot load reward 'runtime\.rewards:nope' \(AttributeError"):
        get_reward_fn("runtime.rewards:nope")
    with pytest.raises(ConfigError, match="is not a function"):
        get_reward_fn("runtime.rewards.dapo:WINDOW_CHARS")


def test_grader_record_names_the_rule_and_math_verify(custom_module):
    from importlib.metadata import version

    from runtime.rewards import grader_record

    mv = version("math-verify")
    assert grader_record() == {"grader": "math", "rule_version": "math-4", "math_verify_version": mv}
    assert grader_record(dapo_reward)["rule_version"] == "dapo-4"
    assert grader_record("deepscaler")["rule_version"] == "deepscaler-4"
    custom = grader_record(custom_module.length_reward)
    assert custom["grader"] == f"{CUSTOM_MODULE}:length_reward" and custom["rule_version"] is None


def test_fail_values_come_from_the_reward_module(custom_module):
    assert reward_fail_value(math_reward) == 0.0
    assert reward_fail_value(deepscaler_reward) == 0.0
    assert reward_fail_value(dapo_reward) == -1.0
    assert reward_fail_value(plain_reward) == 0.0
    assert reward_fail_value(custom_module.misbehaving_reward) == -0.5


# ---------------------------------------------------------------- time-bounded scoring


def test_score_batch_matches_inline_scoring():
    responses = [r"\boxed{\frac{1}{2}}", "Answer: 41", r"\boxed{7}", "nothing"]
    labels = ["0.5", "42", "7", "3"]
    assert score_batch(math_reward, responses, labels, timeout_s=10) == ([1.0, 0.0, 1.0, 0.0], 0)
    assert score_batch(dapo_reward, responses, labels, parallel=False) == ([-1.0, -1.0, -1.0, -1.0], 0)


@pytest.mark.race
def test_hanging_and_raising_rewards_fail_fast_and_pool_recovers(custom_module):
    fn = custom_module.misbehaving_reward
    rewards, n_failed = score_batch(fn, ["ok", "sleep", "raise", "ok"], ["", "", "", ""], timeout_s=1.5)
    # Waiting the hang out would have given "sleep" its 1.0: the fail value says it was cut off.
    assert rewards == [1.0, -0.5, -0.5, 1.0] and n_failed == 2
    assert score_batch(fn, ["ok"] * 5, [""] * 5, timeout_s=10) == ([1.0] * 5, 0)
    assert score_batch(fn, ["nan", "ok"], ["", ""], timeout_s=10, fail_value=-3.0) == ([-3.0, 1.0], 1)


@pytest.mark.race
def test_pathological_math_answer_is_cut_off(caplog):
    # sympy raises 9^(9^(9^9)) in C code; math-verify's own 5 s alarm is not what stops it here: had it
    # fired, math-verify would have answered "wrong" (a reward, not a failure); ours is a timeout failure.
    with caplog.at_level(logging.WARNING, logger="runtime.rewards.timeout"):
        rewards, n_failed = score_batch(math_reward, [r"\boxed{9^{9^{9^{9}}}}"], ["9"], timeout_s=1.0)
    assert rewards == [0.0] and n_failed == 1
    assert "first: timeout: no result within 1 s" in caplog.text
    # the pool goes on (a generous deadline: a plain answer's time on a loaded host is not what is tested)
    assert score_batch(math_reward, [r"\boxed{2}", r"\boxed{3}"], ["2", "2"], timeout_s=60) == ([1.0, 0.0], 0)


def test_workers_see_modules_added_to_sys_path_later(tmp_path, monkeypatch):
    score_batch(math_reward, [r"\boxed{1}"], ["1"], timeout_s=10)  # the pool exists before the path changes
    (tmp_path / "grpoflow_late_reward.py").write_text("def reward(r, l, m=None):\n    return 2.5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("grpoflow_late_reward")
    try:
        assert score_batch(module.reward, ["a", "b"], ["", ""], timeout_s=10) == ([2.5, 2.5], 0)
    finally:
        sys.modules.pop("grpoflow_late_reward", None)


def test_metadata_reaches_the_reward(custom_module):
    rewards, _ = score_batch(custom_module.length_reward, ["ab", "abc"], ["", ""], [{"bonus": 1.0}, None], 10)
    assert rewards == [3.0, 3.0]


def test_the_finish_reason_reaches_rewards_that_take_it(custom_module):
    """A reward declaring `finish_reason` (or **kwargs) gets each sample's; a three-argument one is called as
    before; through score_batch (workers and inline) and the rollout's Collector."""
    from runtime.config import config_from_dict
    from runtime.grpo.collect import Collector
    from runtime.grpo.rollout_batch import Group
    from runtime.rollout.base import SampleResult

    reasons = ["stop", "length", None]
    for parallel in (True, False):
        kw = dict(timeout_s=10, parallel=parallel, finish_reasons=reasons)
        assert score_batch(custom_module.finish_reward, ["a", "b", "c"], ["", "", ""], **kw) == ([1.0, 2.0, 0.0], 0)
        assert score_batch(custom_module.kwargs_reward, ["a", "b", "c"], ["", "", ""], **kw) == ([0.0, 3.0, 0.0], 0)
        assert score_batch(custom_module.length_reward, ["ab", "abc", "a"], ["", "", ""], **kw) == ([2.0, 3.0, 1.0], 0)
    samples = [SampleResult(prompt_ids=[1], response_ids=[2], response_logprobs=[0.0], text="x", finish_reason=f)
               for f in ("stop", "length")]
    for fn, want in ((custom_module.finish_reward, [1.0, 2.0]), (math_reward, [0.0, 0.0])):
        collector = Collector(config_from_dict({}), None, None, None, fn)
        group = Group(prompt={"prompt": "p", "label": "1", "metadata": {}}, samples=samples)
        assert collector.score([group]) == 0 and group.rewards == want
        assert [collector._reward_of_sample(group.prompt, s) for s in samples] == want  # a custom rollout's form
    # math: a box mid-thought in a sample that ran out of tokens states nothing; the same text closed counts
    cut = "<think>\nso it is \\boxed{1}, or maybe"
    assert score_batch(math_reward, [cut, cut + "</think>\\boxed{1}"], ["1", "1"], timeout_s=10,
                       finish_reasons=["length", "length"]) == ([0.0, 1.0], 0)


def test_a_direct_call_is_bounded_on_a_power_tower(monkeypatch, caplog):
    """math_reward called directly (not through score_batch) on a power tower sympy would evaluate for
    minutes returns its failure value within the direct-call bound (lowered to 1 s here to keep the test
    short; the default is 10 s); the grader works again at once."""
    import time

    from runtime.rewards import timeout

    tower = "9^{9^{9^{9}}}"
    t0 = time.monotonic()
    with monkeypatch.context() as m, caplog.at_level(logging.WARNING, logger="runtime.rewards.timeout"):
        m.setattr(timeout, "DIRECT_CALL_TIMEOUT_S", 1.0)
        assert math_reward("\\boxed{" + tower + "}", "9") == 0.0  # as the answer
        assert is_correct("\\boxed{2}", tower) is False  # as the label
    assert time.monotonic() - t0 < 60  # a guard only: the bound is the 1 s deadline, a stuck call never returns
    assert caplog.text.count("first: timeout: no result within 1 s") == 2  # cut off, not graded wrong
    assert math_reward("\\boxed{2}", "2") == 1.0
    assert math_reward("\\boxed{" + tower + "}", tower) == 1.0  # the same tower on both sides: equal as written
    # (every worker ready again before the next test: the killed ones' replacements answer too)
    assert score_batch(math_reward, ["\\boxed{2}"] * 4, ["2"] * 4, timeout_s=60) == ([1.0] * 4, 0)


def test_inline_scoring_counts_exceptions(custom_module):
    rewards, n_failed = score_batch(custom_module.misbehaving_reward, ["raise", "ok"], ["", ""], parallel=False)
    assert rewards == [-0.5, 1.0] and n_failed == 1


def test_unsendable_reward_is_a_config_error():
    with pytest.raises(ConfigError, match="cannot be sent to a worker process"):
        score_batch(lambda r, l, m=None: 1.0, ["a"], ["b"])


# ---------------------------------------------------------------- the grading case set

GRADING_CASES = Path(__file__).parent / "data" / "grading_cases.jsonl"
REQUIRED_CATEGORIES = {
    "integer", "fraction", "root", "power", "pi", "percent", "thousands", "unicode_minus", "units",
    "several_boxes", "nested_braces", "truncated_box", "middle_answer", "empty", "long", "think",
    "answer_line_latex", "space_box", "text_wrapper", "infinity",
    # issue 33: answers cut off, thinking left open, and the engine's finish reason
    "unclosed_think", "cut_sentence", "answer_then_cut", "length_finish", "stop_finish",
}
FINISH_REASONS = ("stop", "length")  # a case without one is a direct call (no finish reason known)


def load_grading_cases() -> list[dict]:
    return [json.loads(line) for line in GRADING_CASES.read_text().splitlines() if line.strip()]


def disagreements(reward_fn, cases) -> list[dict]:
    """Cases where the reward's pass (a positive reward) differs from the verdict by plain meaning; the
    cases are scored as the pipeline scores a rollout (`score_batch`, each with its finish reason)."""
    rewards, failed = score_batch(reward_fn, [c["response"] for c in cases], [c["label"] for c in cases],
                                  timeout_s=60, finish_reasons=[c.get("finish_reason") for c in cases])
    assert failed == 0
    return [c for c, r in zip(cases, rewards) if (r > 0) != (c["verdict"] == "correct")]


def test_grading_case_set_is_well_formed():
    cases = load_grading_cases()
    assert len(cases) >= 200
    assert len({c["id"] for c in cases}) == len(cases)
    for c in cases:
        assert set(c) - {"finish_reason"} == {"id", "category", "response", "label", "verdict", "reason"}, c["id"]
        assert c["verdict"] in ("correct", "incorrect") and c["reason"], c["id"]
        assert c.get("finish_reason", "stop") in FINISH_REASONS, c["id"]
    assert REQUIRED_CATEGORIES <= {c["category"] for c in cases}
    assert max(len(c["response"]) for c in cases) >= 20_000


# Before the grader fixes (answers read as LaTeX, truncation, units) the set measured: math 176/223 (13 false positives), dapo 140/223,
# deepscaler 140/223. Issue 33 added 39 cases (cut-off answers, thinking left open, finish reasons) and turned think-06
# (a box inside thinking never closed) to incorrect: before its fix math had 244/262 (18 false positives).


def test_math_and_is_correct_agree_with_the_plain_meaning():
    cases = load_grading_cases()
    wrong = disagreements(math_reward, cases)
    assert [c["id"] for c in wrong if c["verdict"] == "incorrect"] == []  # no false positive
    assert (len(cases) - len(wrong)) / len(cases) >= 0.97
    assert len(wrong) == 0  # today's count; a rule change that loses a case shows up here
    assert all(is_correct(c["response"], c["label"], c.get("finish_reason")) is (c["verdict"] == "correct")
               for c in cases)


def _last(pattern: str, text: str) -> int:
    """Start of the last match of pattern in text, -1 when none."""
    starts = [m.start() for m in re.finditer(pattern, text)]
    return starts[-1] if starts else -1


ANSWER_LINE_RE = r"(?i)answer\s*:"


def dapo_format_reason(response: str) -> str:
    """Why DAPO's format rule (the last `Answer:` line of the last 300 characters) departs from the
    plain meaning of a response."""
    if _last(ANSWER_LINE_RE, response) < 0:
        return "no Answer: line (a box or a sentence states the answer)"
    if _last(ANSWER_LINE_RE, response[-300:]) < 0:
        return "the Answer: line is not in the last 300 characters"
    if _last(r"\\boxed", response) > _last(ANSWER_LINE_RE, response):
        return "a later box restates the answer (dapo reads only the Answer: line)"
    return "unexplained"


def deepscaler_format_reason(response: str) -> str:
    """Why DeepScaleR's format rule (the last box after </think>) departs from the plain meaning."""
    if "<think>" in response and "</think>" not in response:
        return "<think> never closed"
    graded = response.rsplit("</think>", 1)[-1]
    if "\\boxed" not in graded:
        return "no box (an Answer: line or a sentence states the answer)"
    if _last(ANSWER_LINE_RE, graded) > _last(r"\\boxed", graded):
        return "a later Answer: line restates the answer (deepscaler reads only the box)"
    return "unexplained"


def test_dapo_departs_from_the_plain_meaning_only_by_its_format_rule():
    reasons = Counter(dapo_format_reason(c["response"]) for c in disagreements(dapo_reward, load_grading_cases()))
    assert reasons == {
        "no Answer: line (a box or a sentence states the answer)": 81,
        "the Answer: line is not in the last 300 characters": 1,
        "a later box restates the answer (dapo reads only the Answer: line)": 3,
    }


def test_deepscaler_departs_from_the_plain_meaning_only_by_its_format_rule():
    reasons = Counter(
        deepscaler_format_reason(c["response"]) for c in disagreements(deepscaler_reward, load_grading_cases())
    )
    assert reasons == {
        "no box (an Answer: line or a sentence states the answer)": 85,
        "a later Answer: line restates the answer (deepscaler reads only the box)": 1,
    }


# Where `math` and math-verify used directly (verify(parse(label), parse(response))) differ, and why;
# in every one of them `math` has the verdict by plain meaning.
DIFFERS_FROM_MATH_VERIFY = {
    "bare LaTeX outside $...$ (an Answer: line, an 'answer is' sentence) is read by math-verify as "
    "plain text: only its leading number": [
        "fraction-02", "fraction-06", "fraction-08", "fraction-10", "fraction-12", "fraction-20",
        "root-01", "root-03", "root-04", "root-06", "root-10", "power-01", "power-02", "power-04", "power-05",
        "power-10", "pi-01", "pi-03", "pi-04", "thousands-01", "thousands-03", "thousands-09", "thousands-11",
        "unicode_minus-01", "unicode_minus-04", "units-01", "units-12", "answer_line_latex-08",
        "text_wrapper-01", "text_wrapper-04", "infinity-01", "plain-03", "plain-04",
    ],
    "math-verify reads a thin space or space between digit groups as a product (1\\,000 = 1*0)": [
        "thousands-04", "thousands-08",
    ],
    "math-verify accepts 3 for 300\\% (percent as /100); we read the percent sign as a unit": ["percent-02"],
    "math-verify reads an earlier box or an intermediate number when the response was cut off": [
        "truncated_box-03", "truncated_box-04", "truncated_box-05", "truncated_box-06", "truncated_box-08",
        "truncated_box-09", "think-07",
    ],
    "math-verify reads a box, an Answer: line or a number inside thinking that never closed": [
        "think-06", "unclosed_think-01", "unclosed_think-02", "unclosed_think-03", "unclosed_think-05",
        "unclosed_think-07", "stop_finish-02",
    ],
    "math-verify reads the number a sentence cut off mid-way had got to": [
        "cut_sentence-01", "cut_sentence-02", "cut_sentence-03", "cut_sentence-04", "cut_sentence-07",
    ],
    "math-verify does not know the sample ran out of tokens (finish reason length): it reads what was cut off, "
    "or what the thinking said when nothing after </think> states an answer": [
        "length_finish-02", "length_finish-03", "length_finish-05", "length_finish-06", "length_finish-07",
        "length_finish-08", "length_finish-09", "length_finish-12",
    ],
    "math-verify joins several boxes of one sentence into a set; the last box is the answer": ["several_boxes-05"],
    "math-verify prefers a box to a later Answer: line": ["several_boxes-09"],
}


def test_where_math_differs_from_math_verify_used_directly():
    from math_verify import parse, verify

    cases = load_grading_cases()
    differ = []
    for c in cases:
        direct = verify(parse("\\boxed{" + c["label"] + "}", parsing_timeout=None), parse(c["response"], parsing_timeout=None),
                        timeout_seconds=None)
        ours = is_correct(c["response"], c["label"], c.get("finish_reason"))
        if bool(direct) != ours:
            assert ours is (c["verdict"] == "correct"), c["id"]
            differ.append(c["id"])
    assert sorted(differ) == sorted(i for ids in DIFFERS_FROM_MATH_VERIFY.values() for i in ids)
