"""Baselines at matched expectation on synthetic pools with a planted optimum (known m_C, m_W, E[h])."""

import math

import pytest
import torch

from grpo_lens.formulas.baselines import (
    _group_coefficients,
    _group_estimates,
    baseline_study,
    equal_norms_test,
    estimate_moments,
    mean_score_norm,
    optimal_constant_baseline,
    prompt_baseline_study,
)


def pool(
    m_c: float,
    m_w: float,
    p: float = 0.5,
    m: int = 512,
    k: int = 64,
    shift: float = 0.0,
    seed: int = 0,
    signal: float = 0.0,
):
    """M rollouts: r ~ Bernoulli(p) (exactly p*M correct), h = sqrt(m_r) u with u uniform on the unit sphere
    (E[h] = 0, ||h||^2 = m_r exactly), plus ``signal`` * e_0 on correct rollouts (a true gradient direction) and
    ``shift`` * e_1 on every rollout (a non-zero mean score)."""
    g = torch.Generator().manual_seed(seed)
    r = (torch.randperm(m, generator=g) < round(p * m)).double()  # exactly p*M correct, in random order
    u = torch.randn(m, k, generator=g, dtype=torch.float64)
    u = u / u.norm(dim=1, keepdim=True)
    h = u * torch.where(r == 1, math.sqrt(m_c), math.sqrt(m_w)).unsqueeze(1)
    h[:, 0] += signal * r
    h[:, 1] += shift
    return h, r


def test_planted_optimum_is_recovered():
    # m_C = 9, m_W = 1, p = 1/2: b* = p m_C / (p m_C + (1-p) m_W) = 0.9 (Greensmith et al. 2004, Thm 13).
    h, r = pool(9.0, 1.0)
    assert optimal_constant_baseline(h, r)["b_star"] == pytest.approx(0.9, abs=1e-12)  # ||h||^2 exact by design
    # the constant baseline with the smallest resampled variance is the planted one: Var(b) is proportional to
    # p m_C (1-b)^2 + (1-p) m_W b^2 (cross terms vanish for independent directions), minimised at b = 0.9; on a
    # grid of 0.05 the empirical minimiser must be within one grid step.
    R, S = 8, 3000
    idx = torch.rand(S, 256, generator=torch.Generator().manual_seed(1)).argsort(-1)[:, :R]
    grid = [i / 20 for i in range(21)]
    var = [
        float(
            (lambda e: (e - e.mean(0)).square().sum(-1).mean())(
                _group_estimates(h[:256], r[:256], idx, "optimal_pop", b)
            )
        )
        for b in grid
    ]
    assert abs(grid[min(range(21), key=var.__getitem__)] - 0.9) <= 0.05 + 1e-9
    # the study: population b* from the held-out half is the planted one (||h||^2 exact: no sampling error beyond
    # which rollouts land in B: b* = 9 k_B / (9 k_B + (M_B - k_B)), k_B ~ hypergeometric around 128)
    res = prompt_baseline_study(h, r, R, num_resamples=S)
    assert res["b_star_pop"] == pytest.approx(0.9, abs=0.02)
    assert res["m_correct"] == pytest.approx(9.0) and res["m_wrong"] == pytest.approx(1.0)
    est = res["estimators"]
    # variance: optimal < rloo. Closed forms (1/R^2) sum_i E[(r_i - b)^2 ||h_i||^2] at R = 8: optimal_pop
    # 8 * 0.5 * (9 * 0.01 + 0.81) / 64 = 0.05625; rloo 8 * (1.25 + (0.25/7) * 5) / 64 = 0.1786 (see
    # test_diagnostics_baselines): ratio 3.2, allow 20% for resampling noise and the finite pool
    assert est["rloo"]["variance"] / est["optimal_pop"]["variance"] == pytest.approx(0.1786 / 0.05625, rel=0.2)
    assert est["optimal_loo"]["variance"] < est["rloo"]["variance"]


