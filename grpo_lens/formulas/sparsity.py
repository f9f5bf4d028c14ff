"""Sparsity of GRPO's signal and updates (docs/theory.md §9, §S1, §Sparsity over training).

Shapes: B prompts, R group size, M rollouts of a prompt (M >= R), S sampled entries of the weights (each standing for
``weights`` entries of the full vector), P parameters.

- S1, groups without reward contrast. Measured with :func:`grpo_lens.formulas.advantages.constant_groups` (the one
  test, shared with the advantages); predicted under the Bernoulli model by :func:`predicted_zero_variance_fraction`
  (p known) and without bias from rollouts outside the group by :func:`unbiased_zero_variance_probability` and
  :func:`s1_predicted_outside_group` (what ``grpo-lens probe`` and its baseline study print).
- S2 / S3 of a vector from weighted samples: :func:`zero_share`, :func:`weighted_hoyer` (Hoyer sparsity),
  :func:`top_energy_share` (the top-1% energy share, S2-style), together :func:`sparsity_measures`.
- S4, the bf16 view of an update: :func:`bf16_unchanged_fraction` (every parameter), :func:`update_sparsity` (sampled
  entries, with the claim's control :func:`permuted_bf16_unchanged_probability`, the same update entries permuted
  within each tensor, and the dense Gaussian control :func:`dense_bf16_unchanged_probability`, both from
  :func:`bf16_rounding_cell`).
- :func:`layer_type`: the layer type (norm, embedding, attention, mlp, other) of a parameter name, by which the
  sparsity keys ``sparsity/<type>/...`` are split.

The trainer-side state that samples the weights and keeps the snapshots is :mod:`grpo_lens.lens.sparsity`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

import numpy as np
import torch
from torch import Tensor

from grpo_lens import metrics as mk
from grpo_lens.formulas.stats import stratified_mean_se


def predicted_zero_variance_fraction(success_rates: Tensor, group_size: int) -> float:
    """S1 predicted: mean over prompts of p^R + (1-p)^R, the chance that R Bernoulli(p) rewards are all equal.

    Args:
        success_rates: [B] per-prompt success probabilities p in [0, 1].
        group_size: R.

    Returns:
        float in [0, 1] (p = 0.5, R = 2 gives 0.5).

    Raises:
        ValueError: p outside [0, 1] or R < 1.
    """
    p = torch.as_tensor(success_rates, dtype=torch.float64).reshape(-1)
    if group_size < 1:
        raise ValueError(f"group size must be >= 1, got {group_size}")
    if ((p < 0) | (p > 1)).any():
        raise ValueError("success rates must lie in [0, 1]")
    return float((p**group_size + (1 - p) ** group_size).mean())


def unbiased_zero_variance_probability(correct: Tensor | int, rollouts: Tensor | int, group_size: int) -> Tensor:
    """Unbiased estimate of p^R + (1-p)^R from M >= R Bernoulli(p) rollouts of which k are correct.

        est(k; M, R) = [C(k, R) + C(M - k, R)] / C(M, R),

    the chance that R rollouts drawn without replacement from the M are all correct or all wrong. It is a
    U-statistic: averaging the indicator "all R equal" over every R-subset of the M, whose expectation is
    p^R + (1-p)^R for each subset, so E[est] = p^R + (1-p)^R exactly (Hoeffding 1948; docs/theory.md §S1). With
    M = R it is the indicator itself; the plug-in p_hat^R + (1-p_hat)^R is biased upwards (Jensen).

    Args:
        correct: k, [B] long/float (or an int), 0 <= k <= M.
        rollouts: M, [B] or an int, M >= R.
        group_size: R >= 1.

    Returns:
        [B] float64 in [0, 1] (a 0-d tensor for scalar inputs).

    Raises:
        ValueError: R < 1, M < R, or k outside [0, M].
    """
    k = torch.as_tensor(correct, dtype=torch.float64)
    m = torch.as_tensor(rollouts, dtype=torch.float64)
    k, m = torch.broadcast_tensors(k, m)
    if group_size < 1:
        raise ValueError(f"group size R must be >= 1, got {group_size}")
    if (m < group_size).any():
        raise ValueError(f"need M >= R = {group_size} rollouts per prompt, got M = {int(m.min())}")
    if ((k < 0) | (k > m)).any() or (k != k.round()).any():
        raise ValueError("correct counts k must be whole numbers in [0, M]")

    def log_choose(n: Tensor, group_size: int) -> Tensor:  # log C(n, R), -inf where n < R
        out = torch.lgamma(n + 1) - math.lgamma(group_size + 1) - torch.lgamma((n - group_size).clamp(min=0) + 1)
        return torch.where(n >= group_size, out, torch.full_like(n, -math.inf))

    denom = log_choose(m, group_size)
    return (log_choose(k, group_size) - denom).exp() + (log_choose(m - k, group_size) - denom).exp()


def s1_predicted_outside_group(correct: Tensor, group_size: int) -> Tensor:
    """S1 predicted for each prompt's group (its first R rollouts) from the prompt's other M - R rollouts.

    :func:`unbiased_zero_variance_probability` with k = the correct count among rollouts R..M-1: unbiased for
    p^R + (1-p)^R and independent of the group itself, so measured - predicted has mean 0 under the Bernoulli model
    (docs/theory.md §S1).

    Args:
        correct: [B, M] bool (e.g. reward >= 1), the group's R rollouts first.
        group_size: R, with M - R >= R.

    Returns:
        [B] float64 in [0, 1].

    Raises:
        ValueError: M - R < R.
    """
    m, R = correct.shape[-1], group_size
    if m - R < R:
        raise ValueError(
            f"need M >= 2R rollouts per prompt to predict S1 from rollouts outside the group (M = {m}, R = {R})"
        )
    return unbiased_zero_variance_probability(correct[..., R:].long().sum(-1), m - R, R)


def bf16_unchanged_fraction(before: Iterable[Tensor], after: Iterable[Tensor]) -> float:
    """Share of parameters whose bf16 value is identical in two snapshots (Mukherjee et al. 2025, arXiv 2505.11711).

    Args:
        before: a tensor (any dtype; compared after casting to bfloat16).
        after: the matching tensor after the change.

    Returns:
        float in [0, 1] (1 for no parameters).
    """
    same, total = bf16_unchanged_counts(before, after)
    return same / total if total else 1.0


def bf16_unchanged_counts(before: Iterable[Tensor], after: Iterable[Tensor]) -> tuple[int, int]:
    """(entries whose bf16 value is identical in two snapshots, entries): the counts of
    :func:`bf16_unchanged_fraction`, which add up over the shards of a sharded model.

    Args:
        before: a tensor (any dtype; compared after casting to bfloat16).
        after: the matching tensor after the change.
    """
    same = total = 0
    for a, b in zip(before, after, strict=True):
        assert a.shape == b.shape, (a.shape, b.shape)
        # count_nonzero, not a bool tensor's sum: the same count, 3-5x faster over 10^8 entries on a CPU
        same += int(torch.count_nonzero(a.to(torch.bfloat16) == b.to(device=a.device, dtype=torch.bfloat16)))
        total += a.numel()
    return same, total


#: (type, regex searched in a parameter name), tried in this order; the first match is the parameter's type (norm
#: first, so that ``post_attention_layernorm`` is a norm, not attention).
LAYER_TYPES: tuple[tuple[str, str], ...] = (
    ("norm", r"norm|ln_"),
    ("embedding", r"embed|wte|wpe|lm_head"),
    ("attention", r"q_proj|k_proj|v_proj|o_proj|attn|attention"),
    ("mlp", r"gate_proj|up_proj|down_proj|mlp|fc\d"),
)


def layer_type(name: str) -> str:
    """The layer type of parameter ``name`` (``model.layers.3.mlp.up_proj.weight`` -> ``mlp``): norm, embedding,
    attention, mlp (the first match in :data:`LAYER_TYPES`), else other; the ``<type>`` of ``sparsity/<type>/...``.

    Not the grouping of G2's keys, which is the module's last name component
    (:func:`grpo_lens.gradients.g2.module_kind`: ``up_proj``).
    """
    for kind, pattern in LAYER_TYPES:
        if re.search(pattern, name):
            return kind
    return "other"


def _weights_like(x: Tensor, weights: Tensor | None) -> Tensor:
    w = torch.ones_like(x, dtype=torch.float64) if weights is None else weights.to(torch.float64)
    assert w.shape == x.shape, (w.shape, x.shape)
    return w


def zero_share(x: Tensor, weights: Tensor | None = None) -> float:
    """Share of entries exactly 0. x: [S]; weights: [S] entries each sample stands for (None: 1 each). -> [0, 1]."""
    w = _weights_like(x, weights)
    return float((w * (x == 0)).sum() / w.sum()) if w.sum() > 0 else 1.0


def weighted_hoyer(x: Tensor, weights: Tensor | None = None) -> float:
    """Hoyer sparsity (S3) (sqrt(n) - ||x||_1/||x||_2) / (sqrt(n) - 1) of the full vector, from weighted samples.

    n = sum w (the full vector's length); ||x||_1 ~ sum w |x|, ||x||_2^2 ~ sum w x^2 (exact with unit weights on
    every entry). Source: Hoyer, JMLR 5 (2004), eq. 1.

    Args:
        x: [S] float.  weights: [S] > 0 or None.

    Returns:
        float in [0, 1]; NaN for an all-zero x (0/0: a zero gradient or update has no sparsity to read, and the 1 an
        epsilon would give reads as "one entry"; the run directory stores it as null).
    """
    w = _weights_like(x, weights)
    v = x.detach().double()
    n = float(w.sum())
    if n < 2:
        raise ValueError(f"Hoyer sparsity needs at least 2 entries, got {n}")
    return hoyer_from_norms(float((w * v.abs()).sum()), math.sqrt(float((w * v.square()).sum())), n)


def hoyer_from_norms(l1: float, l2: float, n: float) -> float:
    """(sqrt(n) - l1/l2) / (sqrt(n) - 1): the one body of Hoyer sparsity (Hoyer, JMLR 5 (2004), eq. 1), from a
    vector's (weighted) L1 and L2 norms and its length n >= 2; NaN when l2 = 0 (an all-zero vector: 0/0)."""
    if l2 == 0:
        return math.nan
    return (math.sqrt(n) - l1 / l2) / (math.sqrt(n) - 1)


