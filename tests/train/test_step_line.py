"""The step line says what "accuracy" is when a custom reward runs: the reward names its functions (TRL's
``rewards/<name>/mean`` per function when there are several), "accuracy" reads "task accuracy", and one log line at
the start says that it is the task's correctness check, not the reward."""

from __future__ import annotations

import logging

import pytest

from grpo_lens import metrics as mk
from grpo_lens.train.loop import step_line
from grpo_lens.train.step_metrics import accuracy_note, custom_reward_names

RECORD = {
    mk.STEP: 3,
    mk.REWARD_MEAN: 0.5,
    mk.REWARD_ACCURACY: 0.25,
    "reward/parity": 0.5,
    "reward/format": 0.4,
    mk.LR: 1e-5,
}


def test_builtin_rewards_keep_the_short_line():
    assert step_line(RECORD, 10) == "step 3/10  reward 0.500  accuracy 0.250  lr 1.00e-05"
    assert step_line(RECORD, 10, ["correctness", "format:0.1"]) == step_line(RECORD, 10)
    assert custom_reward_names(["correctness", "math_verify", "format:0.5"]) == []
    assert accuracy_note(["correctness"]) is None


def test_custom_reward_names_itself_and_the_task_accuracy():
    assert step_line(RECORD, 10, ["parity"]) == "step 3/10  reward (parity) 0.500  task accuracy 0.250  lr 1.00e-05"
    assert step_line(RECORD, 10, ["parity:2", "format"]) == (
        "step 3/10  reward (parity) 0.500  rewards/parity/mean 0.500  rewards/format/mean 0.400  task accuracy 0.250"
        "  lr 1.00e-05"
    )
    note = accuracy_note(["parity:2", "correctness"])
    assert "parity" in note and "reward/accuracy" in note and "not the reward" in note


@pytest.mark.e2e
def test_training_logs_the_note_once(tmp_path, caplog):
    from grpo_lens.config import TrainConfig
    from grpo_lens.train.loop import train

    config = TrainConfig(
        model="tiny",
        rewards=["test_parity"],
        group_size=2,
        prompts_per_step=2,
        max_new_tokens=4,
        max_steps=2,
        lens_every=0,
        device="cpu",
        out=str(tmp_path / "run"),
        progress=False,
        save_final_model=False,
        log_completions=0,
    )
    with caplog.at_level(logging.INFO, logger="grpo_lens.train.loop"):
        train(config)
    lines = [r.getMessage() for r in caplog.records if r.name == "grpo_lens.train.loop"]
    assert sum("not the reward" in m for m in lines) == 1
    steps = [m for m in lines if m.startswith("step ")]
    assert len(steps) == 2 and all("reward (test_parity)" in m for m in steps)
