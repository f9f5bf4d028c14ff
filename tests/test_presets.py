"""The presets in configs/ load as valid configs of their command, hold the paper's setting, and the CPU preset and
the training preset run end to end on a tiny model with tiny overrides (the measured times: configs/README.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_lens.config import TrainConfig
from grpo_lens.probe.config import ProbeConfig

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
CPU = CONFIGS / "paper-gsm8k-cpu.yaml"
TRAIN = CONFIGS / "paper-gsm8k-train.yaml"


def test_cpu_preset_is_the_papers_setting_on_the_default_model():
    config = ProbeConfig.load(CPU)
    # GSM8K, the default model, R in {2, 4, 8}, completions long enough for a worked GSM8K answer, every parameter
    assert config.task == "gsm8k" and config.model == ProbeConfig().model and config.group_sizes == [2, 4, 8]
    assert config.max_new_tokens >= 256 and config.rewards == ["math_verify"] and config.gram_source == "exact"
    assert config.device == "cpu" and config.dtype == "float32"
    # sized for 30 minutes on 2 cores (configs/README.md): 5 prompts per R with M = max(2R, 8) rollouts each is
    # 5 * (8 + 8 + 16) = 160 completions
    assert sum(config.prompts_for(r) * max(2 * r, 8) for r in config.group_sizes) == 160
    assert config.baseline_study_prompts == 0 and config.credit_groups == 0


def test_train_preset_is_the_papers_setting():
    config = TrainConfig.load(TRAIN)
    assert config.task == "gsm8k" and config.group_size == 8 and config.max_new_tokens == 512
    assert config.rewards == ["math_verify"] and config.gram_source == "exact"
    # the sparsity trend claim needs >= 5 lens steps after the first: the lens at steps 1, 10, ..., 100
    assert config.max_steps // config.lens_every + 1 >= 6
    assert config.eval_every > 0 and config.lr_scheduler == "cosine"


@pytest.mark.e2e
def test_cpu_preset_runs_end_to_end_on_a_tiny_model(tmp_path):
    from grpo_lens.probe.run import run_probe

    # test_parity (a coin flip per rollout) instead of math_verify: a random tiny model never solves GSM8K, and the
    # probe analyses mixed groups only
    config = ProbeConfig.load(
        CPU,
        dict(
            model="tiny",
            rewards=["test_parity"],
            group_sizes=[2],
            prompts=2,
            max_new_tokens=8,
            baseline_prompts=1,
            resamples=8,
            random_draws=2,
            g2_groups=1,
            coverage_groups=0,
            progress=False,
            out=str(tmp_path / "probe"),
        ),
    )
    out = run_probe(config)
    probe = json.loads((out / "probe.json").read_text())
    assert probe["meta"]["task"] == "gsm8k" and probe["meta"]["gradients"] == "exact_gram"
    assert probe["per_group_size"]["2"]["prompts_sampled"] == 2
    assert (out / "report.md").read_text().startswith("#")


@pytest.mark.e2e
def test_train_preset_runs_end_to_end_on_a_tiny_model(tmp_path):
    from grpo_lens.train.loop import train

    config = TrainConfig.load(
        TRAIN,
        dict(
            model="tiny",
            rewards=["test_parity"],
            group_size=2,
            prompts_per_step=2,
            max_new_tokens=4,
            max_steps=2,
            lens_every=1,
            eval_every=0,
            checkpoint_every=2,
            dtype="float32",
            device="cpu",
            progress=False,
            out=str(tmp_path / "train"),
        ),
    )
    train(config)
    records = [json.loads(line) for line in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "step" in r][-1] == 2
