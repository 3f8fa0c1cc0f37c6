"""Eval metrics (pass@k against brute-force enumeration, avg@n) and `evaluate` with a fake engine."""
from __future__ import annotations

import itertools
import json
import re
from fractions import Fraction

import pytest

from runtime.grpo.evaluation import eval_key, eval_metrics, evaluate, load_eval, numeric_metrics, pass_at_k, save_eval
from runtime.rollout.base import SampleRequest, SampleResult, SamplingParams
from runtime.run.directory import RunDir


def brute_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """The fraction of all k-subsets of n samples (c of them correct) that hold a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(samples[i] for i in s) for s in subsets), len(subsets))


@pytest.mark.parametrize("n", range(1, 8))
def test_pass_at_k_equals_enumeration_of_subsets(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(float(brute_pass_at_k(n, c, k)), abs=1e-12), (n, c, k)


def test_pass_at_k_edges_and_large_n_are_stable():
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(5, 5, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    # large n: the product form has no overflow (math.comb ratios would need big ints / floats)
    v = pass_at_k(2000, 3, 100)
    assert 0.0 < v < 1.0
    assert v == pytest.approx(float(brute_formula(2000, 3, 100)), rel=1e-9)
    for bad in ((3, 4, 1), (3, 1, 0), (3, 1, 4), (3, -1, 1)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def brute_formula(n, c, k):
    from math import comb
    return 1 - Fraction(comb(n - c, k), comb(n, k))


def test_eval_metrics_avg_pass_lengths_truncation():
    correct = [[True, False, False, False], [False, False, False, False], [True, True, True, False]]
    lengths = [[1, 2, 3, 4], [5, 5, 5, 5], [2, 2, 2, 10]]
    truncated = [[False, False, False, True], [False] * 4, [False, False, False, True]]
    m = eval_metrics(correct, lengths, truncated, ks=[1, 2, 4])
    assert set(m) == {"avg@4", "pass@1", "pass@2", "pass@4", "response_len_mean", "truncated_frac",
                      "n_prompts", "n_samples"}
    assert m["avg@4"] == pytest.approx(4 / 12)
    assert m["pass@1"] == pytest.approx(m["avg@4"])  # pass@1 is the mean correctness
    assert m["pass@2"] == pytest.approx((float(brute_pass_at_k(4, 1, 2)) + 0 + float(brute_pass_at_k(4, 3, 2))) / 3)
    assert m["pass@4"] == pytest.approx(2 / 3)
    assert m["response_len_mean"] == pytest.approx(sum(map(sum, lengths)) / 12)
    assert m["truncated_frac"] == pytest.approx(2 / 12)
    assert (m["n_prompts"], m["n_samples"]) == (3, 4)
    with pytest.raises(ValueError, match="same number"):
        eval_metrics([[True], [True, False]], [[1], [1, 1]], [[False], [False, False]], ks=[1])
    with pytest.raises(ValueError, match="pass@k"):
        eval_metrics([[True, False]], [[1, 1]], [[False, False]], ks=[3])


# ---- evaluate with a fake engine ----------------------------------------------------------------
class CharTokenizer:
    """Enough of a tokenizer for evaluate: text -> ids, reversible."""

    def __call__(self, text, add_special_tokens=False):
        assert add_special_tokens is False
        return {"input_ids": [ord(ch) for ch in text]}

    @staticmethod
    def decode(ids):
        return "".join(chr(i) for i in ids)


ROWS = [{"prompt": f"What is {a} + {b}?", "label": str(a + b)} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (9, 9)]]


def fake_engine(log: list):
    """A deterministic stand-in for the rollout engine: right on even prompts (every sample), and on
    odd prompts only for sample 0; the result's own `reward` field says the opposite (as a custom
    rollout's training reward could), which evaluation must ignore. Sample 1 stops on length, its box
    after a closed `</think>` (a sample that ran out of tokens states an answer only there)."""

    def generate(requests: list[SampleRequest], sampling: SamplingParams) -> list[SampleResult]:
        out = []
        for req in requests:
            log.append(req.key)
            seed, rollout, prompt_i, sample_i = req.key
            a, b = map(int, re.findall(r"\d+", CharTokenizer.decode(req.prompt_ids)))
            right = prompt_i % 2 == 0 or sample_i == 0
            text = f"<think>{a} plus {b}</think>The answer is \\boxed{{{a + b if right else a + b + 1}}}"
            ids = [ord(ch) for ch in text][: sampling.max_new_tokens]
            out.append(SampleResult(prompt_ids=req.prompt_ids, response_ids=ids, response_logprobs=[0.0] * len(ids),
                                    text=text, finish_reason="length" if sample_i == 1 else "stop",
                                    reward=0.0 if right else 1.0))
        return out

    return generate


def test_evaluate_keys_counts_and_correctness_ignore_training_reward():
    log: list = []
    sampling = SamplingParams(temperature=1.0, max_new_tokens=64)
    res = evaluate(fake_engine(log), CharTokenizer(), ROWS, n_samples=3, sampling=sampling, seed=7, eval_point=4,
                   ks=[1, 3], reward_timeout_s=None, details=True)
    # keys: (seed, -(1 + eval_point), prompt index, sample index), every one exactly once
    assert sorted(log) == [(7, -5, i, j) for i in range(5) for j in range(3)]
    assert eval_key(7, 0, 2, 1) == (7, -1, 2, 1)
    assert res["n_prompts"] == 5 and res["n_samples"] == 3
    # prompts 0, 2, 4 all right; 1 and 3 one of three (whatever each result's `reward` said)
    assert res["avg@3"] == pytest.approx((3 * 3 + 2 * 1) / 15)
    assert res["pass@3"] == pytest.approx(1.0)
    assert res["pass@1"] == pytest.approx(res["avg@3"])
    assert res["truncated_frac"] == pytest.approx(1 / 3)
    assert res["score_failures"] == 0
    # the rule and the math-verify version that scored them travel with the numbers
    from importlib.metadata import version

    assert res["grader"] == {"grader": "math", "rule_version": "math-4", "math_verify_version": version("math-verify")}
    assert [d["n_correct"] for d in res["details"]] == [3, 1, 3, 1, 3]
    assert res["details"][1]["correct"] == [True, False, False]
    # the loggable view drops the details; a JSON round trip keeps everything
    nm = numeric_metrics(res)
    assert "details" not in nm and nm["avg@3"] == res["avg@3"]
    json.dumps(res)


def test_a_sample_that_ran_out_of_tokens_is_graded_knowing_it():
    """The same text right when the model ended it, wrong when it ran out of tokens with no </think> (the
    finish reason reaches the grader, inline and through the timed scorer)."""

    def engine(finish: str):
        def generate(requests, sampling):
            return [SampleResult(prompt_ids=r.prompt_ids, response_ids=[1], response_logprobs=[0.0],
                                 text="adding them: \\boxed{3}", finish_reason=finish) for r in requests]
        return generate

    kw = dict(n_samples=1, sampling=SamplingParams(max_new_tokens=8), seed=0, eval_point=0, ks=[1], max_prompts=1)
    for timeout_s in (None, 10):
        assert evaluate(engine("stop"), CharTokenizer(), ROWS, **kw, reward_timeout_s=timeout_s)["avg@1"] == 1.0
        assert evaluate(engine("length"), CharTokenizer(), ROWS, **kw, reward_timeout_s=timeout_s)["avg@1"] == 0.0


def test_evaluate_is_independent_of_batching_and_uses_the_timed_scorer():
    from runtime.rewards import shutdown_pool

    sampling = SamplingParams(max_new_tokens=64)
    kw = dict(n_samples=2, sampling=sampling, seed=1, eval_point=0, ks=[1, 2], max_prompts=4)
    log_a, log_b = [], []
    a = evaluate(fake_engine(log_a), CharTokenizer(), ROWS, **kw, reward_timeout_s=None)
    try:
        b = evaluate(fake_engine(log_b), CharTokenizer(), ROWS, **kw, batch_prompts=1, reward_timeout_s=10.0)
    finally:
        shutdown_pool()
    assert sorted(log_a) == sorted(log_b) and len(log_a) == 8  # max_prompts=4 kept the first four
    drop = {"eval_time_s"}
    assert {k: v for k, v in a.items() if k not in drop} == {k: v for k, v in b.items() if k not in drop}
    assert a["avg@2"] == pytest.approx((2 + 1 + 2 + 1) / 8)


def test_save_and_load_eval_roundtrip(tmp_path):
    rd = RunDir(str(tmp_path), "run-a")
    assert load_eval(rd, 4) is None
    results = {"arith": {"avg@2": 0.5, "pass@1": 0.5, "n_prompts": 3}, "aime": {"avg@2": 0.0}}
    path = save_eval(rd, 4, results)
    assert path == rd.eval_result(4) and path.endswith("eval/rollout_4.json")
    assert load_eval(rd, 4) == results
    assert json.loads(open(path).read())["rollout"] == 4
    assert not [p for p in (tmp_path / "runs" / "run-a" / "eval").iterdir() if p.name.startswith(".")]  # no temp left


def test_a_check_cut_off_is_a_score_failure_without_a_timeout(monkeypatch):
    """Checked one at a time (`reward_timeout_s=None`), a power tower sympy would evaluate for minutes is cut
    off by the direct-call bound (lowered to 5 s here: a fresh worker's first check may take a second on a
    loaded host) and counted in `score_failures`, as the timed scorer counts it, not only graded wrong."""
    from runtime.rewards import math_reward, score_batch, timeout

    def engine(requests, sampling):
        texts = ["\\boxed{9^{9^{9^{9}}}}", "\\boxed{7}"]
        return [SampleResult(prompt_ids=r.prompt_ids, response_ids=[1], response_logprobs=[0.0],
                             text=texts[r.key[2]], finish_reason="stop") for r in requests]

    monkeypatch.setattr(timeout, "DIRECT_CALL_TIMEOUT_S", 5.0)
    kw = dict(n_samples=1, sampling=SamplingParams(max_new_tokens=8), seed=0, eval_point=0, ks=[1], max_prompts=2)
    res = evaluate(engine, CharTokenizer(), ROWS, **kw, reward_timeout_s=None, details=True)
    assert res["score_failures"] == 1 and [d["n_correct"] for d in res["details"]] == [0, 1]
    # every worker ready again before the next test: the killed ones' replacements answer too
    assert score_batch(math_reward, ["\\boxed{2}"] * 4, ["2"] * 4, timeout_s=60) == ([1.0] * 4, 0)
