"""LensGRPOTrainer: a TRL GRPOTrainer run on the tiny model logs the lens keys through TRL's logging, and the numbers
equal grpo-lens' own lens on the same batch (TRL's completions and masks, rewards recomputed, advantages from
grpo-lens' estimator) to float tolerance."""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

pytestmark = [
    pytest.mark.e2e,  # every test here builds a model
    pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs the trl extra"),
]

R = 4


def parity(completions, **kwargs):
    """1 when the completion's UTF-8 byte sum is odd: a coin flip per rollout on the random tiny model."""
    return [float(sum(c.encode()) % 2) for c in completions]


TRL_ARGS = ("max_steps", "steps_per_generation", "per_device_train_batch_size")


def make_trainer(tmp_path, cls, **kwargs):
    from datasets import Dataset
    from trl import GRPOConfig

    from grpo_lens.models import build_tiny_model

    trl_args = {k: kwargs.pop(k) for k in TRL_ARGS if k in kwargs}
    lens = kwargs
    model, tok = build_tiny_model(seed=0)
    data = Dataset.from_dict({"prompt": [f"What is {a} + {a + 1}?" for a in range(16)]})
    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        **{"per_device_train_batch_size": 2 * R, "max_steps": 2, **trl_args},
        num_generations=R,
        max_completion_length=6,
        logging_steps=1,
        learning_rate=1e-2,
        loss_type="grpo",
        scale_rewards="group",
        temperature=0.9,
        beta=0.0,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        seed=0,
        bf16=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    return cls(model=model, reward_funcs=parity, args=args, train_dataset=data, processing_class=tok, **lens)


@pytest.mark.parametrize("gram_source", ["sketch", None])  # None: the default, the exact Gram (as the trainer's)
def test_trl_run_logs_lens_keys_equal_to_grpo_lens_own_lens(tmp_path, gram_source):
    from grpo_lens.config import TrainConfig
    from grpo_lens.formulas.advantages import compute_advantages
    from grpo_lens.integrations.trl import LensGRPOTrainer
    from grpo_lens.lens.trainer_lens import TrainerLens
    from grpo_lens.models import build_tiny_model
    from grpo_lens.rollout import RolloutBatch

    captured = []

    class Capturing(LensGRPOTrainer):
        def measure_lens(self, output):
            # the policy's weights as the lens sees them (before this batch's update) and TRL's batch
            state = self.accelerator.unwrap_model(self.model).state_dict()
            captured.append(
                (
                    {k: v.detach().clone() for k, v in state.items()},
                    {k: v.detach().clone() for k, v in output.items() if torch.is_tensor(v)},
                    int(self.state.global_step),
                )
            )
            return super().measure_lens(output)

    source = {} if gram_source is None else {"lens_gram_source": gram_source}
    trainer = make_trainer(tmp_path, Capturing, lens_every=1, sketch_dim=8, lens_seed=3, **source)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "rank/mixed_groups" in h]
    assert len(captured) == 2 and len(logs) == 2, "the lens ran at global steps 0 and 1 and TRL logged it"

    tok = trainer.processing_class
    for (weights, out, step), logged in zip(captured, logs):
        policy, _ = build_tiny_model(seed=0)  # a fresh copy of the model, with the weights TRL had at that step
        policy.load_state_dict(weights)
        policy.train()
        # grpo-lens' side, built independently from TRL's tokens: rewards from the decoded texts, advantages from
        # grpo-lens' grpo estimator (sample std, eps 1e-4), the lens from a TrainConfig.
        texts = [
            tok.decode(ids[m.bool()], skip_special_tokens=True)
            for ids, m in zip(out["completion_ids"], out["completion_mask"])
        ]
        rewards = torch.tensor(parity(texts))
        adv = compute_advantages(rewards.view(-1, R), "grpo", std="sample", eps=1e-4).view(-1)
        torch.testing.assert_close(out["advantages"].float(), adv.float(), rtol=1e-5, atol=1e-5)
        n, t = out["completion_ids"].shape
        batch = RolloutBatch(
            prompt_ids=out["prompt_ids"],
            prompt_mask=out["prompt_mask"],
            completion_ids=out["completion_ids"],
            completion_mask=out["completion_mask"].bool(),
            sampler_logprobs=torch.zeros(n, t),
            truncated=torch.zeros(n, dtype=torch.bool),
            group_size=R,
        )
        config = TrainConfig(
            gram_source=gram_source or "exact",
            sketch_dim=8,
            seed=3,
            temperature=0.9,
            estimator="grpo",
            std="sample",
            std_eps=1e-4,
            loss_aggregation="seq-mean-token-mean",
            max_new_tokens=6,
        )  # TRL's loss_type="grpo"
        ours = TrainerLens(policy, config).measure(step, policy, batch, rewards, torch.ones(n, dtype=torch.bool), adv)
        lens_keys = {k for k in ours if k.split("/")[0] in ("rank", "grad", "baseline", "zero_sum", "sparsity")}
        assert "rank/mixed_groups" in lens_keys
        for key in lens_keys:
            assert logged[key] == pytest.approx(ours[key], rel=1e-5, abs=1e-7), key
        if ours["rank/mixed_groups"] > 0:
            assert "rank/g1_erank" in logged
            # the exact Gram reports its share of the parameters (all of them here); the sketch reports none
            assert logged.get("grad/gram_coverage") == (None if gram_source == "sketch" else 1.0)


