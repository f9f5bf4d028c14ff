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

from grpo_lens.metrics import zero_sum_key


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
        out[zero_sum_key(name)] = obs
        out[zero_sum_key(name, "null")] = float(null.mean())
        out[zero_sum_key(name, "excess")] = obs - float(null.mean())
        out[zero_sum_key(name, "p")] = p
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