def top_energy_share(x: Tensor, weights: Tensor | None = None, top: float = 0.01) -> float:
    """Share of ||x||^2 held by the largest-|x| ``top`` fraction of entries (S2-style; 0.01 = the top 1%).

    With weights, entries are sorted by |x| and taken, largest first, until their weights reach ``top * sum w``
    (the last one fractionally). A dense vector with equal magnitudes gives ``top``; a one-hot vector gives 1.

    Args:
        x: [S] float.  weights: [S] or None.  top: fraction in (0, 1].

    Returns:
        float in [0, 1]; NaN for an all-zero x (no energy to share; as :func:`weighted_hoyer`).
    """
    if not 0 < top <= 1:
        raise ValueError(f"top must be in (0, 1], got {top}")
    w = _weights_like(x, weights)
    e = x.detach().double().square()
    order = torch.argsort(e, descending=True)
    return top_share_of_sorted(e[order], w[order], top)


def top_share_of_sorted(e: Tensor, w: Tensor, top: float) -> float:
    """The one body of the top-``top`` energy share: squared entries ``e`` [S] sorted in descending order with
    their weights ``w`` [S], taken largest first until their weights reach ``top`` · Σw (the last one fractionally);
    NaN when Σ w e = 0 (an all-zero vector)."""
    total = float((w * e).sum())
    if total == 0:
        return math.nan
    before = torch.cumsum(w, 0) - w  # weight of the larger entries
    take = (top * float(w.sum()) - before).clamp(min=0).minimum(w)  # how much of each entry's weight is in the top
    return float((take * e).sum() / total)


