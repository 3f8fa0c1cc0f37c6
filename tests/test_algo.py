"""Exact checks of GRPO's tensor math on small hand-computed cases."""

import math

import pytest
import torch

from runtime.algo import (
    KL_KINDS,
    LOSS_AGGS,
    aggregate,
    entropy_from_logits,
    fill_batch,
    filter_groups,
    group_advantages,
    grpo_loss,
    kl_penalty,
    masked_mean,
    policy_loss,
)
from runtime.config import AlgorithmSection
from runtime.errors import ConfigError

f64 = torch.float64


def t(values):
    return torch.tensor(values, dtype=f64)


# ---------------------------------------------------------------- advantages


def test_group_advantages_use_unbiased_group_std():
    rewards = t([1, 0, 0, 0, 1, 1, 0, 0])
    adv = group_advantages(rewards, n_samples=4, eps=0.0)
    # group 1: mean 1/4, unbiased var (0.75² + 3·0.25²)/3 = 1/4 → std 1/2 (the biased std would be 0.433)
    # group 2: mean 1/2, unbiased var 4·0.25/3 = 1/3
    s = math.sqrt(1 / 3)
    expected = t([1.5, -0.5, -0.5, -0.5, 0.5 / s, 0.5 / s, -0.5 / s, -0.5 / s])
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)


def test_group_advantages_add_eps_to_std_and_zero_equal_groups():
    adv = group_advantages(t([2, 2, 2, 0, 1, 0]), n_samples=3, eps=0.5)
    # group 2: mean 1/3, unbiased std sqrt(1/3); eps is added to the std, not the variance
    s = math.sqrt(1 / 3) + 0.5
    torch.testing.assert_close(adv, t([0, 0, 0, -1 / 3 / s, 2 / 3 / s, -1 / 3 / s]), rtol=0, atol=1e-12)


def test_dr_grpo_only_centres():
    adv = group_advantages(t([1, 0, 0, 0, 1, 1, 0, 0]), n_samples=4, normalize_std=False)
    torch.testing.assert_close(adv, t([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]), rtol=0, atol=0)


def test_group_advantages_reject_bad_group_sizes():
    with pytest.raises(ConfigError, match="rollout.n_samples_per_prompt=1"):
        group_advantages(t([1, 0]), n_samples=1)
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(t([1, 0, 1]), n_samples=4)


# ---------------------------------------------------------------- KL


def test_kl_estimators_exact_values():
    logp = t([math.log(0.5), math.log(0.25)])
    ref = t([math.log(0.25), math.log(0.5)])
    ln2 = math.log(2)
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), t([ln2, -ln2]), rtol=0, atol=1e-12)
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), t([ln2**2 / 2, ln2**2 / 2]), rtol=0, atol=1e-12)
    # k3 = r - log r - 1 with r = ref/p: r = 1/2 → ln2 - 1/2; r = 2 → 1 - ln2
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), t([ln2 - 0.5, 1 - ln2]), rtol=0, atol=1e-12)


def test_k3_is_non_negative_zero_at_equality_and_finite_when_extreme():
    g = torch.Generator().manual_seed(0)
    logp, ref = torch.randn(1000, generator=g, dtype=f64), torch.randn(1000, generator=g, dtype=f64)
    assert (kl_penalty(logp, ref, "k3") >= 0).all()
    assert (kl_penalty(logp, logp, "k3") == 0).all()
    extreme = kl_penalty(t([-1000.0]), t([0.0]), "k3")  # log-ratio 1000 is clamped to 20
    torch.testing.assert_close(extreme, t([math.exp(20) - 21]), rtol=1e-12, atol=0)


def test_unknown_kl_kind_names_the_setting():
    with pytest.raises(ConfigError, match=r"algorithm.kl_type: unknown KL estimator 'k4' \(use k1, k2 or k3\)"):
        kl_penalty(t([0.0]), t([0.0]), "k4")


