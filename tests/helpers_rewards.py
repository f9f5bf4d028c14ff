"""Reward functions for tests, registered in grpo_lens.rewards.REWARDS when this module is imported.

In-process tests import it (tests/ is on sys.path under pytest); a subprocess gets it with
``GRPO_LENS_PLUGINS=helpers_rewards`` and ``PYTHONPATH=tests`` (see :func:`grpo_lens.cli.load_plugins`).

All of them depend on the rollout's position only, never on the text, so they give the same rewards whatever the tiny
random model writes: rollout n of N (n // R is its group).
"""

from __future__ import annotations

import math
import time

from grpo_lens.rewards import REWARDS

#: How long ``test_sleeps`` sleeps (seconds); tests set reward_timeout well below it.
SLEEP_SECONDS = 3.0


def alternating(prompts, completions, **kwargs):
    """1, 0, 1, 0, ...: with an even group size every group mixes right and wrong (non-zero advantages)."""
    return [float(n % 2) for n in range(len(completions))]


def some_invalid(prompts, completions, **kwargs):
    """Per 4 rollouts: None, NaN, 1.0, 0.0. With R = 4 every group has two invalid and two valid (1 and 0) rollouts."""
    return [(None, math.nan, 1.0, 0.0)[n % 4] for n in range(len(completions))]


def raises(prompts, completions, **kwargs):
    """Always raises: every rollout of the call is invalid."""
    raise RuntimeError("test reward function failure")


def raises_in_training(prompts, completions, trainer_state=None, **kwargs):
    """Raises at every training step (trainer_state.global_step >= 1), not in the trainer's start-up check (step 0):
    a function that fails only on what the model writes."""
    if trainer_state is not None and trainer_state.global_step >= 1:
        raise RuntimeError("test reward function failure in training")
    return [1.0] * len(completions)


def sleeps(prompts, completions, **kwargs):
    """Sleeps :data:`SLEEP_SECONDS`, longer than the tests' reward_timeout, then returns 1.0 for everything."""
    time.sleep(SLEEP_SECONDS)
    return [1.0] * len(completions)


for _name, _fn in (
    ("test_alternating", alternating),
    ("test_some_invalid", some_invalid),
    ("test_raises", raises),
    ("test_sleeps", sleeps),
    ("test_raises_in_training", raises_in_training),
):
    if _name not in REWARDS:  # importable twice (as a plugin and by a test) without a double registration
        REWARDS.register(_name)(_fn)
