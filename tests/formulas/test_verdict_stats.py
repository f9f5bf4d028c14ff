"""The statistics the verdicts are decided by: the t CDF, the interval's own test, the
autocorrelation-robust trend test and Holm's procedure, on closed-form values."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_lens.formulas.stats import (
    difference_trend_test,
    holm,
    mean_interval,
    mean_test_p,
    spearman_trend,
    student_t_cdf,
    student_t_quantile,
)


def test_student_t_cdf_closed_forms():
    # df = 1 is Cauchy: F(x) = 1/2 + atan(x)/pi; df = 2: F(x) = 1/2 + x / (2 sqrt(2 + x^2)); df -> inf: normal
    for x in (-3.0, -0.4, 0.0, 1.3, 7.0):
        assert student_t_cdf(x, 1) == pytest.approx(0.5 + math.atan(x) / math.pi, abs=1e-12)
        assert student_t_cdf(x, 2) == pytest.approx(0.5 + x / (2 * math.sqrt(2 + x * x)), abs=1e-12)
    assert student_t_cdf(1.959964, 10**6) == pytest.approx(0.975, abs=1e-5)
    # the table value t_{0.975, 7} = 2.364624 (Student's table)
    assert student_t_cdf(2.364624, 7) == pytest.approx(0.975, abs=1e-6)
    assert student_t_cdf(student_t_quantile(0.9, 12), 12) == pytest.approx(0.9, abs=1e-4)


def test_mean_test_p_is_the_test_of_the_interval():
    # the one-sided p of "mean above c" at c = the lower end of the (1 - 2 alpha) interval is alpha, for skewed data
    # too (Hall's transform is monotone); "below" at the upper end likewise
    gen = torch.Generator().manual_seed(3)
    xs = torch.exp(torch.randn(20, generator=gen, dtype=torch.float64)).tolist()
    for alpha in (0.025, 0.1):
        ci = mean_interval(xs, level=1 - 2 * alpha)
        # (1e-6: the interval takes t from the Cornish-Fisher quantile, the test from the exact CDF)
        assert mean_test_p(xs, ci["lo"], "above") == pytest.approx(alpha, abs=1e-6)
        assert mean_test_p(xs, ci["hi"], "below") == pytest.approx(alpha, abs=1e-6)
    assert mean_test_p(xs[:7], 0.0, "above") == 1.0  # 7 values: no interval, no test
    with pytest.raises(ValueError, match="valid"):
        mean_test_p(xs, 0.0, "sideways")


def test_difference_trend_test_closed_form():
    # y = 2 + 0.5 x + e with e alternating +-0.1 on x = 0..5: differences 0.5 + (-0.2, +0.2, ...) ->
    # slope = mean = 0.5 - 0.2/5 = 0.46; residuals +-0.2 around it: s^2 = (0.2 + 0.04... ) computed below
    xs = [0, 1, 2, 3, 4, 5]
    ys = [2 + 0.5 * x + (0.1 if x % 2 == 0 else -0.1) for x in xs]
    d = [ys[i + 1] - ys[i] for i in range(5)]  # [0.3, 0.7, 0.3, 0.7, 0.3]
    mean = sum(d) / 5
    s2 = sum((v - mean) ** 2 for v in d) / 4
    t = difference_trend_test(xs, ys)
    assert t["slope"] == pytest.approx(mean) and t["df"] == 4
    assert t["t"] == pytest.approx(mean / math.sqrt(s2 / 5))
    assert t["p_up"] == pytest.approx(1 - student_t_cdf(t["t"], 4)) and t["p_up"] + t["p_down"] == pytest.approx(1)
    # a covariate that explains y exactly leaves no slope: y = log(m) with m falling and x rising
    m = [8, 7, 6, 4, 3, 2, 1]
    t = difference_trend_test(
        list(range(7)), [math.log(v) + 1e-3 * ((-1) ** i) for i, v in enumerate(m)], covariate=[math.log(v) for v in m]
    )
    assert abs(t["slope"]) < 0.01 and t["p_up"] > 0.025 and t["p_down"] > 0.025


def _ar(n, phi, gen):
    z = torch.randn(n, generator=gen, dtype=torch.float64).tolist()
    out = [z[0]]
    for e in z[1:]:
        out.append(out[-1] + e if phi >= 1 else phi * out[-1] + math.sqrt(1 - phi * phi) * e)
    return out


@pytest.mark.parametrize("phi", [0.9, 1.0])
def test_trend_level_under_autocorrelation(phi):
    # 7 lens steps of a flat series whose steps are correlated phi (1 = a random walk): the first-difference test's
    # false "rises" (one-sided p <= 0.025) stay <= 0.05 (differences of an AR(1) have autocorrelations <= 0, so its
    # variance is conservative; for a random walk the test is exact, 0.025), while Spearman's permutation test (the
    # 0.2 rule: rho > 0 and p < 0.05) reads "rises" in more than 0.06 of random walks (0.255)
    gen = torch.Generator().manual_seed(11)
    xs = [1, 5, 10, 15, 20, 25, 30]
    new = old = 0
    trials = 400
    for _ in range(trials):
        ys = _ar(7, phi, gen)
        new += difference_trend_test(xs, ys)["p_up"] <= 0.025
        if phi == 1.0:
            rho, p = spearman_trend(xs, ys)
            old += rho > 0 and p < 0.05
    assert new / trials <= 0.05
    if phi == 1.0:
        assert old / trials > 0.06


def test_holm_step_down():
    # m = 4: sorted 0.01 <= 0.05/4, 0.015 <= 0.05/3, 0.03 > 0.05/2 -> the first two only (in input order)
    assert holm([0.03, 0.01, 0.5, 0.015]) == [False, True, False, True]
    assert holm([0.2, 0.0125]) == [False, True] and holm([]) == [] and holm([math.nan, 0.001]) == [False, True]
