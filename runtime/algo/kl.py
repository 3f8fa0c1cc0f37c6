"""Per-token KL estimators between the policy and a reference, from log-probs of sampled tokens."""

from __future__ import annotations

import torch

from runtime.errors import ConfigError

KL_KINDS = ("k1", "k2", "k3")

# exp() of a log-ratio beyond this overflows float32/bf16 long before it means anything (verl and
# miles clamp at the same ±20); `algorithm.logratio_clamp` sets it.
DEFAULT_LOGRATIO_CLAMP = 20.0


def masked_log_ratio(num: torch.Tensor, den: torch.Tensor, mask: torch.Tensor | None, clamp: float) -> torch.Tensor:
    """num - den clamped to ±clamp, and 0 where mask is off (`where`, so a NaN or inf there reaches
    neither the value nor the gradient of num and den)."""
    diff = num - den
    if mask is not None:
        diff = torch.where(mask.bool(), diff, torch.zeros((), dtype=diff.dtype, device=diff.device))
    return diff.clamp(-clamp, clamp)


def kl_penalty(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    kind: str,
    *,
    mask: torch.Tensor | None = None,
    logratio_clamp: float = DEFAULT_LOGRATIO_CLAMP,
    kl_clamp: float | None = None,
) -> torch.Tensor:
    """Schulman's estimators of KL(policy ‖ ref) for tokens sampled from the policy.

    k1 = log p - log r (unbiased, high variance, can be negative);
    k2 = ½ (log p - log r)² (biased, non-negative);
    k3 = exp(log r - log p) - (log r - log p) - 1 (unbiased, non-negative, low variance).

    The log-ratio is clamped to ±logratio_clamp (finite in float32 for any inputs); `kl_clamp` caps
    k3's value (verl's low_var_kl uses 10); positions off `mask` are 0.
    """
    if kind not in KL_KINDS:
        raise ConfigError(f"algorithm.kl_type: unknown KL estimator {kind!r} (use k1, k2 or k3)")
    if kl_clamp is not None and kind != "k3":
        raise ConfigError(f"algorithm.kl_clamp caps the k3 estimator only; unset it or use kl_type k3 (not {kind})")
    if kind == "k1":
        return masked_log_ratio(logp, ref_logp, mask, logratio_clamp)
    if kind == "k2":
        return 0.5 * masked_log_ratio(logp, ref_logp, mask, logratio_clamp).square()
    log_ratio = masked_log_ratio(ref_logp, logp, mask, logratio_clamp)
    k3 = torch.exp(log_ratio) - log_ratio - 1.0
    return k3 if kl_clamp is None else k3.clamp(max=kl_clamp)
