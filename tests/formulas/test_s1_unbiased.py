"""S1 predicted without bias: [C(k,R) + C(M-k,R)] / C(M,R) against closed forms and simulation."""

import math

import pytest
import torch

from grpo_lens.formulas.sparsity import (
    predicted_zero_variance_fraction,
    unbiased_zero_variance_probability,
)


def test_closed_form_values():
    # M = 8, R = 4, k = 6: [C(6,4) + C(2,4)] / C(8,4) = (15 + 0) / 70
    assert float(unbiased_zero_variance_probability(6, 8, 4)) == pytest.approx(15 / 70, abs=1e-12)
    # k = 0: every R-subset is all wrong: 1;  k = 4 of 8, R = 2: [C(4,2) + C(4,2)] / C(8,2) = 12 / 28
    assert float(unbiased_zero_variance_probability(0, 8, 4)) == pytest.approx(1.0, abs=1e-12)
    assert float(unbiased_zero_variance_probability(4, 8, 2)) == pytest.approx(12 / 28, abs=1e-12)
    # M = R: the indicator "all equal" itself
    got = unbiased_zero_variance_probability(torch.tensor([0, 1, 3, 4]), 4, 4)
    assert got.tolist() == pytest.approx([1.0, 0.0, 0.0, 1.0], abs=1e-12)


def test_matches_simulation_where_the_plug_in_is_biased():
    # k ~ Binomial(M, p); E[estimate] must equal p^R + (1-p)^R. 200,000 draws per p: the estimate lies in [0, 1], so
    # its Monte Carlo standard error is <= 0.5 / sqrt(2e5) = 0.0011; the tolerance 0.01 is 9 of them. The plug-in
    # p_hat^R + (1-p_hat)^R from the same M = 2R rollouts is biased up by more than 0.01 at these p (checked below).
    torch.manual_seed(0)
    R, M, draws = 4, 8, 200_000
    for p in (0.1, 0.3, 0.5, 0.8):
        k = torch.distributions.Binomial(M, torch.full((draws,), p)).sample()
        truth = p**R + (1 - p) ** R
        est = unbiased_zero_variance_probability(k, M, R)
        assert float(est.mean()) == pytest.approx(truth, abs=0.01), p
        plug_in = predicted_zero_variance_fraction(k / M, R)
        assert plug_in - truth > 0.01, (p, plug_in, truth)  # the bias the unbiased estimator removes


def test_simulated_groups_from_a_larger_pool():
    # The probe's use: M rollouts per prompt, S1 of groups of R. Draw M = 16 per prompt for 5,000 prompts with
    # p ~ Uniform(0, 1): E[p^R + (1-p)^R] = 2 / (R + 1) = 0.4 for R = 4 (Beta integral). Standard error
    # <= 0.5 / sqrt(5000) = 0.007: tolerance 0.025 (3.5 sigma).
    torch.manual_seed(1)
    p = torch.rand(5000, dtype=torch.float64)
    k = torch.distributions.Binomial(16, p).sample()
    assert float(unbiased_zero_variance_probability(k, 16, 4).mean()) == pytest.approx(0.4, abs=0.025)


def test_bad_input():
    with pytest.raises(ValueError, match="M >= R"):
        unbiased_zero_variance_probability(1, 3, 4)
    with pytest.raises(ValueError, match=r"\[0, M\]"):
        unbiased_zero_variance_probability(9, 8, 4)
    with pytest.raises(ValueError, match="R must be >= 1"):
        unbiased_zero_variance_probability(1, 8, 0)
    assert math.isfinite(float(unbiased_zero_variance_probability(500, 1000, 8)))  # large M: no overflow
