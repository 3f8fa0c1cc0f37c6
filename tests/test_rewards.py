"""Rule-based rewards, the reward registry, and time-bounded batch scoring."""

import importlib
import logging
import sys
import threading

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
from runtime.rewards.math_reward import last_boxed

CUSTOM_MODULE = "grpoflow_test_custom_reward"
CUSTOM_SOURCE = '''
import time

FAIL_VALUE = -0.5


def length_reward(response, label, metadata=None):
    return float(len(response)) + (metadata or {}).get("bonus", 0.0)


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
     (r"\text{(B)}", "(B)"), (r"\left( 1, 2 \right)", "(1,2)"), ("1,2", "1,2")],
)
def test_dapo_normalize_answer(raw, normalized):
    assert normalize_answer(raw) == normalized


def test_dapo_reward_plus_minus_one():
    assert dapo_reward("Reasoning...\nAnswer: 42", "42") == 1.0
    assert dapo_reward("Reasoning...\nAnswer: 41", "42") == -1.0
    assert dapo_reward("Reasoning... the answer is 42", "42") == -1.0  # no Answer: line
    assert dapo_reward("Answer: 41\nAnswer: $\\boxed{1,000}$.", "1000") == 1.0  # last line, normalised
    assert dapo_reward("Answer: 0.5", r"\frac{1}{2}") == 1.0  # strings differ; math-verify agrees


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


def test_hanging_and_raising_rewards_fail_fast_and_pool_recovers(custom_module):
    fn = custom_module.misbehaving_reward
    rewards, n_failed = score_batch(fn, ["ok", "sleep", "raise", "ok"], ["", "", "", ""], timeout_s=1.5)
    # Waiting the hang out would have given "sleep" its 1.0: the fail value says it was cut off.
    assert rewards == [1.0, -0.5, -0.5, 1.0] and n_failed == 2
    assert score_batch(fn, ["ok"] * 5, [""] * 5, timeout_s=10) == ([1.0] * 5, 0)
    assert score_batch(fn, ["nan", "ok"], ["", ""], timeout_s=10, fail_value=-3.0) == ([-3.0, 1.0], 1)


def test_pathological_math_answer_is_cut_off(caplog):
    # sympy raises 9^(9^(9^9)) in C code; math-verify's own 5 s alarm is not what stops it here: had it
    # fired, math-verify would have answered "wrong" (a reward, not a failure); ours is a timeout failure.
    with caplog.at_level(logging.WARNING, logger="runtime.rewards.timeout"):
        rewards, n_failed = score_batch(math_reward, [r"\boxed{9^{9^{9^{9}}}}", r"\boxed{2}"], ["9", "2"],
                                        timeout_s=1.0)
    assert rewards == [0.0, 1.0] and n_failed == 1
    assert "first: timeout: no result within 1 s" in caplog.text


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


def test_inline_scoring_counts_exceptions(custom_module):
    rewards, n_failed = score_batch(custom_module.misbehaving_reward, ["raise", "ok"], ["", ""], parallel=False)
    assert rewards == [-0.5, 1.0] and n_failed == 1


def test_unsendable_reward_is_a_config_error():
    with pytest.raises(ConfigError, match="cannot be sent to a worker process"):
        score_batch(lambda r, l, m=None: 1.0, ["a"], ["b"])
