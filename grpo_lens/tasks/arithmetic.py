"""Procedurally generated arithmetic problems with a difficulty knob.

Difficulty comes from the operand range, the number of operands and the operators. The defaults were chosen by
measurement (benchmarks/measure_arithmetic_difficulty.py) so that SmolLM2-135M-Instruct, sampled at temperature 0.7,
top_p 1, top_k 0, starts between 20% and 60% accuracy: hard enough to learn, easy enough that many groups of 8 mix
right and wrong rollouts (a group whose rewards are all equal gives no policy gradient).

Measured (48 test-split prompts x 8 rollouts, max_new_tokens 16, correctness reward; "mixed" = share of groups with
both right and wrong rollouts), template "What is {expression}? Reply with just the number." unless noted:

    a + b, operands in [2, 60]      acc 0.120   mixed 0.31
    a + b, operands in [2, 30]      acc 0.125   mixed 0.33
    a + b, operands in [2, 20]      acc 0.286   mixed 0.65
    a + b, operands in [0, 9]       acc 0.404   mixed 0.92   <- default (max_new_tokens 24: acc 0.424, mixed 0.94)
    a + b, [0, 9], "Compute {expression}. Give only the final number."   acc 0.263   mixed 0.83
    a + b + c, operands in [0, 9]   acc 0.042   mixed 0.25

``ArithmeticTask(min_operand=2, max_operand=20)`` is a harder setting still inside the 20-60% band.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from grpo_lens.tasks.base import TASKS, Example, check_split, split_rng

DEFAULT_TEMPLATE = "What is {expression}? Reply with just the number."
OPERATORS = "+-*"


def evaluate(operands: list[int], ops: list[str]) -> int:
    """The value of ``operands[0] ops[0] operands[1] ...`` with the usual precedence (``*`` before ``+``/``-``).

    >>> evaluate([2, 3, 4], ["+", "*"])
    14
    """
    if len(ops) != len(operands) - 1:
        raise ValueError(f"need len(ops) == len(operands) - 1, got {len(ops)} ops for {len(operands)} operands")
    terms = [operands[0]]  # products, each with its sign
    for op, x in zip(ops, operands[1:]):
        if op == "*":
            terms[-1] *= x
        elif op == "+":
            terms.append(x)
        elif op == "-":
            terms.append(-x)
        else:
            raise ValueError(f"unknown operator {op!r}; valid: {OPERATORS}")
    return sum(terms)


@dataclass
class ArithmeticTask:
    """Integer arithmetic, e.g. "What is 7 + 5? Reply with just the number." -> answer "12".

    Args:
        min_operand: the smallest operand; operands are drawn uniformly from [min_operand, max_operand].
        max_operand: the largest operand.
        num_operands: operands per problem (>= 2).
        ops: operators to draw from, a string of characters in ``"+-*"``.
        allow_negative: if False, problems whose value is negative are redrawn.
        template: the user message; ``{expression}`` is replaced by e.g. ``"7 + 5"``.
        system_prompt: an optional system message.

    Splits ``train`` and ``test`` are different seeded streams of the same distribution (not disjoint sets).
    Example columns: ``answer`` (the value as a string), ``expression``.
    """

    min_operand: int = 0
    max_operand: int = 9
    num_operands: int = 2
    ops: str = "+"
    allow_negative: bool = False
    template: str = DEFAULT_TEMPLATE
    system_prompt: str | None = None
    name: str = field(default="arithmetic", init=False)
    splits: tuple[str, ...] = field(default=("train", "test"), init=False)

    def __post_init__(self):
        if self.num_operands < 2:
            raise ValueError(f"num_operands must be >= 2, got {self.num_operands}")
        if self.min_operand > self.max_operand:
            raise ValueError(f"min_operand ({self.min_operand}) > max_operand ({self.max_operand})")
        if not self.ops or set(self.ops) - set(OPERATORS):
            raise ValueError(f"ops must be a non-empty string of characters in {OPERATORS!r}, got {self.ops!r}")
        if "{expression}" not in self.template:
            raise ValueError(f"template must contain '{{expression}}', got {self.template!r}")
        if not self.allow_negative and self.max_operand < 0:
            raise ValueError("every problem would be negative: set allow_negative=True or max_operand >= 0")

    def problem(self, rng: random.Random) -> tuple[str, int]:
        """One (expression, value) pair."""
        for _ in range(10_000):
            operands = [rng.randint(self.min_operand, self.max_operand) for _ in range(self.num_operands)]
            ops = [rng.choice(self.ops) for _ in range(self.num_operands - 1)]
            value = evaluate(operands, ops)
            if self.allow_negative or value >= 0:
                break
        else:
            raise ValueError(f"could not draw a non-negative problem from {self}; set allow_negative=True")
        parts = [str(operands[0])]
        for op, x in zip(ops, operands[1:]):
            parts += [op, str(x) if x >= 0 else f"({x})"]
        return " ".join(parts), value

    def example(self, expression: str, value: int) -> Example:
        """The chat prompt of one problem, with its value as the reference ``answer``."""
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": self.template.format(expression=expression)})
        return Example(prompt=messages, answer=str(value), extras={"expression": expression})

    def sample(self, n: int, rng_or_seed=None, split: str = "train", *, seed: int | None = None) -> list[Example]:
        """n problems of ``split`` (with replacement: small ranges repeat problems)."""
        check_split(self, split)
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        rng = split_rng(rng_or_seed, split, seed)
        return [self.example(*self.problem(rng)) for _ in range(n)]


TASKS.register("arithmetic")(ArithmeticTask)