def test_equal_norms_condition_per_prompt():
    assert equal_norms_test(*pool(9.0, 1.0, m=64))["verdict"] == "m_C > m_W"
    assert equal_norms_test(*pool(1.0, 4.0, m=64))["verdict"] == "m_C < m_W"
    # the bootstrap interval is given only with >= 8 rollouts a side; norms within a class are equal here, so every
    # resample gives the ratio 9 exactly
    out = equal_norms_test(*pool(9.0, 1.0, m=64))
    assert out["ratio"] == pytest.approx(9.0) and out["lo"] == pytest.approx(9.0) == out["hi"]
    assert equal_norms_test(*pool(9.0, 1.0, p=2 / 16, m=16))["lo"] is None
    assert equal_norms_test(torch.ones(8), torch.ones(8))["verdict"] == "not testable"
    # one rollout a side, or C(M, k) < 40 (p could never reach 0.05): not testable, so it cannot count as "equal"
    assert equal_norms_test(torch.ones(16), (torch.arange(16) < 1).double())["verdict"] == "not testable"
    assert equal_norms_test(torch.ones(6), (torch.arange(6) < 3).double())["verdict"] == "not testable"  # C(6,3)=20


@pytest.mark.parametrize("k", [2, 5])
def test_equal_norms_test_keeps_its_level_with_few_rollouts_a_side(k):
    # Exchangeable norms (labels independent of them, so m_C = m_W): an exact permutation test rejects at 0.05 with
    # probability <= 0.05 for any M and k. With M = 16 (the study's 4R) and k = 2 or 5, 400 prompts give <= 20
    # rejections on average (SD ~ 4.4); 34 is 3 SD above. A percentile bootstrap from 2 rollouts a side (the previous
    # test) rejected far more often than 5%.
    g = torch.Generator().manual_seed(11)
    rejected = 0
    for s in range(400):
        n = torch.exp(1.5 * torch.randn(16, generator=g, dtype=torch.float64))
        r = (torch.randperm(16, generator=g) < k).double()
        out = equal_norms_test(n, r, seed=s)
        assert out["verdict"] != "not testable" and 0 < out["p"] <= 1
        rejected += out["verdict"] != "m_C = m_W not rejected"
    assert rejected <= 34


def test_non_zero_mean_score_biases_no_baseline_and_shifts_b_star():
    # E[h] = p * signal * e_0 + shift * e_1 = 0.5 e_0 + 0.5 e_1: ||E h||^2 = 0.5, against the floor
    # tr Cov / M ~ (4 + 0.25) / 512 ~ 0.01
    h, r = pool(4.0, 4.0, shift=0.5, signal=1.0)
    ms = mean_score_norm(h)
    assert ms["excess"] == pytest.approx(0.5, abs=0.05)
    assert ms["ratio"] > 10
    h0, r0 = pool(4.0, 4.0, shift=0.0, signal=1.0, seed=3)
    assert mean_score_norm(h0[r0 == 0])["ratio"] < 3  # a mean-zero score sits at its floor (ratio ~1)
    # no baseline estimates E[r h] = Cov(r, h) + E[r] E[h]: its bias^2 ~ ||0.5 (0.5 e_0 + 0.5 e_1)||^2 = 0.125
    # (plus the reference's noise ~0.005 and the mean's resampling noise); RLOO's ~ 0
    res = prompt_baseline_study(h, r, 8, num_resamples=2000)
    assert res["estimators"]["none"]["bias2"] == pytest.approx(0.125, abs=0.04)
    assert res["estimators"]["rloo"]["bias2"] < 0.02
    # b*_exact = (E[r||h||^2] - <E h, E[r h]>) / (E||h||^2 - ||E h||^2) corrects b* for E[h] != 0. Here
    # ||h||^2 ~ 4 + 1 + 0.25 (correct) and 4 + 0.25 (wrong): E[r||h||^2] = 2.625, E||h||^2 = 4.75, so b* = 0.553;
    # E h = (0.5, 0.5), E[r h] = (0.5, 0.25): b*_exact = (2.625 - 0.375) / (4.75 - 0.5) = 0.529, a shift of -0.024
    # (on the held-out half, 256 rollouts: allow 0.012)
    assert res["b_star_exact"] - res["b_star_pop"] == pytest.approx(-0.024, abs=0.012)


