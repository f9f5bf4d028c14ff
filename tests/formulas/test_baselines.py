"""Baselines: b* against its closed form, leave-one-out, and estimator variances on synthetic gradients."""

import math

import pytest
import torch

from grpo_lens.formulas.advantages import loo_optimal_baseline
from grpo_lens.formulas.baselines import (
    BASELINES,
    baseline_metrics,
    correct_wrong_sq_norms,
    estimator_variances,
    optimal_baseline,
    optimal_baseline_binary,
    optimal_constant_baseline,
    variance_relative_to_optimal,
)


def synthetic(norm_correct: float, norm_wrong: float, m: int = 64, p: int = 512, seed: int = 0):
    """M rollouts, half correct; g_i = norm(r_i) * u_i with u_i random unit directions (E g = 0, cross terms ~0)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(m, p, generator=g, dtype=torch.float64)
    u = u / u.norm(dim=1, keepdim=True)
    rewards = (torch.arange(m) % 2 == 0).double()
    norms = torch.where(rewards == 1, norm_correct, norm_wrong)
    return u * norms.unsqueeze(1), rewards


def test_b_star_depends_on_norms_when_they_depend_on_reward():
    grads, rewards = synthetic(3.0, 1.0)
    # m_C = 9, m_W = 1, p = 1/2: b* = p m_C / (p m_C + (1-p) m_W) = 4.5 / 5 = 0.9, not the mean 0.5
    assert correct_wrong_sq_norms(grads, rewards) == (pytest.approx(9.0), pytest.approx(1.0))
    assert optimal_baseline(grads, rewards) == pytest.approx(0.9, abs=1e-12)
    assert optimal_baseline_binary(0.5, 9.0, 1.0) == pytest.approx(0.9)
    metrics = baseline_metrics(grads, rewards)
    assert metrics["baseline/b_star_minus_mean"] == pytest.approx(0.4)


def test_b_star_equals_mean_when_norms_do_not_depend_on_reward():
    grads, rewards = synthetic(2.0, 2.0)
    assert optimal_baseline(grads, rewards) == pytest.approx(0.5, abs=1e-12)
    # Random norms independent of the reward: b* - mean = sum n_i (r_i - rbar) / sum n_i has standard deviation
    # about CV(n) sqrt(p(1-p)/M) = 0.53 * 0.5 / sqrt(4000) = 0.0042 (lognormal sigma = 0.5: CV = 0.53);
    # allow 4 of them. A reward-dependent norm (above) moves b* by 0.4.
    g = torch.Generator().manual_seed(1)
    n = torch.exp(0.5 * torch.randn(4000, generator=g, dtype=torch.float64))
    r = (torch.rand(4000, generator=g) < 0.5).double()
    assert abs(optimal_baseline(n, r) - float(r.mean())) < 4 * 0.0042


def test_leave_one_out_baselines():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    sq = torch.tensor([4.0, 1.0, 1.0, 2.0])
    # b_0 = (1*0 + 1*1 + 2*0) / (1 + 1 + 2) = 1/4;  b_1 = (4 + 1) / (4 + 1 + 2) = 5/7
    # b_2 = 4 / (4 + 1 + 2) = 4/7;               b_3 = (4 + 1) / (4 + 1 + 1) = 5/6
    torch.testing.assert_close(
        loo_optimal_baseline(rewards.double(), sq), torch.tensor([1 / 4, 5 / 7, 4 / 7, 5 / 6], dtype=torch.float64)
    )
    torch.testing.assert_close(BASELINES.get("rloo")(rewards, sq), torch.tensor([1 / 3, 2 / 3, 1 / 3, 2 / 3]))
    torch.testing.assert_close(BASELINES.get("mean")(rewards, sq), torch.full((4,), 0.5))
    # equal norms: leave-one-out b* is the RLOO mean
    torch.testing.assert_close(
        loo_optimal_baseline(rewards.double(), torch.ones(4)), BASELINES.get("rloo")(rewards, sq).double()
    )
    with pytest.raises(ValueError, match="mean, none, optimal, rloo"):
        BASELINES.get("median")


def test_variances_when_norms_depend_on_reward():
    # Cross terms vanish (independent random directions), so Var ghat = (1/R^2) sum_i E[(r_i - b_i)^2 ||g_i||^2].
    # With p = 1/2, m_C = 9, m_W = 1, R = 8 and k' ~ Binomial(7, 1/2) correct among the 7 others:
    #   rloo:    E[(r - p)^2 n] + Var(b) E[n] = 1.25 + (0.25/7) * 5 = 1.4286
    #   optimal: E over k' of 0.5*9*(1 - b)^2 + 0.5*b^2 with b = 9k'/(8k' + 7) = 0.5244
    # ratio 2.724 (resampling from a finite pool of 64 without replacement shifts it by a few %).
    grads, rewards = synthetic(3.0, 1.0)
    rel = variance_relative_to_optimal(estimator_variances(grads, rewards, 8, num_resamples=2000))
    assert rel["optimal"] == 1.0
    assert rel["rloo"] == pytest.approx(2.724, rel=0.15)
    assert rel["none"] > rel["rloo"] > 1.5
    # mean baseline = (R-1)/R times RLOO, sample by sample (module docstring)
    assert rel["mean"] == pytest.approx((7 / 8) ** 2 * rel["rloo"], rel=1e-9)


def test_variances_when_norms_do_not_depend_on_reward():
    # Equal norms: leave-one-out b* is exactly RLOO, so their variances are equal.
    grads, rewards = synthetic(2.0, 2.0)
    rel = variance_relative_to_optimal(estimator_variances(grads, rewards, 8, num_resamples=500))
    assert rel["rloo"] == pytest.approx(1.0, rel=1e-9)
    assert rel["mean"] == pytest.approx((7 / 8) ** 2, rel=1e-9)
    assert rel["none"] > 1.0


def test_variance_input_errors():
    grads, rewards = synthetic(1.0, 1.0, m=10)
    with pytest.raises(ValueError, match="2R = 16"):
        estimator_variances(grads, rewards, 8)
    with pytest.raises(ValueError, match="valid names"):
        estimator_variances(grads, rewards, 2, baselines=["nope"])
    assert math.isnan(correct_wrong_sq_norms(grads[:1], torch.ones(1))[1])


def test_plug_in_b_star_of_the_lens_and_of_the_study_agree():
    # Two bodies of the plug-in b* = sum n r / sum n (r_i included) stay: baseline_metrics' (the lens and the probe's
    # groups, sums) and the study's population b* (optimal_constant_baseline, means). They differ only by rounding;
    # merging them would change printed numbers in the last bits.
    g, r = synthetic(2.0, 1.0, m=32, p=64, seed=3)
    assert optimal_constant_baseline(g, r)["b_star"] == pytest.approx(optimal_baseline(g, r), rel=1e-12)
    zero = torch.zeros(4, 8, dtype=torch.float64)
    r4 = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    assert optimal_constant_baseline(zero, r4)["b_star"] == optimal_baseline(zero, r4) == 0.75  # no norm: mean r
