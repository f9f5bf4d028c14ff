"""Pooling over seeds as strata (grpo_lens/formulas/pooling.py): closed-form values derived in the comments."""

from __future__ import annotations

import math

import pytest

from grpo_lens.formulas.pooling import (
    between_seed_spread,
    chi2_sf,
    combine_summaries,
    stratified_interval,
)
from grpo_lens.formulas.stats import mean_interval

A, B = [1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]


def test_stratified_interval_leaves_between_seed_differences_out():
    # W_h = 4/8 = 0.5; s_h^2 = var([1, 2, 3, 4], ddof 1) = 5/3 in both; a_h = 0.25 * (5/3) / 4 = 5/48
    # SE^2 = 10/48 = 0.208333; df = (10/48)^2 / (2 * (5/48)^2 / 3) = 6; t_6(0.975) = 2.446912
    # half = 2.446912 * sqrt(0.208333) = 1.116874 around the pooled mean 4.5
    s = stratified_interval([A, B])
    assert s["mean"] == pytest.approx(4.5, abs=1e-12)
    assert s["lo"] == pytest.approx(4.5 - 1.116874, abs=2e-3) and s["hi"] == pytest.approx(4.5 + 1.116874, abs=2e-3)
    assert (s["n"], s["strata"]) == (8, 2)
    # the interval over the pooled values counts the seeds' difference as noise: t_7 * sd(1..8) / sqrt(8) = 2.0478
    pooled = mean_interval(A + B)
    assert pooled["hi"] - pooled["mean"] == pytest.approx(2.364624 * math.sqrt(6) / math.sqrt(8), abs=2e-3)


def test_stratified_interval_needs_two_values_per_stratum_and_eight_units():
    assert stratified_interval([A, [9.0]])["lo"] is None  # one value: no variance in that stratum
    assert stratified_interval([[1.0, 2.0], [3.0, 4.0]])["lo"] is None  # 4 < 8 units
    assert stratified_interval([[], []]) == {"mean": None, "lo": None, "hi": None, "n": 0, "strata": 0}
    s = stratified_interval([A, B, [None, float("nan")]])  # non-finite dropped, the empty stratum left out
    assert s["strata"] == 2 and s["n"] == 8


def test_combine_summaries_recovers_the_stratified_interval_from_t_intervals():
    # each stratum 1..8 (+10 for the second) is symmetric, so its interval is Student's t: half = t_7 s / sqrt(8);
    # read back SE_h = s / sqrt(8) = 0.866025; SE^2 = 2 * 0.25 * 0.75 = 0.375; df = 16 - 2 = 14, t_14 = 2.144787
    # half = 2.144787 * sqrt(0.375) = 1.313393 around (4.5 + 14.5) / 2 = 9.5; Satterthwaite's df on the raw values
    # is 14 too, so the raw-value interval is the same
    x = [float(i) for i in range(1, 9)]
    y = [v + 10 for v in x]
    c = combine_summaries([mean_interval(x), mean_interval(y)])
    assert c["mean"] == pytest.approx(9.5, abs=1e-12)
    assert c["hi"] - c["mean"] == pytest.approx(1.313393, abs=2e-3)
    raw = stratified_interval([x, y])
    assert c["lo"] == pytest.approx(raw["lo"], abs=1e-9) and c["hi"] == pytest.approx(raw["hi"], abs=1e-9)
    # weights follow n: 8 values at 4.5 and 2 at 0 (too few there for an interval) -> mean 36/10, no interval
    short = combine_summaries([mean_interval(x), mean_interval([0.0, 0.0])])
    assert short["mean"] == pytest.approx(3.6) and short["lo"] is None
    assert combine_summaries([None, {"mean": None, "n": 0}])["mean"] is None


def test_between_seed_spread_and_cochrans_q():
    # means 2.5 and 6.5: SD = 4 / sqrt(2) = 2.828427; SE_h = sqrt((5/3) / 4) = 0.645497, w_h = 1 / SE_h^2 = 2.4
    # x_w = 4.5, Q = 2.4 * 2^2 * 2 = 19.2, p = P(chi2_1 >= 19.2) = erfc(sqrt(19.2 / 2))
    s = between_seed_spread([A, B])
    assert s["per_seed"] == [2.5, 6.5] and s["n"] == [4, 4]
    assert s["sd"] == pytest.approx(2 * math.sqrt(2), abs=1e-12)
    assert (s["min"], s["max"]) == (2.5, 6.5)
    assert s["q"] == pytest.approx(19.2, abs=1e-9)
    assert s["p"] == pytest.approx(math.erfc(math.sqrt(9.6)), rel=1e-6)
    same = between_seed_spread([A, [v + 0.0 for v in A]])  # identical seeds: Q = 0, p = 1
    assert same["q"] == pytest.approx(0.0) and same["p"] == pytest.approx(1.0)
    one = between_seed_spread([A, []])
    assert one["sd"] is None and one["q"] is None and one["per_seed"] == [2.5, None]


def test_chi2_sf_closed_forms():
    # df = 2: P(chi2_2 >= x) = exp(-x / 2); df = 1: erfc(sqrt(x / 2))
    assert chi2_sf(3.0, 2) == pytest.approx(math.exp(-1.5), rel=1e-9)
    assert chi2_sf(3.84, 1) == pytest.approx(math.erfc(math.sqrt(1.92)), rel=1e-9)
    assert chi2_sf(0.0, 3) == 1.0
    with pytest.raises(ValueError, match="df"):
        chi2_sf(1.0, 0)


def test_seed_slope_test_by_hand():
    from grpo_lens.formulas.pooling import seed_slope_test

    # slopes 1, 2, 3: mean 2, s = 1, SE = 1/√3, t = 2√3 = 3.4641 with 2 df; P(t₂ > t) = 1/2 − t/(2√(2 + t²))
    # = 0.5 − 3.4641/(2·√14) = 0.037090
    t = seed_slope_test([1.0, 2.0, None, 3.0])
    assert t["k"] == 3 and t["df"] == 2
    assert t["t"] == pytest.approx(2 * math.sqrt(3), abs=1e-9)
    assert t["p_up"] == pytest.approx(0.5 - 2 * math.sqrt(3) / (2 * math.sqrt(14)), abs=1e-6)
    assert t["p_down"] == pytest.approx(1 - t["p_up"], abs=1e-12)
    assert seed_slope_test([1.0])["p_up"] == 1.0  # one seed: no test
    assert seed_slope_test([0.5, 0.5])["p_up"] == 0.0  # no spread, mean above 0


def test_seed_mean_test_by_hand():
    from grpo_lens.formulas.pooling import seed_mean_test

    # 0.95, 0.97, 0.99 against 0.9: mean 0.97, s = 0.02, SE = 0.011547, t = 6.0622 (2 df);
    # p = 0.5 − t/(2√(2 + t²)) = 0.5 − 6.06218/12.44990 = 0.013074
    p = seed_mean_test([0.95, 0.97, 0.99], 0.9, "above")
    assert p == pytest.approx(0.013074, abs=2e-6)
    assert seed_mean_test([0.95, 0.97, 0.99], 0.9, "below") == pytest.approx(1 - p, abs=1e-12)
    with pytest.raises(ValueError, match="valid: above, below"):
        seed_mean_test([1.0, 2.0], 0.0, "up")
