"""Evaluation: sample n responses per eval prompt, score them 1/0 with math-verify, report avg@n / pass@k.

Correctness is `runtime.rewards.is_correct` whatever reward trained the model (a DAPO -1/1 reward or
a custom one must not change what "accuracy" means). Eval noise is keyed by
``(seed, -(1 + eval_point), prompt_index, sample_index)``: the negative rollout id keeps it apart from
every training rollout's noise, and the same checkpoint evaluated twice gives the same samples.

Results live in ``eval/rollout_<N>.json`` (one file per eval point, every eval set in it), written
atomically, so a resumed run never re-evaluates a point it already has.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Sequence

from runtime import storage
from runtime.rollout.base import SampleRequest, SampleResult, SamplingParams, keyed_requests, sample_key
from runtime.run.directory import RunDir

EngineGenerate = Callable[[list[SampleRequest], SamplingParams], list[SampleResult]]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): 1 - C(n-c, k) / C(n, k), as a stable product.

    n samples of which c are correct; the probability that at least one of k samples drawn
    without replacement from them is correct.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
    p_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        p_all_wrong *= 1.0 - k / i
    return 1.0 - p_all_wrong


def eval_metrics(correct: Sequence[Sequence[bool]], lengths: Sequence[Sequence[int]],
                 truncated: Sequence[Sequence[bool]], ks: Sequence[int]) -> dict[str, float | int]:
    """Metrics of one eval set: per prompt a list of n samples (correct?, response tokens, truncated?).

    ``avg@{n}`` is the mean correctness over all samples (every prompt has the same n);
    ``pass@{k}`` the mean over prompts of the unbiased estimator.
    """
    if not correct:
        raise ValueError("eval_metrics: no prompts")
    if not len(correct) == len(lengths) == len(truncated):
        raise ValueError("eval_metrics: correct, lengths and truncated must have one entry per prompt")
    ns = {len(c) for c in correct}
    if len(ns) != 1 or 0 in ns:
        raise ValueError(f"eval_metrics: every prompt needs the same number (>= 1) of samples, got {sorted(ns)}")
    n = ns.pop()
    for c, ln, tr in zip(correct, lengths, truncated):
        if not len(c) == len(ln) == len(tr):
            raise ValueError("eval_metrics: correct, lengths and truncated must have one entry per sample")
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise ValueError(f"eval_metrics: pass@k needs 1 <= k <= n_samples={n}, got k={bad}")
    counts = [sum(bool(x) for x in c) for c in correct]
    n_prompts = len(correct)
    out: dict[str, float | int] = {f"avg@{n}": sum(counts) / (n_prompts * n)}
    for k in sorted(set(ks)):
        out[f"pass@{k}"] = statistics.fmean(pass_at_k(n, c, k) for c in counts)
    out["response_len_mean"] = statistics.fmean(x for ln in lengths for x in ln)
    out["truncated_frac"] = sum(bool(x) for tr in truncated for x in tr) / (n_prompts * n)
    out["n_prompts"] = n_prompts
    out["n_samples"] = n
    return out


def eval_slot(eval_point: int) -> int:
    """The key slot of an evaluation: negative, so eval samples never share a training rollout's noise."""
    return -(1 + int(eval_point))


def eval_key(seed: int, eval_point: int, prompt_index: int, sample_index: int) -> tuple[int, int, int, int]:
    """The randomness key of one eval sample."""
    return sample_key(seed, eval_slot(eval_point), prompt_index, sample_index)


def _score(texts: list[str], labels: list[str], finish_reasons: list[str], timeout_s: float | None
           ) -> tuple[list[bool], int]:
    """Correct or not per answer, and how many checks failed (raised or ran out of time: counted wrong)."""
    from runtime.rewards import math_reward, score_batch, timeout

    if timeout_s is None:
        # one at a time, each under the bound a direct `is_correct` call has; a check cut off there is a
        # failure to report, not only a wrong answer
        scored = [score_batch(math_reward, [t], [lab], None, timeout.DIRECT_CALL_TIMEOUT_S, fail_value=0.0,
                              finish_reasons=[f]) for t, lab, f in zip(texts, labels, finish_reasons)]
        return [s >= 0.5 for (s,), _ in scored], sum(failed for _, failed in scored)
    scores, failed = score_batch(math_reward, texts, labels, None, timeout_s, fail_value=0.0,
                                 finish_reasons=finish_reasons)
    return [s >= 0.5 for s in scores], failed


def _grader() -> dict[str, str | None]:
    from runtime.rewards import grader_record

    return grader_record("math")


