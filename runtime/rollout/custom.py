"""Custom rollout functions named by import path (`rollout.custom_rollout: "pkg.mod:fn"`), as slime allows.

The contract a custom rollout function must meet
------------------------------------------------

    def fn(engine, prompts, sampling, keys, reward_fn) -> list[list[SampleResult]]

engine     call `engine.generate(requests, sampling)` as often as needed (multi-turn: generate,
           append tool output, generate again); `engine.tokenizer` is the run's tokenizer.
prompts    list of dicts, one per prompt; "prompt_ids" (list[int], chat template applied) is
           always there, the dataset row's other fields (e.g. "label") ride along.
sampling   the run's `SamplingParams`; pass it on, or a `dataclasses.replace` of it.
keys       keys[i][j] = (seed, rollout_id, prompt_index, sample_index) of sample j of prompt i;
           n = len(keys[i]). All randomness must come from these keys (through the engine), never
           from a global RNG, or a resumed run stops reproducing. A second `generate` for the same
           sample needs a different key: use `turn_key(key, turn)`.
reward_fn  `reward_fn(prompt: dict, sample: SampleResult) -> float`: the run's `rollout.reward`
           on the sample's text and the prompt's label, inline (no timeout). A function may score
           its own samples (set `sample.reward`); samples left with reward None are scored by
           the pipeline afterwards, under `rollout.reward_timeout_s`.

Returns one list per prompt with exactly len(keys[i]) samples, each a `SampleResult` (or a dict
with its fields) where
- prompt_ids is prompts[i]["prompt_ids"], the part the policy was given, not trained on;
- response_ids is every token after it (model turns, tool output, later model turns);
- response_logprobs has one float per response token (the engine's log-probs for model
  tokens; any finite value, e.g. 0.0, where loss_mask is 0);
- loss_mask is None (train on all) or one 0/1 per response token: 0 for tool output, which the
  policy did not produce and must not be trained to produce.
`validate_rollout_output` checks all of this and names the first violation.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping
from typing import Any

from runtime.errors import ConfigError
from runtime.rollout.base import RolloutEngine, SampleRequest, SampleResult, SamplingParams

RolloutFn = Callable[..., list[list[SampleResult]]]

_FIELD = "rollout.custom_rollout"
_TURN_SHIFT = 32  # sample indices stay below 2**32, turns below 2**31: (turn << 32) | index fits int64


def turn_key(key: tuple[int, int, int, int], turn: int) -> tuple[int, int, int, int]:
    """The key for the `turn`-th generate call of one sample; turn 0 is the key itself.

    Every turn restarts decode positions at 0, so reusing the key would replay the same noise.
    """
    seed, rollout_id, prompt_index, sample_index = key
    if not 0 <= sample_index < (1 << _TURN_SHIFT) or not 0 <= turn < (1 << 31):
        raise ValueError(f"turn_key needs 0 <= sample_index < 2**32 and 0 <= turn < 2**31, got {sample_index}, {turn}")
    return (seed, rollout_id, prompt_index, (turn << _TURN_SHIFT) | sample_index)


def load_custom_rollout(path: str) -> RolloutFn:
    """Import "pkg.mod:fn" and return fn. A wrong path raises ConfigError (one line)."""
    if not isinstance(path, str) or path.count(":") != 1:
        raise ConfigError(f"{_FIELD} must look like 'package.module:function', got {path!r}")
    module_name, attr = path.split(":")
    if not module_name or not attr:
        raise ConfigError(f"{_FIELD} must look like 'package.module:function', got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:  # the module or something it imports is missing
        raise ConfigError(
            f"{_FIELD}: cannot import {module_name!r} ({exc}); install it or put it on PYTHONPATH"
        ) from exc
    fn: Any = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ConfigError(f"{_FIELD}: module {module_name!r} has no attribute {attr!r}; fix the name after ':'")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ConfigError(f"{_FIELD}: {path!r} is a {type(fn).__name__}, not a function")
    return fn


def default_rollout(
    engine: RolloutEngine,
    prompts: list[dict],
    sampling: SamplingParams,
    keys: list[list[tuple[int, int, int, int]]],
    reward_fn: Callable[[dict, SampleResult], float] | None = None,
) -> list[list[SampleResult]]:
    """Single-turn rollout under the same contract: one generate call for every sample of every prompt.

    Rewards are left to the pipeline (reward_fn is not called here).
    """
    requests = [
        SampleRequest(prompt_ids=list(prompt["prompt_ids"]), key=key)
        for prompt, prompt_keys in zip(prompts, keys, strict=True)
        for key in prompt_keys
    ]
    flat = engine.generate(requests, sampling)
    grouped, start = [], 0
    for prompt_keys in keys:
        grouped.append(flat[start : start + len(prompt_keys)])
        start += len(prompt_keys)
    return grouped


def _as_sample_result(sample: Any, where: str) -> SampleResult:
    if isinstance(sample, SampleResult):
        return sample
    if isinstance(sample, Mapping):
        try:
            return SampleResult(
                prompt_ids=list(sample["prompt_ids"]),
                response_ids=list(sample["response_ids"]),
                response_logprobs=list(sample["response_logprobs"]),
                text=sample.get("text", ""),
                finish_reason=sample.get("finish_reason", "stop"),
                loss_mask=None if sample.get("loss_mask") is None else list(sample["loss_mask"]),
                reward=sample.get("reward"),
            )
        except KeyError as exc:
            raise ConfigError(f"{_FIELD}: {where} lacks {exc.args[0]!r}") from exc
    raise ConfigError(f"{_FIELD}: {where} is a {type(sample).__name__}, expected a SampleResult or dict")


def validate_rollout_output(
    output: Any, prompts: list[dict], keys: list[list[tuple[int, int, int, int]]]
) -> list[list[SampleResult]]:
    """Check a rollout function's output against the contract; return it as lists of SampleResult."""
    if not isinstance(output, (list, tuple)) or len(output) != len(prompts):
        got = len(output) if isinstance(output, (list, tuple)) else type(output).__name__
        raise ConfigError(f"{_FIELD}: must return one list per prompt ({len(prompts)}), got {got}")
    checked: list[list[SampleResult]] = []
    for i, (group, prompt, prompt_keys) in enumerate(zip(output, prompts, keys, strict=True)):
        if not isinstance(group, (list, tuple)) or len(group) != len(prompt_keys):
            got = len(group) if isinstance(group, (list, tuple)) else type(group).__name__
            raise ConfigError(f"{_FIELD}: prompt {i} must get {len(prompt_keys)} samples, got {got}")
        samples = []
        for j, raw in enumerate(group):
            where = f"sample {j} of prompt {i}"
            sample = _as_sample_result(raw, where)
            n = len(sample.response_ids)
            if list(sample.prompt_ids) != list(prompt["prompt_ids"]):
                raise ConfigError(f"{_FIELD}: {where} has prompt_ids different from the prompt's; put later turns in response_ids")
            if len(sample.response_logprobs) != n:
                raise ConfigError(f"{_FIELD}: {where} has {len(sample.response_logprobs)} logprobs for {n} response tokens")
            if not all(math.isfinite(lp) for lp in sample.response_logprobs):
                raise ConfigError(f"{_FIELD}: {where} has a non-finite logprob; use 0.0 where loss_mask is 0")
            if sample.loss_mask is not None:
                if len(sample.loss_mask) != n:
                    raise ConfigError(f"{_FIELD}: {where} has a loss_mask of {len(sample.loss_mask)} for {n} response tokens")
                if any(m not in (0, 1) for m in sample.loss_mask):
                    raise ConfigError(f"{_FIELD}: {where} has loss_mask values other than 0/1")
            if sample.reward is not None and not math.isfinite(float(sample.reward)):
                raise ConfigError(f"{_FIELD}: {where} has a non-finite reward {sample.reward}")
            samples.append(sample)
        checked.append(samples)
    return checked