def test_bad_lens_settings_fail_before_training(tmp_path):
    from grpo_lens.integrations.trl import LensGRPOTrainer

    with pytest.raises(ValueError, match="lens_every"):
        make_trainer(tmp_path, LensGRPOTrainer, lens_every=0)
    with pytest.raises(ValueError, match="lens_space"):
        make_trainer(tmp_path, LensGRPOTrainer, lens_space="adapter")
    with pytest.raises(ValueError, match="lens_gram_source = 'dense': valid names: exact, sketch"):
        make_trainer(tmp_path, LensGRPOTrainer, lens_gram_source="dense")
    with pytest.raises(ValueError, match="sketch_dim = 0: must be >= 1"):
        make_trainer(tmp_path, LensGRPOTrainer, sketch_dim=0)


def test_the_deprecated_lens_sketch_dim_keyword_warns_and_gives_the_same_settings(tmp_path):
    from grpo_lens.integrations.trl import LensGRPOTrainer
    from grpo_lens.lens.settings import LensSettings

    new = make_trainer(tmp_path, LensGRPOTrainer, sketch_dim=4).lens_settings
    with pytest.warns(DeprecationWarning, match="lens_sketch_dim is deprecated: use sketch_dim") as caught:
        old = make_trainer(tmp_path, LensGRPOTrainer, lens_sketch_dim=4).lens_settings
    assert isinstance(new, LensSettings) and old == new and new.sketch_dim == 4
    assert any(w.filename == __file__ for w in caught), "the warning points at the caller's line"
    with pytest.raises(TypeError, match="not both"):
        make_trainer(tmp_path, LensGRPOTrainer, sketch_dim=4, lens_sketch_dim=4)


def test_trl_run_writes_a_run_directory_that_grpo_lens_report_reads(tmp_path):
    """A TRL run with steps_per_generation = 2 (TRL generates at global steps 0, 2, 4) and lens_every = 3: the lens
    takes the first batch at or after each due step, global steps 0 and 4 (logged at steps 1 and 5); the old test
    ``global_step % lens_every == 0`` met a generation only at step 0. The folder then holds config.yaml,
    metrics.jsonl (grpo-lens keys, one record per logging step) and completions.jsonl, and ``grpo-lens report``
    writes a report with the claims on it, S4 included."""
    import json

    import yaml

    from grpo_lens.integrations.trl import LensGRPOTrainer
    from grpo_lens.metrics import (
        PERF_STEP_SECONDS,
        RANK_MIXED_GROUPS,
        REWARD_FRAC_ZERO_STD_GROUPS,
        REWARD_MEAN,
        REWARD_STD,
        SPARSITY_UPDATE_STEP,
        STEP,
    )
    from grpo_lens.report import write_report

    trainer = make_trainer(
        tmp_path,
        LensGRPOTrainer,
        lens_every=3,
        sketch_dim=4,
        max_steps=6,
        steps_per_generation=2,
        per_device_train_batch_size=R,
    )
    trainer.train()
    out = tmp_path / "trl"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r[STEP] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [s for s, r in zip(range(1, 7), records) if RANK_MIXED_GROUPS in r] == [1, 5]
    assert SPARSITY_UPDATE_STEP in records[0] and SPARSITY_UPDATE_STEP in records[4]
    # a batch's reward statistics go with the step that generated it (TRL logs its own there too): steps 1, 3, 5
    assert [r[STEP] for r in records if REWARD_MEAN in r] == [1, 3, 5]
    trl_logs = [h for h in trainer.state.log_history if "reward_std" in h]
    for r, h in zip([r for r in records if REWARD_MEAN in r], trl_logs):
        assert 0 <= r[REWARD_FRAC_ZERO_STD_GROUPS] <= 1 and r[REWARD_MEAN] == pytest.approx(h["reward"], abs=1e-6)
        # TRL's reward_std is the sample std over the batch's N = 2 R rewards, ours the population std:
        # TRL's = ours * sqrt(N / (N - 1))
        assert h["reward_std"] == pytest.approx(r[REWARD_STD] * (2 * R / (2 * R - 1)) ** 0.5, rel=1e-4)
    for r in records:
        assert r[PERF_STEP_SECONDS] > 0
        assert "reward" not in r and "grad_norm" not in r, "TRL's names are read into grpo-lens' keys"
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["trainer"] == "trl" and config["group_size"] == R and config["mu"] == 1
    assert config["trl"]["num_generations"] == R and config["loss_aggregation"] == "seq-mean-token-mean"
    completions = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert completions and set(completions[0]["rewards"]) == {"parity"}
    report = write_report(out).read_text()
    assert "## Claims: sparsity over training" in report and "### Sparsity over training" in report


