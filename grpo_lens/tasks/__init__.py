"""Tasks: prompts (chat messages) and reference answers.

Built in: ``gsm8k`` (vendored GSM8K) and ``arithmetic`` (procedural, with a difficulty knob). User data: a JSONL file
or a Hugging Face ``datasets`` dataset with a ``prompt`` column and any extra columns (passed to reward functions).

    >>> task = get_task("arithmetic", max_operand=20)
    >>> examples = task.sample(4, 0)            # list[Example]; example.prompt, example.answer, example.columns()
"""

from __future__ import annotations

import os
from pathlib import Path

from grpo_lens.tasks.arithmetic import ArithmeticTask
from grpo_lens.tasks.base import TASKS, Example, Task, as_rng
from grpo_lens.tasks.gsm8k import GSM8KTask, gsm8k_reference
from grpo_lens.tasks.user_data import UserDataTask, dataset_task, jsonl_task, row_to_example


def get_task(name: "str | os.PathLike", **options) -> Task:
    """The task called ``name``, built with ``options``; or a task from a ``.jsonl``/``.json`` file path.

    Args:
        name: a registered name (``gsm8k``, ``arithmetic``, ``jsonl``), or a path to a JSONL file.
        options: keyword arguments of the task's constructor (e.g. ``max_operand=20`` for ``arithmetic``; for a
            path, ``test_path`` and ``system_prompt``).

    Raises:
        ValueError: an unknown name (listing the valid ones), or a malformed data row (naming file and row).
        TypeError: an option the task does not take.
    """
    name = os.fspath(name)
    if name in TASKS:
        return TASKS.get(name)(**options)
    if name.endswith((".jsonl", ".json")) or Path(name).is_file():
        if not Path(name).is_file():
            raise FileNotFoundError(f"task data file {name!r} does not exist")
        return jsonl_task(name, **options)
    raise ValueError(f"unknown task {name!r}; valid names: {', '.join(TASKS.names())}, or a path to a .jsonl file")


__all__ = [
    "TASKS", "Example", "Task", "ArithmeticTask", "GSM8KTask", "UserDataTask", "as_rng", "dataset_task",
    "get_task", "gsm8k_reference", "jsonl_task", "row_to_example",
]
