"""Reward parsing, the built-in rewards, and how combine_rewards treats failing reward functions."""

from __future__ import annotations

import logging
import math
import threading
import time
from fractions import Fraction

import pytest
import torch

from grpo_lens.rewards import (
    REWARDS,
    combine_rewards,
    correctness,
    extract_answer,
    format_reward,
    get_reward,
    parse_number,
    parse_reward_specs,
    score_batch,
)
from grpo_lens.rollout import RolloutBatch

LONG_TAIL = (
    "\n\nTo double-check: 6 apples at 7 each is 42, minus 3 is 39, and 2019 was the year it was 12 "
    "degrees; none of 5, 6 or 7.5 matters here."
)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("#### 1,234", Fraction(1234)),  # thousands comma dropped
        (r"so the total is \boxed{72}.", Fraction(72)),  # boxed, no ####
        ("The answer is 18.0.", Fraction(18)),  # last number; the sentence's period is not a decimal
        ("#### 42" + LONG_TAIL, Fraction(42)),  # #### wins over every later number
        ("It costs $1,000 in total.", Fraction(1000)),  # $ and comma dropped
        ("The temperature fell to -7 degrees.", Fraction(-7)),
        ("#### -3", Fraction(-3)),
        ("10 - 4 = 6", Fraction(6)),  # a minus between numbers is not a sign
        (r"\boxed{\frac{3}{4}}", Fraction(3, 4)),
        (r"\boxed{x = 12}", Fraction(12)),  # last number inside the box
        ("Step 1: 3 + 4 = 7\n#### The answer is 7 apples", Fraction(7)),  # first number on the #### line
        ("0.5 of it", Fraction(1, 2)),
        ("I don't know.", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_parse_number_is_exact():
    # 18.0 and 18 are the same value; Fraction makes 0.1 + 0.2 style float error impossible.
    assert parse_number("18.0") == parse_number("18") == 18
    assert parse_number("1,234.50") == Fraction(246_9, 2)
    assert parse_number("1/2") == Fraction(1, 2)
    assert parse_number("abc") is None and parse_number("1/0") is None


def test_correctness_values():
    completions = ["#### 18.0", "I think it is 17.", "no idea", r"\boxed{18}", "$18"]
    # 18.0 == 18 -> 1; 17 -> 0; no number -> 0 (a wrong answer, not an invalid rollout); boxed 18 -> 1; $18 -> 1.
    assert correctness(["q"] * 5, completions, answer=["18"] * 5) == [1.0, 0.0, 0.0, 1.0, 1.0]


def test_correctness_reference_forms_and_invalid_reference():
    # A full GSM8K solution works as the reference (its #### number); a reference with no number cannot be scored.
    out = correctness(["q"] * 3, ["72", "72", "72"], answer=["... = 72 clips\n#### 72", "1,234", "unknown"])
    assert out == [1.0, 0.0, None]


def test_correctness_needs_answers():
    with pytest.raises(ValueError, match="answer"):
        correctness(["q"], ["1"])
    with pytest.raises(ValueError, match="one per completion"):
        correctness(["q", "q"], ["1", "2"], answer=["1"])


def test_correctness_accepts_chat_message_completions():
    completions = [[{"role": "assistant", "content": "#### 5"}], [{"role": "assistant", "content": "4"}]]
    assert correctness(["q", "q"], completions, answer=["5", "5"]) == [1.0, 0.0]


def test_format_reward():
    # A marked final answer (#### or \boxed) -> 1; a bare trailing number or nothing -> 0.
    assert format_reward(None, ["#### 3", r"\boxed{3}", "it is 3", "nothing"]) == [1.0, 1.0, 0.0, 0.0]


def test_registry_and_specs():
    assert {"correctness", "format"} <= set(REWARDS.names())
    with pytest.raises(ValueError, match="valid names: .*correctness"):
        get_reward("nope")
    assert parse_reward_specs(["correctness", "format:0.1"]) == [("correctness", 1.0), ("format", 0.1)]
    with pytest.raises(ValueError, match="weight"):
        parse_reward_specs(["format:abc"])
    with pytest.raises(ValueError, match="unknown reward"):
        parse_reward_specs(["nope:1"])


def test_math_verify_reward():  # the math extra is installed by `make test` (tests/test_answers.py covers its absence)
    fn = get_reward("math_verify")
    assert fn(["q"] * 2, [r"The answer is $\boxed{\frac{1}{2}}$", r"$\boxed{3}$"], answer=["0.5", "2"]) == [1.0, 0.0]


# ---------------------------------------------------------------------------------------------------------------------
# combine_rewards
# ---------------------------------------------------------------------------------------------------------------------
PROMPTS = ["q1", "q1", "q2", "q2"]
COMPLETIONS = ["#### 5", "it is 4", r"\boxed{7}", "seven"]
ANSWERS = ["5", "5", "7", "7"]


def test_combine_weighted_sum_and_metrics():
    rewards, valid, metrics = combine_rewards({"correctness": 1.0, "format": 0.5}, PROMPTS, COMPLETIONS, answer=ANSWERS)
    # correctness [1, 0, 1, 0], format [1, 0, 1, 0] -> 1 * c + 0.5 * f = [1.5, 0, 1.5, 0].
    torch.testing.assert_close(rewards, torch.tensor([1.5, 0.0, 1.5, 0.0]))
    assert valid.all() and rewards.dtype == torch.float32
    assert metrics["reward/correctness"] == 0.5 and metrics["reward/format"] == 0.5  # unweighted means
    assert metrics["reward/invalid_count"] == 0
    assert metrics["reward/mean"] == pytest.approx(0.75)  # (1.5 + 0 + 1.5 + 0) / 4
    assert metrics["reward/std"] == pytest.approx(0.75)  # population std of {1.5, 0, 1.5, 0}


def test_combine_none_and_nan_skip_that_function_for_the_rollout():
    """TRL's multi-task convention: None / NaN skips that function for that rollout and the others'
    weighted rewards stand (main marked rollouts 1 and 2 invalid)."""

    def partial(prompts, completions, **kw):
        return [1.0, None, float("nan"), 0.0]

    rewards, valid, metrics = combine_rewards([partial, ("correctness", 2.0)], PROMPTS, COMPLETIONS, answer=ANSWERS)
    assert valid.all()
    # correctness [1, 0, 1, 0] (weight 2), partial [1, -, -, 0]: [1 + 2, 0 + 0, - + 2, 0 + 0] = [3, 0, 2, 0].
    assert rewards.tolist() == [3.0, 0.0, 2.0, 0.0]
    assert metrics["reward/invalid_count"] == 0 and metrics["reward/partial/invalid_count"] == 2
    assert metrics["reward/partial"] == 0.5  # mean of its scored values {1, 0}


def test_combine_multi_task_pair_scores_every_rollout_and_all_none_is_invalid():
    """A math-only and a code-only function, each None on the other's rows, score every row; a row neither scores
    is invalid (NaN). Main: every row invalid, so the run trained nothing."""
    kinds = ["math", "code", "math", "other"]

    def math_only(prompts, completions, kind, **kw):
        return [1.0 if k == "math" else None for k in kind]

    def code_only(prompts, completions, kind, **kw):
        return [0.5 if k == "code" else None for k in kind]

    rewards, valid, metrics = combine_rewards(
        [(math_only, 1.0), (code_only, 2.0)], PROMPTS, COMPLETIONS, columns={"kind": kinds}
    )
    assert valid.tolist() == [True, True, True, False]
    assert rewards[:3].tolist() == [1.0, 1.0, 1.0] and torch.isnan(rewards[3])  # 1 * 1; 2 * 0.5; 1 * 1; none
    assert metrics["reward/invalid_count"] == 1


def test_combine_raising_function_invalidates_its_call(caplog):
    def broken(prompts, completions, **kw):
        raise RuntimeError("boom")

    with caplog.at_level(logging.ERROR, logger="grpo_lens.rewards"):
        rewards, valid, metrics = combine_rewards([broken, "correctness"], PROMPTS, COMPLETIONS, answer=ANSWERS)
    assert not valid.any() and torch.isnan(rewards).all()
    assert metrics["reward/error_count"] == 1 and metrics["reward/invalid_count"] == 4
    assert math.isnan(metrics["reward/broken"]) and metrics["reward/correctness"] == 0.5
    assert "boom" in caplog.text


def test_combine_wrong_length_is_a_failed_call():
    rewards, valid, metrics = combine_rewards([lambda p, c, **k: [1.0]], PROMPTS, COMPLETIONS)
    assert not valid.any() and metrics["reward/error_count"] == 1


def test_combine_timeout_marks_rollouts_invalid_and_goes_on(caplog):
    release = threading.Event()

    def hung(prompts, completions, **kw):
        release.wait(10)  # stands for a call that never returns
        return [1.0] * len(completions)

    start = time.perf_counter()
    try:
        with caplog.at_level(logging.ERROR, logger="grpo_lens.rewards"):
            rewards, valid, metrics = combine_rewards([hung, "format"], PROMPTS, COMPLETIONS, timeout_s=0.2)
    finally:
        release.set()
    elapsed = time.perf_counter() - start
    assert elapsed < 5  # returned after the 0.2 s limit, not after the call's 10 s
    assert not valid.any() and metrics["reward/timeout_count"] == 1 and metrics["reward/invalid_count"] == 4
    assert metrics["reward/format"] == 0.5  # the other function still ran
    assert "hung" in caplog.text


def test_combine_with_timeout_runs_normal_functions():
    rewards, valid, _ = combine_rewards(["correctness"], PROMPTS, COMPLETIONS, timeout_s=5, answer=ANSWERS)
    assert rewards.tolist() == [1.0, 0.0, 1.0, 0.0] and valid.all()


def test_combine_checks_arguments():
    with pytest.raises(ValueError, match="one prompt per completion"):
        combine_rewards(["format"], ["q"], COMPLETIONS)
    with pytest.raises(ValueError, match="distinct"):
        combine_rewards([("format", 1.0), ("format", 2.0)], PROMPTS, COMPLETIONS)


def test_score_batch_repeats_prompts_and_columns():
    # B = 2 prompts, R = 2: the per-prompt answers are repeated to one per rollout and the result is [B, R].
    N, T = 4, 3
    batch = RolloutBatch(
        prompt_ids=torch.zeros(N, 2, dtype=torch.long),
        prompt_mask=torch.ones(N, 2, dtype=torch.long),
        completion_ids=torch.zeros(N, T, dtype=torch.long),
        completion_mask=torch.ones(N, T, dtype=torch.bool),
        sampler_logprobs=torch.zeros(N, T),
        truncated=torch.zeros(N, dtype=torch.bool),
        group_size=2,
        prompts=["q1", "q2"],
        completions=COMPLETIONS,
        extras={"answer": ["5", "7"]},
    )
    rewards, valid, _ = score_batch(batch, {"correctness": 1.0})
    assert rewards.tolist() == [[1.0, 0.0], [1.0, 0.0]] and valid.shape == (2, 2)