def test_readme_trl_snippet_runs_and_grpo_lens_report_reads_it(tmp_path, monkeypatch):
    """The README's TRL quickstart as pasted, with two substitutions only: the tiny model (exported as a Hugging
    Face folder, as model_folder() gives the default one) and 2 steps instead of 10; then ``grpo-lens report``."""
    import re
    from pathlib import Path

    from grpo_lens.cli import main
    from grpo_lens.models import export_model

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    code = re.search(r"### The lens inside TRL's GRPOTrainer\n.*?```python\n(.*?)```", readme, re.S).group(1)
    tiny = export_model("tiny", tmp_path / "tiny")
    for old, new in (
        ("str(model_folder())", repr(str(tiny))),
        ("max_steps=10", "max_steps=2"),
        ('output_dir="runs/trl"', "output_dir='runs/trl', disable_tqdm=True"),
    ):
        assert old in code, old
        code = code.replace(old, new)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})
    assert main(["report", "runs/trl"]) == 0
    report = (tmp_path / "runs" / "trl" / "report.md").read_text()
    assert (
        report.startswith("# grpo-lens report")
        and "## Answers" in report
        and "correctness" in (tmp_path / "runs" / "trl" / "completions.jsonl").read_text()
    )


def test_the_last_step_is_measured_whatever_lens_every(tmp_path):
    # max_steps = 3, lens_every = 5, one generation per step: due only at global step 0, and the run's last batch
    # (global step 2, logged as step 3) is measured too, as grpo-lens train measures its last step; the old lens
    # measured step 1 alone, so a README-sized run had no second lens step to compare
    import json

    from grpo_lens.integrations.trl import LensGRPOTrainer
    from grpo_lens.metrics import RANK_MIXED_GROUPS, STEP

    trainer = make_trainer(
        tmp_path, LensGRPOTrainer, lens_every=5, sketch_dim=4, lens_gram_source="sketch", max_steps=3
    )
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "trl" / "metrics.jsonl").read_text().splitlines()]
    assert [r[STEP] for r in records if "perf/lens_seconds" in r] == [1, 3]
    assert all(RANK_MIXED_GROUPS in r for r in records if "perf/lens_seconds" in r)


def test_the_console_line_keeps_trls_keys_and_counts_the_lens_keys(tmp_path, capsys):
    # TRL prints its log dict per logging step; at a lens step the lens adds ~200 keys to it: the console shows TRL's
    # keys and one "lens" entry counting the rest, while log_history (and every tracker) keeps them all
    import ast

    from grpo_lens.integrations.trl import LensGRPOTrainer

    trainer = make_trainer(
        tmp_path, LensGRPOTrainer, lens_every=1, sketch_dim=4, lens_gram_source="sketch", max_steps=1
    )
    trainer.train()
    printed = [ast.literal_eval(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    step = next(d for d in printed if "loss" in d)
    logged = next(h for h in trainer.state.log_history if "loss" in h)
    lens_keys = [k for k in logged if k.startswith(("rank/", "sparsity/", "zero_sum/"))]
    assert lens_keys and not any(k in step for k in lens_keys)
    assert step["lens"].startswith(f"{len(trainer._lens_keys)} keys in log_history")
    assert "reward" in step and "learning_rate" in step  # TRL's own keys stay


def test_a_script_importing_torch_first_is_told_its_omp_wait_policy_came_too_late(tmp_path, monkeypatch):
    """Issue 21: the README's TRL script imported torch before grpo_lens, so OMP_WAIT_POLICY=PASSIVE came after
    OpenMP had read it and the lens's sparsity measures ran 25x slower on a shared CPU. The flag says so, in fresh
    interpreters (each import order), and LensGRPOTrainer warns on a CPU run."""
    import os
    import subprocess
    import sys

    import grpo_lens
    from grpo_lens.integrations.trl import OMP_TOO_LATE_WARNING, LensGRPOTrainer

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    flag = {}
    for order in ("torch, grpo_lens", "grpo_lens, torch"):
        code = f"import {order}; print(grpo_lens.OMP_WAIT_POLICY_TOO_LATE)"
        flag[order] = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()
    assert flag == {"torch, grpo_lens": "True", "grpo_lens, torch": "False"}
    code = "import torch, grpo_lens; print(grpo_lens.OMP_WAIT_POLICY_TOO_LATE)"  # a value of the user's own: no flag
    assert (
        subprocess.run(
            [sys.executable, "-c", code],
            env={**env, "OMP_WAIT_POLICY": "ACTIVE"},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        == "False"
    )
    for too_late in (True, False):
        monkeypatch.setattr(grpo_lens, "OMP_WAIT_POLICY_TOO_LATE", too_late)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            make_trainer(tmp_path, LensGRPOTrainer, lens_every=1)
        assert (OMP_TOO_LATE_WARNING in [str(w.message) for w in seen]) is too_late
