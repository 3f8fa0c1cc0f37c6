"""PPO-clipped policy loss and the GRPO loss built on it.

Tensors are [batch, tokens] with a response mask of the same shape (1 = a trained token).
Every term is aggregated the same way (`aggregate`), so that with a global `normalizer` the losses
(and metrics) of micro-batches add up exactly to those of the whole batch: the trainer sums the
gradients of its micro-batches and must get the gradient of the global loss.
"""

from __future__ import annotations

import torch

from runtime.algo.kl import kl_penalty
from runtime.errors import ConfigError

LOSS_AGGS = ("token_mean", "seq_mean")


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over the positions where mask is set; 0 where nothing is masked in (not NaN)."""
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp_min(1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp_min(1.0)


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, loss_agg: str, normalizer: float | None = None
) -> torch.Tensor:
    """Reduce a per-token quantity to a scalar.

    token_mean: sum over masked tokens / number of masked tokens (every token weighs the same);
    seq_mean: mean over sequences of each sequence's token mean (every sequence weighs the same).
    With `normalizer`, the final division is by it instead of this call's count: the number of masked
    tokens (token_mean) or of sequences (seq_mean) in the whole global batch.
    """
    if normalizer is not None and not normalizer > 0:
        raise ValueError(f"normalizer must be a positive count, got {normalizer}")
    mask = mask.to(per_token.dtype)
    if loss_agg == "token_mean":
        total = (per_token * mask).sum()
        count = mask.sum().clamp_min(1.0) if normalizer is None else normalizer
        return total / count
    if loss_agg == "seq_mean":
        per_seq = masked_mean(per_token, mask, dim=-1)
        count = max(per_seq.numel(), 1) if normalizer is None else normalizer
        return per_seq.sum() / count
    raise ConfigError(f"algorithm.loss_agg: unknown aggregation {loss_agg!r} (use token_mean or seq_mean)")


def _per_token_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if advantages.dim() == like.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    return advantages.expand_as(like)


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
    loss_agg: str = "token_mean",
    rollout_logp: torch.Tensor | None = None,
    tis_cap: float | None = None,
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate: max(-A·ratio, -A·clip(ratio, 1-eps_clip, 1+eps_clip_high)) per token.

    `advantages` is per token or per sequence (broadcast over tokens). With `rollout_logp` and
    `tis_cap`, each token's loss is weighted by min(exp(old_logp - rollout_logp), tis_cap), detached:
    truncated importance sampling that corrects for the rollout engine's probabilities differing from
    the trainer's (slime's TIS).

    Metrics (detached, aggregated like the loss): clip_frac, the share of tokens whose clipped branch
    is the active one; approx_kl, the k3 estimate of KL(old ‖ current) on tokens sampled from the old
    policy, i.e. exp(logp - old_logp) - (logp - old_logp) - 1, non-negative and 0 when nothing moved.
    With TIS: tis_weight (mean weight) and tis_clip_frac (share of tokens capped).
    """
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    adv = _per_token_advantages(advantages, logp)
    ratio = torch.exp(logp - old_logp)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_clip, 1.0 + eps_high)
    per_token = torch.maximum(unclipped, clipped)

    metrics: dict[str, torch.Tensor] = {}
    if tis_cap is not None:
        if rollout_logp is None:
            raise ValueError("tis_cap is set but rollout_logp was not given: TIS needs the rollout engine's log-probs")
        raw = torch.exp(old_logp - rollout_logp).detach()
        weight = raw.clamp(max=tis_cap)
        per_token = per_token * weight
        metrics["tis_weight"] = aggregate(weight, mask, loss_agg, normalizer).detach()
        metrics["tis_clip_frac"] = aggregate((raw > tis_cap).to(logp.dtype), mask, loss_agg, normalizer).detach()

    loss = aggregate(per_token, mask, loss_agg, normalizer)
    with torch.no_grad():
        metrics["clip_frac"] = aggregate((clipped > unclipped).to(logp.dtype), mask, loss_agg, normalizer)
        metrics["approx_kl"] = aggregate(kl_penalty(old_logp, logp, "k3"), mask, loss_agg, normalizer)
    return loss, metrics


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim, computed in float32 from log_softmax.

    -inf logits (banned tokens) contribute 0, not NaN: their log-prob is clamped to the float minimum
    before it multiplies a probability of exactly 0.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    logp = logp.clamp_min(torch.finfo(logp.dtype).min)
    return -(logp.exp() * logp).sum(dim=-1)


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
    loss_agg: str = "token_mean",
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_type: str = "k3",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    rollout_logp: torch.Tensor | None = None,
    tis_cap: float | None = None,
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """pg_loss + kl_coef · aggregate(KL to ref) - entropy_coef · aggregate(entropy).

    `entropy` is per token (see entropy_from_logits). Metrics: pg_loss, kl, entropy, clip_frac,
    approx_kl (plus tis_* with TIS), detached; kl and entropy are 0 when their inputs are not given.
    See `aggregate` for `normalizer` (micro-batching).
    """
    if kl_coef != 0.0 and ref_logp is None:
        raise ValueError("kl_coef is non-zero but ref_logp was not given")
    if entropy_coef != 0.0 and entropy is None:
        raise ValueError("entropy_coef is non-zero but entropy was not given")
    pg_loss, metrics = policy_loss(
        logp, old_logp, advantages, mask, eps_clip, eps_clip_high, loss_agg, rollout_logp, tis_cap, normalizer
    )
    loss = pg_loss
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    kl = zero
    if ref_logp is not None:
        kl = aggregate(kl_penalty(logp, ref_logp, kl_type), mask, loss_agg, normalizer)
        loss = loss + kl_coef * kl
    ent = zero
    if entropy is not None:
        ent = aggregate(entropy, mask, loss_agg, normalizer)
        loss = loss - entropy_coef * ent
    metrics.update(pg_loss=pg_loss.detach(), kl=kl.detach(), entropy=ent.detach())
    return loss, metrics
