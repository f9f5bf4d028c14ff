"""One step's rollouts as the lens reads them (:class:`StepBatch`): what the trainer, its update's lens checks and the
TRL integration hand the lens, in one value instead of six arguments."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_lens.rollout import RolloutBatch


@dataclass(frozen=True)
class StepBatch:
    """One training step's rollouts on this process and what the update computed of them, before the update.

    N = B R rollouts on this process (B prompts, R rollouts each, ``batch.group_size``), T completion tokens.
    """

    step: int
    """The optimizer step being measured (1-based; the lens's per-group seeds follow it)."""
    policy: torch.nn.Module
    """The model being trained, at the step's starting weights."""
    batch: RolloutBatch
    """This process's N rollouts: prompt ids [N, Lp], completion ids and mask [N, T], group size R."""
    rewards: torch.Tensor
    """[N] float, the combined reward of each rollout; NaN where invalid."""
    valid: torch.Tensor
    """[N] bool, the rollouts whose every reward function returned a score."""
    advantages: torch.Tensor
    """[N] A_i, the advantages the update uses."""
