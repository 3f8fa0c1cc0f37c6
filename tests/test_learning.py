"""GRPO learns: from a random tiny model on the tiny config's synthetic task, mean reward rises by
≥ 0.2 absolute and by more than 3 standard errors; the same run with lr=0 stays within noise; and with
partial rollout on, samples are carried out of rollouts and trained later, and the reward reached over the
same rollouts is within noise of partial off.

The task runs with up to 4 new tokens (the tiny config's 2 leave no room for ragged lengths), and the
engine admits requests and checks the stop every 2 decode steps: a sample ends wherever the policy samples
eos, so freed rows take new requests mid-rollout, and partial rollout stops with samples cut mid-way. One
reference run (partial off) serves every comparison."""
from __future__ import annotations

import statistics

import pytest

from runtime.config import load_config
from runtime.grpo.session import TrainSession
from runtime.run import stages
from runtime.run.directory import RunDir

ROLLOUTS = 80
WINDOW = 10  # rollouts averaged at each end
# ragged lengths and 1.5x groups in flight; TIS on in both modes so partial on differs only by partial rollout
TASK = ["rollout.max_new_tokens=4", "rollout.sync_every=2", "rollout.over_sampling_factor=1.5", "algorithm.use_tis=true"]


def _run(root, lr: float, rollouts: int, sets: tuple[str, ...] = ()) -> list[dict]:
    cfg = load_config("configs/tiny.yaml", TASK + [f"train.lr={lr}", f"train.num_rollout={rollouts}",
                                                   f"checkpoint.interval={rollouts}", "eval.interval=null",
                                                   "tracking.enabled=false", f"storage.root={root}", *sets])
    rd = RunDir(str(root), "learn")
    fetched = stages.fetch(cfg, rd)
    stages.convert(cfg, rd, fetched)
    stages.prepare(cfg, rd, fetched)
    session = TrainSession(cfg, rd)
    try:
        return session.run_chunk(0, rollouts)["metrics"]
    finally:
        session.close()


def _rewards(metrics: list[dict]) -> list[float]:
    return [m["reward_mean"] for m in metrics]


def _gain(rewards: list[float]) -> tuple[float, float]:
    first, last = rewards[:WINDOW], rewards[-WINDOW:]
    gain = statistics.fmean(last) - statistics.fmean(first)
    se = (statistics.variance(first) / len(first) + statistics.variance(last) / len(last)) ** 0.5
    return gain, se


@pytest.fixture(scope="module")
def learned(tmp_path_factory) -> list[float]:
    return _rewards(_run(tmp_path_factory.mktemp("learn"), 5e-4, ROLLOUTS))


def test_grpo_raises_reward_and_lr0_does_not(learned, tmp_path):
    gain, se = _gain(learned)
    assert gain >= 0.2 and gain > 3 * se, (gain, se, learned)

    frozen = _rewards(_run(tmp_path, 0.0, 2 * WINDOW))
    gain0, se0 = _gain(frozen)
    assert abs(gain0) < max(3 * se0, 0.05), (gain0, se0, frozen)


def test_partial_rollout_learns_as_well_as_partial_off(learned, tmp_path):
    metrics = _run(tmp_path, 5e-4, ROLLOUTS, ("rollout.partial=true",))
    # partial rollout really happened: unfinished samples left rollouts, and later ones continued and trained them
    assert sum(m["partial_buffered_samples"] > 0 for m in metrics) >= 10, [m["partial_buffered_samples"] for m in metrics]
    assert sum(m["partial_samples_continued"] for m in metrics) >= 20, [m["partial_samples_continued"] for m in metrics]
    assert all(m["partial_prompts_trained"] == 8 * (i + 1) for i, m in enumerate(metrics))  # golden rule

    partial = _rewards(metrics)
    gain, se = _gain(partial)
    assert gain >= 0.15 and gain > 3 * se, (gain, se, partial)
    # within noise of partial off over the same rollouts: the last windows differ by less than 3 standard
    # errors of their difference (and at least 0.1 of reward is allowed)
    off, on = learned[-WINDOW:], partial[-WINDOW:]
    se_diff = (statistics.variance(off) / WINDOW + statistics.variance(on) / WINDOW) ** 0.5
    assert statistics.fmean(off) - statistics.fmean(on) < max(3 * se_diff, 0.1), (off, on, se_diff)
