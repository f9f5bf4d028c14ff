"""The claims section's verdicts follow their documented rules (docs/theory.md §11) on hand-made probe numbers."""

from __future__ import annotations

import pytest

from grpo_lens import metrics as mk
from grpo_lens.claims.base import (
    CLAIMS,
    DOES_NOT_HOLD,
    HOLDS,
    INCONCLUSIVE,
    Claim,
    band_verdict,
    evaluate_claims,
)


def ci(mean, lo, hi, n=16):
    return {"mean": mean, "lo": lo, "hi": hi, "n": n}


def probe(per_r: dict, groups=None, gradients="exact", estimator="grpo") -> dict:
    return {
        "meta": {"gradients": gradients, "sketch_dim": 16, "std": "sample", "eps": 1e-4, "estimator": estimator},
        "per_group_size": {r: {"summary": s, "groups": groups or []} for r, s in per_r.items()},
    }


def verdicts(name, p):
    return {c.scope: c.verdict for c in CLAIMS.get(name)(p)}


def test_band_verdict():
    assert band_verdict(1.6, 2.4, 1.5, 2.5) == HOLDS
    assert band_verdict(2.6, 3.0, 1.5, 2.5) == DOES_NOT_HOLD and band_verdict(0.9, 1.4, 1.5, 2.5) == DOES_NOT_HOLD
    assert band_verdict(2.2, 2.8, 1.5, 2.5) == INCONCLUSIVE and band_verdict(None, None, 1.5, 2.5) == INCONCLUSIVE


def rank_rows(n, top2, top1, null_top2, spread=0.01, erank=2.0):
    # n groups with the given G1 shares and simulated-null top-2 share, spread symmetrically (+-spread * (i - (n-1)/2))
    out = []
    for i in range(n):
        e = spread * (i - (n - 1) / 2)
        out.append(
            {
                "rank/g1_top2_share": top2 + e,
                "rank/g1_top1_share": top1 + e,
                "rank/g1_simnull_top2_share": null_top2,
                "rank/g1_null_top2_share": null_top2,
                "rank/g1_erank": erank,
            }
        )
    return out


def rank_claim(groups_by_r):
    p = {
        "meta": {"gradients": "exact", "config": {"prompts": 32}},
        "per_group_size": {r: {"summary": {}, "groups": g} for r, g in groups_by_r.items()},
    }
    return CLAIMS.get("rank_two_top2_share")(p)


def test_rank_claim_is_one_row_across_r():
    # 20 groups per R, E2 0.97 +- 0.095 (spread 0.01 x 9.5), E1 0.65, null 0.75: every interval clears its control by
    # > 0.05 with SE ~0.0013 -> holds at R = 4 and 8, one row for both; R = 2 is left out (rank <= 2 by construction)
    planted = rank_rows(20, top2=0.97, top1=0.65, null_top2=0.75, spread=0.001)
    (c,) = rank_claim({"2": planted, "4": planted, "8": planted})
    assert c.verdict == HOLDS and c.scope == "R = 4, 8 (one verdict)" and c.n == 20 and c.kind == "claim"
    assert c.p_holds < 1e-6 and c.p_dnh == 1.0
    # fails at R = 8 only (E2 0.75 < 0.9): the one verdict does not hold (it fails at either R)
    flat = rank_rows(20, top2=0.75, top1=0.5, null_top2=0.7, spread=0.001)
    (c,) = rank_claim({"4": planted, "8": flat})
    assert c.verdict == DOES_NOT_HOLD and "fails at R = 8: E2 below 0.9" in c.rule
    # one direction holds 0.97 (E1 > 0.9): not rank 2 although E2 > 0.9 and erank would read 1.9 ("≈ 2")
    one = rank_rows(20, top2=0.99, top1=0.97, null_top2=0.75, spread=0.001, erank=1.9)
    assert rank_claim({"4": one, "8": one})[0].verdict == DOES_NOT_HOLD
    # E2 0.93 > 0.9 > E1 0.8 but equal to its simulated null: d's mean is 0, on the one structure boundary,
    # so neither d > 0 nor d < 0 is shown (each one-sided p = 0.5) -> inconclusive, not holds
    null = rank_rows(20, top2=0.93, top1=0.8, null_top2=0.93, spread=0.001)
    (c,) = rank_claim({"4": null, "8": null})
    assert c.verdict == INCONCLUSIVE and c.p_holds == pytest.approx(0.5, abs=0.01)
    # 12 groups < 16 at R = 8: inconclusive, and the row names the flag and a count
    (c,) = rank_claim({"4": planted, "8": planted[:12]})
    assert c.verdict == INCONCLUSIVE and "`--prompts`" in c.advice and "R = 8: 12 mixed groups < 16" in c.advice
    (c,) = rank_claim({"4": planted, "8": planted[:1]})
    assert "R = 8: 1 mixed group < 16" in c.advice


