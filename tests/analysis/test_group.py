"""The one per-group analysis path (grpo_lens.diagnostics.group) and the aggregation over groups (stats).

Closed-form expectations are derived next to each assert: the identity's constant per estimator, the orthogonal null
(G1 with orthogonal rows IS the null), permutation p-values (valid under exchangeable gradients, tiny for planted
clusters), bootstrap coverage.
"""

from __future__ import annotations

import math

import pytest
import torch
from references import gram_of

from grpo_lens.analysis.group import analyse_group, mean_over_groups
from grpo_lens.formulas.advantages import compute_advantages
from grpo_lens.formulas.identity import identity_constant, rank2_residual
from grpo_lens.formulas.spectrum import RANK_MEASURES, top_singular_value
from grpo_lens.formulas.stats import (
    mean_interval,
    stratify_rows,
    student_t_quantile,
    summarise_rows,
)
from grpo_lens.formulas.zero_sum import cosine_gap, span_energy, zero_sum_tests
from grpo_lens.gradients.g2 import g2_by_type_keys


def _group(R=6, k=2, P=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    grads = torch.randn(R, P, generator=gen, dtype=torch.float64)
    rewards = torch.zeros(R, dtype=torch.float64)
    rewards[:k] = 1.0
    return grads, rewards


@pytest.mark.parametrize(
    "estimator,std,eps",
    [
        ("grpo", "sample", 1e-4),
        ("grpo", "population", 1e-4),
        ("grpo", "sample", 0.3),
        ("grpo", "population", 0.3),
        ("dr_grpo", "sample", 1e-4),
        ("rloo", "sample", 1e-4),
    ],
)
def test_identity_uses_each_estimators_own_constant(estimator, std, eps):
    # sum_i A_i g_i = c (gbar_C - gbar_W) exactly for the estimator's own c (docs/theory.md §4): residual ~1e-16
    for R, k in ((2, 1), (4, 1), (5, 3), (8, 4)):
        grads, rewards = _group(R, k)
        adv = compute_advantages(rewards.view(1, R), estimator, std=std, std_eps=eps)[0]
        row = analyse_group(gram_of(grads), rewards, adv, estimator=estimator, std=std, std_eps=eps)
        assert row["grad/identity_residual"] < 1e-12, (R, k)
        # the constant: k A_C (A_C = the correct rollouts' advantage)
        assert row["grad/identity_constant"] == pytest.approx(k * float(adv[0]), rel=1e-12)


def test_identity_constants_in_closed_form():
    # R = 4, k = 1: p = 1/4; dr_grpo c = k(R-k)/R = 3/4; rloo c = k(R-k)/(R-1) = 1;
    # grpo population (eps = 0) c = sqrt(k(R-k)) = sqrt(3); sample c = sqrt(k(R-k)(R-1)/R) = sqrt(9/4) = 1.5
    assert identity_constant("dr_grpo", 1, 4) == pytest.approx(0.75)
    assert identity_constant("rloo", 1, 4) == pytest.approx(1.0)
    assert identity_constant("grpo", 1, 4, "population", 0.0) == pytest.approx(math.sqrt(3))
    assert identity_constant("grpo", 1, 4, "sample", 0.0) == pytest.approx(1.5)
    assert identity_constant("reinforce", 1, 4) is None and identity_constant("optimal", 1, 4) is None


def test_a_mismatched_constant_leaves_the_predicted_residual():
    # GRPO advantages (sample std) checked with dr_grpo's constant: the residual is |1 - c_dr / c_grpo| exactly
    # (both sides are multiples of gbar_C - gbar_W); R = 4, k = 1, eps -> 0: 1 - 0.75 / 1.5 = 0.5
    grads, rewards = _group(4, 1)
    adv = compute_advantages(rewards.view(1, 4), "grpo", std_eps=1e-12)[0]
    rho = rank2_residual(grads, rewards, advantages=adv, estimator="dr_grpo")
    assert rho == pytest.approx(0.5, rel=1e-9)


def test_identity_absent_where_it_does_not_apply():
    grads, rewards = _group(6, 2)
    # reinforce: A = r, sum_i A_i g_i = k gbar_C, no contrast -> no residual
    adv = compute_advantages(rewards.view(1, 6), "reinforce")[0]
    assert "grad/identity_residual" not in analyse_group(gram_of(grads), rewards, adv, estimator="reinforce")
    # optimal: leave-one-out b* differs per rollout -> advantages not two-valued -> no residual
    norms = grads.square().sum(-1).view(1, 6)
    adv = compute_advantages(rewards.view(1, 6), "optimal", grad_sq_norms=norms)[0]
    assert "grad/identity_residual" not in analyse_group(gram_of(grads), rewards, adv, estimator="optimal")
    # mask_truncated: one correct rollout's advantage zeroed after the estimator -> not two-valued
    adv = compute_advantages(rewards.view(1, 6), "grpo")[0].clone()
    adv[0] = 0.0
    row = analyse_group(gram_of(grads), rewards, adv, estimator="grpo")
    assert "grad/identity_residual" not in row and "zero_sum/span_energy" not in row
    # non-binary rewards: no k, no identity, no baseline split
    row = analyse_group(
        gram_of(grads),
        torch.tensor([0.0, 0.5, 1.0, 0.2, 0.3, 0.9], dtype=torch.float64),
        torch.linspace(-1, 1, 6, dtype=torch.float64),
    )
    assert "group/correct" not in row and "grad/identity_residual" not in row and "rank/g1_erank" in row


def test_orthogonal_rows_match_the_null_exactly():
    # rows g_i = n_i e_i are orthogonal: G1's singular values are |A_i| n_i, which is the null's definition
    R = 5
    norms = torch.tensor([1.0, 2.0, 0.5, 3.0, 1.5], dtype=torch.float64)
    grads = torch.zeros(R, 7, dtype=torch.float64)
    grads[range(R), range(R)] = norms
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    adv = compute_advantages(rewards.view(1, R), "grpo")[0]
    row = analyse_group(gram_of(grads), rewards, adv)
    for m in RANK_MEASURES.names():
        assert row[f"rank/g1_{m}"] == pytest.approx(row[f"rank/g1_null_{m}"], rel=1e-12), m
        assert row[f"rank/g1_{m}_vs_null"] == pytest.approx(1.0, rel=1e-12), m
    # and for identical rows the null is unchanged while G1 collapses to rank 1 (erank 1, ratio < 1)
    same = torch.ones(R, 7, dtype=torch.float64)
    row = analyse_group(gram_of(same), rewards, adv)
    assert row["rank/g1_erank"] == pytest.approx(1.0) and row["rank/g1_erank_vs_null"] < 0.6


def test_span_energy_and_cosine_gap_closed_form():
    # g = (e1, e1, e2, e2): classes {0,1} and {2,3}; gbar_C = e1, gbar_W = e2 hold every row -> share 1.
    # cosines: within pairs 1, between pairs 0 -> gap 1
    g = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]], dtype=torch.float64)
    labels = torch.tensor([True, True, False, False])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    gram = g @ g.T
    assert span_energy(gram, labels, adv) == pytest.approx(1.0)
    assert cosine_gap(gram, labels) == pytest.approx(1.0)
    # relabelled {0, 2}: gbar_C = (e1 + e2)/2 = gbar_W -> a 1-D span along (1, 1)/sqrt 2 holding half of each row
    assert span_energy(gram, torch.tensor([True, False, True, False]), adv) == pytest.approx(0.5)
    # within pairs (0,2), (1,3): cos 0; between (0,1), (2,3): 1, (0,3), (1,2): 0 -> 0 - 1/2 = -0.5
    assert cosine_gap(gram, torch.tensor([True, False, True, False])) == pytest.approx(-0.5)


