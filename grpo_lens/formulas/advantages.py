"""Advantage estimators over the rewards of groups of rollouts, and the leave-one-out baselines they subtract.

Every estimator maps rewards ``[B, R]`` (B prompts, R rollouts each) and a validity mask ``[B, R]`` to advantages
``[B, R]``. Under an output-only reward every token of rollout i gets the same advantage A_i (docs/theory.md §10),
so these R numbers are the whole of GRPO's credit assignment for a group.

The leave-one-out baselines b_i (RLOO's mean of the other rewards, :func:`rloo_baseline`; the variance-optimal b*
from the other rollouts, :func:`loo_optimal_baseline`) have their one body here: the ``rloo`` and ``optimal``
estimators subtract them, and :mod:`grpo_lens.formulas.baselines` registers the same functions in its ``BASELINES``
for the baseline-variance studies. :func:`constant_groups` is the one test for "no reward contrast" (S1, the zero
advantages of an all-equal group, the lens's mixed groups).

Conventions shared by all estimators:
  - Invalid rollouts (mask False: the reward function failed, returned None/NaN or timed out) get A = 0 and are left
    out of every group statistic (mean, std, leave-one-out baselines).
  - A group whose valid rewards are all equal gets A = 0 exactly for the centred estimators (all but
    reinforce and reinforce_pp, :data:`UNCENTRED_ESTIMATORS`): it carries no policy gradient. This is decided by
    comparing values (max == min), not by dividing by a zero std, so repeated fp32 values such as 0.35 give exactly 0
    and never NaN.
  - A group with a single valid rollout has no baseline to compare against and gets A = 0 (centred estimators).
  - Statistics are computed in float64 and the result is cast back to the rewards' dtype.

References:
  - GRPO: Shao et al., "DeepSeekMath", arXiv 2402.03300, §4.1.2 (outcome supervision, A_i = (r_i - mean r) / std r).
  - Dr. GRPO: Liu et al., "Understanding R1-Zero-Like Training", arXiv 2503.20783, §3.2 (no std division).
  - RLOO: Ahmadian et al., "Back to Basics", arXiv 2402.14740, eq. 7 (leave-one-out mean baseline);
    Kool et al., "Buy 4 REINFORCE Samples, Get a Baseline for Free!", ICLR 2019 workshop.
  - Batch-level scaling: TRL's ``scale_rewards="batch"`` (grpo_batch); REINFORCE++: Hu et al., arXiv 2501.03262
    (reinforce_pp, reinforce_pp_baseline).
  - Variance-optimal constant baseline: Greensmith, Bartlett & Baxter, JMLR 5 (2004), Theorem 13;
    Weaver & Tao, arXiv 1301.2315, §4: b* = E[||g||^2 r] / E[||g||^2].
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from grpo_lens.registry import Registry

StdConvention = Literal["sample", "population"]


STD_CONVENTIONS = ("sample", "population")


# fn(rewards [B, R] float64 (invalid entries already 0), valid [B, R] bool, *, std, std_eps, grad_sq_norms) -> [B, R]
EstimatorFn = Callable[..., Tensor]


ADVANTAGE_ESTIMATORS: Registry[EstimatorFn] = Registry("advantage estimator")


# Estimators whose advantages sum to zero over the valid rollouts of every group.
ZERO_SUM_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "grpo_batch", "reinforce_pp_baseline")

#: Estimators whose statistics span the whole batch, not one group: they must see every group of the step (every
#: process's), and their A_i depends on the other groups.
BATCH_ESTIMATORS = ("grpo_batch", "reinforce_pp", "reinforce_pp_baseline")

#: Estimators that do not subtract a group baseline: a group whose rewards are all equal keeps nonzero advantages.
UNCENTRED_ESTIMATORS = ("reinforce", "reinforce_pp")


def _group_counts_and_means(rewards: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """Number of valid rollouts [B, 1] and their mean reward [B, 1] (0 for a group with none)."""
    count = valid.sum(dim=1, keepdim=True).to(rewards.dtype)
    mean = (rewards * valid).sum(dim=1, keepdim=True) / count.clamp(min=1.0)
    return count, mean


def _group_centred(rewards: Tensor, valid: Tensor) -> Tensor:
    """r_i - the mean of i's group over its valid rollouts, 0 on invalid ones. [B, R], [B, R] bool -> [B, R]."""
    _, mean = _group_counts_and_means(rewards, valid)
    return (rewards - mean) * valid


