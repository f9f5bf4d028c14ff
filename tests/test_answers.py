"""Answers and accuracy: signed answers, thousands separators, math-verify in the gsm8k
verdict, and ``reward/accuracy`` as the task's own 0/1 verdict."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
import torch

import grpo_lens.rewards.functions as reward_functions
from grpo_lens.rewards import (
    combine_rewards,
    correctness,
    extract_answer,
    get_reward,
    math_verify_available,
)
from grpo_lens.rollout import RolloutBatch
from grpo_lens.tasks import GSM8KTask, correctness_verdict, get_task
from grpo_lens.train.step_metrics import accuracy_metrics, rollout_correctness


@pytest.mark.parametrize(
    "completion,value",
    [
        (r"\boxed{-\frac{1}{2}}", Fraction(-1, 2)),  # case 7: was read as 2
        (r"\boxed{-\dfrac{3}{4}}", Fraction(-3, 4)),
        (r"\boxed{-(5)}", Fraction(-5)),
        (r"\boxed{\left(-\frac{1}{2}\right)}", Fraction(-1, 2)),
        (r"\boxed{-\left(\frac{1}{2}\right)}", Fraction(-1, 2)),
        ("\\boxed{\u2212\\frac{1}{2}}", Fraction(-1, 2)),  # Unicode minus
        ("The answer is \u2212\\frac{3}{4}.", Fraction(-3, 4)),  # one more: unboxed, Unicode minus before \frac
        (r"#### -\frac{7}{2}", Fraction(-7, 2)),
    ],
)
def test_signed_answers(completion, value):
    assert extract_answer(completion) == value
    ref = str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
    assert correctness(["q"], [completion], answer=[ref]) == [1.0]
    assert correctness(["q"], [completion], answer=[str(-value)]) == [0.0]  # the sign decides


@pytest.mark.parametrize(
    "text,value",
    [
        ("#### 1,234,567", 1234567),
        ("It costs $1,234.50 in total.", Fraction(246900, 200)),
        ("between 3,4 and 12", 12),  # "3,4" is two numbers, not 34
        ("the values 1,23,456", 456),  # not a thousands group: 1, 23, 456 stay separate
        ("1,2345", 2345),  # one more: a 4-digit tail is not a group of 3
        ("scores 12,345,67", 67),  # a trailing 2-digit group breaks the whole group
    ],
)
def test_thousands_separators_never_merge_separate_numbers(text, value):
    assert extract_answer(text) == value


def test_gsm8k_verdict_reads_the_marked_answer_with_and_without_math_verify(monkeypatch):
    task = GSM8KTask()
    completions = ["So she has #### 1,234\nDone in 3 steps.", r"The total is \boxed{72}.", "#### 71", "no answer"]
    answers = ["1234", "72", "72", None]
    assert math_verify_available()  # the math extra is installed by `make test`
    assert task.correct(completions, answers) == [1.0, 1.0, 0.0, None]
    # patched where math_correctness_verdict looks it up (grpo_lens.rewards re-exports it from rewards.functions)
    monkeypatch.setattr(reward_functions, "math_verify_available", lambda: False)
    monkeypatch.setattr("grpo_lens.tasks.gsm8k.math_verify_available", lambda: False)
    assert task.correct(completions, answers) == [1.0, 1.0, 0.0, None]
    with pytest.raises(ValueError, match="math-verify"):
        reward_functions.math_correctness_verdict(["1"], ["1"], use_math_verify=True)


def test_gsm8k_verdict_uses_math_verify():
    # math-verify is symbolic: 0.5 equals 1/2 in any notation; exact extraction agrees on numbers it can read.
    task = GSM8KTask()
    assert task.correct([r"#### \frac{1}{2}", r"\boxed{0.5}", r"#### \sqrt{4}"], ["0.5", "1/2", "2"]) == [1.0] * 3
    assert reward_functions.math_correctness_verdict([r"#### \sqrt{4}"], ["2"]) == [0.0]  # no symbolic step without it


def _batch(completions, answer, R):
    N = len(completions)
    return RolloutBatch(
        prompt_ids=torch.zeros(N, 1, dtype=torch.long),
        prompt_mask=torch.ones(N, 1),
        completion_ids=torch.zeros(N, 1, dtype=torch.long),
        completion_mask=torch.ones(N, 1, dtype=torch.bool),
        sampler_logprobs=torch.zeros(N, 1),
        truncated=torch.zeros(N, dtype=torch.bool),
        group_size=R,
        prompts=["q"] * (N // R),
        completions=completions,
        extras={"answer": answer},
    )


@pytest.mark.parametrize(
    "rewards",
    [
        {"correctness": 1.0, "format": 1.0},  # case 8: combined reward >= 1 on 3 of 4, correct on 1
        {"correctness": 0.5},  # one more: a weight below 1, the old count was always 0
    ],
)
def test_accuracy_is_the_tasks_verdict_not_the_reward(rewards):
    completions = ["#### 5", "#### 4", r"\boxed{3}", "five"]
    batch = _batch(completions, ["5"], 4)
    r, valid, _ = combine_rewards(rewards, ["q"] * 4, completions, answer=["5"] * 4)
    old = float(((r >= 1.0) & valid).float().mean())
    assert old == (0.75 if "format" in rewards else 0.0)  # what the bug reported
    correct = rollout_correctness(get_task("arithmetic"), batch, timeout=10.0)
    assert correct.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert accuracy_metrics(correct) == {"reward/accuracy": 0.25}


def test_accuracy_without_answers_is_absent_and_a_task_may_define_its_verdict():
    class Strict:
        def correct(self, completions, answers):
            return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answers)]

    batch = _batch(["5", "The answer is 5"], ["5"], 2)
    assert rollout_correctness(Strict(), batch, 10.0).tolist() == [1.0, 0.0]
    assert correctness_verdict(get_task("arithmetic"), ["5", "The answer is 5"], ["5", "5"]) == [1.0, 1.0]
    assert accuracy_metrics(torch.tensor([float("nan")] * 2, dtype=torch.float64)) == {}


@pytest.mark.e2e
def test_trainer_writes_the_verdicts_mean(tmp_path):
    # test_alternating gives rewards 1, 0, 1, 0, ...: the old metric would say 0.5; the tiny random model writes
    # bytes, so the arithmetic verdict is 0 on every rollout.
    import helpers_rewards  # noqa: F401

    from grpo_lens.config import TrainConfig
    from grpo_lens.train.loop import train

    config = TrainConfig(
        out=str(tmp_path / "run"),
        model="tiny",
        task="arithmetic",
        rewards=["test_alternating"],
        group_size=4,
        prompts_per_step=2,
        max_new_tokens=4,
        max_steps=1,
        lens_every=0,
        progress=False,
        device="cpu",
        save_final_model=False,
        log_completions=0,
    )
    row = json.loads((train(config).metrics_path).read_text().splitlines()[0])
    assert row["reward/mean"] == 0.5 and row["reward/accuracy"] == 0.0


def test_math_verify_missing_says_how_to_install(monkeypatch):
    # math-verify is installed in the test environment; hide it the way a machine without it looks.
    # get_reward reads REWARDS in grpo_lens.rewards.functions, where it is defined: patch it there
    registry = reward_functions.Registry("reward function")
    for name in reward_functions.REWARDS.names():
        if name != "math_verify":
            registry.register(name)(reward_functions.REWARDS.get(name))
    monkeypatch.setattr(reward_functions, "REWARDS", registry)
    with pytest.raises(ValueError, match="pip install"):
        get_reward("math_verify")
