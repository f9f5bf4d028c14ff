"""Hall's transformed-t interval (grpo_lens.formulas.stats.mean_interval): closed-form cases and coverage."""

import math

import pytest
import torch

from grpo_lens.formulas.stats import (
    interval_t_p,
    mean_interval,
    normal_upper_tail,
    student_t_quantile,
)


def test_symmetric_sample_gives_the_student_t_interval():
    # 1..8: mean 4.5, ddof-1 variance 6, se = sqrt(6/8) = 0.86603, skewness 0 -> x̄ ± t_7 se with t_7(0.975) = 2.36462
    ci = mean_interval([float(i) for i in range(1, 9)])
    half = 2.36462 * math.sqrt(6 / 8)
    assert ci["mean"] == 4.5 and ci["n"] == 8
    assert ci["lo"] == pytest.approx(4.5 - half, abs=2e-3) and ci["hi"] == pytest.approx(4.5 + half, abs=2e-3)


def test_skewed_sample_by_hand():
    # seven 0s and one 1: mean 1/8, s² = (7/64 + 49/64) / 7 = 1/8, se = s/√8 = 1/8; m2 = 56/512 = 0.109375,
    # m3 = (7 (-1/8)³ + (7/8)³) / 8 = 0.0820313, g1 = m3 / m2^1.5 = 2.26779, G1 = g1 √(8·7) / 6 = 2.82843,
    # a = G1/(3√8) = 1/3, b = a/2 = 1/6. h⁻¹(y) = ((1 + 3a(y - b))^(1/3) - 1)/a at y = ±t_7 = ±2.36462:
    # h⁻¹(t) = (3.19795^(1/3) - 1) · 3 = 1.41976, h⁻¹(-t) = ((-1.53129)^(1/3) - 1) · 3 = -6.45779 (a negative cube
    # root) -> [1/8 - 1.41976/8, 1/8 + 6.45779/8] = [-0.05247, 0.93222]; with the unadjusted m3 / s³ (0.1 skewness)
    # the ends were [-0.07704, 1.18485]
    ci = mean_interval([0.0] * 7 + [1.0])
    assert ci["lo"] == pytest.approx(-0.05247, abs=2e-3) and ci["hi"] == pytest.approx(0.93222, abs=3e-3)
    # a plain t interval would be symmetric (1/8 ± 0.2956); clipped to a share's range the lower end is 0
    assert mean_interval([0.0] * 7 + [1.0], bounds=(0.0, 1.0))["hi"] == pytest.approx(0.93222, abs=3e-3)
    assert mean_interval([0.0] * 7 + [1.0], bounds=(0.0, 1.0))["lo"] == 0.0


def test_edge_cases():
    assert mean_interval([]) == {"mean": None, "lo": None, "hi": None, "n": 0}
    assert mean_interval([1.0] * 7)["lo"] is None  # fewer than MIN_INTERVAL_UNITS
    assert mean_interval([2.0] * 8) == {"mean": 2.0, "lo": 2.0, "hi": 2.0, "n": 8}  # no spread
    with pytest.raises(ValueError, match="level"):
        mean_interval([1.0] * 8, level=1.0)
    assert student_t_quantile(0.975, 7) == pytest.approx(2.36462, abs=1e-3)


def test_covers_on_zero_inflated_data_where_the_t_interval_does_not():
    # 60% zeros, log-normal otherwise (mean 0.4 e^0.5 = 0.65949), n = 22, 1000 trials (Monte Carlo SE 0.008):
    # Hall's t covers >= 0.91 (0.93 measured), the symmetric t interval 0.84: a wrong skewness sign or a
    # dropped correction fails the first assert
    gen = torch.Generator().manual_seed(1)
    mu = 0.4 * math.exp(0.5)
    hits = t_hits = 0
    for _ in range(1000):
        x = (
            (torch.rand(22, generator=gen) < 0.4).double()
            * torch.exp(torch.randn(22, generator=gen, dtype=torch.float64))
        ).tolist()
        ci = mean_interval(x)
        hits += ci["lo"] <= mu <= ci["hi"]
        m, s = sum(x) / 22, float(torch.tensor(x).std())
        half = student_t_quantile(0.975, 21) * s / math.sqrt(22)
        t_hits += m - half <= mu <= m + half
    assert hits / 1000 >= 0.91 and t_hits / 1000 <= 0.88, (hits, t_hits)