def constant_groups(rewards: Tensor, valid: Tensor) -> Tensor:
    """Which groups have all valid rewards equal (or fewer than two valid rollouts).

    Args:
        rewards: [B, R] float.
        valid: [B, R] bool.

    Returns:
        [B] bool, True where the group carries no reward contrast (and so no policy gradient).
    """
    big = torch.finfo(rewards.dtype).max
    hi = rewards.masked_fill(~valid, -big).amax(dim=1)
    lo = rewards.masked_fill(~valid, big).amin(dim=1)
    return (hi == lo) | (valid.sum(dim=1) < 2)


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_advantages(
    rewards: Tensor, valid: Tensor, *, std: StdConvention = "sample", std_eps: float = 1e-4, **_: object
) -> Tensor:
    """GRPO: A_i = (r_i - mean r) / (std r + std_eps) over the valid rollouts of each group.

    ``std="sample"`` uses ddof 1 (TRL and verl's default), ``"population"`` ddof 0. Because
    |r_i - mean| <= (n-1)/sqrt(n) * std_sample and <= sqrt(n-1) * std_population for n valid rollouts, every
    advantage obeys |A_i| <= (n-1)/sqrt(n) (sample) or sqrt(n-1) (population) whatever std_eps > 0 is: near-equal
    rewards cannot blow up to 1/std_eps (see :func:`advantage_bound`).

    Source: DeepSeekMath, arXiv 2402.03300, §4.1.2.

    Args:
        rewards: [B, R] float64, invalid entries 0.   valid: [B, R] bool.
    Returns:
        [B, R] float64.
    """
    count, mean = _group_counts_and_means(rewards, valid)
    centred = (rewards - mean) * valid
    ddof = 1.0 if std == "sample" else 0.0
    var = (centred**2).sum(dim=1, keepdim=True) / (count - ddof).clamp(min=1.0)
    return centred / (var.sqrt() + std_eps)


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def dr_grpo_advantages(rewards: Tensor, valid: Tensor, **_: object) -> Tensor:
    """Dr. GRPO: A_i = r_i - mean r (no division by the std). Source: arXiv 2503.20783, §3.2.

    Args:
        rewards: [B, R] float64, invalid entries 0.   valid: [B, R] bool.
    Returns:
        [B, R] float64.
    """
    return _group_centred(rewards, valid)


def _all_valid(rewards: Tensor, valid: Tensor | None) -> Tensor:
    return torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid.to(torch.bool)


def rloo_baseline(rewards: Tensor, sq_norms: Tensor | None = None, *, valid: Tensor | None = None) -> Tensor:
    """RLOO's baseline b_i = mean_{j != i} r_j over the other valid rollouts of the group.

    Source: Kool et al., ICLR 2019 workshop; Ahmadian et al., arXiv 2402.14740, eq. 7.

    Args:
        rewards: [..., R] float, invalid entries 0.
        sq_norms: ignored (the signature of :data:`grpo_lens.formulas.baselines.BASELINES`).
        valid: [..., R] bool, default all valid.
    Returns:
        [..., R] in reward units; for a group with one valid rollout, the other rewards' sum (0).
    """
    v = _all_valid(rewards, valid)
    count = v.sum(dim=-1, keepdim=True).to(rewards.dtype)
    return ((rewards * v).sum(dim=-1, keepdim=True) - rewards) / (count - 1.0).clamp(min=1.0)


