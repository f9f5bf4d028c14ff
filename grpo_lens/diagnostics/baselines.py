"""Baselines for the group's REINFORCE estimator and their variance (docs/theory.md §2).

For one prompt with rollouts i, rewards r_i and per-rollout gradients g_i (``grads`` [R, P] or [M, P], exact or
sketched; only inner products and norms matter), the estimator with baseline b_i is

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
- ``rloo``: b_i = mean_{j != i} r_j.
- ``optimal``: b_i = sum_{j != i} ||g_j||^2 r_j / sum_{j != i} ||g_j||^2 (leave-one-out b*).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Sequence

import torch
from torch import Tensor

from grpo_lens.registry import Registry

if TYPE_CHECKING:
    from grpo_lens.rollout import RolloutBatch

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


@BASELINES.register("rloo")
def rloo_baseline(rewards: Tensor, sq_norms: Tensor) -> Tensor:
    """b_i = mean_{j != i} r_j (Kool et al. 2019; Ahmadian et al., arXiv 2402.14740, eq. 7). R >= 2."""
    r = rewards.shape[-1]
    return (rewards.sum(-1, keepdim=True) - rewards) / (r - 1)


@BASELINES.register("optimal")
def loo_optimal_baseline(rewards: Tensor, sq_norms: Tensor) -> Tensor:
    """b_i = sum_{j != i} n_j r_j / sum_{j != i} n_j with n = ||g||^2 (leave-one-out b*, unbiased).

    Falls back to the RLOO mean where the other rollouts' norms are all zero. rewards, sq_norms: [..., R].
    """
    n = sq_norms.to(rewards.dtype)
    num = (n * rewards).sum(-1, keepdim=True) - n * rewards
    den = n.sum(-1, keepdim=True) - n
    fallback = rloo_baseline(rewards, sq_norms)
    return torch.where(den > 0, num / den.clamp(min=torch.finfo(den.dtype).tiny), fallback)


def loo_optimal_baselines(grads: Tensor, rewards: Tensor) -> Tensor:
    """Leave-one-out b*_i for each rollout of one group. grads [R, P] (or [R] squared norms); rewards [R]. -> [R]."""
    return loo_optimal_baseline(rewards.detach().double(), _sq_norms(grads))


def baseline_metrics(grads: Tensor, rewards: Tensor) -> dict[str, float]:
    """Per-group baseline diagnostics for 0/1 rewards: m_C, m_W, b*, the group mean and their gap.

    Args:
        grads: [R, P] (or [R] squared norms).
        rewards: [R].

    Returns:
        {"baseline/m_correct", "baseline/m_wrong", "baseline/b_star", "baseline/mean", "baseline/b_star_minus_mean"}
        (m's NaN when the group has no correct / no wrong rollout).
    """
    m_c, m_w = correct_wrong_sq_norms(grads, rewards)
    b_star = optimal_baseline(grads, rewards)
    mean = float(rewards.double().mean())
    return {"baseline/m_correct": m_c, "baseline/m_wrong": m_w, "baseline/b_star": b_star, "baseline/mean": mean,
            "baseline/b_star_minus_mean": b_star - mean}


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
    m, r = grads.shape[0], group_size
    assert rewards.shape == (m,), (rewards.shape, m)
    if r < 2:
        raise ValueError(f"group size must be >= 2, got {r}")
    if m < 2 * r:
        raise ValueError(f"need at least 2R = {2 * r} rollouts of the prompt to resample groups, got {m}")
    if num_resamples < 2:
        raise ValueError(f"num_resamples must be >= 2, got {num_resamples}")
    fns = {name: BASELINES.get(name) for name in baselines}
    g = grads.detach().double()
    rw = rewards.detach().double()
    n = g.square().sum(-1)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.rand(num_resamples, m, generator=gen).argsort(-1)[:, :r]  # [S, R]
    r_s, n_s = rw[idx], n[idx]  # [S, R]
    out = {}
    for name, fn in fns.items():
        coef = (r_s - fn(r_s, n_s)) / r  # [S, R]
        w = torch.zeros(num_resamples, m, dtype=torch.float64).scatter_(1, idx, coef)  # [S, M]
        est = w @ g  # [S, P]
        out[name] = float((est - est.mean(0)).square().sum() / (num_resamples - 1))
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


# ----------------------------------------------------------------------------------------------------------------
# The variance-optimal baseline as a training estimator (docs/theory.md §The variance-optimal baseline in training)
# ----------------------------------------------------------------------------------------------------------------


def aggregation_rollout_weights(completion_mask: Tensor, aggregation: str) -> Tensor:
    """c_i: the weight the loss aggregation's numerator puts on rollout i's length-normalised score gradient g_i.

    On the first (on-policy) pass the policy loss's gradient is -(1/Z) sum_i A_i c_i g_i with Z the aggregation's
    normaliser: c_i = 1 for seq-mean-token-mean (each rollout's token mean), c_i = |o_i| for the token-sum modes
    (token-mean, seq-mean-token-sum-norm). Computed from the registered numerator applied to a loss of 1 on every
    token of row i, so a newly registered aggregation is handled too (its numerator must be a sum over rows).

    Args:
        completion_mask: [N, T] bool.
        aggregation: a name in :data:`grpo_lens.losses.LOSS_AGGREGATIONS`.

    Returns:
        [N] float64, >= 0 (0 for an empty completion).

    Raises:
        ValueError: unknown aggregation (listing the valid ones).
    """
    from grpo_lens.losses import LOSS_AGGREGATIONS

    numerator = LOSS_AGGREGATIONS.get(aggregation).numerator
    mask = completion_mask.to(torch.float64)
    ones = torch.ones_like(mask)
    return torch.stack([numerator(ones[i:i + 1], mask[i:i + 1]) for i in range(mask.shape[0])]).reshape(-1)


def sketched_rollout_sq_norms(
    model: torch.nn.Module,
    batch: "RolloutBatch",
    need: Tensor,
    *,
    aggregation: str = "seq-mean-token-mean",
    sketch_dim: int = 16,
    seed: int = 0,
    projection: str = "gaussian",
    temperature: float = 1.0,
) -> Tensor:
    """||c_i g_i||^2 per rollout from one sketched batched backward: the weights of the leave-one-out b*.

    Only the rollouts with ``need`` True are sketched (the trainer passes the rollouts of groups with reward
    contrast; the others get advantage 0 whatever their norm). The norms are those of every ``nn.Linear`` weight
    (embeddings and norms are not sketched), estimated from the two-sided Gaussian sketch of
    :func:`grpo_lens.diagnostics.sketch_rollout_grads` (unbiased per layer; relative error bounded by
    :func:`grpo_lens.diagnostics.kronecker_sketch_variance_factor`), or exact with ``projection="identity"``.
    The projections are fixed by ``seed`` and independent of the rollouts, so b*_{-i} stays independent of
    rollout i and the policy-gradient estimate stays unbiased whatever the sketch error.

    Args:
        model: the policy, in the mode the loss is computed in.
        batch: N rollouts.
        need: [N] bool.
        aggregation: the trainer's loss aggregation (gives c_i, :func:`aggregation_rollout_weights`).
        sketch_dim: k_in = k_out per linear layer.
        seed: projection seed.
        projection: "gaussian" or "identity" (exact; for tests and small models).
        temperature: the sampling temperature (the policy's log-probs, docs/theory.md §Log-probabilities).

    Returns:
        [N] float64 in squared gradient units (0 where ``need`` is False).

    Raises:
        ValueError: the model has no ``nn.Linear`` layer, or an unknown aggregation / projection.
    """
    from grpo_lens.diagnostics.gradients import sketch_rollout_grads

    n = batch.num_rollouts
    assert need.shape == (n,), (need.shape, n)
    out = torch.zeros(n, dtype=torch.float64)
    idx = need.nonzero().reshape(-1).cpu()
    if len(idx) == 0:
        return out
    sub = batch.select(idx)
    c = aggregation_rollout_weights(sub.completion_mask, aggregation)
    sketch = sketch_rollout_grads(model, sub, k_in=sketch_dim, k_out=sketch_dim, projection=projection, seed=seed,
                                  temperature=temperature)
    sq = sum(t.detach().double().square().sum(-1).cpu() for t in sketch.per_layer.values())
    out[idx] = sq * c.square()
    return out


def optimal_vs_rloo(rewards: Tensor, valid: Tensor, advantages: Tensor) -> tuple[float, float, int]:
    """What the leave-one-out b* did against RLOO's baseline, over the valid rollouts of groups with contrast.

    Args:
        rewards: [B, R] (any value where invalid).  valid: [B, R] bool.  advantages: [B, R] from the ``optimal``
            estimator (before any truncation masking), so b*_{-i} = r_i - A_i.

    Returns:
        (sum of b*_{-i}, sum of b*_{-i} - rloo_i, number of rollouts): sums, so that processes can add them.
    """
    from grpo_lens.advantages import constant_groups

    assert rewards.shape == valid.shape == advantages.shape and rewards.dim() == 2, (rewards.shape, valid.shape)
    v = valid.bool()
    r = torch.where(v, rewards.double(), torch.zeros_like(rewards, dtype=torch.float64))
    count = v.sum(1, keepdim=True).double()
    rloo = (r.sum(1, keepdim=True) - r) / (count - 1).clamp(min=1)
    b = r - advantages.double()
    use = v & ~constant_groups(r, v).unsqueeze(1)
    return float(b[use].sum()), float((b - rloo)[use].sum()), int(use.sum())
