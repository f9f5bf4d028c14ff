"""The demo passes the options a user varies to its stages, and --quick shrinks every setting left at its default."""

from __future__ import annotations

import pytest

from grpo_lens.config import ConfigError
from grpo_lens.demo import QUICK, DemoConfig


def test_demo_options_reach_the_training_and_probe_stages():
    c = DemoConfig(
        rewards=["correctness", "format_reward:0.5"],
        estimator="rloo",
        lora_rank=4,
        report_to=["tensorboard"],
        probe_study_prompts=3,
    )
    t, p = c.train_config(), c.probe_config("tiny", "/tmp/unused")
    assert (t.rewards, t.estimator, t.lora_rank, t.report_to) == (
        ["correctness", "format_reward:0.5"],
        "rloo",
        4,
        ["tensorboard"],
    )
    assert (p.rewards, p.estimator, p.baseline_study_prompts, p.credit_groups) == (t.rewards, "rloo", 3, 3)
    with pytest.raises(ConfigError, match="tracker"):
        DemoConfig(report_to=["mlflow"]).train_config()


def test_quick_shrinks_what_is_left_at_its_default():
    c = DemoConfig(quick=True, max_steps=10)  # max_steps given: kept
    assert c.max_steps == 10
    for name, value in QUICK.items():
        if name != "max_steps":
            assert getattr(c, name) == value, name
    p = c.probe_config("tiny", "/tmp/unused")
    assert (p.group_sizes, p.prompts, p.baseline_study_prompts, p.credit_groups) == ([2, 4], 8, 2, 2)
    assert DemoConfig().max_steps == 30 and DemoConfig().probe_prompts == 0  # without --quick: the defaults
    # Monte Carlo credit only where its claim can reach 8 rollouts (4 groups): not on the quick demo's 2 groups
    assert p.mc_groups == 0 and DemoConfig().probe_config("tiny", "/tmp/unused").mc_groups == 4