def loo_optimal_baseline(rewards: Tensor, sq_norms: Tensor, *, valid: Tensor | None = None) -> Tensor:
    """Leave-one-out b*: b_i = sum_{j != i} n_j r_j / sum_{j != i} n_j over the other valid rollouts, n = ||g||^2.

    Leaving rollout i out keeps b_i independent of g_i, so (r_i - b_i) g_i stays unbiased. Where the other rollouts'
    norms are all zero the weights are undefined and :func:`rloo_baseline` is used.

    Source: Greensmith, Bartlett & Baxter, JMLR 2004, Thm 13; Weaver & Tao, arXiv 1301.2315, §4.

    Args:
        rewards: [..., R] float, invalid entries 0.
        sq_norms: [..., R] float >= 0, ||g_i||^2 (squared gradient units; any scale: b is invariant to it).
        valid: [..., R] bool, default all valid.
    Returns:
        [..., R] in reward units.
    """
    v = _all_valid(rewards, valid)
    w = sq_norms.to(rewards.dtype) * v
    wr_sum = (w * rewards).sum(dim=-1, keepdim=True)
    w_loo = w.sum(dim=-1, keepdim=True) - w
    weighted = (wr_sum - w * rewards) / w_loo.clamp(min=torch.finfo(rewards.dtype).tiny)
    return torch.where(w_loo > 0, weighted, rloo_baseline(rewards, valid=v))


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_advantages(rewards: Tensor, valid: Tensor, **_: object) -> Tensor:
    """RLOO: A_i = r_i - mean_{j != i} r_j (:func:`rloo_baseline`) = n/(n-1) (r_i - mean r), n valid rollouts.

    Source: Ahmadian et al., arXiv 2402.14740, eq. 7.

    Args:
        rewards: [B, R] float64, invalid entries 0.   valid: [B, R] bool.
    Returns:
        [B, R] float64.
    """
    return (rewards - rloo_baseline(rewards, valid=valid)) * valid


@ADVANTAGE_ESTIMATORS.register("reinforce")
def reinforce_advantages(rewards: Tensor, valid: Tensor, **_: object) -> Tensor:
    """REINFORCE without a baseline: A_i = r_i (Williams, Machine Learning 8, 1992, eq. 11 with b = 0).

    Not centred: an all-equal group still has a non-zero policy gradient.

    Args:
        rewards: [B, R] float64, invalid entries 0.   valid: [B, R] bool.
    Returns:
        [B, R] float64.
    """
    return rewards * valid


def _batch_std(values: Tensor, valid: Tensor, std: StdConvention) -> Tensor:
    """The std of ``values`` [B, R] over every valid entry of the batch (all groups together), ddof 1 (``sample``)
    or 0 (``population``). Returns a scalar tensor."""
    n = valid.sum().to(values.dtype)
    mean = (values * valid).sum() / n.clamp(min=1.0)
    ddof = 1.0 if std == "sample" else 0.0
    return ((((values - mean) * valid) ** 2).sum() / (n - ddof).clamp(min=1.0)).sqrt()


@ADVANTAGE_ESTIMATORS.register("grpo_batch")
def grpo_batch_advantages(
    rewards: Tensor, valid: Tensor, *, std: StdConvention = "sample", std_eps: float = 1e-4, **_: object
) -> Tensor:
    """A_i = (r_i - mean of i's group) / (std of every valid reward of the batch + std_eps): TRL's
    ``scale_rewards="batch"`` (trl 1.16 GRPOTrainer), GRPO's group mean with the batch-wide scale of REINFORCE++
    (Hu et al., arXiv 2501.03262, §3). One scale for the whole batch keeps a group of nearly equal rewards from being
    blown up to unit scale, as grpo's per-group std does.

    .. warning:: the batch is the step's rollouts on every process (the trainer gathers them); TRL's ``nanstd`` is
       the sample std (ddof 1), as ``std="sample"`` here.

    Args:
        rewards: [B, R] float64, invalid entries 0.   valid: [B, R] bool.
    Returns:
        [B, R] float64.
    """
    return _group_centred(rewards, valid) / (_batch_std(rewards, valid, std) + std_eps)


