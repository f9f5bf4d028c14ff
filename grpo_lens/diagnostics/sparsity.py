"""Sparsity of GRPO's signal and updates (docs/theory.md §9): S1 zero-variance groups, S2 small entries, S3 Hoyer, S4 bf16
update sparsity.

Shapes: B prompts, R group size, P parameters (or entries of any gradient vector).
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import Tensor, nn


# ----------------------------------------------------------------------------------------------------------------
# S1: zero-variance groups
# ----------------------------------------------------------------------------------------------------------------


def zero_variance_groups(rewards: Tensor, mask: Tensor | None = None) -> Tensor:
    """Which groups have all (valid) rewards equal, hence A = 0 and no policy gradient (docs/theory.md §2).

    Args:
        rewards: [B, R] float.
        mask: [B, R] bool of valid rollouts, optional (invalid ones are ignored; a group with < 2 valid counts
            as zero-variance).

    Returns:
        [B] bool.
    """
    assert rewards.dim() == 2, rewards.shape
    if mask is None:
        return rewards.max(1).values == rewards.min(1).values
    assert mask.shape == rewards.shape, (mask.shape, rewards.shape)
    mask = mask.bool()
    hi = torch.where(mask, rewards, torch.full_like(rewards, -math.inf)).max(1).values
    lo = torch.where(mask, rewards, torch.full_like(rewards, math.inf)).min(1).values
    return (mask.sum(1) < 2) | (hi == lo)


def zero_variance_fraction(rewards: Tensor, mask: Tensor | None = None) -> float:
    """S1 measured: share of groups whose rewards are all equal. rewards: [B, R]. Returns a float in [0, 1]."""
    return float(zero_variance_groups(rewards, mask).double().mean())


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


def predicted_zero_variance_fraction_from_rewards(rewards: Tensor, threshold: float = 0.5) -> float:
    """S1 predicted from per-prompt empirical success rates p_b = mean_i [r_{b,i} > threshold] of the same rewards.

    Caveat: a plug-in from the same R samples is biased towards 1 (a group with k = 0 or R gets p = 0 or 1, hence
    prediction 1); the unbiased estimate of p^R + (1-p)^R from those R samples is the measured indicator itself.
    Feed :func:`predicted_zero_variance_fraction` success rates from other samples (e.g. earlier steps) to test the
    Bernoulli model.

    Args:
        rewards: [B, R].
        threshold: a reward above it counts as a success.
    """
    assert rewards.dim() == 2, rewards.shape
    p = (rewards > threshold).double().mean(1)
    return predicted_zero_variance_fraction(p, rewards.shape[1])


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

    def log_choose(n: Tensor, r: int) -> Tensor:  # log C(n, r), -inf where n < r
        out = torch.lgamma(n + 1) - math.lgamma(r + 1) - torch.lgamma((n - r).clamp(min=0) + 1)
        return torch.where(n >= r, out, torch.full_like(n, -math.inf))

    denom = log_choose(m, group_size)
    return (log_choose(k, group_size) - denom).exp() + (log_choose(m - k, group_size) - denom).exp()


def s1_metrics(rewards: Tensor, success_rates: Tensor | None = None, mask: Tensor | None = None) -> dict[str, float]:
    """{"sparsity/zero_var_frac": measured, "sparsity/zero_var_pred": predicted} for a batch of rewards [B, R].

    ``success_rates`` [B] if known, else the plug-in of :func:`predicted_zero_variance_fraction_from_rewards`.
    """
    pred = (predicted_zero_variance_fraction(success_rates, rewards.shape[1]) if success_rates is not None
            else predicted_zero_variance_fraction_from_rewards(rewards))
    return {"sparsity/zero_var_frac": zero_variance_fraction(rewards, mask), "sparsity/zero_var_pred": pred}


# ----------------------------------------------------------------------------------------------------------------
# S2, S3: sparsity of a gradient vector
# ----------------------------------------------------------------------------------------------------------------


def _flat(g: Tensor | Iterable[Tensor]) -> Tensor:
    if isinstance(g, Tensor):
        return g.detach().reshape(-1)
    return torch.cat([t.detach().reshape(-1) for t in g])


def small_entry_share(g: Tensor | Iterable[Tensor], tau: float = 1e-3) -> float:
    """S2: share of entries with |g_j| <= tau * max_j |g_j|.

    Args:
        g: a gradient [P] (any shape, or a list of tensors, e.g. every parameter's ``.grad``).
        tau: relative threshold in [0, 1].

    Returns:
        float in [0, 1]; 1 for an all-zero g (every entry is at most 0).
    """
    v = _flat(g).abs().double()
    return float((v <= tau * v.max()).double().mean())


def hoyer_sparsity(g: Tensor | Iterable[Tensor]) -> float:
    """S3: Hoyer sparsity (sqrt(n) - ||g||_1/||g||_2) / (sqrt(n) - 1) (Hoyer, JMLR 5, 2004, eq. 1).

    1 for a one-hot vector, 0 for a constant-magnitude vector; computed in float64.

    Args:
        g: [P] (any shape or a list of tensors), n = P >= 2 entries.

    Returns:
        float in [0, 1]; 1 for an all-zero g (by convention: no entry is non-zero).

    Raises:
        ValueError: fewer than 2 entries.
    """
    v = _flat(g).double()
    n = v.numel()
    if n < 2:
        raise ValueError(f"Hoyer sparsity needs at least 2 entries, got {n}")
    l2 = v.norm()
    if l2 == 0:
        return 1.0
    return float((math.sqrt(n) - v.abs().sum() / l2) / (math.sqrt(n) - 1))


# ----------------------------------------------------------------------------------------------------------------
# S4: bf16 update sparsity
# ----------------------------------------------------------------------------------------------------------------


def bf16_unchanged_fraction(before: Iterable[Tensor], after: Iterable[Tensor]) -> float:
    """Share of parameters whose bf16 value is identical in two snapshots (Mukherjee et al. 2025, arXiv 2505.11711).

    Args:
        before, after: matching tensors (any dtype; compared after casting to bfloat16).

    Returns:
        float in [0, 1] (1 for no parameters).
    """
    same = total = 0
    for a, b in zip(before, after, strict=True):
        assert a.shape == b.shape, (a.shape, b.shape)
        same += int((a.to(torch.bfloat16) == b.to(device=a.device, dtype=torch.bfloat16)).sum())
        total += a.numel()
    return same / total if total else 1.0


class Bf16UpdateTracker:
    """S4: tracks which parameters change in bfloat16 between steps and since the start.

    Keeps two bf16 copies of the tracked parameters (2 bytes each): the one at construction (start) and the
    previous :meth:`update`. Call :meth:`update` after each optimizer step.

    Args:
        params: a model (its parameters with ``requires_grad``) or an iterable of tensors.
        device: where the snapshots live (default: with each parameter; ``"cpu"`` saves accelerator memory).

    Example::

        tracker = Bf16UpdateTracker(model)
        for step in ...:
            optimizer.step()
            metrics.update(tracker.update())
    """

    def __init__(self, params: nn.Module | Iterable[Tensor], device: str | torch.device | None = None) -> None:
        if isinstance(params, nn.Module):
            params = [p for p in params.parameters() if p.requires_grad]
        self.params = list(params)
        self.device = device
        self.start = self._snapshot()
        self.previous = self.start

    def _snapshot(self) -> list[Tensor]:
        return [p.detach().to(torch.bfloat16).to(self.device if self.device is not None else p.device, copy=True)
                for p in self.params]

    @property
    def num_params(self) -> int:
        """Number of tracked scalar parameters."""
        return sum(p.numel() for p in self.params)

    def update(self) -> dict[str, float]:
        """Compare the current parameters (as bf16) with the previous snapshot and the start, then take a snapshot.

        Returns:
            {"sparsity/update_step": share unchanged since the previous call (or the start),
             "sparsity/update_total": share unchanged since the start}.
        """
        current = self._snapshot()
        out = {
            "sparsity/update_step": bf16_unchanged_fraction(self.previous, current),
            "sparsity/update_total": bf16_unchanged_fraction(self.start, current),
        }
        self.previous = current
        return out