def test_permutation_p_value_is_uniform_under_the_null():
    # labels independent of the gradients (iid Gaussian rows): every relabelling with k fixed is exchangeable, so the
    # exact test (all C(8, 4) = 70 labellings) has P(p <= a) <= a, and ~= a up to the 1/70 grid.
    trials = 300
    ps = {"span_energy": [], "cos_gap": []}
    for t in range(trials):
        grads, rewards = _group(8, 4, P=30, seed=1000 + t)
        adv = compute_advantages(rewards.view(1, 8), "grpo")[0]
        row = zero_sum_tests(grads @ grads.T, rewards, adv)
        for name in ps:
            ps[name].append(row[f"zero_sum/{name}_p"])
    for name, values in ps.items():
        v = torch.tensor(values)
        for a in (0.1, 0.25, 0.5, 0.75):
            frac = float((v <= a).double().mean())
            # binomial sd sqrt(a(1-a)/300) <= 0.029; 3.5 sd plus the 1/70 grid
            assert abs(frac - a) <= 3.5 * math.sqrt(a * (1 - a) / trials) + 1 / 70, (name, a, frac)


def test_permutation_p_value_small_for_planted_clusters():
    # correct rows = mu_C + noise, wrong rows = mu_W + noise, ||mu|| >> noise: the true labels put all energy in the
    # span and make within-class cosines ~1, between ~cos(mu_C, mu_W) ~ 0; no random relabelling of 12 choose 6
    # comes close, so p = 1 / (1 + 256) (random relabellings) < 0.01.
    gen = torch.Generator().manual_seed(3)
    R, k, P = 12, 6, 50
    mu_c, mu_w = (
        5 * torch.randn(P, generator=gen, dtype=torch.float64),
        5 * torch.randn(P, generator=gen, dtype=torch.float64),
    )
    rewards = torch.tensor([1.0] * k + [0.0] * (R - k), dtype=torch.float64)
    grads = torch.where(rewards.bool().unsqueeze(1), mu_c, mu_w) + 0.3 * torch.randn(
        R, P, generator=gen, dtype=torch.float64
    )
    adv = compute_advantages(rewards.view(1, R), "grpo")[0]
    row = analyse_group(gram_of(grads), rewards, adv)
    assert row["zero_sum/span_energy_p"] < 0.01 and row["zero_sum/cos_gap_p"] < 0.01
    assert row["zero_sum/span_energy"] > 0.99 > row["zero_sum/span_energy_null"]