# ---------------------------------------------------------------------------------------------------------------------
# trends over training: OLS slope, fixed-b HAC
# ---------------------------------------------------------------------------------------------------------------------
def test_ols_trend_by_hand():
    from grpo_lens.formulas.stats import ols_trend

    # x̄ = ȳ = 2.5; Sxy = 2.25 − 0.25 − 0.25 + 2.25 = 4, Sxx = 5: slope 0.8; residuals −0.3, 0.9, −0.9, 0.3 (SSR 1.8),
    # s² = 1.8 / (4 − 2) = 0.9, SE = √(0.9 / 5) = 0.424264
    t = ols_trend([1, 2, 3, 4], [1, 3, 2, 4])
    assert t["slope"] == pytest.approx(0.8, abs=1e-12)
    assert t["se_iid"] == pytest.approx(math.sqrt(0.18), abs=1e-9)
    assert t["df"] == 2
    # a covariate equal to x leaves no variation in x: no slope
    assert ols_trend([1, 2, 3, 4], [1, 3, 2, 4], covariate=[1, 2, 3, 4])["slope"] is None
    assert ols_trend([1, 2], [1, 2])["slope"] is None


def test_hac_t_by_hand():
    from grpo_lens.formulas.stats import hac_trend_test

    # x = 1, 2, 3, y = 0, 2, 1: x̃ = −1, 0, 1, slope = 1/2; residuals −0.5, 1, −0.5; v = x̃ û = 0.5, 0, −0.5.
    # Bartlett at M = n = 3: Σ_ts (1 − |t−s|/3) v_t v_s = 0.25 + 0.25 + 2·(1/3)·(−0.25) = 1/3, Ω = 1/9,
    # Var = n Ω / (Σ x̃²)² = 3·(1/9)/4 = 1/12, t = 0.5 / √(1/12) = √3
    t = hac_trend_test([1, 2, 3], [0, 2, 1])
    assert t["slope"] == pytest.approx(0.5, abs=1e-12)
    assert t["t"] == pytest.approx(math.sqrt(3), abs=1e-9)
    assert t["p_up"] + t["p_down"] == pytest.approx(1 + 1 / 4001, abs=1e-12)  # the draw equal to t counts on both


def test_hac_reference_is_exact_under_iid_gaussian_noise():
    import torch

    from grpo_lens.formulas.stats import hac_trend_test

    # the fixed-b law is tabulated from i.i.d. Gaussian series at the same design, so for such data the p-value is
    # uniform: P(p_up <= 0.1) = 0.1 (300 trials: SE 0.017). Reading the HAC t against the normal (|t| > 1.28) rejects
    # about 0.2 at b = 1 (its law has heavy tails), outside [0.05, 0.15].
    gen = torch.Generator().manual_seed(5)
    xs = list(range(1, 11))
    hits = sum(hac_trend_test(xs, torch.randn(10, generator=gen).tolist())["p_up"] <= 0.1 for _ in range(300))
    assert 0.05 <= hits / 300 <= 0.15


def _t_upper_tail_by_quadrature(x: float, df: int, steps: int = 200000) -> float:
    """P(t_df >= x) by Simpson's rule on the density over [x, x + 200] (independent of student_t_cdf)."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    f = lambda u: c * (1 + u * u / df) ** (-(df + 1) / 2)  # noqa: E731
    h = 200.0 / steps
    s = f(x) + f(x + 200.0) + sum((4 if i % 2 else 2) * f(x + i * h) for i in range(1, steps))
    return s * h / 3


def test_interval_t_p_is_the_t_test_on_a_student_interval():
    # x̄ = 1, s = 1, n = 12: se = 1/√12, T = 2√3 = 3.464; the 95% Student interval is x̄ ± t_{11, .975} se, so the
    # helper recovers se and gives P(t_11 >= 3.464) = 0.0026 (quadrature), where the normal reading gives 0.00027
    n, se = 12, 1 / math.sqrt(12)
    half = student_t_quantile(0.975, n - 1) * se
    p = interval_t_p(1.0, 1.0 - half, 1.0 + half, n, 0.0, "above")
    exact = _t_upper_tail_by_quadrature(2 * math.sqrt(3), 11)
    assert exact == pytest.approx(0.00265, abs=5e-5)
    assert p == pytest.approx(exact, rel=0.02)  # the quantile's Cornish-Fisher error (< 1e-3) only
    assert normal_upper_tail(2 * math.sqrt(3)) < exact / 5  # what the normal reading would have said
    # the other side is its complement; a control above the mean makes "below" the small one
    assert interval_t_p(1.0, 1.0 - half, 1.0 + half, n, 0.0, "below") == pytest.approx(1 - p, abs=1e-12)
    assert interval_t_p(-1.0, -1.0 - half, -1.0 + half, n, 0.0, "below") == pytest.approx(p, rel=1e-9)


def test_interval_t_p_edges():
    assert interval_t_p(None, None, None, 12, 0.0, "above") == 1.0
    assert interval_t_p(1.0, 1.0, 1.0, 12, 0.0, "above") == 0.0  # zero width, mean above
    assert interval_t_p(1.0, 1.0, 1.0, 12, 2.0, "above") == 1.0
    with pytest.raises(ValueError, match="valid: above, below"):
        interval_t_p(1.0, 0.0, 2.0, 12, 0.0, "up")
