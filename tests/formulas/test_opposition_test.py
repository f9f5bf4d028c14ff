"""The Monte Carlo credit rule's exact count test (docs/theory.md §12): its sizes, thresholds and inputs in closed
form."""

import math

import pytest

from grpo_lens.formulas.credit import (
    opposing_differences,
    opposing_shifts,
    opposition_size,
    opposition_threshold,
    prefix_success_counts,
)
from grpo_lens.formulas.stats import binomial_pmf, binomial_upper_tail


def test_opposition_size_in_closed_form():
    # K_mc = 1: X, Y iid Bernoulli(p), P(X - Y >= 1) = p (1 - p), largest at p = 1/2: 1/4
    assert opposition_size(1, 1) == pytest.approx(0.25, abs=1e-12)
    # K_mc = 8, d = 5 at p = 1/2: with Y' = 8 - Y, X + Y' ~ Binomial(16, 1/2) and X - Y >= 5 <=> X + Y' >= 13:
    # (C(16,13) + C(16,14) + C(16,15) + C(16,16)) / 2^16 = (560 + 120 + 16 + 1) / 65536 = 697 / 65536
    assert opposition_size(8, 5) == pytest.approx(697 / 65536, abs=1e-12)
    # d > K_mc: a difference larger than K_mc cannot occur
    assert opposition_size(3, 4) == 0.0
    with pytest.raises(ValueError, match="K_mc >= 1 and d >= 1"):
        opposition_size(8, 0)


def test_opposition_threshold_is_the_smallest_d_within_the_bonferroni_level():
    # 3 segments at level 0.05: each test must have size <= 0.01667. d = 4 has (1820 + 697) / 65536 = 0.0384 at
    # p = 1/2 (too large); d = 5 has 697 / 65536 = 0.0106 -> (5, 697 / 65536), alpha_r = 3 x 0.0106 = 0.032
    d, size = opposition_threshold(8, 3, 0.05)
    assert d == 5 and size == pytest.approx(697 / 65536, abs=1e-12)
    assert opposition_size(8, 4) == pytest.approx(2517 / 65536, abs=1e-12)
    # K_mc = 1 has size 1/4 at d = 1, above 0.05: nothing can be flagged
    assert opposition_threshold(1, 1, 0.05) == (2, 0.0)
    with pytest.raises(ValueError, match="level in"):
        opposition_threshold(8, 3, 1.5)


def test_binomial_tail_and_pmf_in_closed_form():
    assert binomial_pmf(3, 0.5) == pytest.approx([1 / 8, 3 / 8, 3 / 8, 1 / 8], abs=1e-15)
    assert binomial_upper_tail(1, 3, 0.5) == pytest.approx(7 / 8, abs=1e-15)  # 1 - P(0) = 1 - 1/8
    assert binomial_upper_tail(0, 3, 0.5) == 1.0
    assert binomial_upper_tail(4, 3, 0.5) == 0.0
    # the test file's example: P(Binomial(8, 0.032) >= 3) = sum_{x>=3} C(8,x) .032^x .968^(8-x) ~ 0.0017
    expected = math.fsum(math.comb(8, x) * 0.032**x * 0.968 ** (8 - x) for x in range(3, 9))
    assert binomial_upper_tail(3, 8, 0.032) == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match="p in"):
        binomial_upper_tail(1, 3, 1.5)


def test_prefix_counts_are_recovered_from_means_and_errors_of_zero_one_draws():
    # K_mc = 4: 2 successes -> mean 0.5, SE sqrt(2 * 2 / (16 * 3)); 1 success -> 0.25, SE sqrt(1 * 3 / 48) = 0.25
    assert prefix_success_counts([0.5, 0.25], [math.sqrt(4 / 48), 0.25], 4) == [2, 1]
    assert prefix_success_counts([0.3], [0.1], 4) is None  # 0.3 x 4 is not a count
    assert prefix_success_counts([0.5], [0.5], 4) is None  # a count, but not the SE 0/1 draws give


def test_opposing_differences_take_the_direction_against_the_advantage():
    assert opposing_differences([5, 2, 6], 1.0) == [3, -4]  # A > 0: a later prefix succeeding less opposes
    assert opposing_differences([5, 2, 6], -0.5) == [-3, 4]
    assert opposing_differences([5, 2, 6], 0.0) == []


