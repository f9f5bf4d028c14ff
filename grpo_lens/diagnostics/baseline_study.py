"""Baselines compared at a common target: bias, variance, MSE and cosine to a reference gradient from a large pool.

docs/theory.md §Baselines at matched expectation. Shapes: M rollouts of one prompt (M >= 4R), R group size, K gradient
dimensions (exact P or a sketch: only inner products are used, and sketches preserve them in expectation).

For one prompt, per-rollout gradient terms h_j (rows of ``grads``) and rewards r_j. Each baseline b gives the group
estimate ghat_b = (1/R) sum_i (r_i - b_i) h_i. The pool is split in two halves, A and B: groups are drawn from A, and
the reference gradient and the population b* come from B, so neither is computed from the groups it is compared with.

- reference: the centred policy gradient Cov(r, h) = E[(r - E r) h], estimated on B by
  g_ref = (1/(|B|-1)) sum_{j in B} (r_j - rbar_B) h_j (unbiased). It is what RLOO estimates without bias, and what
  every baseline estimates when E[h] = 0; the length-normalised score has E[h] != 0, which the study measures.
- estimators: ``none`` (b = 0), ``mean`` (b = group mean, r_i included; its expectation is (R-1)/R of RLOO's, so it
  is reported rescaled by R/(R-1) as ``mean_rescaled``, identical to RLOO sample by sample), ``rloo``,
  ``optimal_loo`` (leave-one-out b* from the group's norms, what ``--estimator optimal`` trains with) and
  ``optimal_pop`` (the population b* from B, a constant).
- per estimator, over S resampled groups: bias2 = ||mean_s ghat_s - g_ref||^2, variance = (1/(S-1)) sum_s
  ||ghat_s - mean ghat||^2, mse = mean_s ||ghat_s - g_ref||^2 and cosine = mean_s cos(ghat_s, g_ref). The reference
  is itself noisy: ``ref_noise`` = its estimated trace variance, which adds to every estimator's mse equally.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

from grpo_lens.diagnostics.group import fixed_k_labellings
from grpo_lens.diagnostics.stats import MIN_INTERVAL_UNITS as MIN_UNITS  # the one rule for intervals (docs/theory.md §7)

STUDY_ESTIMATORS = ("none", "mean_rescaled", "rloo", "optimal_loo", "optimal_pop")


def mean_score_norm(grads: Tensor) -> dict[str, float]:
    """||E[h]|| of per-rollout gradient terms against the floor a mean-zero h would give.

    ||hbar||^2 over M rollouts has expectation ||E h||^2 + tr Cov(h)/M; ``excess`` = ||hbar||^2 - tr Cov_hat/M is
    unbiased for ||E h||^2, and ``ratio`` = ||hbar||^2 / (tr Cov_hat / M) is ~1 for a mean-zero score (the plain
    score: E[grad log pi] = 0) and large when E[h] != 0 (the length-normalised score).

    Args:
        grads: [M, K].

    Returns:
        {"mean_norm": ||hbar||, "floor_norm": sqrt(tr Cov_hat / M), "ratio", "excess", "mean_sq_norm": mean ||h||^2}.
    """
    g = grads.detach().double()
    m = g.shape[0]
    if m < 2:
        raise ValueError(f"need M >= 2 rollouts, got {m}")
    hbar = g.mean(0)
    tr_cov = float((g - hbar).square().sum() / (m - 1))
    mean_sq = float(hbar.square().sum())
    floor = tr_cov / m
    return {"mean_norm": math.sqrt(mean_sq), "floor_norm": math.sqrt(floor),
            "ratio": mean_sq / floor if floor > 0 else math.inf, "excess": mean_sq - floor,
            "mean_sq_norm": float(g.square().sum(-1).mean())}


def optimal_constant_baseline(grads: Tensor, rewards: Tensor) -> dict[str, float]:
    """The trace-variance-optimal constant baseline of (r - b) h, with and without assuming E[h] = 0.

    Var_b = E[(r - b)^2 ||h||^2] - ||E[r h] - b E[h]||^2 is minimised by

        b*_exact = (E[r ||h||^2] - <E h, E[r h]>) / (E||h||^2 - ||E h||^2),

    which reduces to b* = E[r ||h||^2] / E[||h||^2] (Greensmith et al. 2004, Thm 13) when E[h] = 0. The expectations
    are plug-in means over the M rollouts.

    Args:
        grads: [M, K].  rewards: [M].

    Returns:
        {"b_star": b*, "b_star_exact": b*_exact, "shift": b*_exact - b*}.
    """
    g, r = grads.detach().double(), rewards.detach().double()
    n = g.square().sum(-1)
    mu_h, mu_rh = g.mean(0), (r.unsqueeze(1) * g).mean(0)
    b = float((n * r).mean() / n.mean()) if n.sum() > 0 else float(r.mean())
    den = float(n.mean() - mu_h.square().sum())
    b_exact = float(((n * r).mean() - mu_h @ mu_rh) / den) if den > 0 else b
    return {"b_star": b, "b_star_exact": b_exact, "shift": b_exact - b}


def _group_estimates(g: Tensor, r: Tensor, idx: Tensor, name: str, b_pop: float) -> Tensor:
    """[S, K] group estimates of one estimator on resampled groups idx [S, R] of rows g [M, K], rewards r [M]."""
    from grpo_lens.diagnostics.baselines import loo_optimal_baseline, rloo_baseline

    R = idx.shape[1]
    r_s = r[idx]  # [S, R]
    n_s = g.square().sum(-1)[idx]
    if name == "none":
        b = torch.zeros_like(r_s)
    elif name == "mean_rescaled":
        b = r_s.mean(-1, keepdim=True).expand_as(r_s)
    elif name == "rloo":
        b = rloo_baseline(r_s, n_s)
    elif name == "optimal_loo":
        b = loo_optimal_baseline(r_s, n_s)
    elif name == "optimal_pop":
        b = torch.full_like(r_s, b_pop)
    else:
        raise ValueError(f"unknown estimator {name!r}; valid names: {', '.join(STUDY_ESTIMATORS)}")
    coef = (r_s - b) / R
    if name == "mean_rescaled":
        coef = coef * R / (R - 1)
    return torch.einsum("sr,srk->sk", coef, g[idx])


def prompt_baseline_study(grads: Tensor, rewards: Tensor, group_size: int, *, num_resamples: int = 512,
                          seed: int = 0, estimators: Sequence[str] = STUDY_ESTIMATORS) -> dict:
    """Bias, variance, MSE and cosine to the reference of each estimator for one prompt's pool.

    The pool's rows are split by a seeded permutation into A (first half, groups are drawn from it without
    replacement) and B (second half: the reference gradient and the population b*). See the module docstring.

    Args:
        grads: [M, K] per-rollout gradient terms (exact or sketched), M >= 4R.
        rewards: [M] (0/1 for m_C / m_W; any real rewards otherwise).
        group_size: R >= 2.
        num_resamples: S >= 2 groups drawn from A.
        seed: split and resampling seed.
        estimators: names in :data:`STUDY_ESTIMATORS`.

    Returns:
        {"estimators": {name: {"bias2", "variance", "mse", "cosine"}}, "ref_norm2": ||g_ref||^2, "ref_noise": its
        estimated trace variance, "b_star_pop": b* on B, "b_star_exact": b*_exact on B, "p": mean reward of the pool,
        "m_correct", "m_wrong": mean ||h||^2 of r = 1 / r = 0 rollouts over the whole pool (NaN if none),
        "mean_score": :func:`mean_score_norm` of the whole pool}.

    Raises:
        ValueError: M < 4R, R < 2, S < 2, or an unknown estimator.
    """
    g, r = grads.detach().double(), rewards.detach().double()
    m, R = g.shape[0], group_size
    assert r.shape == (m,), (r.shape, m)
    if R < 2:
        raise ValueError(f"group size must be >= 2, got {R}")
    if m < 4 * R:
        raise ValueError(f"need M >= 4R = {4 * R} rollouts of the prompt (half for groups, half for the reference), "
                         f"got {m}")
    if num_resamples < 2:
        raise ValueError(f"num_resamples must be >= 2, got {num_resamples}")
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(m, generator=gen)
    a_idx, b_idx = perm[: m // 2], perm[m // 2:]
    ga, ra, gb, rb = g[a_idx], r[a_idx], g[b_idx], r[b_idx]
    # reference on B: unbiased sample covariance of r and h, and its noise (variance of a mean of M_B terms)
    terms = (rb - rb.mean()).unsqueeze(1) * gb  # [M_B, K]
    ref = terms.sum(0) / (len(rb) - 1)
    ref_noise = float((terms - terms.mean(0)).square().sum() / (len(rb) - 1)) / len(rb)
    pop = optimal_constant_baseline(gb, rb)
    idx = torch.rand(num_resamples, len(ra), generator=gen).argsort(-1)[:, :R]
    out: dict[str, dict[str, float]] = {}
    ref_norm = float(ref.norm())
    for name in estimators:
        est = _group_estimates(ga, ra, idx, name, pop["b_star"])  # [S, K]
        mean = est.mean(0)
        err = (est - ref).square().sum(-1)
        norms = est.norm(dim=-1)
        cos = (est @ ref) / (norms * ref_norm).clamp(min=1e-300)
        out[name] = {"bias2": float((mean - ref).square().sum()),
                     "variance": float((est - mean).square().sum() / (num_resamples - 1)),
                     "mse": float(err.mean()), "cosine": float(cos[norms > 0].mean()) if (norms > 0).any() else 0.0}
    n = g.square().sum(-1)
    c, w = r == 1, r == 0
    return {"estimators": out, "ref_norm2": ref_norm**2, "ref_noise": ref_noise, "b_star_pop": pop["b_star"],
            "b_star_exact": pop["b_star_exact"], "p": float(r.mean()),
            "m_correct": float(n[c].mean()) if c.any() else math.nan,
            "m_wrong": float(n[w].mean()) if w.any() else math.nan, "mean_score": mean_score_norm(g)}


def equal_norms_test(grads: Tensor, rewards: Tensor, *, num_boot: int = 2000, seed: int = 0, level: float = 0.95,
                     max_permutations: int = 2000) -> dict:
    """Is m_C = m_W (the condition under which the group mean is the variance-optimal baseline) for one prompt?

    The verdict comes from a label-permutation test with the correct count k fixed (docs/theory.md §Baselines at
    matched expectation): statistic |log(mean_C ||h||^2 / mean_W ||h||^2)|, p-value = share of the C(M, k)
    relabellings (all of them up to ``max_permutations``, else that many at random and the observed one) whose
    statistic is >= the observed one. With rollouts exchangeable under the null (labels independent of the norms),
    P(p <= 0.05) <= 0.05 for every M and k, which is what makes 0.05 the control of the claim that counts rejections; a
    percentile bootstrap from 2 rollouts of a side has no such guarantee. A prompt is testable when each side has >= 2
    rollouts and C(M, k) >= 40, so that p can reach 0.05 (two mirror labellings give the same statistic when k = M/2);
    a prompt whose test cannot reject would count as evidence for m_C = m_W. The bootstrap interval of the ratio
    (correct and wrong rollouts resampled separately) is for reading only, and given only with >= MIN_UNITS rollouts
    of each side (None otherwise).

    Args:
        grads: [M, K] (or [M] squared norms).  rewards: [M] in {0, 1}.
        num_boot: bootstrap resamples.  level: 1 - the test's level, and the interval's coverage.
        max_permutations: enumerate every relabelling up to this many, else draw this many.

    Returns:
        {"ratio": m_C / m_W, "p": the permutation p-value, "lo", "hi": the bootstrap interval of the ratio or None,
        "verdict": "m_C = m_W not rejected" when p > 1 - level, else "m_C > m_W" or "m_C < m_W"}, or {"verdict":
        "not testable", ...} as above.
    """
    x = grads.detach().double()
    n = x if x.dim() == 1 else x.square().sum(-1)
    r = rewards.detach()
    labels = r == 1
    m, k = len(r), int(labels.sum())
    nc, nw = n[labels], n[~labels]
    alpha = 1 - level
    if min(k, m - k) < 2 or math.comb(m, k) < 2 / alpha or nw.mean() == 0 or nc.mean() == 0:
        return {"ratio": math.nan, "p": math.nan, "lo": None, "hi": None, "verdict": "not testable"}
    gen = torch.Generator().manual_seed(seed)
    labs = torch.stack(fixed_k_labellings(m, k, max_permutations, gen)).double()  # [L, M]
    tiny = torch.finfo(torch.float64).tiny
    means_c = (labs @ n) / k
    means_w = ((1 - labs) @ n) / (m - k)
    null = (means_c.clamp(min=tiny).log() - means_w.clamp(min=tiny).log()).abs()
    log_ratio = float(nc.mean().log() - nw.mean().log())
    ge = int((null >= abs(log_ratio) - 1e-12).sum())
    p = ge / len(labs) if math.comb(m, k) <= max_permutations else (1 + ge) / (1 + len(labs))
    low = high = None
    if min(k, m - k) >= MIN_UNITS:
        bc = nc[torch.randint(len(nc), (num_boot, len(nc)), generator=gen)].mean(1)
        bw = nw[torch.randint(len(nw), (num_boot, len(nw)), generator=gen)].mean(1)
        ratios = bc / bw.clamp(min=1e-300)
        low, high = float(ratios.quantile(alpha / 2)), float(ratios.quantile(1 - alpha / 2))
    verdict = "m_C = m_W not rejected" if p > alpha else ("m_C > m_W" if log_ratio > 0 else "m_C < m_W")
    return {"ratio": math.exp(log_ratio), "p": p, "lo": low, "hi": high, "verdict": verdict}


def bootstrap_mean(values: Sequence[float], num_boot: int = 2000, seed: int = 0, level: float = 0.95,
                   bounds: tuple[float, float] | None = None) -> dict[str, float | int | None]:
    """Mean over units (prompts, groups) with the bootstrap-t interval of
    :func:`grpo_lens.diagnostics.stats.bootstrap_ci` (non-finite values dropped). -> {"mean", "lo", "hi", "n"}.

    With fewer than :data:`MIN_UNITS` units lo = hi = None: a bootstrap over a handful of values has too few distinct
    resamples (with 2, every resample with a spread is the pair itself, so the bootstrap-t interval collapses to the
    mean; with 4 its studentized resamples blow the interval far past the data), and a claim's verdict needs an
    interval. ``bounds``: the range the mean cannot leave (e.g. (0, 1) for a share); the interval is clipped to it.
    """
    from grpo_lens.diagnostics.stats import bootstrap_ci

    out = bootstrap_ci(list(values), level=level, num_resamples=max(num_boot, 100), seed=seed)
    if out["n"] < MIN_UNITS:
        out["lo"] = out["hi"] = None
    elif bounds is not None and out["lo"] is not None:
        out["lo"], out["hi"] = max(out["lo"], bounds[0]), min(out["hi"], bounds[1])
    return out


def baseline_study(pools: Sequence[tuple[Tensor, Tensor]], group_size: int, *, num_resamples: int = 512,
                   seed: int = 0, num_boot: int = 2000) -> dict:
    """:func:`prompt_baseline_study` over prompts, with bootstrap intervals over prompts.

    Args:
        pools: per prompt, (grads [M, K], rewards [M]) with M >= 4R. Prompts whose pool has no reward contrast are
            skipped (every centred estimator is 0 there) and counted in ``prompts_constant``.
        group_size: R.

    Returns:
        {"per_prompt": [prompt results, each with "equal_norms"], "summary": {estimator: {"mse_ratio_to_rloo",
        "cosine", "bias2_share"}: bootstrap_mean over prompts}, "prompts": analysed count, "prompts_constant",
        "b_star_shift": bootstrap_mean of b*_exact - b*, "b_star_minus_p": of b* - p (the group mean's expectation),
        "norm_ratio": of m_C / m_W, "mean_score_ratio": bootstrap_mean of ||hbar||^2 over its
        mean-zero floor, "equal_norms_rejected": share of testable prompts whose permutation test rejects m_C = m_W
        at 0.05, "equal_norms_testable"}.
        MSE is compared as the ratio to RLOO's per prompt (prompts differ in gradient scale); bias2_share = bias2 /
        mse.
    """
    per_prompt, constant = [], 0
    for j, (g, r) in enumerate(pools):
        if bool((r == r[0]).all()):
            constant += 1
            continue
        res = prompt_baseline_study(g, r, group_size, num_resamples=num_resamples, seed=seed + j)
        res["equal_norms"] = equal_norms_test(g, r, seed=seed + j)
        per_prompt.append(res)
    summary = {}
    for name in STUDY_ESTIMATORS:
        ratios = [p["estimators"][name]["mse"] / p["estimators"]["rloo"]["mse"] for p in per_prompt
                  if p["estimators"]["rloo"]["mse"] > 0]
        summary[name] = {
            "mse_ratio_to_rloo": bootstrap_mean(ratios, num_boot, seed),
            "cosine": bootstrap_mean([p["estimators"][name]["cosine"] for p in per_prompt], num_boot, seed),
            "bias2_share": bootstrap_mean([p["estimators"][name]["bias2"] / p["estimators"][name]["mse"]
                                           for p in per_prompt if p["estimators"][name]["mse"] > 0], num_boot, seed),
        }
    testable = [p for p in per_prompt if p["equal_norms"]["verdict"] != "not testable"]
    return {"per_prompt": per_prompt, "summary": summary, "prompts": len(per_prompt), "prompts_constant": constant,
            "b_star_shift": bootstrap_mean([p["b_star_exact"] - p["b_star_pop"] for p in per_prompt], num_boot, seed),
            "b_star_minus_p": bootstrap_mean([p["b_star_pop"] - p["p"] for p in per_prompt], num_boot, seed),
            "norm_ratio": bootstrap_mean([p["m_correct"] / p["m_wrong"] for p in per_prompt
                                          if p["m_wrong"] and math.isfinite(p["m_correct"])], num_boot, seed),
            "mean_score_ratio": bootstrap_mean([p["mean_score"]["ratio"] for p in per_prompt], num_boot, seed),
            "equal_norms_rejected": (sum(p["equal_norms"]["verdict"] != "m_C = m_W not rejected" for p in testable)
                                     / len(testable)) if testable else math.nan,
            "equal_norms_testable": len(testable)}