def test_sparsity_advice_follows_the_runs_own_lens_spacing():
    from grpo_lens.claims.sparsity import _more_lens_steps

    def steps(*s):
        return [{mk.STEP: k} for k in s]

    # every 5 steps (the last step measured too): halving to 2 gives 5 / 2 = 2.5x the lens steps
    assert "every 5 steps; e.g. --lens-every 2 gives about 2.5× as many" in _more_lens_steps(steps(0, 5, 10, 15, 19), 4)
    assert "--lens-every 1 gives about 2.0× as many" in _more_lens_steps(steps(0, 2, 4, 6), 3)
    every = _more_lens_steps(steps(0, 1, 2, 3), 3)
    assert "the lens on every step" in every and "--lens-every" not in every


def test_trend_advice_names_steps_once_seeds_are_pooled():
    from grpo_lens.claims.sparsity import _trend_advice

    more = "the lens on every step"
    # 3 seeds pooled, all usable: more seeds first (the power route)
    assert _trend_advice(more, "seeds", 3, 3).startswith("more seeds")
    # 5 seeds ran and only 3 had enough tested lens steps: more steps per seed, and the count said
    five = _trend_advice(more, "seeds", 5, 3)
    assert five.startswith(more) and "3 of 5 seeds" in five and "more seeds" not in five
    # one run: pool seeds first
    assert _trend_advice(more, "run").startswith("train several seeds")


def test_zero_sum_claim_rules():
    def rows(n, excess, null, var=0.0004, spread=0.0):
        return [
            {
                "zero_sum/unit_span_energy_excess": excess + spread * (i - (n - 1) / 2),
                "zero_sum/unit_span_energy_null": null,
                "zero_sum/unit_span_energy_null_var": var,
            }
            for i in range(n)
        ]

    def verdict(groups):
        p = probe({"2": {}, "4": {}}, gradients="sketch")
        p["per_group_size"]["4"]["groups"] = groups
        (c,) = CLAIMS.get("zero_sum_rank_two")(p)
        assert c.scope == "R = 4 (one verdict)" and "not exact" in c.source
        return c.verdict

    # theta = excess / (1 - null): 0.25 / 0.5 = 0.5 with u_g = x_g - 0.1 (1 - m) = 0.2 +- 0.0045 -> above 0.1: holds
    assert verdict(rows(10, 0.25, 0.5, spread=0.001)) == HOLDS
    # theta = 0.01 / 0.5 = 0.02 (a negligible effect the 0.2 test read "holds" by its p): below 0.1 -> does not hold
    assert verdict(rows(10, 0.01, 0.5, spread=0.001)) == DOES_NOT_HOLD
    # theta = 0.05 / 0.5 = 0.1 exactly, u spread +-0.045: straddles the margin -> inconclusive; 5 groups: inconclusive
    assert verdict(rows(10, 0.05, 0.5, spread=0.01)) == INCONCLUSIVE
    assert verdict(rows(5, 0.25, 0.5, spread=0.001)) == INCONCLUSIVE


