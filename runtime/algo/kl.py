"""Per-token KL estimators between the policy and a reference, from log-probs of sampled tokens."""

from __future__ import annotations

import torch

from runtime.errors import ConfigError

KL_KINDS = ("k1", "k2", "k3")

# exp() of a log-ratio beyond this overflows float32/bf16 long before it means anything.
_LOG_RATIO_LIMIT = 20.0


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Schulman's estimators of KL(policy ‖ ref) for tokens sampled from the policy.

    k1 = log p - log r (unbiased, high variance, can be negative);
    k2 = ½ (log p - log r)² (biased, non-negative);
    k3 = exp(log r - log p) - (log r - log p) - 1 (unbiased, non-negative, low variance).
    """
    if kind == "k1":
        return logp - ref_logp
    if kind == "k2":
        return 0.5 * (logp - ref_logp).square()
    if kind == "k3":
        log_ratio = (ref_logp - logp).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ConfigError(f"algorithm.kl_type: unknown KL estimator {kind!r} (use k1, k2 or k3)")
