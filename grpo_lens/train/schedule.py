"""The learning-rate schedule of ``grpo-lens train``: transformers' schedulers, as a function of the step.

``--lr-scheduler`` (constant, linear, cosine) with ``--warmup-steps`` (steps, or a share of max_steps below 1) names
the scheduler of ``transformers.get_scheduler`` (``constant_with_warmup``, ``linear``, ``cosine``) over ``max_steps``
steps, the schedules TRL's ``lr_scheduler_type`` and ``warmup_steps`` select. The LR of step s (1-based) is
``learning_rate × lambda(s − 1)``, lambda the scheduler's multiplier, set before the step's first optimizer step and
held for its mu × num_mini_batches optimizer steps. As in transformers, the first warm-up step has LR 0.

Resuming: the LR is a function of the step alone, so a resumed run sets the LR of its next step from the checkpoint's
step and follows the unbroken run's sequence exactly (tests/train/test_schedule.py); nothing else needs saving. A
resumed run given a larger ``--max-steps`` stretches a decaying schedule from that step on (the horizon is
``max_steps``), as a longer run would have had it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from transformers import get_scheduler

if TYPE_CHECKING:
    from grpo_lens.config import TrainConfig

#: ``lr_scheduler`` -> the name transformers' ``get_scheduler`` knows (each takes a warm-up).
TRANSFORMERS_SCHEDULERS = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def warmup_steps(config: TrainConfig) -> int:
    """Warm-up steps: ``warmup_steps`` when it is >= 1, else ``ceil(warmup_steps × max_steps)`` (a share, rounded up
    as transformers' ``TrainingArguments.get_warmup_steps`` does)."""
    w = float(config.warmup_steps)
    return int(w) if w >= 1 else math.ceil(w * config.max_steps)


class LRSchedule:
    """Sets the optimizer's LR of each step from transformers' scheduler of ``config.lr_scheduler``.

    Args:
        optimizer: the run's optimizer (every param group gets the same LR).
        config: a :class:`grpo_lens.config.TrainConfig` (learning_rate, lr_scheduler, warmup_steps, max_steps).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, config: TrainConfig):
        self.optimizer = optimizer
        self.base = float(config.learning_rate)
        for group in optimizer.param_groups:  # the scheduler reads its base LR from here
            group["lr"] = self.base
            group.pop("initial_lr", None)
        scheduler = get_scheduler(
            TRANSFORMERS_SCHEDULERS[config.lr_scheduler],
            optimizer,
            num_warmup_steps=warmup_steps(config),
            num_training_steps=max(1, config.max_steps),
        )
        self.multiplier = scheduler.lr_lambdas[0]

    def lr(self, step: int) -> float:
        """The LR of step ``step`` (1-based)."""
        return self.base * float(self.multiplier(step - 1))

    def apply(self, step: int) -> float:
        """Set every param group's LR to :meth:`lr` of ``step``; returns it."""
        lr = self.lr(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr
