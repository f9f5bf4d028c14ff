"""Baselines for the group's REINFORCE estimator, their variance, and the study at matched expectation.

docs/theory.md §2, §The variance-optimal baseline in training, §Baselines at matched expectation. Shapes: R group
size, M rollouts of one prompt, P parameters (or P_s sketch dimensions: only inner products and norms are used, and
sketches preserve them in expectation).

For one prompt with rollouts i, rewards r_i and per-rollout gradients g_i, the estimator with baseline b_i is

    ghat = (1/R) sum_i (r_i - b_i) g_i.

Its trace-variance E||ghat - E ghat||^2 is minimised over constant baselines by

    b* = E[||g||^2 r] / E[||g||^2]          (Greensmith, Bartlett & Baxter, JMLR 5 (2004), Theorem 13;
                                            Weaver & Tao, arXiv 1301.2315, §4),

which for 0/1 rewards with success rate p is b* = p m_C / (p m_C + (1-p) m_W), m_C = E[||g||^2 | correct],
m_W = E[||g||^2 | wrong]: b* = p iff m_C = m_W. A baseline that uses r_i itself biases the estimator, so b* is
estimated leave-one-out, b*_i from the other rollouts of the group.

Baselines compared (:data:`BASELINES`, each fn(rewards [..., R], sq_norms [..., R]) -> b [..., R]):

- ``none``: b_i = 0.
- ``mean``: b_i = mean_j r_j (GRPO's centring, r_i included). Note r_i - mean r = ((R-1)/R)(r_i - rloo_i), so this
  estimator is exactly (R-1)/R times the RLOO one, sample by sample: variance ((R-1)/R)^2 of RLOO's, and biased
  by the same factor.
- ``rloo``: b_i = mean_{j != i} r_j (:func:`grpo_lens.formulas.advantages.rloo_baseline`, the body the ``rloo``
  estimator subtracts).
- ``optimal``: b_i = sum_{j != i} ||g_j||^2 r_j / sum_{j != i} ||g_j||^2 (leave-one-out b*,
  :func:`grpo_lens.formulas.advantages.loo_optimal_baseline`, the body ``--estimator optimal`` subtracts).

Per group (the lens and the probe, through :func:`baseline_metrics`): m_C, m_W and the plug-in b* against the group
mean. Per prompt (the probe): :func:`estimator_variances`, the trace-variance of each baseline's estimate over
resampled groups. In training: :func:`optimal_vs_rloo`, what the leave-one-out b* did against RLOO's baseline.

The study at matched expectation (:func:`baseline_study`, one prompt: :func:`prompt_baseline_study`): each prompt's
pool of M >= 4R rollouts is split in two halves, A and B; groups are drawn from A, and the reference gradient and the
population b* come from B, so neither is computed from the groups it is compared with.

- reference: the centred policy gradient Cov(r, h) = E[(r - E r) h], estimated on B by
  g_ref = (1/(|B|-1)) sum_{j in B} (r_j - rbar_B) h_j (unbiased). It is what RLOO estimates without bias, and what
  every baseline estimates when E[h] = 0; the length-normalised score has E[h] != 0, which the study measures
  (:func:`mean_score_norm`).
- estimators (:data:`STUDY_ESTIMATORS`): ``none`` (b = 0), ``mean`` (b = group mean, r_i included; its expectation
  is (R-1)/R of RLOO's, so it is reported rescaled by R/(R-1) as ``mean_rescaled``, identical to RLOO sample by
  sample), ``rloo``, ``optimal_loo`` (leave-one-out b* from the group's norms, what ``--estimator optimal`` trains
  with) and ``optimal_pop`` (the population b* from B, a constant, :func:`optimal_constant_baseline`).
- per estimator, over S resampled groups: bias2 = ||mean_s ghat_s - g_ref||^2, variance = (1/(S-1)) sum_s
  ||ghat_s - mean ghat||^2, mse = mean_s ||ghat_s - g_ref||^2 and cosine = mean_s cos(ghat_s, g_ref). The reference
  is itself noisy: ``ref_noise`` = its estimated trace variance, which adds to every estimator's mse equally.
- m_C = m_W per prompt: :func:`equal_norms_test`, a label-permutation test with the correct count fixed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from grpo_lens import metrics as mk
from grpo_lens.formulas.advantages import (
    constant_groups,
    loo_optimal_baseline,
    rloo_baseline,
)
from grpo_lens.formulas.stats import MIN_INTERVAL_UNITS as MIN_UNITS
from grpo_lens.formulas.stats import mean_interval
from grpo_lens.formulas.zero_sum import fixed_k_labellings
from grpo_lens.registry import Registry

BaselineFn = Callable[[Tensor, Tensor], Tensor]


BASELINES: Registry[BaselineFn] = Registry("baseline")


def _sq_norms(grads_or_sq_norms: Tensor) -> Tensor:
    """[M] squared norms from grads [M, P] or pass-through [M]."""
    x = grads_or_sq_norms.detach().double()
    return x if x.dim() == 1 else x.square().sum(-1)


def correct_wrong_sq_norms(grads: Tensor, rewards: Tensor) -> tuple[float, float]:
    """(m_C, m_W): mean ||g_i||^2 over the correct (r = 1) and the wrong (r = 0) rollouts of one group.

    Args:
        grads: [R, P] per-rollout gradients (or [R] squared norms).
        rewards: [R] in {0, 1}.

    Returns:
        (m_C, m_W) floats in squared gradient units; NaN for a side with no rollout.
    """
    n = _sq_norms(grads)
    assert rewards.shape == n.shape, (rewards.shape, n.shape)
    c = rewards == 1
    w = rewards == 0
    m_c = float(n[c].mean()) if c.any() else math.nan
    m_w = float(n[w].mean()) if w.any() else math.nan
    return m_c, m_w


def optimal_baseline(grads: Tensor, rewards: Tensor) -> float:
    """b* = sum_i ||g_i||^2 r_i / sum_i ||g_i||^2 of one group (plug-in, r_i included).

    Args:
        grads: [R, P] (or [R] squared norms).
        rewards: [R].

    Returns:
        b* in reward units; the mean reward when every g_i is zero.
    """
    n = _sq_norms(grads)
    r = rewards.detach().double()
    assert r.shape == n.shape, (r.shape, n.shape)
    total = n.sum()
    return float(r.mean()) if total == 0 else float((n * r).sum() / total)


def optimal_baseline_binary(p: float, m_c: float, m_w: float) -> float:
    """b* = p m_C / (p m_C + (1-p) m_W) for 0/1 rewards (docs/theory.md §2); p when the denominator is 0."""
    denom = p * m_c + (1 - p) * m_w
    return p if denom == 0 else p * m_c / denom


@BASELINES.register("none")
def no_baseline(rewards: Tensor, sq_norms: Tensor) -> Tensor:
    """b_i = 0. rewards, sq_norms: [..., R]. Returns [..., R]."""
    return torch.zeros_like(rewards)


@BASELINES.register("mean")
def mean_baseline(rewards: Tensor, sq_norms: Tensor) -> Tensor:
    """b_i = mean_j r_j (r_i included; GRPO / Dr. GRPO centring). Returns [..., R]."""
    return rewards.mean(-1, keepdim=True).expand_as(rewards)


BASELINES.register("rloo")(rloo_baseline)  # b_i = mean_{j != i} r_j; the body is in formulas.advantages
BASELINES.register("optimal")(loo_optimal_baseline)  # leave-one-out b*; the body is in formulas.advantages


def baseline_metrics(grads: Tensor, rewards: Tensor) -> dict[str, float]:
    """Per-group baseline diagnostics for 0/1 rewards: m_C, m_W, b*, the group mean and their gap.

    Args:
        grads: [R, P] (or [R] squared norms).
        rewards: [R].

    Returns:
        {"baseline/m_correct", "baseline/m_wrong", "baseline/b_star", "baseline/b_star_minus_mean",
        "baseline/group_mean"} (m's NaN when the group has no correct / no wrong rollout).
    """
    m_c, m_w = correct_wrong_sq_norms(grads, rewards)
    b_star = optimal_baseline(grads, rewards)
    mean = float(rewards.double().mean())
    return {
        mk.BASELINE_M_CORRECT: m_c,
        mk.BASELINE_M_WRONG: m_w,
        mk.BASELINE_B_STAR: b_star,
        mk.BASELINE_B_STAR_MINUS_MEAN: b_star - mean,
        mk.BASELINE_GROUP_MEAN: mean,
    }


def estimator_variances(
    grads: Tensor,
    rewards: Tensor,
    group_size: int,
    *,
    baselines: Sequence[str] = ("none", "mean", "rloo", "optimal"),
    num_resamples: int = 256,
    seed: int = 0,
) -> dict[str, float]:
    """Trace-variance of ghat = (1/R) sum_i (r_i - b_i) g_i per baseline, by resampling groups of one prompt.

    Draws ``num_resamples`` groups of R distinct rollouts (without replacement) from M >= 2R rollouts of the same
    prompt and returns, per baseline, the sample trace-covariance (1/(S-1)) sum_s ||ghat_s - mean ghat||^2. All
    baselines see the same resampled groups. Works on exact gradients or sketches (sketches preserve inner
    products in expectation).

    Args:
        grads: [M, P] per-rollout gradients of one prompt.
        rewards: [M].
        group_size: R (>= 2).
        baselines: names in :data:`BASELINES`.
        num_resamples: S (>= 2).
        seed: resampling seed.

    Returns:
        {baseline name: variance} in squared gradient units.

    Raises:
        ValueError: M < 2R, R < 2, S < 2, or an unknown baseline name (listing the valid ones).
    """
    m, R = grads.shape[0], group_size
    assert rewards.shape == (m,), (rewards.shape, m)
    if R < 2:
        raise ValueError(f"group size must be >= 2, got {R}")
    if m < 2 * R:
        raise ValueError(f"need at least 2R = {2 * R} rollouts of the prompt to resample groups, got {m}")
    if num_resamples < 2:
        raise ValueError(f"num_resamples must be >= 2, got {num_resamples}")
    fns = {name: BASELINES.get(name) for name in baselines}
    g = grads.detach().double()
    rw = rewards.detach().double()
    n = g.square().sum(-1)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.rand(num_resamples, m, generator=gen).argsort(-1)[:, :R]  # [S, R]
    r_s, n_s = rw[idx], n[idx]  # [S, R]
    out = {}
    for name, fn in fns.items():
        coef = (r_s - fn(r_s, n_s)) / R  # [S, R]
        w = torch.zeros(num_resamples, m, dtype=torch.float64).scatter_(1, idx, coef)  # [S, M]
        # the variance does not involve the reference: any ref (here 0) gives it
        out[name] = estimate_moments(g, w, torch.zeros(g.shape[1], dtype=torch.float64))["variance"]
    return out


def variance_relative_to_optimal(variances: dict[str, float]) -> dict[str, float]:
    """{name: var_name / var_optimal} (1 for ``optimal`` itself; inf if var_optimal = 0 < var_name).

    Raises:
        ValueError: no ``optimal`` entry.
    """
    if "optimal" not in variances:
        raise ValueError("variances have no 'optimal' entry")
    ref = variances["optimal"]
    return {k: (v / ref if ref > 0 else (1.0 if v == 0 else math.inf)) for k, v in variances.items()}


def optimal_vs_rloo(rewards: Tensor, valid: Tensor, advantages: Tensor) -> tuple[float, float, int]:
    """What the leave-one-out b* did against RLOO's baseline, over the valid rollouts of groups with contrast.

    Args:
        rewards: [B, R] (any value where invalid).  valid: [B, R] bool.  advantages: [B, R] from the ``optimal``
            estimator (before any truncation masking), so b*_{-i} = r_i - A_i.

    Returns:
        (sum of b*_{-i}, sum of b*_{-i} - rloo_i, number of rollouts): sums, so that processes can add them.
    """
    assert rewards.shape == valid.shape == advantages.shape and rewards.dim() == 2, (rewards.shape, valid.shape)
    v = valid.bool()
    r = torch.where(v, rewards.double(), torch.zeros_like(rewards, dtype=torch.float64))
    rloo = rloo_baseline(r, valid=v)
    b = r - advantages.double()
    use = v & ~constant_groups(r, v).unsqueeze(1)
    return float(b[use].sum()), float((b - rloo)[use].sum()), int(use.sum())


STUDY_ESTIMATORS = ("none", "mean_rescaled", "rloo", "optimal_loo", "optimal_pop")


def mean_score_norm(grads: Tensor) -> dict[str, float]:
    """||E[h]|| of per-rollout gradient terms against the floor a mean-zero h would give.

    ||hbar||^2 over M rollouts has expectation ||E h||^2 + tr Cov(h)/M; ``excess`` = ||hbar||^2 - tr Cov_hat/M is
    unbiased for ||E h||^2, and ``ratio`` = ||hbar||^2 / (tr Cov_hat / M) is ~1 for a mean-zero score (the plain
    score: E[grad log pi] = 0) and large when E[h] != 0 (the length-normalised score).

    Args:
        grads: [M, P].

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
    return {
        "mean_norm": math.sqrt(mean_sq),
        "floor_norm": math.sqrt(floor),
        "ratio": mean_sq / floor if floor > 0 else math.inf,
        "excess": mean_sq - floor,
        "mean_sq_norm": float(g.square().sum(-1).mean()),
    }


def optimal_constant_baseline(grads: Tensor, rewards: Tensor) -> dict[str, float]:
    """The trace-variance-optimal constant baseline of (r - b) h, with and without assuming E[h] = 0.

    Var_b = E[(r - b)^2 ||h||^2] - ||E[r h] - b E[h]||^2 is minimised by

        b*_exact = (E[r ||h||^2] - <E h, E[r h]>) / (E||h||^2 - ||E h||^2),

    which reduces to b* = E[r ||h||^2] / E[||h||^2] (Greensmith et al. 2004, Thm 13) when E[h] = 0. The expectations
    are plug-in means over the M rollouts.

    Args:
        grads: [M, P].  rewards: [M].

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


def _group_coefficients(r: Tensor, sq: Tensor, idx: Tensor, name: str, b_pop: float) -> Tensor:
    """[S, R] weights (r_i - b_i) / R of one estimator on resampled groups idx [S, R] of rewards r [M] and squared
    norms sq [M] (``mean_rescaled`` times R / (R - 1)): group s's estimate is sum_i coef[s, i] g[idx[s, i]]."""
    R = idx.shape[1]
    r_s = r[idx]  # [S, R]
    n_s = sq[idx]
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
    return coef


def _group_estimates(g: Tensor, r: Tensor, idx: Tensor, name: str, b_pop: float) -> Tensor:
    """[S, P] group estimates of one estimator on resampled groups idx [S, R] of rows g [M, P], rewards r [M]."""
    return torch.einsum("sr,srk->sk", _group_coefficients(r, g.square().sum(-1), idx, name, b_pop), g[idx])


def estimate_moments(g: Tensor, coef: Tensor, ref: Tensor) -> dict[str, float]:
    """bias2, variance, mse and cosine to ``ref`` of S estimates ghat_s = C_s g, from the Gram of g.

    C [S, M] holds each estimate's weights on the M rows of g [M, P] (ref [P]). With K = g g^T [M, M] and
    q = g ref [M], every moment is a small product (no [S, P] estimate is formed): bias2 = ||cbar g - ref||^2
    (cbar = mean_s C_s, formed in P once), variance = sum_s (C_s - cbar) K (C_s - cbar)^T / (S - 1),
    ||ghat_s||^2 = C_s K C_s^T, <ghat_s, ref> = C_s q, and mse = mean_s ||ghat_s - ref||^2
    = bias2 + variance (S - 1) / S (the mean-square split about the mean). The same numbers as from the estimates
    themselves, float64 rounding aside (a test compares them).

    Args:
        g: [M, P] float64 rows (per-rollout gradients or their sketch).  coef: [S, M] float64, S >= 2.  ref: [P].

    Returns:
        {"bias2", "variance", "mse", "cosine": mean_s cos(ghat_s, ref) over the non-zero estimates (0 if none)}, in
        squared gradient units (cosine: none).
    """
    S = coef.shape[0]
    K, q = g @ g.T, g @ ref  # [M, M], [M]
    cbar = coef.mean(0)
    bias2 = float((cbar @ g - ref).square().sum())
    dev = coef - cbar
    variance = float(((dev @ K) * dev).sum() / (S - 1))
    norms = ((coef @ K) * coef).sum(-1).clamp(min=0).sqrt()  # [S] ||ghat_s||
    cos = (coef @ q) / (norms * float(ref.norm())).clamp(min=1e-300)
    return {
        "bias2": bias2,
        "variance": variance,
        "mse": bias2 + variance * (S - 1) / S,
        "cosine": float(cos[norms > 0].mean()) if (norms > 0).any() else 0.0,
    }


def prompt_baseline_study(
    grads: Tensor,
    rewards: Tensor,
    group_size: int,
    *,
    num_resamples: int = 512,
    seed: int = 0,
    estimators: Sequence[str] = STUDY_ESTIMATORS,
) -> dict:
    """Bias, variance, MSE and cosine to the reference of each estimator for one prompt's pool.

    The pool's rows are split by a seeded permutation into A (first half, groups are drawn from it without
    replacement) and B (second half: the reference gradient and the population b*). See the module docstring.

    Args:
        grads: [M, P] per-rollout gradient terms (exact or sketched), M >= 4R.
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
        raise ValueError(
            f"need M >= 4R = {4 * R} rollouts of the prompt (half for groups, half for the reference), got {m}"
        )
    if num_resamples < 2:
        raise ValueError(f"num_resamples must be >= 2, got {num_resamples}")
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(m, generator=gen)
    a_idx, b_idx = perm[: m // 2], perm[m // 2 :]
    ga, ra, gb, rb = g[a_idx], r[a_idx], g[b_idx], r[b_idx]
    # reference on B: unbiased sample covariance of r and h, and its noise (variance of a mean of M_B terms)
    terms = (rb - rb.mean()).unsqueeze(1) * gb  # [M_B, P]
    ref = terms.sum(0) / (len(rb) - 1)
    ref_noise = float((terms - terms.mean(0)).square().sum() / (len(rb) - 1)) / len(rb)
    pop = optimal_constant_baseline(gb, rb)
    idx = torch.rand(num_resamples, len(ra), generator=gen).argsort(-1)[:, :R]
    sq_a = ga.square().sum(-1)
    rows = torch.zeros(num_resamples, len(ra), dtype=torch.float64)  # [S, M_A]: each group's weights on A's rows
    out: dict[str, dict[str, float]] = {}
    for name in estimators:
        coef = _group_coefficients(ra, sq_a, idx, name, pop["b_star"])  # [S, R]
        out[name] = estimate_moments(ga, rows.zero_().scatter_(1, idx, coef), ref)
    ref_norm = float(ref.norm())
    n = g.square().sum(-1)
    c, w = r == 1, r == 0
    return {
        "estimators": out,
        "ref_norm2": ref_norm**2,
        "ref_noise": ref_noise,
        "b_star_pop": pop["b_star"],
        "b_star_exact": pop["b_star_exact"],
        "p": float(r.mean()),
        "m_correct": float(n[c].mean()) if c.any() else math.nan,
        "m_wrong": float(n[w].mean()) if w.any() else math.nan,
        "mean_score": mean_score_norm(g),
    }


def equal_norms_test(
    grads: Tensor,
    rewards: Tensor,
    *,
    num_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
    max_permutations: int = 2000,
) -> dict:
    """Is m_C = m_W (the condition under which the group mean is the variance-optimal baseline) for one prompt?

    The verdict comes from a label-permutation test with the correct count k fixed (docs/theory.md §Baselines at
    matched expectation): statistic |Welch t| of mean_C ||h||^2 against mean_W ||h||^2 (studentized, so that the
    null is equal means rather than equal distributions: the 0.2 statistic |log ratio of means| rejected 0.19-0.38 of
    prompts when only the spreads differed), p-value = share of the C(M, k)
    relabellings (all of them up to ``max_permutations``, else that many at random and the observed one) whose
    statistic is >= the observed one. With rollouts exchangeable under the null (labels independent of the norms),
    P(p <= 0.05) <= 0.05 for every M and k, which is what makes 0.05 the control of the claim that counts rejections; a
    percentile bootstrap from 2 rollouts of a side has no such guarantee. A prompt is testable when each side has >= 2
    rollouts and C(M, k) >= 40, so that p can reach 0.05 (two mirror labellings give the same statistic when k = M/2);
    a prompt whose test cannot reject would count as evidence for m_C = m_W. The bootstrap interval of the ratio
    (correct and wrong rollouts resampled separately) is for reading only, and given only with >= MIN_UNITS rollouts
    of each side (None otherwise).

    Args:
        grads: [M, P] (or [M] squared norms).  rewards: [M] in {0, 1}.
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
    log_ratio = float(nc.mean().log() - nw.mean().log())

    # the studentized statistic |Welch t| of the two means, permuted: equal means, not equal
    # distributions, is the null; a studentized permutation test is exact under exchangeability and asymptotically
    # exact for equal means with unequal spreads (Janssen, Statist. Probab. Lett. 36, 1997)
    def welch(lab: Tensor) -> Tensor:  # lab [L, M] 0/1 -> [L]
        kc, kw = lab.sum(1), (1 - lab).sum(1)
        mc, mw = (lab @ n) / kc, ((1 - lab) @ n) / kw
        vc = (lab @ n.square() - kc * mc.square()) / (kc - 1)
        vw = ((1 - lab) @ n.square() - kw * mw.square()) / (kw - 1)
        se = (vc.clamp(min=0) / kc + vw.clamp(min=0) / kw).sqrt()
        return ((mc - mw) / se.clamp(min=torch.finfo(torch.float64).tiny)).abs()

    null = welch(labs)
    obs = float(welch(labels.double()[None])[0])
    ge = int((null >= obs - 1e-12).sum())
    p = ge / len(labs) if math.comb(m, k) <= max_permutations else (1 + ge) / (1 + len(labs))
    low = high = None
    if min(k, m - k) >= MIN_UNITS:
        bc = nc[torch.randint(len(nc), (num_boot, len(nc)), generator=gen)].mean(1)
        bw = nw[torch.randint(len(nw), (num_boot, len(nw)), generator=gen)].mean(1)
        ratios = bc / bw.clamp(min=1e-300)
        low, high = float(ratios.quantile(alpha / 2)), float(ratios.quantile(1 - alpha / 2))
    verdict = "m_C = m_W not rejected" if p > alpha else ("m_C > m_W" if log_ratio > 0 else "m_C < m_W")
    return {"ratio": math.exp(log_ratio), "p": p, "lo": low, "hi": high, "verdict": verdict}


#: the equivalence margin of m_C = m_W in effect units (fixed before any measurement): the root mean square
#: over prompts of log(m_C / m_W) at most log 1.25 (b* within about ±0.056 of p at p = 0.5; docs/theory.md §12)
LOG_RATIO_MARGIN = math.log(1.25)


def log_norm_ratio(sq_norms: Tensor, rewards: Tensor) -> tuple[float, float] | None:
    """One prompt's d = log(m̂_C / m̂_W) with m̂ the mean ‖h‖² of its correct / wrong rollouts, jackknifed on each side,
    and the jackknife variance of d (Quenouille 1956; Efron & Stein, Ann. Statist. 9, 1981).

    Per side of k rollouts with leave-one-out means m̂_(i) and l_i = log m̂_(i): the bias-corrected log mean
    k log m̂ − (k − 1) mean(l) (removes the O(1/k) bias −CV²/(2k) of log m̂, which differs between sides whose
    spreads differ) and the variance (k − 1)/k Σ (l_i − mean l)²; d is the difference of the sides, v the sum of
    their variances. The delta method's CV²/k under-states Var log m̂ for skewed ‖h‖² (by about 20% at k = 8,
    squared norms ~ Exponential(1)), which biased mean(d² − v) upward. Only the class means enter, so unequal
    spreads are no effect, and a side whose rollouts are one string (every m̂_(i) equal) is exact: d = log ratio,
    v = 0.

    Args:
        sq_norms: [M] ‖h_i‖² (or [M, P] gradients, squared and summed).  rewards: [M] in {0, 1}.

    Returns:
        (d, v), or None when a side has fewer than 2 rollouts or a leave-one-out mean that is not positive.
    """
    x = sq_norms.detach().double()
    n = x if x.dim() == 1 else x.square().sum(-1)
    c = rewards.detach() == 1
    correct, wrong = _jackknife_log_mean(n[c]), _jackknife_log_mean(n[~c])
    if correct is None or wrong is None:
        return None
    return correct[0] - wrong[0], correct[1] + wrong[1]


def _jackknife_log_mean(x: Tensor) -> tuple[float, float] | None:
    """(bias-corrected log mean, its jackknife variance) of one side's [k] values, or None with k < 2 or a
    leave-one-out mean <= 0 (:func:`log_norm_ratio`)."""
    k = len(x)
    if k < 2:
        return None
    loo = (x.sum() - x) / (k - 1)  # [k] leave-one-out means
    if not bool((loo > 0).all()):
        return None
    logs = loo.log()
    if float(logs.max() - logs.min()) == 0.0:  # one string: the mean is known exactly
        return float(x.mean().log()), 0.0
    centred = logs - logs.mean()
    return float(k * x.mean().log() - (k - 1) * logs.mean()), float((k - 1) / k * centred.square().sum())


def rms_log_ratio(d: Sequence[float], v: Sequence[float], w: Sequence[float] | None = None) -> dict[str, Any]:
    """The root mean square over prompts of δ_j = log(m_C / m_W), the effect size of "m_C = m_W" (docs/theory.md
    §12): y_j = d_j² − v_j estimates δ_j² without its noise term (E d_j² = δ_j² + Var d_j), so the weighted mean
    Σ w_j y_j / Σ w_j estimates the weighted mean of δ², with the linearised (ratio) interval of
    u_j = w_j (y_j − msq) over prompts (:func:`grpo_lens.formulas.stats.mean_interval`).

    Args:
        d: [n] per-prompt log ratios (the first of each :func:`log_norm_ratio` pair).
        v: [n] their estimated variances (the second of each pair).
        w: [n] per-prompt weights >= 0 that depend on the design only (:func:`log_ratio_weight` of the class
            counts), never on d or v; None weighs every prompt 1. With no prompt or every weight 0, msq and its
            interval are None.

    Returns:
        {"msq", "lo", "hi", "n" (weighted mean δ² and its interval), "rms", "rms_lo", "rms_hi" (their square roots,
        0 below zero), "y": the [n] per-prompt y_j, "w": the [n] weights}.
    """
    y = [di * di - vi for di, vi in zip(d, v)]
    w = [1.0] * len(y) if w is None else [float(wi) for wi in w]
    msq = sum(wi * yi for wi, yi in zip(w, y)) / sum(w) if sum(w) > 0 else None  # no prompt, or every weight 0
    ci = mean_interval([wi * (yi - msq) for wi, yi in zip(w, y)]) if msq is not None else mean_interval([])
    mean_w = sum(w) / len(w) if w else 1.0
    lo = None if ci["lo"] is None or msq is None else msq + ci["lo"] / mean_w
    hi = None if ci["hi"] is None or msq is None else msq + ci["hi"] / mean_w
    root = lambda a: None if a is None else math.sqrt(max(a, 0.0))  # noqa: E731
    return {
        "msq": msq,
        "lo": lo,
        "hi": hi,
        "n": len(y),
        "rms": root(msq),
        "rms_lo": root(lo),
        "rms_hi": root(hi),
        "y": y,
        "w": w,
    }


def log_ratio_weight(n_correct: int, n_wrong: int) -> float:
    """A prompt's weight in :func:`rms_log_ratio`: h² with h = k (M − k) / M the effective count of its two classes
    (k correct, M − k wrong rollouts), since Var d ∝ 1/h and Var(d² − v) ∝ 1/h² at equal coefficients of variation:
    inverse-variance weights that depend on the counts alone (a design weight, so the weighted y stays unbiased for
    the weighted δ²; docs/theory.md §12). Prompts with k near 0 or M count little. 0 when a class is empty."""
    m = n_correct + n_wrong
    return 0.0 if m == 0 else (n_correct * n_wrong / m) ** 2


def baseline_study(
    pools: Sequence[tuple[Tensor, Tensor]],
    group_size: int,
    *,
    num_resamples: int = 512,
    seed: int = 0,
    num_boot: int = 2000,
) -> dict:
    """:func:`prompt_baseline_study` over prompts, with 95% intervals over prompts (:func:`mean_interval`, Hall's
    transformed t).

    Args:
        pools: per prompt, (grads [M, P], rewards [M]) with M >= 4R. Prompts whose pool has no reward contrast are
            skipped (every centred estimator is 0 there) and counted in ``prompts_constant``.
        group_size: R.

    Returns:
        {"per_prompt": [prompt results, each with "equal_norms"], "summary": {estimator: {"mse_ratio_to_rloo",
        "cosine", "bias2_share"}: mean_interval over prompts}, "prompts": analysed count, "prompts_constant",
        "b_star_shift": mean_interval of b*_exact - b*, "b_star_minus_p": of b* - p (the group mean's expectation),
        "norm_ratio": of m_C / m_W, "mean_score_ratio": mean_interval of ||hbar||^2 over its
        mean-zero floor, "equal_norms_rejected": share of testable prompts whose permutation test rejects m_C = m_W
        at 0.05, "equal_norms_testable", "log_ratio_rms": :func:`rms_log_ratio` over the prompts with both sides
        (without its per-prompt "y")}.
        MSE is compared as the ratio to RLOO's per prompt (prompts differ in gradient scale); bias2_share = bias2 /
        mse.
    """
    per_prompt, constant = [], 0
    for j, (g, r) in enumerate(pools):
        res = baseline_prompt(g, r, group_size, num_resamples=num_resamples, seed=seed + j)
        if res is None:
            constant += 1
        else:
            per_prompt.append(res)
    return summarise_baseline_prompts(per_prompt, constant, num_boot=num_boot, seed=seed)


def baseline_prompt(
    grads: Tensor, rewards: Tensor, group_size: int, *, num_resamples: int = 512, seed: int = 0
) -> dict | None:
    """One prompt of :func:`baseline_study`: :func:`prompt_baseline_study` with its ``"equal_norms"``
    (:func:`equal_norms_test`) and ``"log_ratio"``, ``"log_ratio_var"`` (:func:`log_norm_ratio`, None where a side has
    fewer than 2 rollouts), or None when the pool has no reward contrast. grads: [M, P]; rewards: [M]."""
    if bool(constant_groups(rewards.view(1, -1), torch.ones(1, len(rewards), dtype=torch.bool))):
        return None
    res = prompt_baseline_study(grads, rewards, group_size, num_resamples=num_resamples, seed=seed)
    res["equal_norms"] = equal_norms_test(grads, rewards, seed=seed)
    lr = log_norm_ratio(grads, rewards)
    res["log_ratio"], res["log_ratio_var"] = lr if lr is not None else (None, None)
    res["n_correct"] = int((rewards == 1).sum())
    res["n_wrong"] = len(rewards) - res["n_correct"]
    return res


def summarise_baseline_prompts(
    per_prompt: Sequence[dict], constant: int = 0, *, num_boot: int = 2000, seed: int = 0
) -> dict:
    """The over-prompts part of :func:`baseline_study` (its return value) from :func:`baseline_prompt` results;
    ``constant`` prompts without reward contrast are only counted."""
    per_prompt = list(per_prompt)
    summary = {}
    for name in STUDY_ESTIMATORS:
        ratios = [
            p["estimators"][name]["mse"] / p["estimators"]["rloo"]["mse"]
            for p in per_prompt
            if p["estimators"]["rloo"]["mse"] > 0
        ]
        summary[name] = {
            "mse_ratio_to_rloo": mean_interval(ratios),
            "cosine": mean_interval([p["estimators"][name]["cosine"] for p in per_prompt]),
            "bias2_share": mean_interval(
                [
                    p["estimators"][name]["bias2"] / p["estimators"][name]["mse"]
                    for p in per_prompt
                    if p["estimators"][name]["mse"] > 0
                ],
            ),
        }
    testable = [p for p in per_prompt if p["equal_norms"]["verdict"] != "not testable"]
    return {
        "per_prompt": per_prompt,
        "summary": summary,
        "prompts": len(per_prompt),
        "prompts_constant": constant,
        "b_star_shift": mean_interval([p["b_star_exact"] - p["b_star_pop"] for p in per_prompt]),
        "b_star_minus_p": mean_interval([p["b_star_pop"] - p["p"] for p in per_prompt]),
        "norm_ratio": mean_interval(
            [p["m_correct"] / p["m_wrong"] for p in per_prompt if p["m_wrong"] and math.isfinite(p["m_correct"])],
        ),
        "mean_score_ratio": mean_interval([p["mean_score"]["ratio"] for p in per_prompt]),
        "equal_norms_rejected": (
            sum(p["equal_norms"]["verdict"] != "m_C = m_W not rejected" for p in testable) / len(testable)
        )
        if testable
        else math.nan,
        "equal_norms_testable": len(testable),
        "log_ratio_rms": {k: v for k, v in rms_log_ratio(*log_ratios(per_prompt)).items() if k not in ("y", "w")},
    }


def log_ratios(per_prompt: Sequence[dict]) -> tuple[list[float], list[float], list[float]]:
    """(d, v, w) of the prompts that have :func:`log_norm_ratio` and their class counts (rows from older probes have
    neither): w = :func:`log_ratio_weight`."""
    rows = [
        p
        for p in per_prompt
        if p.get("log_ratio") is not None and p.get("log_ratio_var") is not None and p.get("n_correct") is not None
    ]
    return (
        [float(p["log_ratio"]) for p in rows],
        [float(p["log_ratio_var"]) for p in rows],
        [log_ratio_weight(int(p["n_correct"]), int(p["n_wrong"])) for p in rows],
    )