# ---------------------------------------------------------------- PPO clipping


def one_token_loss(ratio, advantage, eps_clip=0.2, eps_clip_high=None):
    logp = t([[math.log(ratio)]]).requires_grad_()
    loss, metrics = policy_loss(logp, t([[0.0]]), t([advantage]), torch.ones(1, 1), eps_clip, eps_clip_high)
    loss.backward()
    return loss.item(), logp.grad.item(), metrics["clip_frac"].item()


def test_positive_advantage_clipped_above_unless_clip_higher():
    loss, grad, clip_frac = one_token_loss(1.25, 1.0, eps_clip=0.2)
    assert loss == pytest.approx(-1.2, abs=1e-12) and grad == 0.0 and clip_frac == 1.0
    # DAPO clip-higher: 1 + 0.28 leaves ratio 1.25 inside; d(-A·ratio)/dlogp = -A·ratio
    loss, grad, clip_frac = one_token_loss(1.25, 1.0, eps_clip=0.2, eps_clip_high=0.28)
    assert loss == pytest.approx(-1.25, abs=1e-12) and grad == pytest.approx(-1.25, abs=1e-12) and clip_frac == 0.0


def test_negative_advantage_clipped_below_and_pessimistic_above():
    loss, grad, clip_frac = one_token_loss(0.75, -1.0)
    assert loss == pytest.approx(0.8, abs=1e-12) and grad == 0.0 and clip_frac == 1.0
    # above 1+eps the unclipped term is the larger loss, so it stays and keeps its gradient
    loss, grad, clip_frac = one_token_loss(1.25, -1.0)
    assert loss == pytest.approx(1.25, abs=1e-12) and grad == pytest.approx(1.25, abs=1e-12) and clip_frac == 0.0
    # the low side uses eps_clip, not eps_clip_high
    loss, _, clip_frac = one_token_loss(0.75, -1.0, eps_clip=0.2, eps_clip_high=0.5)
    assert loss == pytest.approx(0.8, abs=1e-12) and clip_frac == 1.0


def test_positive_advantage_below_one_is_not_clipped():
    loss, grad, clip_frac = one_token_loss(0.75, 1.0)
    assert loss == pytest.approx(-0.75, abs=1e-12) and grad == pytest.approx(-0.75, abs=1e-12) and clip_frac == 0.0


def test_clipped_tokens_get_zero_gradient_in_a_batch():
    ratios = t([[1.25, 1.1, 0.7, 0.9]])
    adv = t([[1.0, 1.0, -1.0, -1.0]])
    logp = ratios.log().requires_grad_()
    loss, metrics = policy_loss(logp, torch.zeros_like(logp), adv, torch.ones(1, 4), eps_clip=0.2)
    loss.backward()
    # tokens 0 (1.25 > 1.2, A>0) and 2 (0.7 < 0.8, A<0) are clipped; the others: -A·ratio / 4 tokens
    torch.testing.assert_close(logp.grad, t([[0.0, -1.1 / 4, 0.0, 0.9 / 4]]), rtol=0, atol=1e-12)
    assert metrics["clip_frac"].item() == 0.5


def test_approx_kl_is_k3_of_old_vs_new():
    logp = t([[math.log(2.0), 0.0]])
    _, metrics = policy_loss(logp, torch.zeros_like(logp), t([0.0]), torch.ones(1, 2), eps_clip=0.2)
    # per token exp(logp-old) - (logp-old) - 1: 2 - ln2 - 1 and 0
    assert metrics["approx_kl"].item() == pytest.approx((1 - math.log(2)) / 2, abs=1e-12)


# ---------------------------------------------------------------- aggregation


