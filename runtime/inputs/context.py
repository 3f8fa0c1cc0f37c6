"""A prompt and its response must fit the model's positions (``max_position_embeddings``): past them a rotary
model attends with positions it never saw, and trains on the result without a word.

Checked twice: by the config against the model's config where that is known before anything is fetched (a
local dir, a built-in model, an hf:// model in the HF cache or shipped in runtime/models/known_configs) —
``data.max_prompt_len`` plus the longest response must fit — and at prepare, against the prompts themselves.
"""
from __future__ import annotations

from runtime.config import GrpoConfig
from runtime.errors import ConfigError, DataError


def positions_of(hf_config) -> int | None:
    n = getattr(hf_config, "max_position_embeddings", None)
    return n if isinstance(n, int) and n > 0 else None


def known_positions(source: str) -> int | None:
    """The model's positions without fetching it; None where its config is not at hand."""
    if source.startswith("builtin://"):
        from runtime.inputs.fetch import BUILTIN_MODELS
        from runtime.models.tiny import MAX_POSITIONS
        return MAX_POSITIONS if source[len("builtin://"):].strip("/") in BUILTIN_MODELS else None
    from runtime.plan.summary import model_config_for_plan
    try:
        hf_config, _ = model_config_for_plan(source)
    except Exception:  # noqa: BLE001 - not a model dir: the fetch stage says so in its own line
        return None
    return positions_of(hf_config) if hf_config is not None else None


def longest_response(cfg: GrpoConfig, field: str = "") -> int:
    """rollout.max_new_tokens, or for an eval set (``field`` data.eval.<name>) eval.max_new_tokens when set;
    without a field the longest of both."""
    r, e = cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
    if field.startswith("data.eval"):
        return e
    if field:
        return r
    return max(r, e) if cfg.data.eval else r


def _response_key(cfg: GrpoConfig, n: int) -> str:
    return "eval.max_new_tokens" if cfg.eval.max_new_tokens == n and n != cfg.rollout.max_new_tokens \
        else "rollout.max_new_tokens"


def check_context(cfg: GrpoConfig) -> None:
    """Raise ConfigError (one line) when data.max_prompt_len plus the longest response exceeds the positions of
    a model whose config is known now; nothing is said where it is not (prepare checks the prompts)."""
    limit = known_positions(cfg.model.source)
    if limit is None:
        return
    prompt, response = cfg.data.max_prompt_len, longest_response(cfg)
    if prompt + response <= limit:
        return
    key = _response_key(cfg, response)
    if response >= limit:
        raise ConfigError(f"{key}={response} leaves no room for a prompt in the {limit} positions of "
                          f"{cfg.model.source} (max_position_embeddings); lower {key} below {limit}")
    fix = f"lower data.max_prompt_len to {limit - response} (longer prompts are left out at prepare)"
    if prompt < limit:
        fix += f" or {key} to {limit - prompt}"
    raise ConfigError(f"data.max_prompt_len + {key} = {prompt} + {response} = {prompt + response} exceeds the {limit} "
                      f"positions of {cfg.model.source} (max_position_embeddings); {fix}")


def check_prompts_fit(path: str, prompt_tokens: list[int], *, max_new_tokens: int, positions: int | None,
                      response_key: str = "rollout.max_new_tokens") -> None:
    """Raise DataError (one line: how many, the longest, the limit, the fix) when prompts of the prepared
    dataset ``path`` leave fewer than ``max_new_tokens`` of the model's ``positions``."""
    if positions is None:
        return
    room = positions - max_new_tokens
    over = [n for n in prompt_tokens if n > room]
    if not over:
        return
    longest = max(over)
    fix = (f"set data.max_prompt_len: {room} to leave them out" if room > 0 else "")
    if longest < positions:
        fix += (" or " if fix else "") + f"lower {response_key} to {positions - longest}"
    raise DataError(f"{path}: {len(over)} of {len(prompt_tokens)} prompts with {response_key}={max_new_tokens} "
                    f"exceed the model's {positions} positions (longest prompt {longest} tokens, room for {room}); "
                    f"{fix or f'lower {response_key}'}")