@ADVANTAGE_ESTIMATORS.register("reinforce_pp")
def reinforce_pp_advantages(
    rewards: Tensor, valid: Tensor, *, std: StdConvention = "sample", std_eps: float = 1e-4, **_: object
) -> Tensor:
    """REINFORCE++ with an outcome reward: A_i = (r_i - mean over the batch) / (std over the batch + std_eps), the
    return (r_i on every token, gamma = 1) normalised over the global batch, with no group baseline (Hu et al.,
    "REINFORCE++", arXiv 2501.03262, §3; verl's ``reinforce_plus_plus``). Not centred per group: a group whose
    rewards are all equal keeps A_i = (r - batch mean) / std, nonzero.

    .. warning:: verl whitens the per-token returns over the batch's tokens, so a long rollout weighs more in the
       mean and std there; here each valid rollout counts once (the lens's and the claims' unit). REINFORCE++'s
       per-token KL penalty in the reward is ``--kl-in-reward`` (sequence-level) here.

    Args:
        rewards: [B, R] float64, invalid entries 0.   valid: [B, R] bool.
    Returns:
        [B, R] float64.
    """
    mean = (rewards * valid).sum() / valid.sum().to(rewards.dtype).clamp(min=1.0)
    return (rewards - mean) * valid / (_batch_std(rewards, valid, std) + std_eps)


@ADVANTAGE_ESTIMATORS.register("reinforce_pp_baseline")
def reinforce_pp_baseline_advantages(
    rewards: Tensor, valid: Tensor, *, std: StdConvention = "sample", std_eps: float = 1e-4, **_: object
) -> Tensor:
    """REINFORCE++-baseline: x_i = r_i - mean of i's group, then normalised over the batch,
    A_i = (x_i - mean_batch x) / (std_batch x + std_eps) (Hu et al., arXiv 2501.03262, REINFORCE++ with baseline; verl's
    ``reinforce_plus_plus_baseline``). Over the valid rollouts mean_batch x = 0, so A_i = x_i / (std_batch x + std_eps):
    zero-sum per group, like grpo_batch but scaled by the spread of the centred rewards, not of the raw ones.

    Args:
        rewards: [B, R] float64, invalid entries 0.   valid: [B, R] bool.
    Returns:
        [B, R] float64.
    """
    x = _group_centred(rewards, valid)
    return x / (_batch_std(x, valid, std) + std_eps)


@ADVANTAGE_ESTIMATORS.register("optimal")
def optimal_baseline_advantages(
    rewards: Tensor, valid: Tensor, *, grad_sq_norms: Tensor | None = None, **_: object
) -> Tensor:
    """A_i = r_i - b*_{-i}, the variance-optimal constant baseline estimated leave-one-out
    (:func:`loo_optimal_baseline`).

    b*_{-i} = sum_{j != i} ||g_j||^2 r_j / sum_{j != i} ||g_j||^2 over the valid rollouts j of the group. Leaving
    rollout i out keeps b*_{-i} independent of g_i, so the estimator stays unbiased. When the other rollouts all have
    zero gradient norm the weights are undefined and the plain leave-one-out mean is used.

    Source: Greensmith, Bartlett & Baxter, JMLR 2004, Thm 13; Weaver & Tao, arXiv 1301.2315, §4.

    Args:
        rewards: [B, R] float64, invalid entries 0.   valid: [B, R] bool.
        grad_sq_norms: [B, R] float, ||g_i||^2 of each rollout's score gradient (docs/theory.md §1).
    Returns:
        [B, R] float64.
    Raises:
        ValueError: grad_sq_norms missing, of the wrong shape, negative or not finite.
    """
    if grad_sq_norms is None:
        raise ValueError(
            "estimator 'optimal' needs grad_sq_norms [B, R] (squared per-rollout gradient norms); "
            "compute them with grpo_lens.gradients.sketch.sketched_rollout_sq_norms or pick another "
            "estimator"
        )
    w = grad_sq_norms.to(rewards.dtype)
    if w.shape != rewards.shape:
        raise ValueError(f"grad_sq_norms must have the rewards' shape {tuple(rewards.shape)}, got {tuple(w.shape)}")
    if not torch.isfinite(w[valid]).all() or (w[valid] < 0).any():
        raise ValueError("grad_sq_norms must be finite and >= 0 on valid rollouts")
    return (rewards - loo_optimal_baseline(rewards, w, valid=valid)) * valid


