"""One analysis path: everything measured on ONE group of R rollouts, as a flat dict of canonical metric keys.

:func:`analyse_group` is the single per-group function that both the trainer's lens (:mod:`grpo_lens.lens`) and
``grpo-lens probe`` (:mod:`grpo_lens.probe`) call; they only aggregate its rows over groups (the lens: means over the
step's mixed groups; the probe: means with bootstrap intervals, strata by k and by distinct completions, see
:mod:`grpo_lens.diagnostics.stats`). Every key is documented in docs/metrics.md; formulas are in docs/theory.md.

Inputs are the group's per-rollout gradients ``grads`` [R, K] (exact [R, P] or a linear sketch [R, K]: everything here
uses inner products only, so a sketch gives unbiased Gram entries), its rewards [R] and the advantages [R] the trainer
actually used. ``grads`` row i must be the rollout's term in the trainer's loss gradient without its advantage
(``sum_i A_i grads_i`` = the group's share of the update direction; docs/theory.md §3).

Keys (``<m>`` ranges over :data:`grpo_lens.diagnostics.spectrum.RANK_MEASURES`: erank, stable_rank,
participation_ratio, k90, k99):

- ``group/size`` R, ``group/reward_mean``, ``group/correct`` k (0/1 rewards only), ``group/distinct_completions``
  (when completion ids are given).
- ``rank/g1_<m>``: G1, rows A_i g_i.  Controls on the same rows: ``rank/g1_no_adv_<m>`` (rows g_i),
  ``rank/g1_random_<m>`` (rows w_i g_i, w random zero-sum with ||w|| = ||A||, mean over draws), ``rank/g1_nll_<m>``
  (rows of the supervised token-mean NLL gradient; with a completion mask), ``rank/g1_null_<m>`` (the orthogonal null:
  singular values |A_i| ||g_i||, what G1 would have if its rows were orthogonal) and ``rank/g1_<m>_vs_null`` =
  rank/g1_<m> / rank/g1_null_<m>.
- ``grad/identity_residual``: relative residual of sum_i A_i g_i = c (gbar_C - gbar_W) with the estimator's own c
  (:func:`grpo_lens.diagnostics.identity.identity_constant`); absent when the identity does not apply (non-binary
  rewards, an estimator without the decomposition, advantages not two-valued per class). ``grad/identity_constant`` c.
- ``baseline/m_correct``, ``baseline/m_wrong``, ``baseline/b_star``, ``baseline/group_mean``,
  ``baseline/b_star_minus_mean`` (0/1 rewards).
- ``zero_sum/span_energy`` (share of G1's energy in span{gbar_C, gbar_W}), ``zero_sum/cos_gap`` (mean within-class
  minus mean between-class cosine of the g_i), each with ``..._null`` (mean over relabellings that keep k),
  ``..._excess`` (observed minus that mean) and ``..._p`` (permutation p-value, exact over all C(R, k) relabellings up
  to ``max_permutations``); 0/1 rewards only.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor


def fixed_k_labellings(r: int, k: int, max_permutations: int, generator: torch.Generator) -> list[Tensor]:
    """The relabellings of a permutation test with k fixed: all C(r, k) boolean labellings with k ones when there are
    at most ``max_permutations``, else that many drawn at random with ``generator`` (each a [r] bool tensor; the
    caller adds the observed labelling to a random draw's p-value)."""
    if math.comb(r, k) <= max_permutations:
        out = []
        for idx in itertools.combinations(range(r), k):
            lab = torch.zeros(r, dtype=torch.bool)
            lab[list(idx)] = True
            out.append(lab)
        return out
    out = []
    for _ in range(max_permutations):
        lab = torch.zeros(r, dtype=torch.bool)
        lab[torch.randperm(r, generator=generator)[:k]] = True
        out.append(lab)
    return out


def span_energy(gram: Tensor, labels: Tensor, advantages: Tensor) -> float:
    """Share of the energy of the rows A_i g_i that lies in span{gbar_C, gbar_W} (C = labels, W = not labels).

    With U = [gbar_C, gbar_W] = g^T M^T (M [2, R] the class-averaging matrix), the projection energy of x_i = A_i g_i
    is A_i^2 (M G)_{:,i}^T (M G M^T)^+ (M G)_{:,i}; the share divides its sum by sum_i A_i^2 G_ii (docs/theory.md §6).

    Args:
        gram: [R, R] float64 Gram matrix of the g_i.  labels: [R] bool.  advantages: [R].

    Returns:
        a share in [0, 1]; NaN when the rows have no energy.
    """
    r = gram.shape[0]
    m = torch.zeros(2, r, dtype=gram.dtype)
    m[0, labels] = 1.0 / labels.sum()
    m[1, ~labels] = 1.0 / (~labels).sum()
    mg = m @ gram  # [2, R]
    inner = torch.linalg.pinv(mg @ m.T, hermitian=True)  # [2, 2]
    a2 = advantages.to(gram.dtype).square()
    proj = (a2 * (mg * (inner @ mg)).sum(0)).sum()
    total = (a2 * gram.diagonal()).sum()
    return float(proj / total) if total > 0 else math.nan


def cosine_gap(gram: Tensor, labels: Tensor) -> float:
    """Mean cosine of g_i, g_j over same-class pairs minus over cross-class pairs (docs/theory.md §6).

    gram: [R, R]; labels: [R] bool. NaN when there is no same-class pair (R = 2) or a zero gradient.
    """
    d = gram.diagonal().clamp(min=0).sqrt()
    if bool((d == 0).any()):
        return math.nan
    cos = gram / torch.outer(d, d)
    same = labels.unsqueeze(0) == labels.unsqueeze(1)
    off = ~torch.eye(len(labels), dtype=torch.bool)
    within, between = cos[same & off], cos[~same]
    if within.numel() == 0 or between.numel() == 0:
        return math.nan
    return float(within.mean() - between.mean())


def zero_sum_tests(gram: Tensor, rewards: Tensor, advantages: Tensor, *, max_permutations: int = 256,
                   seed: int = 0) -> dict[str, float]:
    """The label-permutation test with k fixed for one group with 0/1 rewards (docs/theory.md §6).

    For the true labels (correct = reward 1) and for each relabelling with the same k, computes
    :func:`span_energy` (the advantages follow the labels: A_C on the labelled-correct rows, A_W on the others) and
    :func:`cosine_gap`. p = #{relabellings with stat >= observed} / #relabellings (the true labelling is one of them
    when all C(R, k) are enumerated, so p >= 1/C(R, k); with random relabellings p = (1 + #{>=}) / (1 + n)).

    Args:
        gram: [R, R] float64.  rewards: [R] in {0, 1}, 0 < k < R.  advantages: [R] (two-valued per class).
        max_permutations: enumerate every relabelling up to this many, else draw this many at random.
        seed: seed of the random relabellings.

    Returns:
        {"zero_sum/span_energy", "zero_sum/span_energy_null", "zero_sum/span_energy_excess" (observed - null
        mean: mean-zero under the null when the relabellings are enumerated), "zero_sum/span_energy_p", and the same
        four for "zero_sum/cos_gap" (absent when undefined, e.g. R = 2)}.
    """
    labels = rewards == 1
    r, k = len(rewards), int(labels.sum())
    a_c = float(advantages[labels].mean())
    a_w = float(advantages[~labels].mean())
    gen = torch.Generator().manual_seed(seed)
    labs = fixed_k_labellings(r, k, max_permutations, gen)
    exhaustive = math.comb(r, k) <= max_permutations

    def adv_for(lab: Tensor) -> Tensor:
        return torch.where(lab, torch.tensor(a_c, dtype=gram.dtype), torch.tensor(a_w, dtype=gram.dtype))

    out: dict[str, float] = {}
    for name, stat in (("span_energy", lambda lab: span_energy(gram, lab, adv_for(lab))),
                       ("cos_gap", lambda lab: cosine_gap(gram, lab))):
        obs = stat(labels)
        if not math.isfinite(obs):
            continue
        null = torch.tensor([stat(lab) for lab in labs], dtype=torch.float64)
        ge = int((null >= obs - 1e-12).sum())
        p = ge / len(labs) if exhaustive else (1 + ge) / (1 + len(labs))
        out[f"zero_sum/{name}"] = obs
        out[f"zero_sum/{name}_null"] = float(null.mean())
        out[f"zero_sum/{name}_excess"] = obs - float(null.mean())
        out[f"zero_sum/{name}_p"] = p
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
    return {"adv": a, "abs": a.abs(), "shift": a + a.abs().mean(), "reward": r, "uniform": torch.ones_like(a),
            "single": single}