def test_bootstrap_interval_covers_a_known_mean():
    # the 95% interval over n = 24 draws: covers the true mean in >= 90% of 400 synthetic trials
    gen = torch.Generator().manual_seed(0)
    for sampler, true_mean in (
        (lambda: 2.0 + torch.randn(24, generator=gen, dtype=torch.float64), 2.0),
        (lambda: torch.rand(24, generator=gen, dtype=torch.float64), 0.5),
    ):
        hits = 0
        for _ in range(400):
            ci = mean_interval(sampler().tolist())
            hits += ci["lo"] <= true_mean <= ci["hi"]
        assert hits / 400 >= 0.90, hits / 400


def test_bootstrap_edge_cases_and_summaries():
    assert mean_interval([]) == {"mean": None, "lo": None, "hi": None, "n": 0}
    assert mean_interval([3.0, float("nan"), None]) == {"mean": 3.0, "lo": None, "hi": None, "n": 1}
    # a right-skewed sample: the interval reaches further up than down (Hall's t widens the long tail's side)
    ci = mean_interval([0.5, 0.52, 2.78, 0.6, 0.7, 0.55, 0.65, 0.5])
    assert ci["lo"] <= ci["mean"] <= ci["hi"] and ci["hi"] - ci["mean"] > 2 * (ci["mean"] - ci["lo"])
    # Student t quantiles: exact 12.706 (df 1), 4.303 (df 2); 2.228 (df 10), 2.069 (df 23) to 1e-3
    for df, want in ((1, 12.7062), (2, 4.3027), (10, 2.2281), (23, 2.0687)):
        assert student_t_quantile(0.975, df) == pytest.approx(want, abs=1e-3)
    with pytest.raises(ValueError, match="level"):
        mean_interval([1.0, 2.0], level=1.5)
    rows = [{"a": 1.0, "group/correct": 1.0}, {"a": 3.0, "group/correct": 1.0}, {"a": 10.0, "group/correct": 2.0}]
    s = summarise_rows(rows)
    assert s["a"]["mean"] == pytest.approx(14 / 3) and s["a"]["n"] == 3
    strata = stratify_rows(rows, "group/correct")
    assert strata["1"]["a"]["mean"] == pytest.approx(2.0) and strata["2"]["a"]["n"] == 1