def test_study_over_prompts_has_intervals():
    pools = [pool(9.0, 1.0, m=64, seed=s, signal=1.0) for s in range(8)] + [(torch.randn(64, 8), torch.ones(64))]
    out = baseline_study(pools, 4, num_resamples=300, num_boot=500)
    assert out["prompts"] == 8 and out["prompts_constant"] == 1
    s = out["summary"]
    assert s["rloo"]["mse_ratio_to_rloo"]["mean"] == pytest.approx(1.0)
    # mean rescaled by R/(R-1) equals RLOO sample by sample (baselines.py docstring)
    assert s["mean_rescaled"]["mse_ratio_to_rloo"]["mean"] == pytest.approx(1.0, abs=1e-9)
    lo, hi = s["optimal_pop"]["mse_ratio_to_rloo"]["lo"], s["optimal_pop"]["mse_ratio_to_rloo"]["hi"]
    assert lo <= s["optimal_pop"]["mse_ratio_to_rloo"]["mean"] <= hi < 1.0  # optimal beats RLOO when m_C != m_W
    assert out["equal_norms_rejected"] == 1.0
    # E||3u + e_0||^2 = 9 + 1 = 10 (correct, with the signal) against m_W = 1: the interval over prompts covers 10
    assert out["norm_ratio"]["lo"] <= 10.0 <= out["norm_ratio"]["hi"]
    with pytest.raises(ValueError, match="M >= 4R"):
        prompt_baseline_study(*pool(1.0, 1.0, m=12), 4)


def test_estimate_moments_equal_those_of_the_estimates_themselves():
    # The Gram form (K = g g^T, q = g ref) against the [S, P] estimates formed and reduced directly: bias2 =
    # ||mean_s e_s - ref||^2, variance = sum_s ||e_s - mean||^2 / (S - 1), mse = mean_s ||e_s - ref||^2, cosine =
    # mean_s cos(e_s, ref) over non-zero e_s (``none`` on an all-wrong group is 0). Rows with a planted mean
    # (signal, shift) so that no moment is near 0; a variance without the centring, a mse without the bias or a
    # wrong S - 1 is off by far more than 1e-10.
    h, r = pool(9.0, 1.0, m=32, k=16, shift=0.7, signal=1.5, seed=4)
    ref = h[16:].mean(0)
    idx = torch.rand(40, 32, generator=torch.Generator().manual_seed(2)).argsort(-1)[:, :4]
    for name in ("none", "rloo", "optimal_loo", "mean_rescaled"):
        coef = _group_coefficients(r, h.square().sum(-1), idx, name, 0.3)
        est = _group_estimates(h, r, idx, name, 0.3)  # [S, P]
        rows = torch.zeros(40, 32, dtype=torch.float64).scatter_(1, idx, coef)
        got = estimate_moments(h, rows, ref)
        mean = est.mean(0)
        want = {
            "bias2": float((mean - ref).square().sum()),
            "variance": float((est - mean).square().sum() / 39),
            "mse": float((est - ref).square().sum(-1).mean()),
            "cosine": float(((est @ ref) / (est.norm(dim=-1) * ref.norm()))[est.norm(dim=-1) > 0].mean()),
        }
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-10), (name, key)


def test_log_norm_ratio_by_hand():
    # correct ‖h‖² = 1, 3 (mean 2): leave-one-out means 3, 1, logs (log 3, 0), mean log 3 / 2;
    #   jackknifed log mean 2 log 2 − 1 · log 3 / 2, variance (1/2) · 2 · (log 3 / 2)² = (log 3 / 2)²
    # wrong 1, 1, 4 (mean 2): leave-one-out means 2.5, 2.5, 1, logs (l, l, 0) with l = log 2.5, mean 2l/3;
    #   jackknifed log mean 3 log 2 − 2 · 2l/3, variance (2/3) · (2 (l/3)² + (2l/3)²) = (2/3) · (6/9) l² = 4l²/9
    # the delta method would give d = log(2/2) = 0 and v = 0.5: the jackknife moves both
    from grpo_lens.formulas.baselines import log_norm_ratio

    l3, l25 = math.log(3), math.log(2.5)
    d, v = log_norm_ratio(torch.tensor([1.0, 3.0, 1.0, 1.0, 4.0]), torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0]))
    assert d == pytest.approx((2 * math.log(2) - l3 / 2) - (3 * math.log(2) - 4 * l25 / 3), rel=1e-10)
    assert v == pytest.approx((l3 / 2) ** 2 + 4 * l25**2 / 9, rel=1e-10)
    # one string per class: exact means, d = log(4/2), v = 0; one rollout a side: None
    d, v = log_norm_ratio(torch.tensor([4.0, 4.0, 2.0, 2.0]), torch.tensor([1.0, 1.0, 0.0, 0.0]))
    assert d == pytest.approx(math.log(2), rel=1e-12) and v == 0.0
    assert log_norm_ratio(torch.tensor([4.0, 2.0, 2.0]), torch.tensor([1.0, 0.0, 0.0])) is None