def test_opposing_shifts_pool_rollouts_by_segment_position():
    # K_mc = 8. Rollout 1 (A > 0): 6, 2, 4 -> differences against A: 4, -2 -> shifts 0.5, -0.25; rollout 2 (A < 0):
    # 3, 5 -> 2 -> 0.25 at position 1 only; rollout 3 (A = 0) is left out
    e = opposing_shifts([[6, 2, 4], [3, 5], [1, 2, 3]], [1.0, -1.0, 0.0], 8)
    assert e == [[0.5, 0.25], [-0.25]]
    # E e = sign(A)(p_j − p_j+1) exactly: the mean over all 9 × 9 count pairs of Binomial(8, 0.6) and
    # Binomial(8, 0.3) is (8 · 0.6 − 8 · 0.3) / 8 = 0.3
    pmf6, pmf3 = binomial_pmf(8, 0.6), binomial_pmf(8, 0.3)
    mean = sum(pmf6[x] * pmf3[y] * opposing_shifts([[x, y]], [1.0], 8)[0][0] for x in range(9) for y in range(9))
    assert mean == pytest.approx(0.3, abs=1e-12)


def _mc_probe(rng, n, k, p_paths, signs):
    """A probe dict whose credit study holds n rollouts, each with prefixes drawn as Binomial(K_mc, p) counts."""
    rows = []
    for i in range(n):
        counts = [sum(rng.random() < p for _ in range(k)) for p in p_paths[i]]
        rows.append(
            {
                "values": [x / k for x in counts],
                "errors": [math.sqrt(x * (k - x) / (k * k * (k - 1))) for x in counts],
                "grpo_advantage": signs[i],
            }
        )
    return {"studies": {"credit": {"monte_carlo": {"rollouts": rows, "samples_per_prefix": k}}}}


def test_the_monte_carlo_credit_rule_keeps_its_level_under_noise_and_finds_a_planted_opposition():
    import random

    from grpo_lens.claims import CLAIMS

    rule = CLAIMS.get("monte_carlo_credit")
    rng = random.Random(0)
    n, k, trials = 100, 8, 200
    signs = [1.0 if i % 2 else -1.0 for i in range(n)]
    # null: every prefix of a rollout has one success probability (no segment opposes A_i), drawn per rollout.
    # The exact test's false holds are at most 0.05; the 0.1 rule's 2-SE counting gave 0.16 here (docs/calibration.md).
    # 200 trials: SE of a 0.05 share is 0.015, so 0.08 is 2 SE above the level and far below 0.16.
    false_holds = 0
    for _ in range(trials):
        paths = [[p] * 4 for p in (rng.random() for _ in range(n))]
        false_holds += rule(_mc_probe(rng, n, k, paths, signs))[0].verdict == "holds"
    assert false_holds / trials <= 0.08
    # planted: in every rollout one segment moves against A_i by 0.6 (0.8 -> 0.2 where A_i > 0): holds
    paths = [[0.5, 0.8, 0.2, 0.2] if s > 0 else [0.5, 0.2, 0.8, 0.8] for s in signs]
    assert rule(_mc_probe(rng, n, k, paths, signs))[0].verdict == "holds"


def test_the_monte_carlo_credit_row_shows_the_deciding_segment_whole():
    import random

    from grpo_lens.claims import CLAIMS
    from grpo_lens.claims.base import primary_text

    rng = random.Random(1)
    n, k = 100, 8
    signs = [1.0 if i % 2 else -1.0 for i in range(n)]
    # one segment moves against A_i by 0.6 in every rollout: the row holds on that segment, and the first screen shows
    # that segment's interval and its n in full (the first clause of the measurement was cut at 110 characters)
    paths = [[0.5, 0.8, 0.2, 0.2] if s > 0 else [0.5, 0.2, 0.8, 0.8] for s in signs]
    (c,) = CLAIMS.get("monte_carlo_credit")(_mc_probe(rng, n, k, paths, signs))
    text = primary_text(c)
    assert c.verdict == "holds" and text.startswith("shift against A_i, segment ")
    assert not text.endswith("…") and f"(n = {c.n} rollouts)" in text


def test_the_monte_carlo_credit_row_says_why_when_there_is_nothing_to_decide():
    from grpo_lens.claims import CLAIMS

    rule = CLAIMS.get("monte_carlo_credit")
    # the credit study ran without its Monte Carlo part
    (c,) = rule({"studies": {"credit": {"monte_carlo": {"rollouts": [], "samples_per_prefix": 8}}}})
    assert (c.verdict, c.scope) == ("inconclusive", "not measured") and c.rule.startswith("not run: --mc-groups 4")
    # one prefix per rollout: no interior segment to test (values 4/8 with the Binomial SE of 4 of 8)
    row = {"values": [0.5], "errors": [math.sqrt(4 * 4 / (64 * 7))], "grpo_advantage": 1.0}
    (c,) = rule({"studies": {"credit": {"monte_carlo": {"rollouts": [row] * 4, "samples_per_prefix": 8}}}})
    assert (c.verdict, c.rule) == ("inconclusive", "nothing to test") and c.scope == "4 rollouts, K_mc = 8"
    assert c.control and c.source == "Monte Carlo continuations from prefixes"
