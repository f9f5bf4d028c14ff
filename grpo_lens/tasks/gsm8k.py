"""GSM8K (Cobbe et al. 2021, arXiv 2110.14168): grade-school math word problems, vendored in grpo_lens/data/gsm8k.

The reference answer is the number after ``####`` in the dataset's solution, with thousands commas removed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from importlib import resources

from grpo_lens.rewards import math_correctness_verdict, math_verify_available
from grpo_lens.tasks.base import TASKS, Example, check_split, sample_rows, split_rng

GSM8K_INSTRUCTION = (
    "Solve the problem step by step. At the end, write the final answer as a number on its own line, "
    "in the form '#### <number>'."
)


def gsm8k_reference(solution: str) -> str:
    """The number after ``####`` in a GSM8K solution, commas removed: ``"... #### 1,234"`` -> ``"1234"``.

    Raises:
        ValueError: the solution has no ``####`` line.
    """
    if "####" not in solution:
        raise ValueError(f"GSM8K solution has no '####' answer: {solution[-80:]!r}")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


@cache
def load_gsm8k(split: str) -> tuple[dict, ...]:
    """The vendored GSM8K rows of ``split`` (``"train"``: 7473, ``"test"``: 1319) as dicts with ``question``,
    ``answer`` (the full solution)."""
    text = resources.files("grpo_lens").joinpath("data", "gsm8k", f"{split}.jsonl").read_text(encoding="utf-8")
    return tuple(json.loads(line) for line in text.splitlines() if line.strip())


@dataclass
class GSM8KTask:
    """GSM8K prompts: the question and an instruction to reason step by step and end with ``#### <number>``.

    Args:
        instruction: appended to the question in the user message.
        system_prompt: an optional system message (None: the chat template's default, if any).

    Example columns: ``answer`` (the reference number as a string), ``solution`` (the dataset's worked solution),
    ``question``.
    """

    instruction: str = GSM8K_INSTRUCTION
    system_prompt: str | None = None
    name: str = field(default="gsm8k", init=False)
    splits: tuple[str, ...] = field(default=("train", "test"), init=False)

    def prompt(self, question: str) -> list[dict[str, str]]:
        """The chat messages for one question."""
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": f"{question}\n{self.instruction}"})
        return messages

    def example(self, row: dict) -> Example:
        """The chat prompt of one GSM8K row, with the number after ``####`` as the reference ``answer``."""
        return Example(
            prompt=self.prompt(row["question"]),
            answer=gsm8k_reference(row["answer"]),
            extras={"question": row["question"], "solution": row["answer"]},
        )

    def correct(self, completions: list, answers: list) -> list[float | None]:
        """The 0/1 verdict ``reward/accuracy`` averages: the completion's marked answer (``####`` line, else the last
        ``\\boxed{}``, else the text) against the reference number, with math-verify when it is installed (the
        ``math`` extra), else by exact number extraction (:func:`grpo_lens.rewards.math_correctness_verdict`)."""
        return math_correctness_verdict(completions, answers, use_math_verify=math_verify_available())

    def size(self, split: str = "train") -> int:
        """Number of rows in ``split``; ValueError for an unknown split."""
        check_split(self, split)
        return len(load_gsm8k(split))

    def sample(self, n: int, rng_or_seed=None, split: str = "train", *, seed: int | None = None) -> list[Example]:
        """n examples of ``split``, without replacement (while n <= the split's size)."""
        check_split(self, split)
        rows = list(load_gsm8k(split))
        return [self.example(row) for row in sample_rows(rows, n, split_rng(rng_or_seed, split, seed))]


TASKS.register("gsm8k")(GSM8KTask)