def test_log_ratio_weight_is_the_squared_effective_count():
    # k = 8 of M = 16: h = 8 · 8 / 16 = 4, w = 16; k = 2: h = 2 · 14 / 16 = 1.75, w = 3.0625; an empty class: 0
    from grpo_lens.formulas.baselines import log_ratio_weight

    assert log_ratio_weight(8, 8) == 16.0 and log_ratio_weight(2, 14) == pytest.approx(3.0625)
    assert log_ratio_weight(0, 16) == 0.0


def test_rms_log_ratio_weights_prompts():
    # y = d² − v = 0.09 − 0.04 = 0.05 (w = 3) and 0 − 0 = 0 (w = 1): weighted mean 0.15 / 4 = 0.0375
    from grpo_lens.formulas.baselines import rms_log_ratio

    r = rms_log_ratio([0.3, 0.0] * 4, [0.04, 0.0] * 4, [3.0, 1.0] * 4)
    assert r["msq"] == pytest.approx(0.0375, rel=1e-12) and r["rms"] == pytest.approx(math.sqrt(0.0375))
    # interval: the ratio Σ w y / Σ w linearised, u_j = w_j (y_j − msq) = +0.0375 (w = 3) and −0.0375 (w = 1), four
    # of each: mean 0, symmetric (Hall's interval is Student's), SD (ddof 1) 0.0375 √(8/7), SE 0.0375 / √7;
    # half-width t_{7, 0.975} · SE / mean(w) = 2.364624 · 0.0141737 / 2 = 0.0167577 around 0.0375
    half = 2.364624 * 0.0375 / math.sqrt(7) / 2
    assert r["lo"] == pytest.approx(0.0375 - half, abs=1e-5) and r["hi"] == pytest.approx(0.0375 + half, abs=1e-5)
    # every weight 0 (no prompt with both classes): nothing to estimate, not a division by zero
    assert rms_log_ratio([0.3], [0.04], [0.0])["msq"] is None and rms_log_ratio([], [])["rms"] is None


def test_rms_log_ratio_removes_the_noise_term():
    # y_j = d_j² − v_j: d = ±0.3 with v = 0.04 gives y = 0.05 each, so mean δ² = 0.05 and RMS √0.05 = 0.2236
    from grpo_lens.formulas.baselines import rms_log_ratio

    r = rms_log_ratio([0.3, -0.3] * 4, [0.04] * 8)
    assert r["msq"] == pytest.approx(0.05, rel=1e-12) and r["rms"] == pytest.approx(math.sqrt(0.05), rel=1e-12)
    assert r["n"] == 8 and r["lo"] == pytest.approx(0.05) and r["hi"] == pytest.approx(0.05)  # no spread
    # m_C = m_W planted on 400 prompts of 8 + 8 rollouts (‖h‖² ~ Exponential(1) a side): E y = O(1/M²) while
    # uncorrected E d² ≈ Var d = 2/8 = 0.25, so mean y is within 0.05 of 0 where a wrong sign of v would give 0.5
    from grpo_lens.formulas.baselines import log_norm_ratio

    g = torch.Generator().manual_seed(0)
    pairs = [
        log_norm_ratio(torch.empty(16, dtype=torch.float64).exponential_(generator=g), torch.arange(16) < 8)
        for _ in range(400)
    ]
    r = rms_log_ratio([p[0] for p in pairs], [p[1] for p in pairs])
    assert abs(r["msq"]) < 0.05 and sum(p[0] ** 2 for p in pairs) / 400 > 0.15