def test_labels_row_shows_the_mean_share_and_skips_uninformative_groups():
    from grpo_lens.claims.base import primary_text

    # 10 groups with θ_g = x / (1 − m) = 0.25 / 0.5 = 0.5 ± 0.002 and 10 with no room (m = 1: two distinct directions,
    # no label information): θ̄ = 0.5 over the 10 informative groups; pooled, the empty groups would not change it, but
    # counted as units with θ_g = 0 they would halve it
    informative = [
        {
            "zero_sum/unit_span_energy_excess": 0.25 + 0.001 * (i - 4.5),
            "zero_sum/unit_span_energy_null": 0.5,
            "zero_sum/unit_span_energy_null_var": 0.0004,
        }
        for i in range(10)
    ]
    empty = [
        {
            "zero_sum/unit_span_energy_excess": 0.0,
            "zero_sum/unit_span_energy_null": 1.0,
            "zero_sum/unit_span_energy_null_var": 0.0,
        }
    ] * 10
    p = probe({"2": {}, "4": {}}, gradients="sketch")
    p["per_group_size"]["4"]["groups"] = informative + empty
    (c,) = CLAIMS.get("zero_sum_rank_two")(p)
    assert c.verdict == HOLDS and c.n == 10
    assert primary_text(c).startswith("θ̄ 0.500 [") and primary_text(c).endswith("(R = 4)")
    assert "10 of 20 groups carry label information" in c.measurement
    # the pooled reading beside it, descriptive: Σ x / Σ (1 − m) = 2.5 / 5 = 0.5 (the empty groups add 0 to both)
    assert "pooled θ = Σ x / Σ (1 − m) 0.500 (not used)" in c.measurement


def test_identity_claim_rules():
    groups = [
        {"grad/identity_residual": 3e-8, "group/correct": 1.0, "group/size": 4.0},
        {"grad/identity_residual": 1e-7, "group/correct": 2.0, "group/size": 4.0},
    ]
    (c,) = CLAIMS.get("identity")(probe({"4": {}}, groups))
    assert c.verdict == HOLDS and "1.0e-07" in c.rule
    # control: population constant instead of sample: |1 - sqrt(R/(R-1))| = 0.155 for R = 4 (eps negligible)
    assert "0.155" in c.control
    bad = [dict(groups[0], **{"grad/identity_residual": 0.13})]
    assert CLAIMS.get("identity")(probe({"4": {}}, bad))[0].verdict == DOES_NOT_HOLD
    assert CLAIMS.get("identity")(probe({"4": {}}, []))[0].verdict == INCONCLUSIVE


def test_g2_weighting_claim_rules():
    def row(adv_sr, other_sr):
        out = {}
        for t in ("q_proj", "down_proj"):
            out[f"rank/g2_adv_{t}_stable_rank"] = adv_sr
            for w in ("abs", "shift", "reward", "uniform"):
                out[f"rank/g2_{w}_{t}_stable_rank"] = other_sr
        return out

    def claim(rows):
        p = {"meta": {"gradients": "exact"}, "per_group_size": {"4": {"g2_weightings": {"groups": rows}}}}
        return CLAIMS.get("zero_sum_g2_weighting")(p)[0]

    # descriptive since 0.3 (its rule could not tell planted zero-sum-irrelevant from decisive cases): no
    # verdict whatever the numbers, and the reading is kept in the text
    c = claim([row(2.0, 3.5 + 0.1 * i) for i in range(10)])
    assert c.verdict == INCONCLUSIVE and c.kind == "descriptive" and "difference interval below 0" in c.rule
    c = claim([row(2.0, 3.5)])
    assert c.verdict == INCONCLUSIVE and "--g2-groups" in c.rule


def test_claim_records_are_checked_and_listed():
    with pytest.raises(ValueError, match="verdict"):
        Claim("c", "s", "m", "n", "maybe", "r", "src")
    with pytest.raises(ValueError, match="valid names"):
        evaluate_claims(probe({}), ["nope"])
    assert {"rank_two_top2_share", "zero_sum_rank_two", "identity"} <= set(CLAIMS.names())