def compute_advantages(
    rewards: Tensor,
    estimator: str = "grpo",
    *,
    std: StdConvention = "sample",
    std_eps: float = 1e-4,
    mask: Tensor | None = None,
    grad_sq_norms: Tensor | None = None,
) -> Tensor:
    """Advantages of B groups of R rollouts with the named estimator.

    Args:
        rewards: [B, R] float. Entries where ``mask`` is False may hold anything, NaN included.
        estimator: one of :data:`ADVANTAGE_ESTIMATORS` (grpo, dr_grpo, rloo, reinforce, optimal; the batch-level
            grpo_batch, reinforce_pp, reinforce_pp_baseline of :data:`BATCH_ESTIMATORS`, whose ``rewards`` must be
            the whole batch).
        std: ``"sample"`` (ddof 1, default, as TRL and verl) or ``"population"`` (ddof 0); used by grpo.
        std_eps: > 0, added to the std in grpo's denominator.
        mask: [B, R] bool, True for valid rollouts; default: every finite reward is valid.
        grad_sq_norms: [B, R] float, ||g_i||^2; needed by ``optimal`` only.

    Returns:
        [B, R] advantages in the rewards' dtype; exactly 0 for invalid rollouts, for groups whose valid rewards
        are all equal and for groups of one valid rollout (centred estimators).

    Raises:
        ValueError: unknown estimator or std (listing the valid names), rewards not 2-D, mask of another shape,
            std_eps <= 0, a valid reward that is not finite.
    """
    fn = ADVANTAGE_ESTIMATORS.get(estimator)
    if std not in STD_CONVENTIONS:
        raise ValueError(f"unknown std convention {std!r}; valid names: {', '.join(STD_CONVENTIONS)}")
    if not (isinstance(std_eps, (int, float)) and std_eps > 0 and math.isfinite(std_eps)):
        raise ValueError(f"std_eps must be a finite number > 0, got {std_eps!r}")
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [B, R] (prompts x group size), got shape {tuple(rewards.shape)}")
    if mask is None:
        mask = torch.isfinite(rewards)
    elif mask.shape != rewards.shape:
        raise ValueError(f"mask must have the rewards' shape {tuple(rewards.shape)}, got {tuple(mask.shape)}")
    valid = mask.to(torch.bool)
    r64 = rewards.to(torch.float64)
    if not torch.isfinite(r64[valid]).all():
        raise ValueError("a reward marked valid is NaN or infinite; mark it invalid in mask instead")
    r64 = torch.where(valid, r64, torch.zeros_like(r64))
    adv = fn(r64, valid, std=std, std_eps=float(std_eps), grad_sq_norms=grad_sq_norms)
    if estimator not in UNCENTRED_ESTIMATORS:
        adv = adv.masked_fill(constant_groups(r64, valid).unsqueeze(1), 0.0)
    adv = adv.masked_fill(~valid, 0.0)
    return adv.to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def advantage_bound(num_valid: int, std: StdConvention = "sample") -> float:
    """The largest |A_i| that grpo can give a group of ``num_valid`` valid rollouts, for any std_eps > 0.

    From sum_j (r_j - mean)^2 = (n - ddof) s^2 and Cauchy-Schwarz on the other n-1 deviations:
    |r_i - mean| <= sqrt((n-1)/n) * sqrt(sum_j (r_j - mean)^2), i.e. (n-1)/sqrt(n) s for the sample std and
    sqrt(n-1) s for the population std; dividing by s + std_eps > s keeps |A_i| strictly below that.

    Args:
        num_valid: n >= 1.
        std: "sample" or "population".
    Returns:
        The bound (dimensionless).
    """
    n = num_valid
    return (n - 1) / math.sqrt(n) if std == "sample" else math.sqrt(n - 1)


def is_binary(rewards: Tensor) -> bool:
    """True when every reward is 0 or 1 (what the rank-2 identity and m_C / m_W need). rewards: any shape."""
    return bool(torch.all((rewards == 0) | (rewards == 1)))