def test_mean_over_groups_is_the_lens_aggregate():
    rows = [
        {"rank/g1_erank": 2.0, "grad/identity_residual": 1e-9},
        {"rank/g1_erank": 3.0, "grad/identity_residual": 1e-7},
    ]
    agg = mean_over_groups(rows)
    assert agg == {"rank/g1_erank": 2.5, "grad/identity_residual": 1e-7}  # mean; max for the residual


def test_g2_stable_rank_by_type_uses_an_accurate_top_singular_value():
    # power iteration's s_1 against the SVD for a decaying spectrum and a flat one; stable rank = ||M||_F^2 / s_1^2
    gen = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(40, 10, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(30, 10, generator=gen, dtype=torch.float64))
    for sv in (torch.tensor([5.0, 3.0, 1.0] + [0.1] * 7, dtype=torch.float64), torch.ones(10, dtype=torch.float64)):
        m = (u * sv) @ v.T
        assert top_singular_value(m) == pytest.approx(float(sv.max()), rel=1e-6)
    m = (u * torch.tensor([5.0, 3.0, 1.0] + [0.1] * 7, dtype=torch.float64)) @ v.T
    keys = g2_by_type_keys(
        {
            "model.layers.0.mlp.down_proj": m,
            "model.layers.1.mlp.down_proj": 2 * m,
            "model.layers.0.self_attn.q_proj": u[:, :1] @ v[:, :1].T,
        },
        "adv",
    )
    # (25 + 9 + 1 + 7 * 0.01) / 25 = 1.4028 for both down_proj layers (scale-free); a rank-one q_proj has 1
    assert keys == {
        "rank/g2_adv_down_proj_stable_rank": pytest.approx(35.07 / 25),
        "rank/g2_adv_q_proj_stable_rank": pytest.approx(1.0),
    }


def test_one_rule_for_the_fewest_units_of_an_interval():
    from grpo_lens.claims import base as claims
    from grpo_lens.claims import credit as claims_credit
    from grpo_lens.formulas import stats

    # one constant: mean_interval (probe.json summaries, strata, the studies) and the claims' minimum
    assert stats.MIN_INTERVAL_UNITS == 8
    assert claims_credit.MIN_UNITS is stats.MIN_INTERVAL_UNITS and claims.MIN_GROUPS == stats.MIN_INTERVAL_UNITS
    # the new-user report: erank(G1) 3.45 [3.35, 3.55] from n = 2 groups -> no interval now, at n = 2 .. 7
    for n in range(2, 8):
        ci = mean_interval([3.35, 3.55] * (n // 2) + [3.45] * (n % 2))
        assert ci["lo"] is None and ci["hi"] is None and ci["n"] == n and ci["mean"] == pytest.approx(3.45)
        assert stats.mean_interval([0.1, 0.3] * (n // 2) + [0.2] * (n % 2))["lo"] is None
    assert mean_interval([3.35, 3.55] * 4)["lo"] is not None
    # per-R summaries and strata follow it: 2 rows of stratum "1" give no interval, 8 rows do
    rows = [{"a": float(i), "group/correct": 1.0} for i in range(2)] + [
        {"a": float(i), "group/correct": 2.0} for i in range(8)
    ]
    strata = stratify_rows(rows, "group/correct")
    assert strata["1"]["a"]["lo"] is None and strata["2"]["a"]["lo"] is not None
    # and the text says so instead of printing a collapsed interval
    from grpo_lens.report import _ci as report_ci

    assert report_ci({"mean": 3.45, "lo": None, "hi": None, "n": 2}) == "3.45 (n = 2)†"  # † said once per report
