"""The rank-2 identity of GRPO with 0/1 rewards (docs/theory.md §4), checked on real per-rollout gradients.

One group: R rollouts, rewards r_i in {0, 1}, k of them correct (0 < k < R), g_i the per-rollout gradients [R, P]
(exact or sketched, :mod:`grpo_lens.gradients`), gbar_C and gbar_W their means over the correct and the wrong
rollouts.

Derivation. The mean reward is p = k/R, so r_i - p = (R-k)/R for a correct rollout and -k/R for a wrong one:

    sum_i (r_i - p) g_i = ((R-k)/R) * k gbar_C - (k/R) * (R-k) gbar_W = (k(R-k)/R) (gbar_C - gbar_W).

The population std of the rewards is sigma = sqrt(p(1-p)) = sqrt(k(R-k))/R, the sample std is
s = sigma sqrt(R/(R-1)) = sqrt(k(R-k) / (R(R-1))). With A_i = (r_i - p)/(std + std_eps):

    sum_i A_i g_i = c(k, R) (gbar_C - gbar_W),
    c = (k(R-k)/R) / (std + std_eps) = c0 * std / (std + std_eps),
    c0 = sqrt(k(R-k))                  (population std),
    c0 = sqrt(k(R-k)(R-1)/R)           (sample std; the population value times sqrt((R-1)/R)).

Whatever R is, the group's update is the single contrastive direction gbar_C - gbar_W inside the 2-dimensional
span{gbar_C, gbar_W}. The relative residual

    rho = || sum_i A_i g_i - c (gbar_C - gbar_W) || / || sum_i A_i g_i ||

is round-off only (about 1e-7 in float32) when the advantages and c use the same conventions; a mismatched
convention leaves |1 - c_wrong/c| (e.g. 1 - sqrt((R-1)/R) = 0.134 for R = 4).

Other estimators (:func:`identity_constant`, docs/theory.md §4). Any estimator whose advantages are A_C on every correct
rollout and A_W on every wrong one, with k A_C + (R-k) A_W = 0, gives sum_i A_i g_i = k A_C (gbar_C - gbar_W):

    dr_grpo   A_i = r_i - p                   c = k(R-k)/R
    rloo      A_i = (R/(R-1)) (r_i - p)       c = k(R-k)/(R-1)
    grpo      A_i = (r_i - p)/(std + std_eps)     c = (k(R-k)/R)/(std + std_eps)   (both std conventions)

``reinforce`` (A_i = r_i: sum_i A_i g_i = k gbar_C, not zero-sum) and ``optimal`` (leave-one-out b*_{-i} differs per
rollout, so A is not two-valued) have no such constant; a group whose advantages were changed after the estimator
(``mask_truncated`` zeroes them on truncated rollouts) is not two-valued either. For those the identity does not apply
and no residual is reported.

The residual has one body, :func:`identity_residual`, which :func:`grpo_lens.analysis.group.analyse_group` reports as
``grad/identity_residual`` for the lens and the probe; :func:`rank2_residual` is the 0.1 entry point that checks its
inputs and calls it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from grpo_lens.formulas.advantages import (
    STD_CONVENTIONS,
    StdConvention,
    grpo_advantages,
    is_binary,
)


def _check_std(std: str) -> None:
    if std not in STD_CONVENTIONS:
        raise ValueError(f"unknown std convention {std!r}; valid names: {', '.join(sorted(STD_CONVENTIONS))}")


def binary_group_std(k: int, group_size: int, std: StdConvention = "sample") -> float:
    """Std of R 0/1 rewards with k ones: sqrt(k(R-k))/R (population) or sqrt(k(R-k)/(R(R-1))) (sample).

    Raises:
        ValueError: unknown convention, or k outside [0, R], or R < 2 for the sample std.
    """
    _check_std(std)
    R = group_size
    if not 0 <= k <= R:
        raise ValueError(f"k must be in [0, R], got k={k}, R={R}")
    if std == "population":
        return math.sqrt(k * (R - k)) / R
    if R < 2:
        raise ValueError("the sample std needs R >= 2")
    return math.sqrt(k * (R - k) / (R * (R - 1)))


def rank2_constant(k: int, group_size: int, std: StdConvention = "sample", std_eps: float = 0.0) -> float:
    """c(k, R) with sum_i A_i g_i = c (gbar_C - gbar_W) for GRPO advantages A = (r - mean)/(std + std_eps).

    c = (k(R-k)/R) / (std + std_eps): sqrt(k(R-k)) for the population std and sqrt(k(R-k)(R-1)/R) for the sample std
    when std_eps = 0, scaled by std/(std + std_eps) otherwise (derivation in the module docstring).

    Args:
        k: number of correct rollouts, 0 < k < R.
        group_size: R.
        std: ``"sample"`` (ddof 1) or ``"population"`` (ddof 0).
        std_eps: the advantage's std_eps.

    Raises:
        ValueError: k not in (0, R) or unknown convention.
    """
    R = group_size
    if not 0 < k < R:
        raise ValueError(f"the identity needs 0 < k < R, got k={k}, R={R}")
    return (k * (R - k) / R) / (binary_group_std(k, R, std) + std_eps)


#: Estimators with a rank-2 decomposition sum_i A_i g_i = c (gbar_C - gbar_W) for 0/1 rewards.
IDENTITY_ESTIMATORS = ("grpo", "dr_grpo", "rloo")


def identity_constant(
    estimator: str, k: int, group_size: int, std: StdConvention = "sample", std_eps: float = 1e-4
) -> float | None:
    """c with sum_i A_i g_i = c (gbar_C - gbar_W) under ``estimator`` for 0/1 rewards, k of R correct.

    grpo: :func:`rank2_constant` (``std``, ``std_eps``); dr_grpo: k(R-k)/R; rloo: k(R-k)/(R-1) (module docstring,
    docs/theory.md §4). None for estimators without the decomposition (reinforce, optimal, any other name).

    Raises:
        ValueError: k not in (0, R), or an unknown std convention (grpo).
    """
    R = group_size
    if not 0 < k < R:
        raise ValueError(f"the identity needs 0 < k < R, got k={k}, R={R}")
    if estimator == "grpo":
        return rank2_constant(k, R, std, std_eps)
    if estimator == "dr_grpo":
        return k * (R - k) / R
    if estimator == "rloo":
        return k * (R - k) / (R - 1)
    return None


def identity_residual(gram: Tensor, correct: Tensor, advantages: Tensor, constant: float) -> float:
    """rho = ||sum_i A_i g_i - c (gbar_C - gbar_W)|| / ||sum_i A_i g_i||, the rank-2 identity's relative residual,
    from the Gram matrix of the g_i alone.

    Both sides are combinations of the rows: sum_i A_i g_i = sum_i a_i g_i and c (gbar_C - gbar_W) = sum_i m_i g_i with
    m_i = c / k on the k correct rows and -c / (R - k) on the others, so with e = a - m and G = (<g_i, g_j>),
    rho^2 = e^T G e / a^T G a (docs/theory.md §4). Computed in the dtype of ``gram`` (the lens and the probe pass
    float64; round-off ~1e-7 in float32, ~1e-16 in float64 when the conventions match: e is then ~ round-off
    coefficient by coefficient, so no cancellation happens inside e^T G e).

    Args:
        gram: [R, R] Gram matrix of the per-rollout g_i (exact, one layer's, or sketched: sketches are linear, so the
            identity holds for them too).
        correct: [R] bool, True for the rollouts with reward 1 (at least one of each class).
        advantages: [R] the advantages A_i actually used.
        constant: c from :func:`identity_constant` (or :func:`rank2_constant`).

    Returns:
        rho (float >= 0, dimensionless); 0 when sum_i A_i g_i = 0.
    """
    a = advantages.to(gram.dtype)
    k = int(correct.sum())
    m = torch.where(correct, torch.full_like(a, constant / k), torch.full_like(a, -constant / (len(a) - k)))
    e = a - m
    den = float(a @ gram @ a)
    return math.sqrt(max(float(e @ gram @ e), 0.0) / den) if den > 0 else 0.0


def rank2_residual(
    grads: Tensor,
    rewards: Tensor,
    *,
    std: StdConvention = "sample",
    std_eps: float = 1e-4,
    advantages: Tensor | None = None,
    estimator: str = "grpo",
) -> float:
    """:func:`identity_residual` of one group with 0/1 rewards, from its rewards (the 0.1 entry point).

    c from :func:`identity_constant` for ``estimator`` (grpo: with the given ``std`` and ``std_eps``); computed in the
    gradients' dtype.

    Args:
        grads: [R, P] per-rollout g_i.
        rewards: [R] in {0, 1}.
        std: the std convention for c (and for A when ``advantages`` is None).
        std_eps: the epsilon, likewise.
        advantages: [R] the advantages actually used; None computes grpo's with ``std`` and ``std_eps``
            (:func:`grpo_lens.formulas.advantages.grpo_advantages`; only allowed for estimator grpo).
        estimator: whose decomposition c to use (grpo, dr_grpo, rloo; see :func:`identity_constant`).

    Returns:
        rho (float >= 0); 0 when sum_i A_i g_i = 0.

    Raises:
        ValueError: rewards not 0/1, or all equal (k = 0 or k = R), or an estimator without the decomposition.
    """
    assert grads.dim() == 2 and rewards.shape == (grads.shape[0],), (grads.shape, rewards.shape)
    if not is_binary(rewards):
        raise ValueError("the rank-2 identity needs 0/1 rewards")
    correct = rewards == 1
    k, r = int(correct.sum()), rewards.numel()
    c = identity_constant(estimator, k, r, std, std_eps)
    if c is None:
        raise ValueError(
            f"estimator {estimator!r} has no rank-2 decomposition; valid: {', '.join(IDENTITY_ESTIMATORS)}"
        )
    if advantages is None and estimator != "grpo":
        raise ValueError("pass the advantages actually used for estimators other than grpo")
    if advantages is None:
        r64 = rewards.double().view(1, r)
        advantages = grpo_advantages(r64, torch.ones_like(r64, dtype=torch.bool), std=std, std_eps=std_eps)[0]
    return identity_residual(grads @ grads.T, correct, advantages.to(grads.dtype), c)