def test_holm_decides_the_table_and_leaves_checks_apart():
    from grpo_lens.claims.base import holm_claims

    def row(ph, pd, kind="claim"):
        return Claim("c", "s", "m", "n", INCONCLUSIVE, "r", "src", kind=kind, n=16, p_holds=ph, p_dnh=pd)

    rows = [
        row(0.001, 1.0),
        row(1.0, 0.011),
        row(0.02, 1.0),
        row(0.5, 0.5),
        Claim("identity", "all R", "m", "n", HOLDS, "r", "s", kind="check"),
    ]
    out, note = holm_claims(rows)
    # 4 claims -> 8 hypotheses. Sorted: 0.001 <= 0.05/8 = 0.00625 (rejected); 0.011 <= 0.05/7 = 0.00714? no -> stop.
    assert [c.verdict for c in out] == [HOLDS, INCONCLUSIVE, INCONCLUSIVE, INCONCLUSIVE, HOLDS]
    assert "p = 0.001 <= 0.00625" in out[0].rule and "8 one-sided hypotheses" in note
    assert out[4] is rows[4]  # the check passes through
    # alone (0.025 per branch) the third row would hold; under Holm it does not, and its rule says so
    assert "alone" not in out[2].rule and "not decided at family-wise 0.05" in out[2].rule
    assert holm_claims([rows[4]])[1] == ""


def test_rank_over_training_claim_and_the_lens_intervals():
    from grpo_lens.analysis.group import lens_rank_intervals

    def step(i, top2=0.95, top1=0.6, lo=0.93, hi=0.97, groups=12):
        return {
            "step": 5 * i,
            "rank/mixed_groups": groups,
            "rank/g1_top2_share": top2,
            "rank/g1_top1_share": top1,
            "rank/g1_top2_share_lo": lo,
            "rank/g1_top2_share_hi": hi,
            "rank/g1_top1_share_lo": top1 - 0.02,
            "rank/g1_top1_share_hi": top1 + 0.02,
        }

    # 7 lens steps, each with E2 0.95 [0.93, 0.97] (se 0.0102: z = 4.9) and E1 0.6 +- 0.02: every step clears 0.9
    recs = [step(i) for i in range(7)]
    (c,) = CLAIMS.get("rank_stays_near_two")({"records": recs})
    assert c.verdict == HOLDS and "7 lens steps" in c.scope and c.n == 12  # n: the fewest mixed groups of a step
    # one step of 7 with E2 0.80 [0.78, 0.82]: z = -9.8 at that step -> does not hold (the 0.2 rule tested the mean)
    bad = recs[:3] + [step(3, top2=0.8, lo=0.78, hi=0.82)] + recs[4:]
    assert CLAIMS.get("rank_stays_near_two")({"records": bad})[0].verdict == DOES_NOT_HOLD
    # the demo's 4 mixed groups per lens step give no step interval: inconclusive, naming the flag
    few = [{k: v for k, v in step(i, groups=4).items() if not k.endswith(("_lo", "_hi"))} for i in range(7)]
    (c,) = CLAIMS.get("rank_stays_near_two")({"records": few})
    assert c.verdict == INCONCLUSIVE and "--prompts-per-step" in c.advice and "at most 4 mixed groups per" in c.advice
    one = [{k: v for k, v in step(i, groups=1).items() if not k.endswith(("_lo", "_hi"))} for i in range(7)]
    assert "at most 1 mixed group per lens step" in CLAIMS.get("rank_stays_near_two")({"records": one})[0].advice
    assert CLAIMS.get("rank_stays_near_two")({"records": [{"step": 1}]}) == []
    # lens intervals: 1..8 as erank of 8 groups -> the t interval 4.5 -+ 2.36462 sqrt(6/8) (symmetric data); none
    # from 7 groups
    rows = [{"rank/g1_erank": float(i), "rank/g1_top2_share": 0.9} for i in range(1, 9)]
    ci = lens_rank_intervals(rows)
    assert ci["rank/g1_erank_lo"] == pytest.approx(4.5 - 2.36462 * (6 / 8) ** 0.5, abs=2e-3)
    assert ci["rank/g1_top2_share_lo"] == ci["rank/g1_top2_share_hi"] == pytest.approx(0.9)
    assert lens_rank_intervals(rows[:7]) == {}