def evaluate(engine_generate: EngineGenerate, tokenizer, rows: list[dict], *, n_samples: int,
             sampling: SamplingParams, seed: int, eval_point: int, ks: Sequence[int] = (1,),
             max_prompts: int | None = None, batch_prompts: int | None = None,
             reward_timeout_s: float | None = 5.0, details: bool = False) -> dict[str, Any]:
    """Evaluate the policy behind ``engine_generate`` on prepared rows (``prompt``, ``label``).

    Returns the metrics of :func:`eval_metrics` plus ``score_failures`` (answers whose check raised
    or timed out: counted wrong), ``grader`` (``runtime.rewards.grader_record``: the rule and
    math-verify version that scored them) and ``eval_time_s``; with ``details=True`` also ``details``: per
    prompt its label, the number correct and the first response. ``max_prompts`` keeps the first rows;
    ``batch_prompts`` bounds how many prompts go to the engine per call (results do not depend on
    it: every sample's noise is keyed). ``reward_timeout_s=None`` checks answers one at a time, each
    within ``rewards.timeout.DIRECT_CALL_TIMEOUT_S`` (a check cut off counts in ``score_failures``). A sample
    that ran out of tokens is graded knowing it (``is_correct``'s finish reason).
    """
    if isinstance(ks, int):
        ks = [ks]
    if n_samples < 1:
        raise ValueError(f"evaluate: n_samples must be >= 1, got {n_samples}")
    rows = list(rows[:max_prompts] if max_prompts else rows)
    if not rows:
        raise ValueError("evaluate: no eval prompts")
    t0 = time.time()
    step = batch_prompts or len(rows)
    results: list[SampleResult] = []
    for start in range(0, len(rows), step):
        ids = [tokenizer(row["prompt"], add_special_tokens=False)["input_ids"] for row in rows[start:start + step]]
        reqs = [q for group in keyed_requests(ids, seed=seed, slot=eval_slot(eval_point), n=n_samples,
                                              first_prompt=start) for q in group]
        out = engine_generate(reqs, sampling)
        if len(out) != len(reqs):
            raise RuntimeError(f"evaluate: the engine returned {len(out)} results for {len(reqs)} requests")
        results += out
    texts = [r.text for r in results]
    labels = [str(row["label"]) for row in rows for _ in range(n_samples)]
    flat_correct, failed = _score(texts, labels, [r.finish_reason for r in results], reward_timeout_s)

    def grouped(values: list) -> list[list]:
        return [values[i * n_samples:(i + 1) * n_samples] for i in range(len(rows))]

    correct = grouped(flat_correct)
    metrics: dict[str, Any] = eval_metrics(
        correct, grouped([len(r.response_ids) for r in results]),
        grouped([r.finish_reason == "length" for r in results]), ks)
    metrics["score_failures"] = failed
    metrics["grader"] = _grader()  # which rule scored these numbers (kept in eval/rollout_<N>.json)
    metrics["eval_time_s"] = time.time() - t0
    if details:
        metrics["details"] = [
            {"prompt_index": i, "label": str(row["label"]), "n_correct": sum(c),
             "correct": [bool(x) for x in c], "first_response": results[i * n_samples].text}
            for i, (row, c) in enumerate(zip(rows, correct))]
    return metrics


def numeric_metrics(result: dict[str, Any]) -> dict[str, float]:
    """The loggable part of an evaluate() result: numbers (not NaN, not bools); details dropped."""
    return {k: float(v) for k, v in result.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not (isinstance(v, float) and math.isnan(v))}


def save_eval(rd: RunDir, rollout: int, results_by_set: dict[str, dict[str, Any]]) -> str:
    """Write ``eval/rollout_<N>.json`` atomically: {"rollout", "created", "sets": {name: result}}."""
    from runtime.testing.moments import moment
    moment("eval-sampled")  # every eval set scored, nothing saved
    path = rd.eval_result(rollout)
    storage.write_json_atomic(path, {"rollout": int(rollout), "created": time.time(), "sets": results_by_set})
    moment("eval-saved")
    return path


def load_eval(rd: RunDir, rollout: int) -> dict[str, dict[str, Any]] | None:
    """The ``results_by_set`` saved for this eval point, or None when it was not evaluated (yet)."""
    path = rd.eval_result(rollout)
    if not storage.exists(path):
        return None
    try:
        doc = storage.read_json(path)
        return dict(doc["sets"])
    except (ValueError, KeyError, TypeError):
        return None  # unreadable: evaluate again (writes are atomic, so this is not expected)


__all__ = ["pass_at_k", "eval_metrics", "eval_key", "evaluate", "numeric_metrics", "save_eval", "load_eval"]
