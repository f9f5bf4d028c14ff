"""What the claims print where a bare number misled a reader: the identity's control per R (one value, not a range of
equal ends), an exact-zero residual with why, and the sketch's share of ||g||^2 with what it is (an estimate that
can exceed 1)."""

from __future__ import annotations

from grpo_lens.claims.base import CLAIMS, source_of


def identity_control(groups) -> str:
    probe = {
        "meta": {"gradients": "exact", "std": "sample", "eps": 1e-4, "estimator": "grpo"},
        "per_group_size": {"all": {"groups": groups}},
    }
    (claim,) = CLAIMS.get("identity")(probe)
    return claim.control


def group(k: int, R: int) -> dict:
    return {"grad/identity_residual": 1e-8, "group/correct": float(k), "group/size": float(R)}


def test_identity_control_is_one_value_per_group_size():
    # sample std / population std of R 0/1 rewards = sqrt(R / (R - 1)) whatever k, so with eps 1e-4 the other
    # constant's residual is (sigma_s - sigma_p) / (sigma_p + eps): 0.155 at R = 4 (k = 1: (0.5 - 0.4330) / 0.4331 =
    # 0.1547; k = 2: (0.5774 - 0.5) / 0.5001 = 0.1547) and sqrt(2) - 1 = 0.414 at R = 2
    assert identity_control([group(2, 4)]).endswith("would be 0.155 at R = 4 (one group)")
    assert identity_control([group(1, 4), group(2, 4), group(3, 4)]).endswith("would be 0.155 at R = 4 (3 groups)")
    assert identity_control([group(1, 4), group(1, 2)]).endswith(
        "would be 0.414 at R = 2 (one group), 0.155 at R = 4 (one group)"
    )
    assert "–" not in identity_control([group(1, 4), group(2, 4)])  # never "0.155–0.155"


def test_sketch_share_says_it_is_an_estimate():
    meta = {"gradients": "sketch", "sketch_dim": 16, "sketch_coverage": 1.05}
    text = source_of({"meta": meta})
    assert "share of Σ‖g‖² estimated at 1.05" in text and "can exceed 1" in text
    assert "covering 1.05" not in text
    assert "estimate" not in source_of({"meta": {**meta, "sketch_coverage": None}})


def test_identity_residual_of_exactly_zero_says_why():
    # at k = R/2 with matching conventions a_i and c(k, R)'s coefficient are the same float64 number, so e = 0 and the
    # residual is exactly 0: the text says so instead of a bare "0.0e+00"; a non-zero residual keeps its 1-digit form
    probe = {
        "meta": {"gradients": "exact", "std": "sample", "eps": 1e-4, "estimator": "grpo"},
        "per_group_size": {"all": {"groups": [{**group(2, 4), "grad/identity_residual": 0.0}]}},
    }
    (claim,) = CLAIMS.get("identity")(probe)
    assert "0.0e+00" not in claim.rule and claim.rule.startswith("max residual 0 (exact: ")
    assert claim.verdict == "holds"
    (claim,) = CLAIMS.get("identity")({**probe, "per_group_size": {"all": {"groups": [group(2, 4)]}}})
    assert claim.rule == "max residual 1.0e-08 < 1e-04"


def test_a_zero_gradient_has_no_sparsity_to_read():
    # every lens step without reward contrast: the gradient is exactly 0, Hoyer is 0/0 (stored as null); the row says
    # so instead of reading Hoyer 1.000 ("one entry", the old epsilon's value) or vanishing
    records = [
        {"step": s, "perf/lens_seconds": 1.0, "sparsity/grad_zero": 1.0, "sparsity/grad_hoyer": None} for s in (1, 3)
    ]
    (claim,) = CLAIMS.get("sparsity_intensifies")({"records": records})
    assert claim.verdict == "inconclusive" and "exactly zero at every lens step" in claim.measurement


def test_pooled_sparsity_row_shows_the_tested_slope():
    # 3 seeds of 12 lens steps (every step, no LR warm-up logged): Hoyer = 0.5 + b_s · step with b_s = 0.0019, 0.002,
    # 0.0021 per seed, so the seeds' OLS slopes are exactly those (no noise): mean 0.002, SE 0.0001/√3, t = 34.6 on
    # 2 df (holds); the first screen shows that tested number, not the first clause of the measurement
    from grpo_lens.claims.base import primary_text

    runs = [
        [
            {"step": s, "perf/lens_seconds": 1.0, "sparsity/grad_hoyer": 0.5 + b * s, "rank/mixed_groups": 4.0}
            for s in range(1, 13)
        ]
        for b in (0.0019, 0.002, 0.0021)
    ]
    (claim,) = CLAIMS.get("sparsity_intensifies")({"records": runs[0], "seed_runs": runs})
    assert claim.verdict == "holds"
    assert primary_text(claim).startswith("mean OLS slope of the Hoyer over 3 seeds 0.0020 per step (t = 34.64, df 2)")
