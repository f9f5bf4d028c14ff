"""What a task is: a source of prompts (chat messages) and reference answers, sampled by seed."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from grpo_lens.registry import Registry
from grpo_lens.rewards import math_correctness_verdict

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class Example:
    """One prompt of a task.

    Attributes:
        prompt: chat messages, e.g. ``[{"role": "user", "content": "What is 2 + 3?"}]``, or a plain string (a user
            dataset's string prompt, kept as given).
        answer: the reference answer as a string (e.g. ``"5"``), or None when the task has none; a user dataset's
            list or mapping answer is kept as given (for the user's reward functions; correctness cannot score it).
        extras: any other per-prompt columns (e.g. ``question``), passed to reward functions as keyword arguments.
    """

    prompt: Messages | str
    answer: Any = None
    extras: dict[str, Any] = field(default_factory=dict)

    def columns(self) -> dict[str, Any]:
        """The keyword columns a reward function receives for this prompt: ``answer`` (when set) and ``extras``."""
        cols = dict(self.extras)
        if self.answer is not None:
            cols["answer"] = self.answer
        return cols


@runtime_checkable
class Task(Protocol):
    """A task: ``name`` and ``sample(n, rng_or_seed, split)``; ``splits`` names the splits it has."""

    name: str
    splits: tuple[str, ...]

    def sample(
        self, n: int, rng_or_seed: int | random.Random | Any = None, split: str = "train", *, seed: int | None = None
    ) -> list[Example]:
        """n examples of ``split``, drawn with ``rng_or_seed`` (or the keyword ``seed``; 0 if neither is given);
        the same seed gives the same examples."""
        ...


#: name -> factory(**options) -> Task.
TASKS: Registry = Registry("task")


def as_rng(rng_or_seed: int | random.Random | Any) -> random.Random:
    """A ``random.Random`` from an int seed, a ``random.Random`` (returned as is) or a ``numpy.random.Generator``
    (a seed is drawn from it)."""
    if isinstance(rng_or_seed, random.Random):
        return rng_or_seed
    if isinstance(rng_or_seed, bool):
        raise TypeError("rng_or_seed must be an int seed, a random.Random or a numpy Generator, got a bool")
    if isinstance(rng_or_seed, int):
        return random.Random(rng_or_seed)
    if hasattr(rng_or_seed, "integers"):  # numpy.random.Generator
        return random.Random(int(rng_or_seed.integers(0, 2**63 - 1)))
    raise TypeError(
        f"rng_or_seed must be an int seed, a random.Random or a numpy Generator, got {type(rng_or_seed).__name__}"
    )


def split_rng(rng_or_seed: int | random.Random | Any, split: str, seed: int | None = None) -> random.Random:
    """An RNG for one split: an int seed gives a different stream per split (train and test with seed 0 differ).

    ``seed`` is the keyword form of an int ``rng_or_seed`` (``task.sample(4, seed=1)``); give one or the other.
    """
    if seed is not None:
        if rng_or_seed is not None:
            raise TypeError("give rng_or_seed or seed, not both")
        rng_or_seed = seed
    if rng_or_seed is None:
        rng_or_seed = 0
    if isinstance(rng_or_seed, int) and not isinstance(rng_or_seed, bool):
        return random.Random(f"{split}:{rng_or_seed}")
    return as_rng(rng_or_seed)


def check_split(task: Task, split: str) -> None:
    """ValueError naming the valid splits when ``split`` is not one of the task's."""
    if split not in task.splits:
        raise ValueError(f"task {task.name!r} has no split {split!r}; valid splits: {', '.join(task.splits)}")


def sample_rows(rows: list, n: int, rng: random.Random) -> list:
    """n rows without replacement while n <= len(rows); beyond that whole shuffled passes, then a partial one."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not rows:
        raise ValueError("cannot sample from an empty split")
    out: list = []
    while len(out) < n:
        take = min(n - len(out), len(rows))
        out.extend(rng.sample(rows, take))
    return out


#: How a training step draws its B prompts from a task's rows (TrainConfig.prompt_order).
PROMPT_ORDERS = ("independent", "epoch")


def epoch_rows(rows: list, n: int, start: int, seed: int) -> list:
    """Positions ``start`` .. ``start + n - 1`` of the epoch order over ``rows`` (``--prompt-order epoch``, TRL's
    convention): one shuffled pass over the N rows after another, every row once per epoch. Epoch e is the
    permutation ``random.Random(seed * 1_000_003 + e).sample(range(N), N)``; position p is row
    ``perm_{p // N}[p % N]``. A pure function of (rows, position, seed): a resumed run draws what the uninterrupted
    one would.

    Raises:
        ValueError: no rows, n < 0 or start < 0.
    """
    if not rows:
        raise ValueError("cannot draw from an empty split")
    if n < 0 or start < 0:
        raise ValueError(f"n and start must be >= 0, got n={n}, start={start}")
    N, out, perms = len(rows), [], {}
    for p in range(start, start + n):
        e = p // N
        if e not in perms:
            perms[e] = random.Random(seed * 1_000_003 + e).sample(range(N), N)
        out.append(rows[perms[e][p % N]])
    return out


def correctness_verdict(task: Task, completions: list, answers: list) -> list[float | None]:
    """The task's own 0/1 correctness verdict of N completions (None: no verdict, e.g. no reference answer).

    A task may define ``correct(completions, answers) -> list[float | None]``; otherwise the reference answer is
    compared with :func:`grpo_lens.rewards.math_correctness_verdict`. ``reward/accuracy`` is the mean of this verdict
    over the rollouts that have one: independent of the configured reward functions and their weights.

    Args:
        task: a task.   completions: N completion texts.   answers: N reference answers (None where absent).
    Returns:
        N values in {0.0, 1.0, None}.
    """
    correct = getattr(task, "correct", None)
    if callable(correct):
        return list(correct(completions, answers))

    return math_correctness_verdict(completions, answers)
