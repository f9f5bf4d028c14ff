"""The paper's preset (configs/paper-gsm8k-probe.yaml) loads as a valid probe config and runs end to end on CPU with a
tiny Nemotron model and tiny overrides; the report names the exact Gram with coverage 1.00."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_lens.probe.config import ProbeConfig
from grpo_lens.probe.run import run_probe

PRESET = Path(__file__).resolve().parents[2] / "configs" / "paper-gsm8k-probe.yaml"


def test_preset_is_the_papers_setting():
    config = ProbeConfig.load(PRESET)
    assert config.task == "gsm8k" and config.group_sizes == [2, 4, 8] and 256 <= config.max_new_tokens <= 512
    assert config.rewards == ["math_verify"] and config.gram_source == "exact" and not config.dense_oracle


@pytest.mark.e2e
def test_preset_runs_end_to_end_on_a_tiny_nemotron(tmp_path):
    # test_parity (a coin flip per rollout) instead of math_verify: a random tiny model never solves GSM8K, and the
    # probe analyses mixed groups only
    config = ProbeConfig.load(
        PRESET,
        dict(
            model="tiny-nemotron",
            rewards=["test_parity"],
            group_sizes=[2],
            prompts=4,
            prompts_per_batch=4,
            max_new_tokens=8,
            dtype="float32",
            device="cpu",
            baseline_prompts=1,
            resamples=8,
            random_draws=2,
            g2_groups=0,
            coverage_groups=0,
            baseline_study_prompts=0,
            credit_groups=0,
            progress=False,
            out=str(tmp_path / "probe"),
        ),
    )
    out = run_probe(config)
    probe = json.loads((out / "probe.json").read_text())
    meta = probe["meta"]
    assert meta["task"] == "gsm8k" and meta["gradients"] == "exact_gram" and meta["gram_coverage"] == 1.0
    assert probe["per_group_size"]["2"]["groups_mixed"] >= 1
    assert "coverage 1.00" in (out / "report.md").read_text()
