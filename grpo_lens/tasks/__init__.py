"""Tasks: prompts (chat messages) and reference answers.

Built in: ``gsm8k`` (vendored GSM8K) and ``arithmetic`` (procedural, with a difficulty knob). User data: a JSONL file
or a Hugging Face ``datasets`` dataset with a ``prompt`` column and any extra columns (passed to reward functions).

    >>> task = get_task("arithmetic", max_operand=20)
    >>> examples = task.sample(4, 0)            # list[Example]; example.prompt, example.answer, example.columns()
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

from grpo_lens.tasks.arithmetic import ArithmeticTask
from grpo_lens.tasks.base import TASKS, Example, Task, as_rng, correctness_verdict
from grpo_lens.tasks.gsm8k import GSM8KTask, gsm8k_reference
from grpo_lens.tasks.user_data import (
    UserDataTask,
    dataset_task,
    jsonl_task,
    row_to_example,
    user_task,
)


class TaskOptionError(TypeError, ValueError):
    """A task option the task does not take, or of the wrong type (a TypeError and a ValueError: bad input)."""


def get_task(name: str | os.PathLike, dataset=None, **options) -> Task:
    """The task called ``name``, built with ``options``; or a task from the user's data.

    Args:
        name: a registered name (``gsm8k``, ``arithmetic``, ``jsonl``), or a path to a JSONL file.
        dataset (Any): the data of task ``jsonl`` (see :func:`user_task`: a JSONL path, a Hugging Face dataset name or
            object, or a list of rows); must be None for the other tasks.
        options (Any): keyword arguments of the task's constructor (e.g. ``max_operand=20`` for ``arithmetic``;
            ``system_prompt``, ``test_path`` for user data).

    Raises:
        ValueError: an unknown name (listing the valid ones), a dataset given to a built-in task or missing for
            ``jsonl``, or a malformed data row (naming file and row).
        TaskOptionError: an option the task does not take or of the wrong type, listing the accepted ones (a
            TypeError and a ValueError).
    """
    name = os.fspath(name)
    if name == "jsonl":
        if dataset is None:
            raise ValueError(
                "task 'jsonl' needs a dataset: a path to a .jsonl file with a 'prompt' column (flag --dataset)"
            )
        return _build(name, user_task, dataset, **options)
    if name in TASKS:
        if dataset is not None:
            raise ValueError(f"task {name!r} takes no dataset (got {dataset!r}); use task 'jsonl' for your own data")
        return _build(name, TASKS.get(name), **options)
    if name.endswith((".jsonl", ".json")) or Path(name).is_file():
        return _build(name, user_task, name, **options)
    raise ValueError(f"unknown task {name!r}; valid names: {', '.join(TASKS.names())}, or a path to a .jsonl file")


def _build(name: str, factory, *args, **options) -> Task:
    """``factory(*args, **options)``; a TypeError (unknown option, option of the wrong type) becomes a
    :class:`TaskOptionError` listing the options the task accepts."""
    try:
        return factory(*args, **options)
    except TypeError as err:
        accepted = [p for p in inspect.signature(factory).parameters if p not in ("self", "dataset")]
        raise TaskOptionError(
            f"task {name!r}: bad task_options {options!r} ({err}); accepted options: {', '.join(accepted) or 'none'}"
        ) from None


__all__ = [
    "TASKS",
    "Example",
    "Task",
    "TaskOptionError",
    "ArithmeticTask",
    "GSM8KTask",
    "UserDataTask",
    "as_rng",
    "correctness_verdict",
    "dataset_task",
    "get_task",
    "gsm8k_reference",
    "jsonl_task",
    "row_to_example",
    "user_task",
]
