"""`grpo-lens calibrate`: planted groups through the product's path, and the quick run's table."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_lens.claims.calibrate import (
    CREDIT_TOKEN_FAMILIES,
    CalibrationConfig,
    _credit_token_truth,
    credit_token_pool,
    planted_credit_group,
    planted_group,
    render,
    run_calibration,
)
from grpo_lens.formulas.spectrum import gram_singular_values, top2_share


def test_planted_groups_have_their_structure():
    gen = torch.Generator().manual_seed(0)
    # a0.001: exact rank 2 plus 0.1% noise: the Gram's top two eigen-directions hold > 0.99 of its energy
    gram, rewards = planted_group("a0.001", 8, 2048, gen)
    assert gram.shape == (8, 8) and 1 <= int(rewards.sum()) <= 7
    assert top2_share(gram_singular_values(gram)) > 0.99
    # b0: random directions in R^2048, unit expected norms: off-diagonal cosines ~ N(0, 1/2048), |cos| < 0.15
    gram, _ = planted_group("b0", 8, 2048, gen)
    d = gram.diagonal().sqrt()
    cos = gram / torch.outer(d, d) - torch.eye(8, dtype=torch.float64)
    assert float(cos.abs().max()) < 0.15 and float(d.square().mean()) == pytest.approx(1.0, abs=0.15)
    # c_shared: pairwise cosine 0.5 (half of each row's energy in the shared direction)
    gram, _ = planted_group("c_shared", 8, 2048, gen)
    d = gram.diagonal().sqrt()
    off = (gram / torch.outer(d, d))[~torch.eye(8, dtype=torch.bool)]
    assert float(off.mean()) == pytest.approx(0.5, abs=0.05)
    with pytest.raises(ValueError, match="valid"):
        planted_group("zz", 4, 64, gen)


def test_planted_credit_groups_have_their_classes_and_truth():
    gen = torch.Generator().manual_seed(0)
    grads, classes, rewards, mask = planted_credit_group("credit concentrates on answers, e = 1", 4, 64, gen)
    assert grads.shape == (4, 24, 64) and classes.shape == mask.shape == (4, 24)
    lengths = mask.sum(-1)
    assert bool(((10 <= lengths) & (lengths <= 24)).all()) and 1 <= int(rewards.sum()) <= 3
    assert bool((classes[~mask] == -1).all()) and bool((grads[~mask] == 0).all())
    for i, n in enumerate(lengths.tolist()):
        assert classes[i, n - 1] == 1 and 1 <= int((classes[i] == 0).sum()) <= 3  # EOS closes; 1-3 answer tokens
        assert classes[i, n - 2] == 0  # the answer tokens stand right before it
    # e = 1: every answer token holds e σ_i v plus its noise, so correct and wrong rollouts' answer tokens point
    # opposite ways along v: cos(mean correct answer gradient, mean wrong one) near -1/(1 + 1/n) < -0.3
    ans = classes == 0
    right = grads[(rewards == 1)[:, None] & ans].mean(0)
    wrong = grads[(rewards == 0)[:, None] & ans].mean(0)
    assert float(torch.nn.functional.cosine_similarity(right, wrong, dim=0)) < -0.3
    with pytest.raises(ValueError, match="valid"):
        planted_credit_group("zz", 4, 64, gen)
    # the stated truths on the pool means (dimension 128 here for speed, 300 groups): geometry only and the near-null
    # e = 0.25 inside every class's band, e = 0.5 and 1 outside
    want = {"geometry only: equal norms": "true", "geometry only: format 10× smaller": "true",
            "geometry only: format 10× smaller, answer 3× larger": "true",
            "credit concentrates on answers, e = 0.25": "true", "credit concentrates on answers, e = 0.5": "false",
            "credit concentrates on answers, e = 1": "false"}
    assert set(want) == set(CREDIT_TOKEN_FAMILIES)
    got = {fam: _credit_token_truth(credit_token_pool(fam, 4, 300, 128, 1))[0] for fam in want}
    assert got == want


def test_quick_calibration_separates_the_planted_cases(tmp_path):
    res = run_calibration(CalibrationConfig.quick(), tmp_path, mode="quick", log=lambda s: None)
    assert (tmp_path / "calibration.md").read_text() == render(res)
    rows = {(r["rule"], r["family"], r["n"]): r for r in res["group_rules"]}
    # planted rank 2 at R = 4 (a0.01): the top-2 rule holds; no structure with spread norms (b2): every measure's
    # rule says does not hold; near-collinear class means (d0.95_0.01, effectively rank 1): top-2 does not hold
    assert rows[("rank ≈ 2 (top2_share)", "a0.01", 28)]["holds"] >= 0.9
    assert all(rows[(f"rank ≈ 2 ({m})", "b2", 28)]["does_not_hold"] >= 0.9
               for m in ("top2_share", "erank", "stable_rank"))
    assert rows[("rank ≈ 2 (top2_share)", "d0.95_0.01", 28)]["does_not_hold"] >= 0.9
    # the relabelling test: label-dependent rows hold, label-free rows almost never do
    assert rows[("labels structure G1 (zero-sum, G1)", "a0.01", 28)]["holds"] >= 0.9
    assert rows[("labels structure G1 (zero-sum, G1)", "b1", 28)]["holds"] <= 0.15
    # the 0.1 sparsity rule (update Hoyer) says "holds" for stationary Gaussian gradients; the gradient rule does not
    train = {(r["rule"], r["family"]): r for r in res["training_rules"]}
    old = train[("0.1 rule: trend of the update's Hoyer (for comparison)", "gaussian gradients under AdamW")]
    new = train[("gradient sparsity intensifies", "gaussian gradients under AdamW")]
    assert old["holds"] >= 0.5 and new["holds"] <= 0.15
    assert train[("gradient sparsity intensifies", "rising gradients under AdamW")]["holds"] >= 0.9
    # "most parameters unchanged" through the lens: a dense update with log-normal per-entry scale (the false
    # holds under the dense control) never holds, and its bf16 share matches the permutation control, not the dense
    # one; a 90%-zero update holds
    s4 = {r["family"]: r for r in res["update_rules"]}
    dense = s4["dense, log-normal scale (σ = 2)"]
    assert dense["truth"] == "false" and dense["holds"] == 0.0 and dense["does_not_hold"] >= 0.9
    assert abs(dense["bf16_unchanged"] - dense["bf16_permuted"]) < 0.01 < dense["bf16_unchanged"] - dense["bf16_dense"]
    sparse = s4["90% zeros, the rest moving bf16"]
    assert sparse["truth"] == "true" and sparse["holds"] >= 0.9
    # Monte Carlo credit: a planted opposing segment (one in four, by 0.6) holds at 100 rollouts
    mc = {(r["family"], r["n"]): r for r in res["credit_rules"]}
    assert mc[("one segment in four opposes A_i by 0.6", "100 rollouts (400 segments)")]["holds"] >= 0.9
    # token credit: the planted answer-credit effect e = 1 never holds and reads does not hold in most trials at the
    # probe's 8 groups; geometry only (format tokens 10x smaller) rarely reads does not hold
    tok = {r["family"]: r for r in res["credit_token_rules"]}
    assert set(tok) == {"geometry only: format 10× smaller", "credit concentrates on answers, e = 1"}
    assert tok["credit concentrates on answers, e = 1"]["holds"] == 0.0
    assert tok["credit concentrates on answers, e = 1"]["does_not_hold"] >= 0.5
    assert tok["geometry only: format 10× smaller"]["does_not_hold"] <= 0.15
    assert "| credit concentrates on answers, e = 1 | 4 | 8 groups | false |" in render(res)
    # baseline study: a clear m_C != m_W (correct rollouts' noise 2x) never reads holds
    base = {r["family"]: r for r in res["baseline_rules"]}
    assert base["correct rollouts' noise 2× (m_C = 3.4 m_W)"]["holds"] == 0.0
    # coverage rows: 3 data sets x 3 n, each a share
    assert len(res["coverage"]) == 9 and all(0 <= r["coverage"] <= 1 for r in res["coverage"])
    assert math.isfinite(res["meta"]["seconds"]) and "Summary" in render(res)


@pytest.mark.e2e
def test_calibrate_command_quick(tmp_path, capsys):
    from grpo_lens.cli import main

    assert main(["calibrate", "--quick", "--out", str(tmp_path / "cal")]) == 0
    assert "calibration written to" in capsys.readouterr().out
    assert (tmp_path / "cal" / "calibration.json").exists()