def sparsity_measures(x: Tensor, weights: Tensor | None = None, top: float = 0.01) -> dict[str, float]:
    """{"zero": :func:`zero_share`, "hoyer": :func:`weighted_hoyer`, "top1_energy": :func:`top_energy_share`}."""
    return {
        "zero": zero_share(x, weights),
        "hoyer": weighted_hoyer(x, weights),
        "top1_energy": top_energy_share(x, weights, top),
    }


def bf16_rounding_cell(values: Tensor) -> tuple[Tensor, Tensor]:
    """[lo, hi]: the float32 interval that rounds to the same bfloat16 value as each entry.

    bf16 keeps the top 16 bits of a float32, so the bf16 neighbours of v = bf16(x) are the float32 bit patterns
    of v +- 2^16; the cell runs between the midpoints (round to nearest; ties, which have measure 0, are ignored).

    Args:
        values: [S] float.

    Returns:
        (lo [S], hi [S]) float64 with lo <= x <= hi for finite x.
    """
    v = values.detach().float().to(torch.bfloat16).float()
    bits = v.view(torch.int32)
    a = (bits + 65536).view(torch.float32).double()  # next bf16 away from 0 (towards -inf for negative v)
    b = (bits - 65536).view(torch.float32).double()  # next bf16 towards 0
    v64 = v.double()
    zero = v == 0
    tiny = 2.0**-133  # the smallest positive bf16 (subnormal)
    b = torch.where(zero, torch.full_like(v64, -tiny), b)  # bits - 2^16 of +0 is not a number
    a = torch.where(zero, torch.full_like(v64, tiny), a)
    m1, m2 = (v64 + a) / 2, (v64 + b) / 2
    return torch.minimum(m1, m2), torch.maximum(m1, m2)


