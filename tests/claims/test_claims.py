"""The claims section's verdicts follow their documented rules (docs/theory.md §11) on hand-made probe numbers."""

from __future__ import annotations

import pytest

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
    return {"meta": {"gradients": gradients, "sketch_dim": 16, "std": "sample", "eps": 1e-4, "estimator": estimator},
            "per_group_size": {r: {"summary": s, "groups": groups or []} for r, s in per_r.items()}}


def verdicts(name, p):
    return {c.scope: c.verdict for c in CLAIMS.get(name)(p)}


def test_band_verdict():
    assert band_verdict(1.6, 2.4, 1.5, 2.5) == HOLDS
    assert band_verdict(2.6, 3.0, 1.5, 2.5) == DOES_NOT_HOLD and band_verdict(0.9, 1.4, 1.5, 2.5) == DOES_NOT_HOLD
    assert band_verdict(2.2, 2.8, 1.5, 2.5) == INCONCLUSIVE and band_verdict(None, None, 1.5, 2.5) == INCONCLUSIVE


def rank_rows(n, top2, top1, null_top2, erank, null_erank, sr, null_sr, spread=0.01):
    # n groups with the given G1 and orthogonal-null measures, spread symmetrically (+-spread * (i - (n-1)/2))
    out = []
    for i in range(n):
        e = spread * (i - (n - 1) / 2)
        out.append({"rank/g1_top2_share": top2 + e / 10, "rank/g1_top1_share": top1 + e / 10,
                    "rank/g1_null_top2_share": null_top2, "rank/g1_erank": erank + e, "rank/g1_null_erank": null_erank,
                    "rank/g1_stable_rank": sr + e, "rank/g1_null_stable_rank": null_sr})
    return out


def rank_verdicts(groups_by_r):
    p = {"meta": {"gradients": "exact"},
         "per_group_size": {r: {"summary": {}, "groups": g} for r, g in groups_by_r.items()}}
    names = {"top-2": "top-2 energy share", "entropy": "entropy effective rank", "stable": "stable rank"}
    return {(c.scope, next(k for k, v in names.items() if v in c.claim)): c.verdict
            for c in CLAIMS.get("erank_near_two")(p)}


def test_rank_claim_rules_per_measure():
    planted = rank_rows(12, top2=0.97, top1=0.65, null_top2=0.75, erank=2.1, null_erank=3.6, sr=1.6, null_sr=2.1)
    v = rank_verdicts({"2": planted, "4": planted})
    # R = 2 cannot fail; R = 4: top-2 in (0.9, 1] with top-1 < 0.9, erank and stable rank in [1.5, 2.5], every
    # reduction (0.22, 1.5, 0.5) above 0 with a tight interval -> holds under each measure
    assert {m: v[("R = 2", m)] for m in ("top-2", "entropy", "stable")} == dict.fromkeys(
        ("top-2", "entropy", "stable"), INCONCLUSIVE)
    assert {m: v[("R = 4", m)] for m in ("top-2", "entropy", "stable")} == dict.fromkeys(
        ("top-2", "entropy", "stable"), HOLDS)
    # no structure but spread norms: erank 2.2 inside the band, the same as the null's (reduction 0 within +-0.5):
    # today's ratio rule said holds (ratio just below 1); now does not hold under every measure
    flat = rank_rows(12, top2=0.93, top1=0.8, null_top2=0.93, erank=2.2, null_erank=2.2, sr=1.7, null_sr=1.7)
    v = rank_verdicts({"4": flat})
    assert set(v.values()) == {DOES_NOT_HOLD}
    # the top-2 margin 1 - 0.9 is 0.09999999999999998 in floats: the rule text prints it through fmt
    texts = [c.rule + c.control for c in CLAIMS.get("erank_near_two")(
        {"meta": {"gradients": "exact"}, "per_group_size": {"4": {"summary": {}, "groups": flat}}})]
    assert any("inside ±0.10 " in t for t in texts) and not any("999999" in t for t in texts)
    # effectively rank 1: top-1 share 0.97 > 0.9 -> k90 = 1, does not hold (erank 1.9 would read "≈ 2")
    one = rank_rows(12, top2=0.99, top1=0.97, null_top2=0.75, erank=1.9, null_erank=3.6, sr=1.03, null_sr=2.1)
    v = rank_verdicts({"4": one})
    assert v[("R = 4", "top-2")] == DOES_NOT_HOLD and v[("R = 4", "entropy")] == HOLDS
    assert v[("R = 4", "stable")] == DOES_NOT_HOLD  # 1.03 < 1.5
    # 5 groups: too few for an interval; a wide spread straddling 2.5: inconclusive
    assert set(rank_verdicts({"4": planted[:5]}).values()) == {INCONCLUSIVE}
    wide = rank_rows(12, top2=0.97, top1=0.65, null_top2=0.75, erank=2.45, null_erank=3.6, sr=1.6, null_sr=2.1,
                     spread=0.1)
    assert rank_verdicts({"4": wide})[("R = 4", "entropy")] == INCONCLUSIVE


