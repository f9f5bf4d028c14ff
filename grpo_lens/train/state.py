"""What the training loop carries: the models it trains (:class:`Models`), the run's step-to-step state
(:class:`RunState`), one step's rollouts (:class:`Rollouts`), how the lens measures a step (:class:`LensPlan`), the
random generators' states a checkpoint saves, and :class:`Lens`, what the loop asks of a lens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from grpo_lens import metrics as mk
from grpo_lens.lens.step_batch import StepBatch
from grpo_lens.rollout import RolloutBatch


@dataclass
class Models:
    """What a run trains.

    policy: the model being trained (LoRA-wrapped with ``lora_rank`` > 0).   tokenizer: its tokenizer.
    reference: a frozen copy of the base model for the KL term (None with beta = 0).   optimizer: AdamW over
    ``params``, the parameters that require gradients.
    """

    policy: torch.nn.Module
    tokenizer: Any
    reference: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]


@dataclass
class RunState:
    """What a run carries from step to step besides weights and optimizer: ``step`` (the last step taken; a resumed
    run's checkpoint step at the start) and the non-finite guard's counters ``guard`` (``consecutive`` and ``total``
    trainer steps skipped). Both are saved in every checkpoint, with the random generators' states (:func:`_rng_state`),
    so a resumed run continues as the uninterrupted one would."""

    step: int = 0
    guard: dict[str, int] = field(default_factory=lambda: {"consecutive": 0, "total": 0, "unscored": 0})

    def count_skipped(self, skipped: bool) -> dict[str, int]:
        """Count one trainer step, ``skipped`` when any of its optimizer steps was skipped for a non-finite loss or
        gradient; returns the ``guard/*`` metrics of the step."""
        self.guard["consecutive"] = self.guard["consecutive"] + 1 if skipped else 0
        self.guard["total"] += int(skipped)
        return {
            mk.GUARD_STEP_SKIPPED: int(skipped),
            mk.GUARD_SKIPPED_STEPS: self.guard["total"],
            mk.GUARD_CONSECUTIVE_SKIPPED: self.guard["consecutive"],
        }

    def count_dead(self, dead: bool) -> dict[str, int]:
        """Count one trainer step, ``dead`` when no group of any process had reward contrast
        (``guard["dead"]``: consecutive such steps, saved with the guard so a resumed run counts on); returns
        ``dead/steps_without_mixed``."""
        self.guard["dead"] = self.guard.get("dead", 0) + 1 if dead else 0
        return {mk.DEAD_STEPS_WITHOUT_MIXED: self.guard["dead"]}

    def count_unscored(self, unscored: bool) -> None:
        """Count one trainer step, ``unscored`` when no rollout of any process got a valid reward
        (``guard["unscored"]``: consecutive such steps)."""
        self.guard["unscored"] = self.guard.get("unscored", 0) + 1 if unscored else 0

    def count_untrained(self, untrained: bool) -> None:
        """Count one trainer step, ``untrained`` when --overlong mask / filter zeroed every rollout's advantage (every
        completion was cut at max_new_tokens): ``guard["untrained"]``, consecutive such steps."""
        self.guard["untrained"] = self.guard.get("untrained", 0) + 1 if untrained else 0


# ---------------------------------------------------------------------------------------------------------------------
# One step: sampling, advantages, reference, lens, record
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class Rollouts:
    """One step's rollouts on this process (N = B_local R, B_local = prompts_per_step / processes) and their scores.

    batch: the N rollouts.   rewards: [N] float, NaN where invalid.   valid: [N] bool.   correct: [N] float64, the
    task's 0/1 verdict (NaN: none).   reward_info: this process's ``reward/*`` metrics of the reward calls.
    dynamic: ``dynamic/*`` metrics (empty without dynamic sampling).   sampled: every round's (rewards, valid,
    correct), kept or not (dynamic sampling's all-groups view; the one round without it).   generation_seconds: the
    time spent generating, over all rounds.
    """

    batch: RolloutBatch
    rewards: torch.Tensor
    valid: torch.Tensor
    correct: torch.Tensor
    reward_info: dict[str, float]
    dynamic: dict[str, float]
    sampled: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    generation_seconds: float


@dataclass
class LensPlan:
    """How the lens measures a step: ``lens_step`` (a lens step at all), ``capture`` (the lens's gradient capture for
    the update's first pass to fill, :func:`grpo_lens.train.update.lens_reads_update`; None when the lens ran its own
    pass), ``metrics`` (what the lens's own pass, before the update, measured) and ``per_rollout`` (the update runs
    every rollout's own prompt, as on every lens step on the cadence, :func:`grpo_lens.train.loop.on_lens_cadence`;
    False: as a lens-off step)."""

    lens_step: bool
    capture: Any = None
    metrics: dict[str, float] = field(default_factory=dict)
    per_rollout: bool = False


def _rng_state() -> dict[str, Any]:
    """The states of Python's, NumPy's and torch's global random generators (saved in every checkpoint). NumPy's is
    stored as plain values and a tensor (its 624 key words as int64), which ``torch.load(weights_only=True)`` reads."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    numpy_state = {
        "name": str(name),
        # numpy types the state tuple loosely: keys is an array
        "keys": torch.from_numpy(keys.astype(np.int64)),  # type: ignore[attr-defined]
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }
    return {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}


def _set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`_rng_state` saved, so a resumed run draws what the uninterrupted one would (also the
    NumPy state tuple of checkpoints written before it was stored as a tensor)."""
    random.setstate(_as_tuples(state["python"]))
    numpy_state = state["numpy"]
    if isinstance(numpy_state, dict):
        numpy_state = (
            numpy_state["name"],
            numpy_state["keys"].numpy().astype(np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    np.random.set_state(numpy_state)
    torch.set_rng_state(state["torch"])


def _as_tuples(value: Any) -> Any:
    """``random.setstate`` wants tuples where a round trip may give lists."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


class Lens(Protocol):
    """What the training loop asks of a lens (:class:`grpo_lens.lens.trainer_lens.TrainerLens` is the one grpo-lens
    builds; :func:`grpo_lens.train.loop.train` takes any other through its ``lens`` argument).

    The loop calls :meth:`start` once on a new run, :meth:`before_step` before each update, :meth:`measure` on a lens
    step (before the update), :meth:`after_step` after it, and :meth:`state_dict` / :meth:`load_state_dict` with each
    checkpoint. A lens may also offer, looked up with ``hasattr`` (:func:`grpo_lens.train.update.lens_reads_update`,
    :func:`grpo_lens.train.update.lens_fuses_gram`), ``mixed_groups``, ``update_capture``, ``update_gram_capture``
    and ``measure_from_update``, which read its g_i off the update's own first pass instead of a pass of its own.

    A step's rollouts come as one :class:`grpo_lens.lens.step_batch.StepBatch` (step, policy, batch, rewards [N] NaN
    where invalid, valid [N] bool, advantages [N]; N rollouts on this process).
    """

    def start(self, policy: torch.nn.Module) -> None:
        """Called once before a new run's first step (not on resume)."""

    def before_step(self, policy: torch.nn.Module) -> None:
        """Called before each step's update, with the step's starting weights."""

    def measure(self, step_batch: StepBatch) -> dict[str, float]:
        """The lens's metrics of step ``step_batch.step`` from its own pass, before the update."""

    def after_step(self, step: int, policy: torch.nn.Module, lens_step: bool) -> dict[str, float]:
        """Called after each step's update; ``lens_step``: the step was a lens step. Returns metrics to log."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the lens."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s state on resume."""
