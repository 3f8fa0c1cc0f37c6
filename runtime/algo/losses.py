"""PPO-clipped policy loss and the GRPO loss built on it.

Tensors are [batch, tokens] with a response mask of the same shape (1 = a trained token). Positions
off the mask are dropped with `torch.where`, never multiplied by 0: a NaN or inf there (padding,
a stale value) reaches neither the loss nor its gradient. Log-ratios are clamped (±20 by default,
as verl and miles do) before `exp`, so the loss and its gradient are finite in float32 for any
finite inputs (and for -inf log-probs).

Every term is aggregated the same way (`aggregate`), so that with a global `normalizer` the losses
(and metrics) of micro-batches add up exactly to those of the whole batch: the trainer sums the
gradients of its micro-batches and must get the gradient of the global loss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from runtime.algo.kl import DEFAULT_LOGRATIO_CLAMP, kl_penalty, masked_log_ratio
from runtime.errors import ConfigError

if TYPE_CHECKING:
    from runtime.config import AlgorithmSection

LOSS_AGGS = ("token_mean", "seq_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")


def _zero_off_mask(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over the positions where mask is set; 0 where nothing is masked in (not NaN)."""
    count = mask.bool().to(x.dtype)
    if dim is None:
        return _zero_off_mask(x, mask).sum() / count.sum().clamp_min(1.0)
    return _zero_off_mask(x, mask).sum(dim) / count.sum(dim).clamp_min(1.0)


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    loss_agg: str,
    normalizer: float | None = None,
    norm_tokens: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token quantity to a scalar.

    token_mean: sum over masked tokens / number of masked tokens (every token weighs the same);
    seq_mean: mean over sequences of each sequence's token mean (every sequence weighs the same);
    seq_mean_token_sum: mean over sequences of each sequence's token sum (longer ones weigh more);
    seq_mean_token_sum_norm (Dr.GRPO): seq_mean_token_sum / norm_tokens, a constant
      (`algorithm.loss_norm_tokens`, by default rollout.max_new_tokens): no length-dependent division.
    With `normalizer`, the final division is by it instead of this call's count: the number of masked
    tokens (token_mean) or of sequences (every seq_* mode) in the whole global batch.
    """
    if normalizer is not None and not normalizer > 0:
        raise ValueError(f"normalizer must be a positive count, got {normalizer}")
    values = _zero_off_mask(per_token, mask)
    if loss_agg == "token_mean":
        count = mask.bool().to(per_token.dtype).sum().clamp_min(1.0) if normalizer is None else normalizer
        return values.sum() / count
    if loss_agg == "seq_mean":
        per_seq = masked_mean(per_token, mask, dim=-1)
    elif loss_agg == "seq_mean_token_sum":
        per_seq = values.sum(-1)
    elif loss_agg == "seq_mean_token_sum_norm":
        if norm_tokens is None or not norm_tokens > 0:
            raise ValueError(f"seq_mean_token_sum_norm needs a positive norm_tokens, got {norm_tokens}")
        per_seq = values.sum(-1) / norm_tokens
    else:
        raise ConfigError(f"algorithm.loss_agg: unknown aggregation {loss_agg!r} (use {', '.join(LOSS_AGGS)})")
    count = max(per_seq.numel(), 1) if normalizer is None else normalizer
    return per_seq.sum() / count


def metric_agg(loss_agg: str) -> str:
    """How shares and means (clip_frac, approx_kl, tis_weight) are reported: a token mean, or a
    sequence mean for the seq_* modes (whose normalizer counts sequences), never a sum."""
    return "token_mean" if loss_agg == "token_mean" else "seq_mean"


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
    *,
    logratio_clamp: float = DEFAULT_LOGRATIO_CLAMP,
    dual_clip_c: float | None = None,
    norm_tokens: float | None = None,
    tis_mode: str = "truncate",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate: max(-A·ratio, -A·clip(ratio, 1-eps_clip, 1+eps_clip_high)) per token.

    ratio = exp(clamp(logp - old_logp, ±logratio_clamp)); beyond the clamp the gradient is 0.
    `dual_clip_c` (> 1; verl's dual clip): for A < 0 the per-token loss is also capped at -A·c, so a
    token whose ratio ran far above 1 cannot dominate the step (its gradient is then 0).
    `advantages` is per token or per sequence (broadcast over tokens). With `rollout_logp` and
    `tis_cap`, each token's loss is weighted by min(exp(old_logp - rollout_logp), tis_cap), detached:
    truncated importance sampling that corrects for the rollout engine's probabilities differing from
    the trainer's (slime's TIS), and for tokens an older policy made (partial rollout). `tis_mode` "mask"
    (MIS, masked importance sampling) instead gives a token whose ratio is above `tis_cap` weight 0.

    Metrics (detached, aggregated by `metric_agg`): clip_frac, the share of tokens whose clipped
    branch is the active one; approx_kl, the k3 estimate of KL(old ‖ current) on tokens sampled from
    the old policy, i.e. exp(logp - old_logp) - (logp - old_logp) - 1, non-negative and 0 when
    nothing moved. With dual clip: dual_clip_frac. With TIS: tis_weight (mean weight) and
    tis_clip_frac (share of tokens capped).
    """
    if dual_clip_c is not None and not dual_clip_c > 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    m_agg = metric_agg(loss_agg)
    adv = _zero_off_mask(_per_token_advantages(advantages, logp), mask)
    log_ratio = masked_log_ratio(logp, old_logp, mask, logratio_clamp)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_clip, 1.0 + eps_high)
    per_token = torch.maximum(unclipped, clipped)

    metrics: dict[str, torch.Tensor] = {}
    if dual_clip_c is not None:
        cap = -adv * dual_clip_c
        capped = (adv < 0) & (per_token > cap)
        per_token = torch.where(capped, cap, per_token)
        metrics["dual_clip_frac"] = aggregate(capped.to(logp.dtype), mask, m_agg, normalizer).detach()
    if tis_cap is not None:
        if rollout_logp is None:
            raise ValueError("tis_cap is set but rollout_logp was not given: TIS needs the rollout engine's log-probs")
        raw = torch.exp(masked_log_ratio(old_logp, rollout_logp, mask, logratio_clamp)).detach()
        weight = raw.clamp(max=tis_cap) if tis_mode == "truncate" else torch.where(raw <= tis_cap, raw, 0.0)
        per_token = per_token * weight
        metrics["tis_weight"] = aggregate(weight, mask, m_agg, normalizer).detach()
        metrics["tis_clip_frac"] = aggregate((raw > tis_cap).to(logp.dtype), mask, m_agg, normalizer).detach()

    loss = aggregate(per_token, mask, loss_agg, normalizer, norm_tokens)
    with torch.no_grad():
        metrics["clip_frac"] = aggregate((clipped > unclipped).to(logp.dtype), mask, m_agg, normalizer)
        metrics["approx_kl"] = aggregate(
            kl_penalty(old_logp, logp, "k3", mask=mask, logratio_clamp=logratio_clamp), mask, m_agg, normalizer)
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
    algorithm: AlgorithmSection,
    *,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    rollout_logp: torch.Tensor | None = None,
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """pg_loss + kl_coef · aggregate(KL to ref) - entropy_coef · aggregate(entropy), by the settings
    of `algorithm` (the config's AlgorithmSection): clipping, loss_agg, KL kind and clamps, dual clip,
    TIS (on with `use_tis`, from `rollout_logp`).

    `entropy` is per token (see entropy_from_logits). Metrics: pg_loss, kl, entropy (the loss's
    terms, aggregated like it), clip_frac, approx_kl (plus dual_clip_frac, tis_*), detached; kl and
    entropy are 0 when their inputs are not given. See `aggregate` for `normalizer` (micro-batching).
    """
    a = algorithm
    if a.kl_coef != 0.0 and ref_logp is None:
        raise ValueError("kl_coef is non-zero but ref_logp was not given")
    if a.entropy_coef != 0.0 and entropy is None:
        raise ValueError("entropy_coef is non-zero but entropy was not given")
    if a.use_tis and rollout_logp is None:
        raise ValueError("use_tis is on but rollout_logp was not given")
    norm_tokens = a.loss_norm_tokens
    pg_loss, metrics = policy_loss(
        logp, old_logp, advantages, mask, a.eps_clip, a.eps_clip_high, a.loss_agg,
        rollout_logp if a.use_tis else None, a.tis_cap if a.use_tis else None, normalizer,
        logratio_clamp=a.logratio_clamp, dual_clip_c=a.dual_clip_c, norm_tokens=norm_tokens, tis_mode=a.tis_mode,
    )
    loss = pg_loss
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    kl = zero
    if ref_logp is not None:
        per_token_kl = kl_penalty(logp, ref_logp, a.kl_type, mask=mask, logratio_clamp=a.logratio_clamp,
                                  kl_clamp=a.kl_clamp)
        kl = aggregate(per_token_kl, mask, a.loss_agg, normalizer, norm_tokens)
        loss = loss + a.kl_coef * kl
    ent = zero
    if entropy is not None:
        ent = aggregate(entropy, mask, a.loss_agg, normalizer, norm_tokens)
        loss = loss - a.entropy_coef * ent
    metrics.update(pg_loss=pg_loss.detach(), kl=kl.detach(), entropy=ent.detach())
    return loss, metrics
