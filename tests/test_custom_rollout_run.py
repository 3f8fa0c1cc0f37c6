"""A custom rollout (rollout.custom_rollout) through a real train session: it gets the documented
arguments, its output is validated, and its samples and rewards are what the trainer trains on."""
from __future__ import annotations

import statistics

import pytest

from runtime.config import load_config
from runtime.errors import ConfigError
from runtime.grpo.session import TrainSession
from runtime.rollout.base import SampleRequest
from runtime.run import stages
from runtime.run.directory import RunDir

SEEN: dict = {}


def masked_rollout(engine, prompts, sampling, keys, reward_fn):
    """One generate per sample; the last response token is masked out; odd samples score themselves 1.0,
    even samples are scored by the run's reward through reward_fn(prompt, sample)."""
    SEEN.update(prompts=prompts, keys=keys, tokenizer=engine.tokenizer)
    flat = engine.generate([SampleRequest(prompt_ids=p["prompt_ids"], key=k)
                            for p, ks in zip(prompts, keys) for k in ks], sampling)
    groups, i = [], 0
    for p, ks in zip(prompts, keys):
        group = []
        for j, _ in enumerate(ks):
            s = flat[i]
            i += 1
            s.loss_mask = [1] * (len(s.response_ids) - 1) + [0]
            s.reward = 1.0 if j % 2 else reward_fn(p, s)
            group.append(s)
        groups.append(group)
    SEEN["samples"] = [s for g in groups for s in g]
    return groups


def broken_rollout(engine, prompts, sampling, keys, reward_fn):
    return [[] for _ in prompts]


def _session(tmp_path, fn: str) -> TrainSession:
    cfg = load_config("configs/tiny.yaml", ["train.num_rollout=1", "checkpoint.interval=1", "eval.interval=null",
                                            "tracking.enabled=false", f"storage.root={tmp_path}",
                                            f"rollout.custom_rollout={__name__}:{fn}"])
    rd = RunDir(str(tmp_path), "custom")
    fetched = stages.fetch(cfg, rd)
    stages.convert(cfg, rd, fetched)
    stages.prepare(cfg, rd, fetched)
    return TrainSession(cfg, rd)


def test_custom_rollout_samples_and_rewards_reach_the_trainer(tmp_path):
    session = _session(tmp_path, "masked_rollout")
    try:
        metrics = session.run_chunk(0, 1)["metrics"][0]
        cfg = session.cfg
        prompts, keys = SEEN["prompts"], SEEN["keys"]
        assert len(prompts) == cfg.rollout.rollout_batch_size and all(len(k) == cfg.rollout.n_samples_per_prompt for k in keys)
        assert all(p["prompt_ids"] and "label" in p for p in prompts)
        assert keys[1][3] == (cfg.train.seed, 0, 1, 3)
        assert SEEN["tokenizer"] is session.tokenizer
        samples = SEEN["samples"]
        rewards = [s.reward for s in samples]
        assert metrics["reward_mean"] == pytest.approx(statistics.fmean(rewards))
        # the trainer trained exactly the tokens the rollout left unmasked
        assert metrics["train_tokens"] == sum(sum(s.loss_mask) for s in samples)
        assert metrics["response_len_mean"] == pytest.approx(statistics.fmean(len(s.response_ids) for s in samples))
    finally:
        session.close()


def test_custom_rollout_output_is_validated(tmp_path):
    session = _session(tmp_path, "broken_rollout")
    try:
        with pytest.raises(ConfigError, match="must get 16 samples"):
            session.run_chunk(0, 1)
    finally:
        session.close()
