"""What happens to completions cut at the length budget: ``--overlong none | mask | filter | soft-punish``.

Shapes: N rollouts, T completion tokens. Formulas and sources: docs/theory.md §Overlong handling (DAPO, Yu et al.,
arXiv 2503.14476, §3.4 and eq. 13).
"""

from __future__ import annotations

import torch
from torch import Tensor

#: The overlong modes: none (truncated completions are trained on like any other), mask (advantage 0, still in the
#: loss normaliser and in group statistics), filter (DAPO's overlong filtering: their tokens leave the loss and its
#: normaliser), soft-punish (DAPO's soft overlong punishment added to the reward).
OVERLONG_MODES = ("none", "mask", "filter", "soft-punish")


def _check(mode: str) -> None:
    if mode not in OVERLONG_MODES:
        raise ValueError(f"unknown overlong mode {mode!r}; valid names: {', '.join(OVERLONG_MODES)}")


def soft_overlong_penalty(lengths: Tensor, max_length: int, buffer: int) -> Tensor:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13), added to each rollout's reward:

        R_length(y) = 0                                   if |y| <= L_max - L_cache
                      ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                      -1                                  if |y| > L_max

    Args:
        lengths: [N] completion lengths |y| in tokens (up to and including EOS).
        max_length: L_max >= 1.
        buffer: L_cache, 1 <= L_cache <= L_max: the punishment interval's width.
    Returns:
        [N] float32 penalties in [-1, 0].
    Raises:
        ValueError: buffer or max_length out of range.
    """
    if not 1 <= buffer <= max_length:
        raise ValueError(f"the overlong buffer L_cache must be in [1, L_max = {max_length}], got {buffer}")
    y = lengths.float()
    inside = ((max_length - buffer) - y) / buffer
    penalty = torch.where(y <= max_length - buffer, torch.zeros_like(y), inside)
    return torch.where(y > max_length, torch.full_like(y, -1.0), penalty)


def overlong_advantages(advantages: Tensor, truncated: Tensor, mode: str) -> Tensor:
    """Advantages [N] with truncated rollouts set to 0 under ``mask`` and ``filter`` (their group statistics were
    computed with them in); unchanged under ``none`` and ``soft-punish``.

    Raises:
        ValueError: unknown mode, listing the valid ones.
    """
    _check(mode)
    if mode in ("mask", "filter"):
        return advantages.masked_fill(truncated.to(advantages.device), 0.0)
    return advantages


def overlong_loss_mask(completion_mask: Tensor, truncated: Tensor, mode: str) -> Tensor:
    """The tokens that enter the loss and its normaliser: [N, T] bool. Under ``filter`` a truncated rollout's tokens
    are all removed (DAPO's overlong filtering), so token-mean divides by the kept tokens only and the per-rollout
    modes by the kept rollouts; otherwise the completion mask as it is.

    Args:
        completion_mask: [N, T] bool.   truncated: [N] bool.   mode: one of :data:`OVERLONG_MODES`.
    Raises:
        ValueError: unknown mode, listing the valid ones.
    """
    _check(mode)
    if mode == "filter":
        return completion_mask & ~truncated.to(completion_mask.device).unsqueeze(1)
    return completion_mask
