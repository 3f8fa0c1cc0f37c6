"""Collect one rollout: draw prompts, generate n samples each, score them, keep the groups to train on.

With dynamic sampling (DAPO) it draws `over_sampling_factor` times the prompts it needs and keeps the
first `rollout_batch_size` groups whose rewards differ, drawing again (up to `rollout.max_draws` times)
when too few do. Which groups are kept depends only on rewards, never on timing; every sample's randomness
is keyed by (seed, rollout id, prompt index, sample index). With partial rollout (`runtime/grpo/partial.py`)
groups also carry over from one rollout to the next.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from runtime.algo import fill_batch
from runtime.config import GrpoConfig
from runtime.grpo.rollout_batch import Group, RolloutBatch
from runtime.placement.handles import EngineHandle
from runtime.rewards.contract import call_reward
from runtime.rewards.timeout import score_batch
from runtime.rollout.base import SampleRequest, SampleResult, SamplingParams, keyed_requests
from runtime.rollout.custom import validate_rollout_output

def sampling_params(d: dict) -> SamplingParams:
    return SamplingParams(temperature=d["temperature"], top_p=d["top_p"], top_k=d["top_k"],
                          max_new_tokens=d["max_new_tokens"])


@dataclass
class EngineForCustomRollout:
    """What a custom rollout function gets as `engine` (runtime/rollout/custom.py's contract)."""

    handle: EngineHandle
    tokenizer: Any

    def generate(self, requests: list[SampleRequest], sampling: SamplingParams) -> list[SampleResult]:
        return self.handle.generate(requests, sampling)


class Collector:
    """Everything a rollout needs that outlives it: the engine, the data, the tokenizer, the reward."""

    def __init__(self, cfg: GrpoConfig, engine: EngineHandle, dataset, tokenizer, reward_fn: Callable,
                 custom_rollout: Callable | None = None):
        self.cfg, self.engine, self.dataset, self.tokenizer = cfg, engine, dataset, tokenizer
        self.reward_fn, self.custom_rollout = reward_fn, custom_rollout
        self.sampling = sampling_params(cfg.rollout_sampling())

    def collect(self, rollout_id: int, cursor: dict, partial_state: dict | None = None) -> RolloutBatch:
        r = self.cfg.rollout
        if r.partial:
            from runtime.grpo.partial import collect_partial
            p = collect_partial(self, rollout_id, cursor, partial_state)
            return RolloutBatch(groups=p.groups, generated=p.completed, cursor=p.cursor, dropped=p.filtered,
                                reward_failures=p.reward_failures, generate_s=p.generate_s, reward_s=p.reward_s,
                                new_tokens=p.new_tokens, partial_state=p.state, extra_metrics=p.metrics)
        need = r.rollout_batch_size
        want = max(need, int(need * r.over_sampling_factor)) if r.dynamic_sampling else need
        generated: list[Group] = []
        generate_s = reward_s = 0.0
        failures = 0
        for _ in range(r.max_draws):
            rows, cursor = self.dataset.batch(cursor, want)
            t0 = time.time()
            groups = self.generate(rows, rollout_id, first_prompt=len(generated))
            t1 = time.time()
            failures += self.score(groups)
            generate_s, reward_s = generate_s + t1 - t0, reward_s + time.time() - t1
            generated += groups
            if not r.dynamic_sampling or sum(g.informative for g in generated) >= need:
                break
        kept, dropped = select_groups(generated, need, r.dynamic_sampling)
        return RolloutBatch(groups=kept, generated=generated, cursor=cursor, dropped=dropped,
                            reward_failures=failures, generate_s=generate_s, reward_s=reward_s)

    def generate(self, rows: list[dict], rollout_id: int, first_prompt: int) -> list[Group]:
        n = self.cfg.rollout.n_samples_per_prompt
        prompts = [{**row, "prompt_ids": self.tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]}
                   for row in rows]
        requests = keyed_requests([p["prompt_ids"] for p in prompts], seed=self.cfg.train.seed, slot=rollout_id,
                                  n=n, first_prompt=first_prompt)
        if self.custom_rollout is not None:
            keys = [[q.key for q in group] for group in requests]
            out = self.custom_rollout(EngineForCustomRollout(self.engine, self.tokenizer), prompts, self.sampling, keys,
                                      self._reward_of_sample)
            samples = validate_rollout_output(out, prompts, keys)
        else:
            flat = self.engine.generate([q for group in requests for q in group], self.sampling)
            samples = [flat[i * n:(i + 1) * n] for i in range(len(prompts))]
        return [Group(prompt=p, samples=s) for p, s in zip(prompts, samples)]

    def _reward_of_sample(self, prompt: dict, sample: SampleResult) -> float:
        """The run's reward in the custom-rollout contract's form: reward_fn(prompt, sample)."""
        return float(call_reward(self.reward_fn, sample.text, prompt["label"], prompt.get("metadata") or {},
                                 sample.finish_reason))

    def score(self, groups: list[Group]) -> int:
        """Fill each group's rewards (a custom rollout may have set some); returns how many failed. The
        reward gets each sample's finish reason when it takes one (`rewards.contract`)."""
        todo = [(g, i) for g in groups for i, s in enumerate(g.samples) if s.reward is None]
        scored, failed = score_batch(self.reward_fn, [g.samples[i].text for g, i in todo],
                                     [g.prompt["label"] for g, _ in todo],
                                     [g.prompt.get("metadata") or {} for g, _ in todo], self.cfg.rollout.reward_timeout_s,
                                     finish_reasons=[g.samples[i].finish_reason for g, i in todo])
        for g in groups:
            g.rewards = [float(s.reward) if s.reward is not None else 0.0 for s in g.samples]
        for (g, i), value in zip(todo, scored):
            g.rewards[i] = float(value)
        return failed


def select_groups(generated: list[Group], need: int, dynamic: bool) -> tuple[list[Group], int]:
    """The groups to train on, in prompt order, and how many uninformative ones were dropped.

    Without dynamic sampling every group is kept. With it, the first `need` informative groups; when
    too few exist, uninformative ones fill the batch (they carry zero advantage) so its size is fixed.
    """
    if not dynamic:
        return list(generated), 0
    kept, dropped = fill_batch(list(range(len(generated))), [g.rewards for g in generated], need)
    kept += [i for i in range(len(generated)) if i not in kept][: need - len(kept)]
    return [generated[i] for i in sorted(kept)], dropped