def test_rank_rule_branches_share_one_structure_boundary():
    # E2 0.95 > 0.9 > E1 0.6 with a small structure excess d = 0.05 (G1 0.95 vs simulated null 0.90). The
    # 0.3 rule's "no structure" route accepted |d| < 0.1 (SE of d ~ 0.0003 here: p ~ 0) and read *does not hold*;
    # with one boundary at d = 0 the same rows clear every holds test (d 0.05 > 0 by ~170 SE) -> holds.
    small = rank_rows(20, top2=0.95, top1=0.6, null_top2=0.90, spread=0.0001)
    (c,) = rank_claim({"4": small, "8": small})
    assert c.verdict == HOLDS and c.p_dnh == 1.0
    # d < 0 (the null holds more energy than G1: no shared structure) is the one "no structure" route
    below = rank_rows(20, top2=0.93, top1=0.6, null_top2=0.95, spread=0.0001)
    (c,) = rank_claim({"4": below, "8": below})
    assert c.verdict == DOES_NOT_HOLD and "no structure (reduction below 0.00)" in c.rule


def test_rank_stays_step_p_is_students_t():
    from grpo_lens.claims.rank import _step_p
    from grpo_lens.formulas.stats import student_t_quantile

    # a step with 12 mixed groups, E2 0.95 and its 95% t interval [0.95 - h, 0.95 + h] where h = t_{.975,11} * se,
    # se chosen so that t = (0.95 - 0.9)/se = 3.5: the one-sided t-test with 11 df gives p = 0.00249 (the normal
    # approximation of the 0.3 rule, se = h / 1.96 -> z = 0.05 / (h / 1.96) = 3.5 * 1.96 / 2.201 = 3.117, gave 0.0009)
    se = 0.05 / 3.5
    h = student_t_quantile(0.975, 11) * se
    row = {
        "rank/mixed_groups": 12,
        "rank/g1_top2_share": 0.95,
        "rank/g1_top2_share_lo": 0.95 - h,
        "rank/g1_top2_share_hi": 0.95 + h,
    }
    assert _step_p(row, "top2_share", "above") == pytest.approx(0.00249, abs=5e-5)
    assert _step_p(row, "top2_share", "below") == pytest.approx(1 - 0.00249, abs=5e-5)


def test_near_two_is_an_equivalence_test_at_every_r():
    from grpo_lens.claims.rank import near_two

    def s(lo, hi):
        return {"mean": (lo + hi) / 2, "lo": lo, "hi": hi, "n": 16}

    # stable rank: [1.6, 2.4] and [1.8, 2.3] inside [1.5, 2.5] at both R -> yes (intersection-union, no penalty)
    both = {"4": s(1.6, 2.4), "8": s(1.8, 2.3)}
    assert near_two(both, both, "stable_rank") == "yes"
    # one R straddles 2.5 -> not yes; the Bonferroni interval at R = 8 [2.6, 3.0] lies above the band -> no at R = 8
    assert (
        near_two({"4": s(1.6, 2.4), "8": s(2.4, 3.1)}, {"4": s(1.5, 2.5), "8": s(2.6, 3.0)}, "erank") == "no at R = 8"
    )
    # straddling without a wholly-outside interval: undecided; E2's band is (0.9, 1]: 0.91 above, 0.95 inside
    assert near_two({"4": s(2.4, 2.6)}, {"4": s(2.3, 2.7)}, "erank") == "undecided"
    assert near_two({"4": s(0.91, 0.95)}, {"4": s(0.905, 0.96)}, "top2_share") == "yes"
    # an R with fewer than 8 groups has no interval: no test
    few = {"4": s(1.6, 2.4), "8": {"mean": 2.0, "lo": None, "hi": None, "n": 5}}
    assert near_two(few, few, "stable_rank") == "no interval"