def dense_bf16_unchanged_probability(values: Tensor, rms: Tensor | float) -> Tensor:
    """P(bf16(v + d) == bf16(v)) for a dense Gaussian update d ~ N(0, rms^2) of each entry.

    = Phi((hi - v) / rms) - Phi((lo - v) / rms) with [lo, hi] the bf16 rounding cell of v
    (:func:`bf16_rounding_cell`). The control for the bf16-unchanged share: an update with no zero entries at all
    still leaves this share of bf16 values unchanged.

    Args:
        values: [S] float, the weights before the update.
        rms: scalar or [S] > 0, the update's per-tensor root mean square.

    Returns:
        [S] float64 probabilities (1 where rms = 0).
    """
    lo, hi = bf16_rounding_cell(values)
    v = values.detach().double()
    s = torch.as_tensor(rms, dtype=torch.float64).expand_as(v)
    safe = s.clamp(min=1e-300)
    phi = lambda z: 0.5 * torch.erfc(-z / math.sqrt(2.0))  # noqa: E731  (standard normal CDF, accurate in the tails)
    p = phi((hi - v) / safe) - phi((lo - v) / safe)
    return torch.where(s > 0, p, torch.ones_like(p))


def permuted_bf16_unchanged_probability(values: Tensor, update: Tensor, strata: Tensor | None = None) -> Tensor:
    """For each entry, the chance that its bf16 value is unchanged when the update's entries are permuted at random
    within its stratum (tensor): the within-tensor permutation control of "most parameters unchanged".

    Entry i of stratum t, with weight v_i and bf16 rounding cell [lo_i, hi_i] (:func:`bf16_rounding_cell`), receives a
    uniformly random one of the stratum's update entries d_j under a random permutation, so

        p_i = (1/s_t) · #{j in t : lo_i <= v_i + d_j <= hi_i},

    the exact mean over all within-stratum permutations (no draws), by sorting each stratum's d once and two binary
    searches per entry: O(S log S). The control keeps every tensor's distribution of update magnitudes (zeros
    included) and the weights, and removes only where each magnitude lands. Its mean equals the observed bf16-unchanged
    share when placement does not matter; a dense update with heavy-tailed magnitudes (most entries far below the bf16
    spacing, a few large) matches it, which the dense Gaussian control (:func:`dense_bf16_unchanged_probability`, one
    RMS per tensor, dominated by the large entries) does not: it reads such an update as sparser than rounding.
    Because zeros stay zeros under a permutation, the control cannot tell a sparse update from a small one; the
    float32-unchanged share does (docs/theory.md §Sparsity over training).

    Args:
        values: [S] float, the weights before the update (sampled entries).
        update: [S] float, d = after - before of the same entries.
        strata: [S] long, the tensor of each entry (None: one stratum).

    Returns:
        [S] float64 in [0, 1].

    Raises:
        ValueError: mismatched shapes.
    """
    if values.shape != update.shape or (strata is not None and strata.shape != values.shape):
        raise ValueError(
            f"values, update and strata must have one shape, got {values.shape}, {update.shape}, "
            f"{None if strata is None else strata.shape}"
        )
    lo, hi = bf16_rounding_cell(values)
    v = values.detach().float().double()
    d = update.detach().float().double()
    h = torch.zeros_like(d, dtype=torch.long) if strata is None else strata.reshape(-1).long()
    # each stratum's entries contiguous, then one sort and two searches per stratum (numpy's searchsorted: torch's
    # pays a thread start-up per call, ~10x slower on a few thousand entries)
    order = torch.argsort(h, stable=True).numpy()
    ends = torch.cumsum(torch.bincount(h), 0).tolist()
    dn, lon, hin = d.numpy()[order], (lo - v).numpy()[order], (hi - v).numpy()[order]
    counts = np.empty(len(order), dtype=np.float64)
    start = 0
    for end in ends:
        if end > start:
            ds = np.sort(dn[start:end])
            counts[start:end] = (
                np.searchsorted(ds, hin[start:end], side="right") - np.searchsorted(ds, lon[start:end], side="left")
            ) / (end - start)
        start = end
    out = torch.empty_like(d)
    out[torch.from_numpy(order)] = torch.from_numpy(counts)
    return out


