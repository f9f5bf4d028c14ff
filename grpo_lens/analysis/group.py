"""One analysis path: everything measured on ONE group of R rollouts, as a flat dict of canonical metric keys.

:func:`analyse_group` is the single per-group function that both the trainer's lens (:mod:`grpo_lens.lens.trainer_lens`)
and ``grpo-lens probe`` (:func:`grpo_lens.probe.groups.measure_group`) call; they only aggregate its rows over groups
(the lens: :func:`mean_over_groups` over the step's mixed groups; the probe: means with 95% intervals, strata by
k and by distinct completions, :mod:`grpo_lens.formulas.stats`). It composes the formulas of
:mod:`grpo_lens.formulas` into keys and computes nothing of its own: every key is named in :mod:`grpo_lens.metrics`
(documented in docs/metrics.md), every formula in docs/theory.md.

The input is the Gram matrix G = (<g_i, g_j>) [R, R] of the group's per-rollout gradients (exact over every
parameter, one layer's, or of a linear sketch: every key here is a function of inner products only, so a sketch gives
unbiased Gram entries), its rewards [R] and the advantages [R] the trainer actually used. g_i must be rollout i's
term in the trainer's loss gradient without its advantage (``sum_i A_i g_i`` = the group's share of the update
direction; docs/theory.md §3). Vectors g_i are never needed: a source that computes the Gram matrix directly serves
every key.

Keys of :func:`analyse_group` (``<m>`` ranges over :data:`grpo_lens.formulas.spectrum.RANK_MEASURES`: erank,
stable_rank, participation_ratio, k90, k99, top1_share, top2_share):

- ``group/size`` R, ``group/reward_mean``, ``group/correct`` k (0/1 rewards only), ``group/distinct_completions``
  (when completion ids are given).
- ``rank/g1_<m>``: G1, rows A_i g_i, and its controls on the same rows
  (:func:`grpo_lens.formulas.spectrum.g1_controls`): ``rank/g1_no_adv_<m>`` (rows g_i), ``rank/g1_random_<m>``
  (rows w_i g_i, w random zero-sum with ||w|| = ||A||, mean over draws), ``rank/g1_nll_<m>`` (rows of the supervised
  token-mean NLL gradient; with a completion mask), ``rank/g1_null_<m>`` (the orthogonal null: singular values
  |A_i| ||g_i||, what G1 would have if its rows were orthogonal) and ``rank/g1_<m>_vs_null`` = rank/g1_<m> /
  rank/g1_null_<m>; with ``null_dim`` = P also ``rank/g1_simnull_<m>``, the simulated null (G1's row norms, random
  directions in R^P).
- ``grad/identity_residual``: relative residual of sum_i A_i g_i = c (gbar_C - gbar_W) with the estimator's own c
  (:func:`grpo_lens.formulas.identity.identity_residual`, c from :func:`grpo_lens.formulas.identity.identity_constant`);
  absent when the identity does not apply (non-binary rewards, an estimator without the decomposition, advantages
  not two-valued per class). ``grad/identity_constant`` c.
- ``baseline/m_correct``, ``baseline/m_wrong``, ``baseline/b_star``, ``baseline/group_mean``,
  ``baseline/b_star_minus_mean`` (0/1 rewards; :func:`grpo_lens.formulas.baselines.baseline_metrics`).
- ``zero_sum/span_energy`` (share of G1's energy in span{gbar_C, gbar_W}), ``zero_sum/cos_gap`` (mean within-class
  minus mean between-class cosine of the g_i), each with ``..._null`` (mean over relabellings that keep k),
  ``..._excess`` (observed minus that mean) and ``..._p`` (permutation p-value, exact over all C(R, k) relabellings up
  to ``max_permutations``); 0/1 rewards only (:func:`grpo_lens.formulas.zero_sum.zero_sum_tests`).

The other functions give the keys of the probe's model-dependent pieces in the same vocabulary: :func:`g1_rank_keys`
(G1 of one layer), :func:`g2_keys` (G2 of one layer), :func:`sketch_check_keys` (the sketch against exact gradients,
with :func:`parameter_category`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from grpo_lens import metrics as mk
from grpo_lens.formulas.advantages import is_binary
from grpo_lens.formulas.baselines import baseline_metrics
from grpo_lens.formulas.identity import identity_constant, identity_residual
from grpo_lens.formulas.sketch_error import sketch_gram_error_bound
from grpo_lens.formulas.spectrum import (
    RANK_MEASURES,
    distinct_completions,
    effective_rank,
    g1_controls,
    gram_singular_values,
    numerical_rank,
    rank_measures,
    simulated_null_measures,
    weighted_gram_measures,
)
from grpo_lens.formulas.spectrum import singular_values as svals
from grpo_lens.formulas.stats import mean_interval
from grpo_lens.formulas.zero_sum import zero_sum_tests


def analyse_group(
    gram: Tensor,
    rewards: Tensor,
    advantages: Tensor,
    *,
    completion_mask: Tensor | None = None,
    completion_ids: Tensor | None = None,
    estimator: str = "grpo",
    std: str = "sample",
    std_eps: float = 1e-4,
    num_random: int = 8,
    max_permutations: int = 256,
    null_dim: int | None = None,
    seed: int = 0,
) -> dict[str, float]:
    """Every per-group measurement of GRPO's gradient structure, as canonical metric keys (module docstring).

    Args:
        gram: [R, R] Gram matrix <g_i, g_j> of the per-rollout gradients (exact or sketched), float (symmetric PSD).
        rewards: [R] float, all valid.
        advantages: [R] the advantages the trainer used for these rollouts.
        completion_mask: [R, T] bool, optional (NLL control).
        completion_ids: [R, T] long, optional (distinct completions).
        estimator: the advantage estimator (for the identity's constant).
        std: its std convention.
        std_eps: its epsilon.
        num_random: draws of random zero-sum weights for ``rank/g1_random_*``.
        max_permutations: relabellings of the permutation test (exhaustive up to this many).
        null_dim: P, the dimension the g_i live in; with it, ``rank/g1_simnull_<m>`` (the simulated null of
            :func:`grpo_lens.formulas.spectrum.simulated_null_measures`); without it the claims use the orthogonal
            null, its limit as P grows.
        seed: seed of the random draws.

    Returns:
        {key: float}; keys that do not apply to this group are absent (see module docstring).

    Raises:
        AssertionError: shapes disagree.
    """
    R = gram.shape[0]
    assert gram.shape == (R, R) and rewards.shape == (R,) and advantages.shape == (R,), (
        gram.shape,
        rewards.shape,
        advantages.shape,
    )
    gram = gram.detach().double()
    a = advantages.detach().double()
    rw = rewards.detach().double()
    out: dict[str, float] = {mk.GROUP_SIZE: float(R), mk.GROUP_REWARD_MEAN: float(rw.mean())}
    if completion_ids is not None and completion_mask is not None:
        out[mk.GROUP_DISTINCT_COMPLETIONS] = float(distinct_completions(completion_ids, completion_mask))

    # G1 and its controls
    controls = g1_controls(gram, a, completion_mask, num_random=num_random, seed=seed)
    for name, measures in controls.items():
        for m, v in measures.items():
            out[mk.rank_key(name, m)] = v
    g1, null = controls["g1"], controls["g1_null"]
    if null_dim is not None:
        for m, v in simulated_null_measures(gram, a, null_dim, seed=seed).items():
            out[mk.RANK_G1_SIMNULL.format(m=m)] = v
    for m in RANK_MEASURES.names():
        if null[m] > 0:
            out[mk.RANK_G1_VS_NULL.format(m=m)] = g1[m] / null[m]

    if is_binary(rw):
        labels = rw == 1
        k = int(labels.sum())
        out[mk.GROUP_CORRECT] = float(k)
        if 0 < k < R:
            out.update({key: float(v) for key, v in baseline_metrics(gram.diagonal(), rw).items()})
            two_valued = bool((a[labels] == a[labels][0]).all() and (a[~labels] == a[~labels][0]).all())
            # the config's check allows only these names
            c = identity_constant(estimator, k, R, std, std_eps)  # type: ignore[arg-type]  # None: the estimator has no decomposition
            if c is not None and two_valued:
                out[mk.GRAD_IDENTITY_CONSTANT] = c
                out[mk.GRAD_IDENTITY_RESIDUAL] = identity_residual(gram, labels, a, c)
            if two_valued:
                same = None
                if completion_ids is not None and completion_mask is not None:  # duplicates by token ids, exact
                    seqs = [tuple(x[m].tolist()) for x, m in zip(completion_ids, completion_mask.bool())]
                    same = torch.tensor([[u == v for v in seqs] for u in seqs])
                out.update(
                    zero_sum_tests(gram, rw, a, max_permutations=max_permutations, seed=seed, same_completion=same)
                )
    return out


def mean_over_groups(
    rows: Sequence[dict[str, float]], max_keys: Sequence[str] = (mk.GRAD_IDENTITY_RESIDUAL,)
) -> dict[str, float]:
    """The lens's aggregate: the mean over groups of every key (max for ``max_keys``), NaN/None skipped.

    rows: per-group dicts from :func:`analyse_group`. Returns {key: float}.
    """
    keys = sorted({k for row in rows for k in row})
    out = {}
    for k in keys:
        vals = [float(row[k]) for row in rows if row.get(k) is not None and math.isfinite(float(row[k]))]
        if vals:
            out[k] = max(vals) if k in max_keys else sum(vals) / len(vals)
    return out


#: the rank measures whose interval over groups the lens logs each lens step (the rank claims' measures)
LENS_INTERVAL_MEASURES = ("top2_share", "top1_share", "erank", "stable_rank")


def lens_rank_intervals(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    """``rank/g1_<m>_lo`` / ``_hi``: the 95% interval over the step's groups (Hall's t,
    :func:`grpo_lens.formulas.stats.mean_interval`) of the measures of :data:`LENS_INTERVAL_MEASURES`; none with
    fewer than 8 groups. rows: per-group dicts from :func:`analyse_group`."""
    out = {}
    for m in LENS_INTERVAL_MEASURES:
        ci = mean_interval([row.get(mk.RANK_G1.format(m=m)) for row in rows])
        if ci["lo"] is not None:
            # lo set: hi is set too
            out[mk.RANK_G1_LO.format(m=m)], out[mk.RANK_G1_HI.format(m=m)] = ci["lo"], ci["hi"]  # type: ignore[assignment]
    return out


def g1_rank_keys(gram: Tensor, advantages: Tensor, name: str) -> dict[str, float]:
    """``rank/<name>_<m>`` for the matrix with rows A_i g_i (e.g. ``name="g1_layer"`` for one layer's rows), from
    the Gram matrix of the g_i.

    gram: [R, R]; advantages: [R]. Returns {key: float}.
    """
    return {
        mk.rank_key(name, m): v for m, v in weighted_gram_measures(gram.detach().double(), advantages.double()).items()
    }


def g2_keys(
    g2: Tensor, rank_bound: int, computed_dtype: torch.dtype = torch.float32, singular_values: Tensor | None = None
) -> dict[str, float]:
    """``rank/g2_<m>``, ``rank/g2_numerical_rank`` and ``rank/g2_rank_bound`` of one layer's weight gradient of the
    group loss, G2 [d_out, d_in] (docs/theory.md §5).

    Args:
        g2: [d_out, d_in].  rank_bound: :func:`grpo_lens.formulas.spectrum.g2_rank_bound` of the group.
        computed_dtype: the precision G2 was computed in (sets the numerical-rank tolerance).
        singular_values: G2's singular values if already computed (else from the smaller Gram matrix in float64:
            accurate to ~1e-8 s_1, well below the float32 rank tolerance max(d) * 1.2e-7).
    """
    s = svals(g2.double(), method="gram") if singular_values is None else singular_values
    out = {mk.rank_key("g2", m): v for m, v in rank_measures(s).items()}
    # G2 is a matrix
    out[mk.RANK_G2_NUMERICAL_RANK] = float(numerical_rank(s, shape=tuple(g2.shape), dtype=computed_dtype))  # type: ignore[arg-type]
    out[mk.RANK_G2_RANK_BOUND] = float(rank_bound)
    return out


def parameter_category(name: str, module_is_linear: bool) -> str:
    """'linear' (an nn.Linear weight: what the sketch covers), 'embedding', 'norm' or 'other' (biases, ...)."""
    if module_is_linear and name.endswith(".weight"):
        return "linear"
    if "embed" in name:
        return "embedding"
    if "norm" in name:
        return "norm"
    return "other"


def sketch_check_keys(
    exact_gram: Tensor,
    sketch: Tensor,
    advantages: Tensor,
    category_sq_norms: dict[str, float],
    layer_grams: Sequence[Tensor],
    sketch_in: int,
    sketch_out: int,
) -> dict[str, float]:
    """How well one group's sketch stands in for its exact per-rollout gradients (docs/theory.md §8), from exact
    Gram matrices (every quantity below is a function of inner products <g_i, g_j>; no [R, P] vector is needed).

    Args:
        exact_gram: [R, R] <g_i, g_j> over every parameter (:func:`grpo_lens.gradients.gram.exact_rollout_gram`).
        sketch: [R, P_s] the sketched g_i of the same rollouts.   advantages: [R].
        category_sq_norms: {category: sum_i ||g_i||^2 over that category's parameters} (categories of
            :func:`parameter_category`; their sum is trace(exact_gram)).
        layer_grams: [R, R] exact Grams of the sketched (nn.Linear) weights, one per layer, for the error bound.
        sketch_in: sketch size on the layer-input side.
        sketch_out: sketch size on the layer-output side.

    Returns:
        ``sketch/coverage``: Σ_i ||S g_i||² / Σ_i ||g_i||² (the sketch's energy, unbiased for the part it sees, over the
        exact total); ``sketch/exact_share_<category>``: each category's share of Σ_i ||g_i||²;
        ``sketch/gram_error``: ||Ĝ - G||_F / ||G||_F for G1's Gram (W G W) sketched vs exact over every parameter
        (missing coverage and projection noise together); ``sketch/gram_error_bound``: the bound of
        :func:`grpo_lens.formulas.sketch_error.sketch_gram_error_bound` for the sketched layers alone;
        ``sketch/g1_erank_error``: erank(G1) sketched minus exact. Empty when every g_i is 0.
    """
    e, s = exact_gram.detach().double().cpu(), sketch.detach().double().cpu()
    a = advantages.detach().double().cpu()
    total = float(e.trace())
    out: dict[str, float] = {}
    if total == 0:
        return out
    out[mk.SKETCH_COVERAGE] = float(s.square().sum()) / total
    for cat, sq in category_sq_norms.items():
        out[mk.sketch_share_key(cat)] = float(sq) / total
    w = torch.outer(a, a)
    g_exact, g_sketch = e * w, (s @ s.T) * w
    den = float(g_exact.norm())
    if den > 0:
        out[mk.SKETCH_GRAM_ERROR] = float((g_sketch - g_exact).norm()) / den
        grams = [g.detach().double().cpu() * w for g in layer_grams]
        if grams:
            out[mk.SKETCH_GRAM_ERROR_BOUND] = sketch_gram_error_bound(grams, sketch_in, sketch_out)
    out[mk.SKETCH_G1_ERANK_ERROR] = effective_rank(gram_singular_values(g_sketch)) - effective_rank(
        gram_singular_values(g_exact)
    )
    return out
