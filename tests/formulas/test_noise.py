"""Closed-form checks of grpo_lens/formulas/noise.py (docs/theory.md §Noise scale and dead groups)."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_lens.formulas.noise import (
    dead_group_counts,
    group_gradient_gram,
    logit_variance_proxy,
    noise_scale,
    noise_scale_from_sums,
    noise_scale_jackknife,
    normalizer_dilution,
    rank_correlation,
    score_norm_proxy,
    signal_sign_flip_p,
    zero_advantage_groups,
)


def planted(a: float, s: float, B: int) -> torch.Tensor:
    """[B, B+1] group gradients G_b = a e_0 + s (e_b - mean_c e_c): mean a e_0, each off the mean by s(e_b - e-bar)."""
    e = torch.eye(B, dtype=torch.float64)
    noise = s * (e - e.mean(dim=0))
    return torch.cat([torch.full((B, 1), a, dtype=torch.float64), noise], dim=1)


def test_group_gradient_gram_sums_weighted_rows():
    # R = 2: G_0 = 1*(1,0) - 1*(0,1) = (1,-1); G_1 = 2*(1,1) + 1*(2,0) = (4,2); M = [[2, 2], [2, 20]]
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, 0.0]], dtype=torch.float64)
    w = torch.tensor([1.0, -1.0, 2.0, 1.0])
    m = group_gradient_gram(x @ x.T, w, 2)
    assert torch.allclose(m, torch.tensor([[2.0, 2.0], [2.0, 20.0]], dtype=torch.float64), atol=0, rtol=1e-12)
    with pytest.raises(ValueError, match="multiple of the group size 3"):
        group_gradient_gram(x @ x.T, w, 3)


def test_noise_scale_planted_gram():
    # planted(a=2, s=1, B=8): the sample variance sum_b |G_b - G-bar|^2/(B-1) = s^2 (1 - 1/B) B/(B-1) = 1 = tr(Sigma);
    # every cross pair <G_b, G_c> = a^2 + s^2 (0 - 2/B + 1/B) = 4 - 1/8, whose mean is the unbiased |G|^2 = 3.875;
    # B_simple = 1 / 3.875; SNR = 3.875 * 8 / 1 = 31
    g = planted(2.0, 1.0, 8)
    out = noise_scale(g @ g.T)
    assert out["trace_sigma"] == pytest.approx(1.0, rel=1e-12)
    assert out["grad_sq"] == pytest.approx(3.875, rel=1e-12)
    assert out["b_simple"] == pytest.approx(1 / 3.875, rel=1e-12)
    assert out["snr"] == pytest.approx(31.0, rel=1e-12)


def test_groups_without_gradient_count_as_zero_rows():
    # 4 more groups with G_b = 0 are the same as 4 zero rows and columns in M
    g = planted(2.0, 1.0, 8)
    m = g @ g.T
    padded = torch.zeros(12, 12, dtype=torch.float64)
    padded[:8, :8] = m
    assert noise_scale(m, num_groups=12) == pytest.approx(noise_scale(padded))
    # by hand: D = 8 (4 - 1/8 + ... ) -> S - D = 8*7*3.875 = 217; |G|^2 = 217 / (12*11)
    assert noise_scale(m, num_groups=12)["grad_sq"] == pytest.approx(217 / 132, rel=1e-12)
    with pytest.raises(ValueError, match="at least 2 groups"):
        noise_scale_from_sums(1.0, 1.0, 1)


def test_no_signal_gives_nan_b_simple():
    # a = 0: |G|^2 = -s^2/B < 0, so B_simple and SNR are NaN, tr(Sigma) still 1
    g = planted(0.0, 1.0, 8)
    out = noise_scale(g @ g.T)
    assert out["grad_sq"] == pytest.approx(-0.125, rel=1e-12)
    assert math.isnan(out["b_simple"]) and math.isnan(out["snr"])


def reference_jackknife(g: torch.Tensor, name: str) -> tuple[float, float]:
    """The jackknife from explicit group gradients [B, P], one deletion at a time (the reference)."""
    from grpo_lens.formulas.stats import student_t_quantile

    B = g.shape[0]
    full = noise_scale(g @ g.T)[name]
    loo = torch.tensor(
        [noise_scale(torch.cat([g[:b], g[b + 1 :]]) @ torch.cat([g[:b], g[b + 1 :]]).T)[name] for b in range(B)],
        dtype=torch.float64,
    )
    se = math.sqrt((B - 1) / B * float(((loo - loo.mean()) ** 2).sum()))
    t = student_t_quantile(0.975, B - 1)
    return full - t * se, full + t * se


def test_jackknife_matches_explicit_deletions():
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(10, 6, generator=gen, dtype=torch.float64) + torch.tensor([3.0, 0, 0, 0, 0, 0], dtype=torch.float64)
    out = noise_scale_jackknife(g @ g.T)
    for name in ("grad_sq", "trace_sigma", "b_simple"):
        lo, hi = reference_jackknife(g, name)
        assert out[f"{name}_lo"] == pytest.approx(lo, rel=1e-9)
        assert out[f"{name}_hi"] == pytest.approx(hi, rel=1e-9)
    # with 2 zero groups: the same as explicit zero rows
    z = torch.cat([g, torch.zeros(2, 6, dtype=torch.float64)])
    lo, hi = reference_jackknife(z, "grad_sq")
    padded = noise_scale_jackknife(g @ g.T, num_groups=12)
    assert (padded["grad_sq_lo"], padded["grad_sq_hi"]) == pytest.approx((lo, hi), rel=1e-9)
    assert noise_scale_jackknife(g[:7] @ g[:7].T) == {}  # fewer than MIN_INTERVAL_UNITS groups


def test_sign_flip_null():
    # signal: the observed cross sum is reached only when every sign agrees, probability 2 / 2^8 = 1/128
    g = planted(2.0, 1.0, 8)
    p = signal_sign_flip_p(g @ g.T, draws=4000, seed=1)
    assert 1 / 4001 <= p < 0.02
    # no signal: every cross pair is -1/8, and any flip's sum -(1/8)((sum s)^2 - 8) >= -(1/8)(64 - 8): p = 1
    g0 = planted(0.0, 1.0, 8)
    assert signal_sign_flip_p(g0 @ g0.T, draws=500) == pytest.approx(1.0)


def test_verl_proxy():
    # two-token vocabulary at p = (0.5, 0.5): |e - pi|^2 = 0.25 + 0.25 = 0.5; a certain token adds 1 - 2 + 1 = 0;
    # a masked token adds nothing. A = 2: A^2 W = 4 * 0.5 = 2; A = 0 adds 0; mean over 2 rollouts = 1
    probs = torch.tensor([[0.5, 1.0, 0.3], [0.5, 0.5, 0.5]])
    sumsq = torch.tensor([[0.5, 1.0, 0.58], [0.5, 0.5, 0.5]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    w = score_norm_proxy(probs, sumsq, mask)
    assert w.tolist() == pytest.approx([0.5, 1.5], abs=1e-12)
    assert logit_variance_proxy(torch.tensor([2.0, 0.0]), w) == pytest.approx(1.0, abs=1e-12)


def test_dead_group_counts_and_dilution():
    rewards = torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.5, 0.5], [1.0, 0.0], [0.0, 9.0]])
    valid = torch.tensor([[True, True], [True, True], [True, True], [True, True], [False, False]])
    out = dead_group_counts(rewards, valid)
    assert out == {"all_best": 1, "all_worst": 1, "all_other": 1, "mixed": 1, "empty": 1}
    # on a declared scale [0, 2], the all-1 group is 'other'
    assert dead_group_counts(rewards, valid, best=2.0, worst=0.0)["all_other"] == 2
    adv = torch.tensor([[0.0, 0.0], [0.5, -0.5]])
    dead = zero_advantage_groups(adv)
    assert dead.tolist() == [True, False]
    # token-mean: 3 + 5 of 3 + 5 + 2 + 2 tokens held by the dead group = 8/12
    assert normalizer_dilution(torch.tensor([[3.0, 5.0], [2.0, 2.0]]), dead) == pytest.approx(8 / 12, abs=1e-12)
    assert math.isnan(normalizer_dilution(torch.zeros(2, 2), dead))


def test_rank_correlation():
    # monotone -> 1, reversed -> -1; ties get their mean rank: x = [1, 2, 2, 3] ranks [1, 2.5, 2.5, 4] against
    # y = [1, 2, 3, 4]: centred [-1.5, 0, 0, 1.5] . [-1.5, -0.5, 0.5, 1.5] = 4.5 over sqrt(4.5 * 5) -> 0.9487
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert rank_correlation(x, x.exp()) == pytest.approx(1.0)
    assert rank_correlation(x, -x) == pytest.approx(-1.0)
    assert rank_correlation(torch.tensor([1.0, 2.0, 2.0, 3.0]), x) == pytest.approx(4.5 / math.sqrt(22.5), abs=1e-12)
    assert math.isnan(rank_correlation(x[:2], x[:2])) and math.isnan(rank_correlation(x, torch.ones(4)))
