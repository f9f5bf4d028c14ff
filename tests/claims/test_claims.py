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


def test_erank_claim_rules():
    below_null = ci(0.5, 0.45, 0.55)
    p = probe({
        "2": {"rank/g1_erank": ci(1.9, 1.85, 1.95), "rank/g1_erank_vs_null": below_null},  # R = 2: cannot fail
        "4": {"rank/g1_erank": ci(2.1, 1.9, 2.3), "rank/g1_erank_vs_null": below_null},  # in band, below null: holds
        "8": {"rank/g1_erank": ci(3.4, 3.1, 3.7), "rank/g1_erank_vs_null": below_null},  # outside the band
        "16": {"rank/g1_erank": ci(2.1, 1.9, 2.3), "rank/g1_erank_vs_null": ci(0.98, 0.9, 1.05)},  # null explains it
        "32": {"rank/g1_erank": ci(2.1, 1.9, 2.3, n=5), "rank/g1_erank_vs_null": below_null},  # too few groups
        "64": {"rank/g1_erank": ci(2.4, 2.2, 2.6), "rank/g1_erank_vs_null": below_null},  # straddles the edge
    })
    assert verdicts("erank_near_two", p) == {"R = 2": INCONCLUSIVE, "R = 4": HOLDS, "R = 8": DOES_NOT_HOLD,
                                              "R = 16": INCONCLUSIVE, "R = 32": INCONCLUSIVE, "R = 64": INCONCLUSIVE}
    claim = {c.scope: c for c in CLAIMS.get("erank_near_two")(p)}["R = 4"]
    assert "2.10 [1.90, 2.30] (n = 16 groups)" in claim.measurement and "0.50 [0.45, 0.55]" in claim.control
    assert claim.source == "exact gradients of every parameter"


def test_zero_sum_claim_rules():
    p = probe({
        "2": {"zero_sum/span_energy_excess": ci(0.0, 0.0, 0.0)},
        "4": {"zero_sum/span_energy_excess": ci(0.08, 0.03, 0.12)},  # above 0: holds
        "8": {"zero_sum/span_energy_excess": ci(-0.05, -0.09, -0.01)},  # below the negligible share: does not hold
        "16": {"zero_sum/span_energy_excess": ci(0.01, -0.03, 0.06)},  # includes 0 and 0.06: inconclusive
    }, gradients="sketch")
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
    # no difference beyond +-0.05: inside the 0.25 equivalence margin -> does not hold
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