def update_sparsity(
    before: Tensor,
    after: Tensor,
    weights: Tensor | None = None,
    rms: Tensor | float | None = None,
    strata: Tensor | None = None,
) -> dict[str, float]:
    """Sparsity of the update d = after - before of sampled entries, and its bf16 view with its controls.

    Args:
        before: [S] float32 weights (the sampled entries).
        after: [S] the same entries after the change.
        weights: [S] entries each sample stands for, or None (1 each).
        rms: [S] or scalar, the per-tensor RMS of d for the dense control; default: the RMS of the given d.
        strata: [S] long, the tensor of each entry, for the permutation control and the stratified standard errors
            (None: one stratum).

    Returns:
        {"f32_unchanged": share with d = 0 exactly, "bf16_unchanged": share with bf16(after) = bf16(before),
            "bf16_permuted": the expected bf16-unchanged share with d permuted within each stratum
            (:func:`permuted_bf16_unchanged_probability`),
            "bf16_dense": the expected bf16-unchanged share of a dense Gaussian update with the same per-tensor RMS,
            "hoyer", "top1_energy": of d,
            "f32_unchanged_se", "bf16_unchanged_se", "bf16_excess_se": the stratified standard errors
            (:func:`grpo_lens.formulas.stats.stratified_mean_se`) of the two shares and of bf16_unchanged -
            bf16_permuted}. All weighted means over the sampled entries.
    """
    assert before.shape == after.shape, (before.shape, after.shape)
    d = after.detach().float() - before.detach().float()
    w = _weights_like(d, weights)
    h = torch.zeros_like(d, dtype=torch.long) if strata is None else strata
    if rms is None:
        rms = float(d.double().square().mean().sqrt()) if d.numel() else 0.0
    same16 = (before.detach().float().to(torch.bfloat16) == after.detach().float().to(torch.bfloat16)).double()
    dense = dense_bf16_unchanged_probability(before, rms)
    perm = permuted_bf16_unchanged_probability(before, d, h)
    m = sparsity_measures(d, w)
    return {
        "f32_unchanged": m["zero"],
        "bf16_unchanged": float((w * same16).sum() / w.sum()),
        "bf16_permuted": float((w * perm).sum() / w.sum()),
        "bf16_dense": float((w * dense).sum() / w.sum()),
        "hoyer": m["hoyer"],
        "top1_energy": m["top1_energy"],
        "f32_unchanged_se": stratified_mean_se((d == 0).double(), w, h),
        "bf16_unchanged_se": stratified_mean_se(same16, w, h),
        "bf16_excess_se": stratified_mean_se(same16 - perm, w, h),
    }


#: Metric names of :meth:`SparsityOverTraining.after_step` for the whole model; per layer type they are
#: ``sparsity/<type>/<name>`` (docs/metrics.md). Named once, in :data:`grpo_lens.metrics.SPARSITY_MEASURES`.
UPDATE_MEASURES = mk.SPARSITY_MEASURES["update_step"]

#: The measures of a sampled vector (``sparsity/grad_<name>``), from :data:`grpo_lens.metrics.SPARSITY_MEASURES`.
GRAD_MEASURES = mk.SPARSITY_MEASURES["grad"]


def flatten_sparsity(prefix: str, results: dict[str, dict[str, float]]) -> dict[str, float]:
    """{"all": {m: v}, type: {m: v}} -> {"sparsity/<prefix>_<m>": v, "sparsity/<type>/<prefix>_<m>": v}."""
    out = {}
    for group, values in results.items():
        for m, v in values.items():
            out[mk.sparsity_key(prefix, m, None if group == "all" else group)] = v
    return out
