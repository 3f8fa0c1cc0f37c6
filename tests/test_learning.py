"""GRPO learns: from a random tiny model on the tiny config's synthetic task, mean reward rises by
≥ 0.2 absolute and by more than 3 standard errors; the same run with lr=0 stays within noise."""
from __future__ import annotations

import statistics


from runtime.run import stages
from runtime.config import load_config
from runtime.grpo.session import TrainSession
from runtime.run.directory import RunDir

ROLLOUTS = 80
WINDOW = 10  # rollouts averaged at each end


def _rewards(tmp_path, run_id: str, lr: float, rollouts: int) -> list[float]:
    cfg = load_config("configs/tiny.yaml", [f"train.lr={lr}", f"train.num_rollout={rollouts}",
                                            f"checkpoint.interval={rollouts}", "eval.interval=null",
                                            "tracking.enabled=false", f"storage.root={tmp_path}"])
    rd = RunDir(str(tmp_path), run_id)
    fetched = stages.fetch(cfg, rd)
    stages.convert(cfg, rd, fetched)
    stages.prepare(cfg, rd, fetched)
    session = TrainSession(cfg, rd)
    try:
        chunk = session.run_chunk(0, rollouts)
    finally:
        session.close()
    return [m["reward_mean"] for m in chunk["metrics"]]


def _gain(rewards: list[float]) -> tuple[float, float]:
    first, last = rewards[:WINDOW], rewards[-WINDOW:]
    gain = statistics.fmean(last) - statistics.fmean(first)
    se = (statistics.variance(first) / len(first) + statistics.variance(last) / len(last)) ** 0.5
    return gain, se


def test_grpo_raises_reward_and_lr0_does_not(tmp_path):
    learned = _rewards(tmp_path / "learn", "learn", 5e-4, ROLLOUTS)
    gain, se = _gain(learned)
    assert gain >= 0.2 and gain > 3 * se, (gain, se, learned)

    frozen = _rewards(tmp_path / "frozen", "frozen", 0.0, 2 * WINDOW)
    gain0, se0 = _gain(frozen)
    assert abs(gain0) < max(3 * se0, 0.05), (gain0, se0, frozen)
