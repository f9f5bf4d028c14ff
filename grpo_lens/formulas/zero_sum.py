"""Zero-sum structure of a group's gradient: the label-permutation test with k fixed (docs/theory.md §6).

One group of R rollouts with 0/1 rewards, k of them correct (0 < k < R); everything is computed from the Gram matrix
G = (<g_i, g_j>) [R, R] of the per-rollout gradients (exact or sketched) and the advantages [R].

- :func:`span_energy`: the share of the energy of the rows A_i g_i (G1) in span{gbar_C, gbar_W}.
- :func:`cosine_gap`: mean within-class minus mean between-class cosine of the g_i.
- :func:`zero_sum_tests`: both statistics against their permutation null, relabellings that keep k
  (:func:`fixed_k_labellings`: all C(R, k) up to ``max_permutations``, else random): ``zero_sum/<stat>``,
  ``_null``, ``_excess`` and ``_p``, the keys :func:`grpo_lens.analysis.group.analyse_group` reports.
- :data:`WEIGHTINGS` / :func:`weightings`: the row weightings of the zero-sum test on G2 and G3 (the advantages and
  the controls that are not zero-sum), used by the probe's G3 and its G2 stable ranks.

:func:`fixed_k_labellings` also serves the m_C = m_W test of :func:`grpo_lens.formulas.baselines.equal_norms_test`.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor

from grpo_lens import metrics as mk


def fixed_k_labellings(num_rollouts: int, k: int, max_permutations: int, generator: torch.Generator) -> list[Tensor]:
    """The relabellings of a permutation test with k fixed: all C(n, k) boolean labellings of n = ``num_rollouts``
    (a group's R, or a baseline pool's M) with k ones when there are at most ``max_permutations``, else that many
    drawn at random with ``generator`` (each a [n] bool tensor; the caller adds the observed labelling to a random
    draw's p-value)."""
    if math.comb(num_rollouts, k) <= max_permutations:
        out = []
        for idx in itertools.combinations(range(num_rollouts), k):
            lab = torch.zeros(num_rollouts, dtype=torch.bool)
            lab[list(idx)] = True
            out.append(lab)
        return out
    out = []
    for _ in range(max_permutations):
        lab = torch.zeros(num_rollouts, dtype=torch.bool)
        lab[torch.randperm(num_rollouts, generator=generator)[:k]] = True
        out.append(lab)
    return out


def span_energies(gram: Tensor, labels: Tensor, advantages: Tensor) -> Tensor:
    """:func:`span_energy` of L labellings at once. gram: [R, R] float64; labels: [L, R] bool; advantages: [L, R].
    Returns [L] float64 (NaN where the rows have no energy)."""
    lab = labels.to(gram.dtype)
    m = torch.stack([lab / lab.sum(1, keepdim=True), (1 - lab) / (1 - lab).sum(1, keepdim=True)], 1)  # [L, 2, R]
    mg = m @ gram  # [L, 2, R]
    lam, vec = torch.linalg.eigh(mg @ m.transpose(1, 2))  # [L, 2], [L, 2, 2]: the pseudo-inverse of M G Mᵀ
    keep = lam > lam.abs().amax(1, keepdim=True) * 2 * torch.finfo(gram.dtype).eps  # pinv's default cutoff
    inner = (
        vec * torch.where(keep, 1 / torch.where(keep, lam, torch.ones_like(lam)), torch.zeros_like(lam))[:, None]
    ) @ vec.transpose(1, 2)  # [L, 2, 2]
    a2 = advantages.to(gram.dtype).square()  # [L, R]
    proj = (a2 * (mg * (inner @ mg)).sum(1)).sum(1)
    total = (a2 * gram.diagonal()).sum(1)
    return torch.where(total > 0, proj / total.clamp(min=1e-300), torch.full_like(total, math.nan))


def span_energy(gram: Tensor, labels: Tensor, advantages: Tensor) -> float:
    """Share of the energy of the rows A_i g_i that lies in span{gbar_C, gbar_W} (C = labels, W = not labels).

    With U = [gbar_C, gbar_W] = g^T M^T (M [2, R] the class-averaging matrix), the projection energy of x_i = A_i g_i
    is A_i^2 (M G)_{:,i}^T (M G M^T)^+ (M G)_{:,i}; the share divides its sum by sum_i A_i^2 G_ii (docs/theory.md §6).
    One labelling of :func:`span_energies`.

    Args:
        gram: [R, R] float64 Gram matrix of the g_i.  labels: [R] bool.  advantages: [R].

    Returns:
        a share in [0, 1]; NaN when the rows have no energy.
    """
    return float(span_energies(gram, labels[None], advantages[None])[0])


def cosine_gaps(gram: Tensor, labels: Tensor) -> Tensor:
    """:func:`cosine_gap` of L labellings at once. gram: [R, R]; labels: [L, R] bool. Returns [L] float64 (NaN
    when there is no same-class pair or a zero gradient)."""
    d = gram.diagonal().clamp(min=0).sqrt()
    n_lab = labels.shape[0]
    if bool((d == 0).any()):
        return torch.full((n_lab,), math.nan, dtype=torch.float64)
    cos = (gram / torch.outer(d, d)).double()
    same = (labels[:, None, :] == labels[:, :, None]) & ~torch.eye(labels.shape[1], dtype=torch.bool)  # [L, R, R]
    cross = labels[:, None, :] != labels[:, :, None]
    n_same, n_cross = same.sum((1, 2)), cross.sum((1, 2))
    within = (cos * same).sum((1, 2)) / n_same.clamp(min=1)
    between = (cos * cross).sum((1, 2)) / n_cross.clamp(min=1)
    ok = (n_same > 0) & (n_cross > 0)
    return torch.where(ok, within - between, torch.full_like(within, math.nan))


def cosine_gap(gram: Tensor, labels: Tensor) -> float:
    """Mean cosine of g_i, g_j over same-class pairs minus over cross-class pairs (docs/theory.md §6); one labelling
    of :func:`cosine_gaps`.

    gram: [R, R]; labels: [R] bool. NaN when there is no same-class pair (R = 2) or a zero gradient.
    """
    return float(cosine_gaps(gram, labels[None])[0])


#: two rollouts are one completion for the permutation test when ‖g_i − g_j‖² <= this share of ‖g_i‖² + ‖g_j‖²
#: (identical completions have identical gradients and identical sketches; 1e-6 leaves float32 Gram rounding room)
DUPLICATE_TOL = 1e-6


def distinct_rows(
    gram: Tensor, rewards: Tensor, tol: float = DUPLICATE_TOL, same_completion: Tensor | None = None
) -> Tensor:
    """The rollouts that stay when duplicate completions are merged: i is dropped when an earlier j with the same
    reward is the same completion: ``same_completion[i, j]`` when given (token ids compared, exact), else
    ‖g_i − g_j‖² = G_ii + G_jj − 2 G_ij <= ``tol`` (G_ii + G_jj) (identical completions give identical gradients,
    exact or sketched; two zero gradients are duplicates). Rollouts with different rewards are never merged.

    Args:
        gram: [R, R] Gram matrix.  rewards: [R].  tol: relative tolerance.
        same_completion: [R, R] bool or None.

    Returns:
        [R'] long, the kept indices in order (R' = R without duplicates).
    """
    g = gram.double()
    d = g.diagonal()
    if same_completion is not None:
        same = same_completion.bool() & (rewards[:, None] == rewards[None, :])
    else:
        dist = d[:, None] + d[None, :] - 2 * g  # [R, R] ‖g_i − g_j‖²
        same = (dist <= tol * (d[:, None] + d[None, :])) & (rewards[:, None] == rewards[None, :])
    keep: list[int] = []
    for i in range(g.shape[0]):
        if not any(bool(same[i, j]) for j in keep):
            keep.append(i)
    return torch.tensor(keep, dtype=torch.long)


def zero_sum_tests(
    gram: Tensor,
    rewards: Tensor,
    advantages: Tensor,
    *,
    max_permutations: int = 256,
    seed: int = 0,
    same_completion: Tensor | None = None,
) -> dict[str, float]:
    """The label-permutation test with k fixed for one group with 0/1 rewards (docs/theory.md §6).

    The units are distinct completions (:func:`distinct_rows`): identical completions have identical gradients and
    always share a reward, so relabelling them apart would let the duplicates alone read as label structure (every
    correct rollout one string: *labels structure G1* in 0.80 of trials at R = 4); merged, k and R count
    distinct completions, and a group left with fewer than 3 (or one class empty of distinct ones) carries no label
    information (every relabelling gives the same span energy: excess 0, null variance 0).

    For the true labels (correct = reward 1) and for each relabelling with the same k, computes
    :func:`span_energy` (the advantages follow the labels: A_C on the labelled-correct rows, A_W on the others) and
    :func:`cosine_gap`. p = #{relabellings with stat >= observed} / #relabellings (the true labelling is one of them
    when all C(R, k) are enumerated, so p >= 1/C(R, k); with random relabellings p = (1 + #{>=}) / (1 + n)).

    Args:
        gram: [R, R] float64.  rewards: [R] in {0, 1}, 0 < k < R.  advantages: [R] (two-valued per class).
        max_permutations: enumerate every relabelling up to this many, else draw this many at random.
        seed: seed of the random relabellings.
        same_completion: [R, R] bool, which rollouts are the same completion (from the token ids); None: from the
            Gram (:func:`distinct_rows`).

    Returns:
        {"zero_sum/span_energy", "zero_sum/span_energy_null", "zero_sum/span_energy_excess" (observed - null
        mean: mean-zero under the null when the relabellings are enumerated), "zero_sum/span_energy_null_var" (the
        variance of the statistic over the relabellings: the across-group test's null variance, docs/theory.md §11),
        "zero_sum/span_energy_p", and the same five for "zero_sum/cos_gap" (absent when undefined, e.g. R = 2) and
        for "zero_sum/unit_span_energy" (the span energy of the cosine Gram G_ij / (‖g_i‖ ‖g_j‖): a label effect on
        the norms alone leaves it at its null; absent when some g_i = 0)}.
    """
    labels = rewards == 1
    a_c = float(advantages[labels].mean())
    a_w = float(advantages[~labels].mean())
    keep = distinct_rows(gram, rewards, same_completion=same_completion)  # units: distinct completions
    gram, labels = gram[keep][:, keep], labels[keep]
    r, k = len(labels), int(labels.sum())
    gen = torch.Generator().manual_seed(seed)
    labs = torch.stack([labels] + fixed_k_labellings(r, k, max_permutations, gen))  # [1 + L, R]: the truth first
    exhaustive = math.comb(r, k) <= max_permutations
    adv = torch.where(labs, torch.tensor(a_c, dtype=gram.dtype), torch.tensor(a_w, dtype=gram.dtype))

    out: dict[str, float] = {}
    d = gram.diagonal().clamp(min=0).sqrt()
    stats = [("span_energy", span_energies(gram, labs, adv)), ("cos_gap", cosine_gaps(gram, labs))]
    if bool((d > 0).all()):  # the cosine Gram: the same statistic with every g_i scaled to norm 1
        stats.append(("unit_span_energy", span_energies(gram / torch.outer(d, d), labs, adv)))
    for name, values in stats:
        obs, null = float(values[0]), values[1:]
        if not math.isfinite(obs):
            continue
        ge = int((null >= obs - 1e-12).sum())
        p = ge / len(null) if exhaustive else (1 + ge) / (1 + len(null))
        out[mk.zero_sum_key(name)] = obs
        out[mk.zero_sum_key(name, "null")] = float(null.mean())
        out[mk.zero_sum_key(name, "excess")] = obs - float(null.mean())
        out[mk.zero_sum_key(name, "null_var")] = float(null.var(unbiased=False))
        out[mk.zero_sum_key(name, "p")] = p
    return out


#: Row weightings of the zero-sum test on G2 and G3 (docs/theory.md §6): the advantages and controls that are not
#: zero-sum (|A|, A + lambda 1 with lambda = mean |A|, the rewards r, uniform 1) and a single rollout (e_1).
WEIGHTINGS = ("adv", "abs", "shift", "reward", "uniform", "single")


def weightings(advantages: Tensor, rewards: Tensor) -> dict[str, Tensor]:
    """{name: [R] weights} for :data:`WEIGHTINGS`: adv = A; abs = |A|; shift = A + mean|A| (not zero-sum); reward = r;
    uniform = 1; single = (1, 0, ..., 0) (the first rollout alone). advantages, rewards: [R]. float64."""
    a, r = advantages.detach().double(), rewards.detach().double()
    single = torch.zeros_like(a)
    single[0] = 1.0
    return {
        "adv": a,
        "abs": a.abs(),
        "shift": a + a.abs().mean(),
        "reward": r,
        "uniform": torch.ones_like(a),
        "single": single,
    }