def test_zero_sum_claim_rules():
    def rows(n, excess, null, var, spread=0.0):
        return [{"zero_sum/span_energy_excess": excess + spread * (i - (n - 1) / 2), "zero_sum/span_energy_null": null,
                 "zero_sum/span_energy_null_var": var, "zero_sum/span_energy": null + excess} for i in range(n)]

    p = probe({"2": {}, "4": {}, "8": {}, "16": {}}, gradients="sketch")
    per = p["per_group_size"]
    per["2"]["groups"] = rows(10, 0.0, 1.0, 0.0)
    # 10 groups, excess 0.05 each, null variance 0.0004: z = 0.5 / sqrt(0.004) = 7.9, p ~ 1e-15 -> holds
    per["4"]["groups"] = rows(10, 0.05, 0.5, 0.0004)
    # excess 0 +- 0.0005, null span energy 0.5: theta = 0 with an interval of about +-0.0007 < 0.1 -> does not hold
    per["8"]["groups"] = rows(10, 0.0, 0.5, 0.0004, spread=0.0001)
    # excess 0.005 with room 1 - 0.95 = 0.05: z = 0.05 / sqrt(10 * 0.0004) = 0.79 (p 0.21); theta = 0.1 -> inconclusive
    per["16"]["groups"] = rows(10, 0.005, 0.95, 0.0004, spread=0.001)
    assert verdicts("zero_sum_rank_two", p) == {"R = 2": INCONCLUSIVE, "R = 4": HOLDS, "R = 8": DOES_NOT_HOLD,
                                                "R = 16": INCONCLUSIVE}
    assert all("not exact" in c.source for c in CLAIMS.get("zero_sum_rank_two")(p))


def test_identity_claim_rules():
    groups = [{"grad/identity_residual": 3e-8, "group/correct": 1.0, "group/size": 4.0},
              {"grad/identity_residual": 1e-7, "group/correct": 2.0, "group/size": 4.0}]
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

    # A gives a rank lower by 1.5-2.5 in 10 groups: interval below 0 -> holds
    assert claim([row(2.0, 3.5 + 0.1 * i) for i in range(10)]).verdict == HOLDS
    # no difference beyond +-0.05 of 2.0 (+-2.5%): inside the 10% relative equivalence margin -> does not hold
    assert claim([row(2.0, 2.0 + 0.01 * (i - 5)) for i in range(10)]).verdict == DOES_NOT_HOLD
    # one group only -> inconclusive, and the rule says how to get more
    c = claim([row(2.0, 3.5)])
    assert c.verdict == INCONCLUSIVE and "--g2-groups" in c.rule


def test_claim_records_are_checked_and_listed():
    with pytest.raises(ValueError, match="verdict"):
        Claim("c", "s", "m", "n", "maybe", "r", "src")
    with pytest.raises(ValueError, match="valid names"):
        evaluate_claims(probe({}), ["nope"])
    assert {"erank_near_two", "zero_sum_rank_two", "identity"} <= set(CLAIMS.names())


def test_family_wise_note_counts_the_rows_with_a_test():
    from grpo_lens.claims.base import family_wise_note

    rows = [Claim("c", "R = 4", "m", "n", HOLDS, "r", "s"), Claim("c", "R = 8", "m", "n", INCONCLUSIVE, "r", "s"),
            Claim("c", "R = 2", "m", "n", INCONCLUSIVE, "r", "s"),  # inconclusive by construction: no test
            Claim("the group update is ... (the rank-2 identity)", "all R", "m", "n", HOLDS, "r", "s")]
    # 2 tested rows (1 decided): bound 2 x 0.025 = 0.05; family-wise per-branch level 0.05 / 2 = 0.025
    note = family_wise_note(rows)
    assert "2 rows carry a test (1 decided)" in note and "= 0.05 (Bonferroni" in note and "0.0250 per branch" in note
    assert family_wise_note(rows[2:]) == ""


def test_rank_over_training_claim_and_the_lens_intervals():
    from grpo_lens.analysis.group import lens_rank_intervals

    # 8 lens steps with top-2 share 0.95 +- 0.01 and top-1 0.6: both intervals clear 0.9 -> holds
    recs = [{"step": 5 * i, "rank/g1_top2_share": 0.95 + 0.01 * (-1) ** i, "rank/g1_top1_share": 0.6,
             "rank/g1_erank": 2.0} for i in range(8)]
    (c,) = CLAIMS.get("rank_stays_near_two")({"records": recs})
    assert c.verdict == HOLDS and "8 lens steps" in c.scope
    # the top direction alone holds 0.95: effectively rank 1 -> does not hold; 7 lens steps: inconclusive
    one = [dict(r, **{"rank/g1_top1_share": 0.95, "rank/g1_top2_share": 0.99}) for r in recs]
    assert CLAIMS.get("rank_stays_near_two")({"records": one})[0].verdict == DOES_NOT_HOLD
    assert CLAIMS.get("rank_stays_near_two")({"records": recs[:7]})[0].verdict == INCONCLUSIVE
    assert CLAIMS.get("rank_stays_near_two")({"records": [{"step": 1}]}) == []
    # lens intervals: 1..8 as erank of 8 groups -> the t interval 4.5 -+ 2.36462 sqrt(6/8) (symmetric data); none
    # from 7 groups
    rows = [{"rank/g1_erank": float(i), "rank/g1_top2_share": 0.9} for i in range(1, 9)]
    ci = lens_rank_intervals(rows)
    assert ci["rank/g1_erank_lo"] == pytest.approx(4.5 - 2.36462 * (6 / 8) ** 0.5, abs=2e-3)
    assert ci["rank/g1_top2_share_lo"] == ci["rank/g1_top2_share_hi"] == pytest.approx(0.9)
    assert lens_rank_intervals(rows[:7]) == {}