def test_token_mean_and_seq_mean_on_unequal_lengths():
    # sequence 0: one token of value 3; sequence 1: three tokens of value 1; padding holds junk
    values = t([[3.0, 100.0, 100.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    assert aggregate(values, mask, "token_mean").item() == pytest.approx(6 / 4, abs=1e-12)
    assert aggregate(values, mask, "seq_mean").item() == pytest.approx((3 + 1) / 2, abs=1e-12)
    # the same through the loss: with ratio 1 the per-token loss is -A
    loss_tok, _ = policy_loss(torch.zeros(2, 3, dtype=f64), torch.zeros(2, 3, dtype=f64), -values, mask, 0.2)
    loss_seq, _ = policy_loss(
        torch.zeros(2, 3, dtype=f64), torch.zeros(2, 3, dtype=f64), -values, mask, 0.2, loss_agg="seq_mean"
    )
    assert loss_tok.item() == pytest.approx(1.5, abs=1e-12) and loss_seq.item() == pytest.approx(2.0, abs=1e-12)


def test_masked_mean_per_row_and_empty_mask():
    x = t([[1.0, 2.0, 9.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    torch.testing.assert_close(masked_mean(x, mask, dim=-1), t([1.5, 4.0]), rtol=0, atol=0)
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0


def test_unknown_loss_agg_names_the_setting():
    with pytest.raises(ConfigError, match="algorithm.loss_agg"):
        aggregate(t([1.0]), torch.ones(1), "sum")


# ---------------------------------------------------------------- TIS


def test_tis_weights_are_capped_and_detached():
    old = torch.zeros(1, 3, dtype=f64)
    rollout = -t([[math.log(3.0), math.log(0.5), 0.0]])  # old - rollout = ln3, ln0.5, 0 → weights 3→2, 0.5, 1
    rollout.requires_grad_()
    logp = old.clone().requires_grad_()
    loss, metrics = policy_loss(logp, old, t([1.0]), torch.ones(1, 3), 0.2, rollout_logp=rollout, tis_cap=2.0)
    assert loss.item() == pytest.approx(-(2.0 + 0.5 + 1.0) / 3, abs=1e-12)
    assert metrics["tis_clip_frac"].item() == pytest.approx(1 / 3, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, t([[-2.0, -0.5, -1.0]]) / 3, rtol=0, atol=1e-12)
    assert rollout.grad is None


def test_tis_cap_without_rollout_logp_is_refused():
    with pytest.raises(ValueError, match="rollout_logp"):
        policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1), 0.2, tis_cap=2.0)


# ---------------------------------------------------------------- full loss and micro-batching


def random_batch(seed, batch=6, length=7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([1, 7, 3, 5, 2, 6])[:batch]
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(f64)
    old = -torch.rand(batch, length, generator=g, dtype=f64) * 3
    return dict(
        logp=old + 0.3 * torch.randn(batch, length, generator=g, dtype=f64),
        old_logp=old,
        ref_logp=old + 0.2 * torch.randn(batch, length, generator=g, dtype=f64),
        rollout_logp=old + 0.5 * torch.randn(batch, length, generator=g, dtype=f64),
        entropy=torch.rand(batch, length, generator=g, dtype=f64),
        advantages=torch.randn(batch, generator=g, dtype=f64),
        mask=mask,
    )


def algo(**kw) -> AlgorithmSection:
    return AlgorithmSection(**{"eps_clip": 0.2, "eps_clip_high": 0.28, **kw})


def test_grpo_loss_composes_pg_kl_and_entropy_terms():
    b = random_batch(1)
    loss, m = grpo_loss(**b, algorithm=algo(kl_coef=0.1, kl_type="k2", entropy_coef=0.01))
    pg, _ = policy_loss(b["logp"], b["old_logp"], b["advantages"], b["mask"], 0.2, 0.28)
    kl = masked_mean(0.5 * (b["logp"] - b["ref_logp"]) ** 2, b["mask"])
    ent = masked_mean(b["entropy"], b["mask"])
    torch.testing.assert_close(loss, pg + 0.1 * kl - 0.01 * ent, rtol=0, atol=1e-12)
    torch.testing.assert_close(m["pg_loss"], pg, rtol=0, atol=0)
    torch.testing.assert_close(m["kl"], kl, rtol=0, atol=1e-12)
    torch.testing.assert_close(m["entropy"], ent, rtol=0, atol=1e-12)
    assert set(m) == {"pg_loss", "kl", "entropy", "clip_frac", "approx_kl"}
    assert not any(v.requires_grad for v in m.values())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
def test_micro_batches_with_global_normalizer_sum_to_full_batch(loss_agg, dtype):
    # every option on: dual clip, the k3 clamp, TIS, a tight log-ratio clamp; and a stale token far out
    b = {k: v.to(dtype) for k, v in random_batch(2).items()}
    b["logp"][1, 2] += 8.0  # beyond logratio_clamp: ratio e^5, gradient 0
    b["advantages"] = b["advantages"] - b["advantages"].mean()
    a = algo(loss_agg=loss_agg, kl_coef=0.05, kl_type="k3", kl_clamp=0.02, entropy_coef=0.01, use_tis=True,
             tis_cap=1.5, dual_clip_c=1.5, logratio_clamp=5.0, loss_norm_tokens=9)
    tol = dict(rtol=0, atol=1e-13) if dtype == torch.float64 else dict(rtol=1e-6, atol=1e-6)

    full_logp = b["logp"].clone().requires_grad_()
    full_loss, full_metrics = grpo_loss(**{**b, "logp": full_logp}, algorithm=a)
    full_loss.backward()

    normalizer = b["mask"].sum().item() if loss_agg == "token_mean" else float(b["mask"].shape[0])
    micro_logp = b["logp"].clone().requires_grad_()
    total_loss, total_metrics = 0.0, {}
    for rows in (slice(0, 2), slice(2, 6)):
        part = {k: v[rows] for k, v in b.items()}
        part["logp"] = micro_logp[rows]
        loss, metrics = grpo_loss(**part, algorithm=a, normalizer=normalizer)
        loss.backward()  # gradients accumulate as in the trainer
        total_loss = total_loss + loss.detach()
        for k, v in metrics.items():
            total_metrics[k] = total_metrics.get(k, 0.0) + v

    assert full_metrics["dual_clip_frac"] > 0 and full_metrics["tis_clip_frac"] > 0  # the options are exercised
    torch.testing.assert_close(total_loss, full_loss.detach(), **tol)
    torch.testing.assert_close(micro_logp.grad, full_logp.grad, **tol)
    assert full_logp.grad[1, 2] == 0  # clamped log-ratio
    for k in full_metrics:
        torch.testing.assert_close(total_metrics[k], full_metrics[k], **tol)
    # without the global normalizer each micro-batch normalises itself and the sum is wrong
    wrong = sum(grpo_loss(**{k: v[r] for k, v in b.items()}, algorithm=a)[0] for r in (slice(0, 2), slice(2, 6)))
    assert abs(wrong.item() - full_loss.item()) > 1e-3


# ---------------------------------------------------------------- entropy


def test_entropy_of_uniform_logits_is_log_vocab():
    ent = entropy_from_logits(torch.full((2, 3, 11), 4.0))
    torch.testing.assert_close(ent, torch.full((2, 3), math.log(11)), rtol=0, atol=1e-6)


def test_entropy_known_distribution_and_banned_tokens():
    logits = torch.tensor([[math.log(0.5), math.log(0.25), math.log(0.25), -math.inf]], requires_grad=True)
    ent = entropy_from_logits(logits)
    assert ent.item() == pytest.approx(1.5 * math.log(2), abs=1e-6)
    ent.sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 3] == 0


# ---------------------------------------------------------------- dynamic sampling


def test_filter_groups_drops_all_equal_groups():
    keep = filter_groups(t([1, 1, 0, 1, 0, 0, 0.5, 0.5]), n_samples=2)
    assert keep.tolist() == [False, True, False, False]


def test_fill_batch_keeps_first_passing_groups_in_order():
    ids = [10, 11, 12, 13, 14]
    rewards = [[1, 1], [0, 1], [0, 0], [1, 0], [0, 1]]
    assert fill_batch(ids, rewards, needed=2) == ([11, 13], 2)  # 14 is surplus, not dropped
    assert fill_batch(ids, rewards, needed=5) == ([11, 13, 14], 2)  # ran out: caller samples more
    assert fill_batch(ids, rewards, needed=0) == ([], 0)
    with pytest.raises(ValueError, match="5 group ids but 4"):
        fill_batch(ids, rewards[:4], needed=2)


# ---------------------------------------------------------------- micro-batches by length


def test_step_slices_group_samples_of_like_length():
    import random

    from runtime.trainer.batch import step_slices

    rng = random.Random(0)
    lengths = [rng.choice([40, 300, 2000, 8000]) + rng.randrange(20) for _ in range(64)]

    def padding(slices):  # pad tokens: micro-batch rows x its longest sample, minus the real tokens
        return sum(len(mb) * max(lengths[i] for i in mb) - sum(lengths[i] for i in mb) for step in slices for mb in step)

    for dp_rank in (0, 1):
        plain = step_slices(64, 2, 2, dp_rank, 4)
        by_len = step_slices(64, 2, 2, dp_rank, 4, lengths=lengths)
        for p, s in zip(plain, by_len):
            # the same samples per step and rank, cut into micro-batches of the same size
            assert sorted(i for mb in p for i in mb) == sorted(i for mb in s for i in mb)
            assert [len(mb) for mb in p] == [len(mb) for mb in s]
            flat = [i for mb in s for i in mb]
            assert [lengths[i] for i in flat] == sorted((lengths[i] for i in flat), reverse=True)
        assert padding(by_len) < 0.5 * padding(plain)
    assert step_slices(8, 1, 1, 0, 4) == [[[0, 1, 2, 3], [4, 5, 6, 7]]]


# ---------------------------------------------------------------- finiteness, masking and the peers' options

BOTH_DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64])


def token_loss(log_ratio, advantage, dtype, **kw):
    """Loss and d loss / d logp of one token with the given log-ratio (old_logp = 0)."""
    logp = torch.tensor([[float(log_ratio)]], dtype=dtype, requires_grad=True)
    loss, metrics = policy_loss(logp, torch.zeros(1, 1, dtype=dtype), torch.tensor([float(advantage)], dtype=dtype),
                                torch.ones(1, 1), kw.pop("eps_clip", 0.2), **kw)
    loss.backward()
    return loss.item(), logp.grad.item(), metrics


@BOTH_DTYPES
@pytest.mark.parametrize("log_ratio", [100.0, -100.0, 1e4, -1e4, -math.inf])
@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_extreme_log_ratios_give_a_finite_loss_and_gradient(log_ratio, advantage, dtype):
    loss, grad, metrics = token_loss(log_ratio, advantage, dtype)
    clamped_ratio = torch.exp(torch.tensor(math.copysign(20.0, log_ratio), dtype=dtype)).item()
    # A > 0 takes the clipped branch above 1+eps (-1.2) and the ratio below; A < 0 the reverse
    bound = {True: -torch.tensor(1.2, dtype=dtype).item(), False: torch.tensor(0.8, dtype=dtype).item()}
    expected = {(1.0, True): bound[True], (1.0, False): -clamped_ratio, (-1.0, True): clamped_ratio,
                (-1.0, False): bound[False]}
    assert loss == expected[(advantage, log_ratio > 0)]  # exact, in the loss's own dtype
    assert grad == 0.0  # clamped or clipped: no gradient, never NaN
    assert all(math.isfinite(v.item()) for v in metrics.values())


@BOTH_DTYPES
def test_logratio_clamp_is_configurable_and_stops_the_gradient_only_beyond_it(dtype):
    e = torch.exp(torch.tensor(1.0, dtype=dtype)).item()
    loss, grad, _ = token_loss(2.0, -1.0, dtype, logratio_clamp=1.0)
    assert loss == e and grad == 0.0
    loss, grad, _ = token_loss(0.5, -1.0, dtype, logratio_clamp=1.0)  # inside: -A·ratio and its gradient
    r = torch.exp(torch.tensor(0.5, dtype=dtype)).item()
    assert loss == r and grad == r


@BOTH_DTYPES
def test_dual_clip_caps_negative_advantage_losses(dtype):
    ln = math.log
    loss, grad, m = token_loss(ln(5.0), -2.0, dtype, dual_clip_c=3.0)  # -A·ratio = 10 > -A·c = 6
    assert loss == 6.0 and grad == 0.0 and m["dual_clip_frac"].item() == 1.0
    loss, grad, m = token_loss(ln(2.0), -2.0, dtype, dual_clip_c=3.0)  # 4 < 6: the PPO loss and its gradient
    assert loss == pytest.approx(4.0, rel=1e-6) and grad == pytest.approx(4.0, rel=1e-6)
    assert m["dual_clip_frac"].item() == 0.0
    loss, _, m = token_loss(ln(5.0), 2.0, dtype, dual_clip_c=3.0)  # positive advantages are untouched
    assert loss == pytest.approx(-2.4, rel=1e-6) and m["dual_clip_frac"].item() == 0.0
    loss, _, _ = token_loss(ln(5.0), -2.0, dtype)  # off by default: the pessimistic unclipped loss
    assert loss == pytest.approx(10.0, rel=1e-6)
    with pytest.raises(ValueError, match="dual_clip_c must be > 1"):
        token_loss(0.0, -1.0, dtype, dual_clip_c=1.0)


@BOTH_DTYPES
def test_kl_clamp_caps_k3_and_its_gradient(dtype):
    logp = torch.zeros(2, dtype=dtype, requires_grad=True)
    ref = torch.tensor([5.0, 1.0], dtype=dtype)
    k3 = kl_penalty(logp, ref, "k3", kl_clamp=10.0)
    e = torch.exp(torch.tensor(1.0, dtype=dtype))
    torch.testing.assert_close(k3, torch.stack([torch.tensor(10.0, dtype=dtype), e - 2]), rtol=0, atol=0)
    k3.sum().backward()
    # d/dlogp [exp(r - l) - (r - l) - 1] = 1 - exp(r - l); 0 where the cap holds
    torch.testing.assert_close(logp.grad, torch.stack([torch.tensor(0.0, dtype=dtype), 1 - e]), rtol=0, atol=0)
    assert kl_penalty(logp, ref, "k3")[0].item() == pytest.approx(math.exp(5) - 6, rel=1e-6)  # off by default
    with pytest.raises(ConfigError, match="algorithm.kl_clamp caps the k3 estimator only"):
        kl_penalty(logp, ref, "k1", kl_clamp=10.0)


@BOTH_DTYPES
@pytest.mark.parametrize("kind", KL_KINDS)
def test_kl_estimators_finite_for_extreme_inputs(kind, dtype):
    logp = torch.tensor([-1e4, 1e4, -math.inf, 0.0], dtype=dtype, requires_grad=True)
    ref = torch.tensor([1e4, -1e4, 0.0, -math.inf], dtype=dtype)
    kl = kl_penalty(logp, ref, kind)
    kl.sum().backward()
    assert torch.isfinite(kl).all() and torch.isfinite(logp.grad).all()


def test_token_sum_aggregations_exact():
    # sequence 0: one token of value 3; sequence 1: three tokens of value 1; padding holds junk
    values = t([[3.0, math.nan, math.inf], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    assert aggregate(values, mask, "seq_mean_token_sum").item() == (3 + 3) / 2
    assert aggregate(values, mask, "seq_mean_token_sum_norm", norm_tokens=4).item() == (3 + 3) / (2 * 4)
    # with a global normalizer (sequences of the whole step) the division is by it
    assert aggregate(values, mask, "seq_mean_token_sum", normalizer=6.0).item() == 1.0
    assert aggregate(values, mask, "seq_mean_token_sum_norm", normalizer=6.0, norm_tokens=4).item() == 0.25
    with pytest.raises(ValueError, match="norm_tokens"):
        aggregate(values, mask, "seq_mean_token_sum_norm")
    # through the loss: ratio 1, per-token loss -A
    a = algo(loss_agg="seq_mean_token_sum_norm", loss_norm_tokens=4)
    zeros = torch.zeros(2, 3, dtype=f64)
    loss, _ = grpo_loss(zeros, zeros, -torch.nan_to_num(values, nan=0.0, posinf=0.0), mask, a)
    assert loss.item() == 0.75


@BOTH_DTYPES
@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
def test_nan_and_inf_at_masked_positions_poison_nothing(loss_agg, dtype):
    clean = {k: v.to(dtype) for k, v in random_batch(3).items()}
    clean["advantages"] = clean["advantages"][:, None].expand(-1, 7).clone()  # per token, so junk fits
    masked_out = clean["mask"] == 0
    dirty = {k: v.clone() for k, v in clean.items()}
    junk = torch.tensor([math.nan, math.inf, -math.inf], dtype=dtype).repeat(20)[: int(masked_out.sum())]
    for k in ("logp", "old_logp", "ref_logp", "rollout_logp", "entropy", "advantages"):
        dirty[k][masked_out] = junk
    a = algo(loss_agg=loss_agg, kl_coef=0.1, entropy_coef=0.01, use_tis=True, dual_clip_c=3.0, kl_clamp=10.0,
             loss_norm_tokens=7)

    def run(batch):
        logp = batch["logp"].clone().requires_grad_()
        entropy = batch["entropy"].clone().requires_grad_()
        loss, metrics = grpo_loss(**{**batch, "logp": logp, "entropy": entropy}, algorithm=a)
        loss.backward()
        return loss, metrics, logp.grad, entropy.grad

    loss_c, m_c, g_c, e_c = run(clean)
    loss_d, m_d, g_d, e_d = run(dirty)
    assert torch.isfinite(loss_d) and torch.isfinite(g_d).all() and torch.isfinite(e_d).all()
    assert loss_d.item() == loss_c.item()
    assert torch.equal(g_d, g_c) and torch.equal(e_d, e_c) and (g_d[masked_out] == 0).all()
    assert {k: v.item() for k, v in m_d.items()} == {k: v.item() for k, v in m_c.items()}


def test_algorithm_options_validate_with_one_line_errors():
    from pydantic import ValidationError

    assert AlgorithmSection().logratio_clamp == 20.0 and AlgorithmSection().dual_clip_c is None
    for bad, match in [({"dual_clip_c": 1.0}, "must be > 1"), ({"kl_clamp": 10.0, "kl_type": "k2"}, "k3 estimator only"),
                       ({"logratio_clamp": 0.0}, "greater than 0"), ({"loss_agg": "sum"}, "seq_mean_token_sum_norm")]:
        with pytest.raises(ValidationError, match=match):
            AlgorithmSection(**bad)


def test_dr_grpo_constant_defaults_to_max_new_tokens():
    from runtime.config import load_config

    cfg = load_config("configs/tiny.yaml", ["algorithm.loss_agg=seq_mean_token_sum_norm", "rollout.max_new_tokens=7"])
    assert cfg.algorithm.loss_norm_tokens == 7
    cfg = load_config("configs/tiny.yaml", ["algorithm.loss_agg=seq_mean_token_sum_norm", "algorithm.loss_norm_tokens=64"])
    assert cfg.algorithm.loss_norm_tokens == 64
    assert load_config("configs/tiny.yaml", []).algorithm.loss_norm_tokens is None  # unused: left unset
