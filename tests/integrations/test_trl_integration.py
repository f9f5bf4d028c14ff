"""LensGRPOTrainer: a TRL GRPOTrainer run on the tiny model logs the lens keys through TRL's logging, and the numbers
equal grpo-lens' own lens on the same batch (TRL's completions and masks, rewards recomputed, advantages from
grpo-lens' estimator) to float tolerance."""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

from grpo_lens import metrics as mk

pytestmark = [
    pytest.mark.e2e,  # every test here builds a model
    pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs the trl extra"),
]

R = 4


def parity(completions, **kwargs):
    """1 when the completion's UTF-8 byte sum is odd: a coin flip per rollout on the random tiny model."""
    return [float(sum(c.encode()) % 2) for c in completions]


TRL_ARGS = (
    "max_steps",
    "steps_per_generation",
    "per_device_train_batch_size",
    "entropy_coef",
    "top_entropy_quantile",
    "off_policy_mask_threshold",
)


def make_trainer(tmp_path, cls, **kwargs):
    from datasets import Dataset
    from trl import GRPOConfig

    from grpo_lens.models import build_tiny_model

    trl_args = {k: kwargs.pop(k) for k in TRL_ARGS if k in kwargs}
    reward_funcs = kwargs.pop("reward_funcs", parity)
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
    return cls(model=model, reward_funcs=reward_funcs, args=args, train_dataset=data, processing_class=tok, **lens)


@pytest.mark.parametrize("gram_source", ["sketch", None])  # None: the default, the exact Gram (as the trainer's)
def test_trl_run_logs_lens_keys_equal_to_grpo_lens_own_lens(tmp_path, gram_source):
    from grpo_lens.config import TrainConfig
    from grpo_lens.formulas.advantages import compute_advantages
    from grpo_lens.integrations.trl import LensGRPOTrainer
    from grpo_lens.lens.step_batch import StepBatch
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
        adv = compute_advantages(rewards.view(-1, R), "grpo", std="sample", std_eps=1e-4).view(-1)
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
        ours = TrainerLens(policy, config).measure(
            StepBatch(step, policy, batch, rewards, torch.ones(n, dtype=torch.bool), adv)
        )
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


def test_trl_run_writes_a_run_directory_that_grpo_lens_report_reads(tmp_path):
    """A TRL run with steps_per_generation = 2 (TRL generates at global steps 0, 2, 4) and lens_every = 3: the lens
    takes the first batch at or after each due step, global steps 0 and 4 (logged at steps 1 and 5); the old test
    ``global_step % lens_every == 0`` met a generation only at step 0. The folder then holds config.yaml,
    metrics.jsonl (grpo-lens keys, one record per logging step) and completions.jsonl, and ``grpo-lens report``
    writes a report with the claims on it, S4 included."""
    import json

    import yaml

    from grpo_lens.integrations.trl import LensGRPOTrainer
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
    assert [r[mk.STEP] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [s for s, r in zip(range(1, 7), records) if mk.RANK_MIXED_GROUPS in r] == [1, 5]
    assert mk.SPARSITY_UPDATE_STEP in records[0] and mk.SPARSITY_UPDATE_STEP in records[4]
    # a batch's reward statistics go with the step that generated it (TRL logs its own there too): steps 1, 3, 5
    assert [r[mk.STEP] for r in records if mk.REWARD_MEAN in r] == [1, 3, 5]
    trl_logs = [h for h in trainer.state.log_history if "reward_std" in h]
    for r, h in zip([r for r in records if mk.REWARD_MEAN in r], trl_logs):
        assert 0 <= r[mk.REWARD_FRAC_ZERO_STD_GROUPS] <= 1 and r[mk.REWARD_MEAN] == pytest.approx(h["reward"], abs=1e-6)
        # TRL's reward_std is the sample std over the batch's N = 2 R rewards, ours the population std:
        # TRL's = ours * sqrt(N / (N - 1))
        assert h["reward_std"] == pytest.approx(r[mk.REWARD_STD] * (2 * R / (2 * R - 1)) ** 0.5, rel=1e-4)
    for r in records:
        assert r[mk.PERF_STEP_SECONDS] > 0
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

    trainer = make_trainer(
        tmp_path, LensGRPOTrainer, lens_every=5, sketch_dim=4, lens_gram_source="sketch", max_steps=3
    )
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "trl" / "metrics.jsonl").read_text().splitlines()]
    assert [r[mk.STEP] for r in records if "perf/lens_seconds" in r] == [1, 3]
    assert all(mk.RANK_MIXED_GROUPS in r for r in records if "perf/lens_seconds" in r)


def by_prompt(prompts, completions, **kwargs):
    """1 for "What is a + ..." with a % 4 == 0, 0 with a % 4 == 1 (groups without contrast, all correct / all wrong),
    else :func:`parity`."""
    a = [int(p.split()[2]) % 4 for p in prompts]
    return [1.0 if k == 0 else 0.0 if k == 1 else r for k, r in zip(a, parity(completions))]


def test_every_step_logs_the_dead_group_keys_as_grpo_lens_train_does(tmp_path):
    """The TRL lens once wrote no ``dead/*`` key, which ``grpo-lens train`` writes every step. Now each step's
    record has them. 2 R rollouts a step = 2 groups, each either mixed or without reward contrast, so
    all_correct + all_wrong + all_equal_other + mixed = 2 and the dead ones are the step's zero-std share of groups.
    loss_type "grpo" is seq-mean-token-mean: every rollout with a completion token is one unit of the normaliser and a
    group without contrast has advantages 0 (scale_rewards "group"), so dead/normalizer_share = dead groups / 2."""
    import json

    from grpo_lens.integrations.trl import LensGRPOTrainer

    trainer = make_trainer(
        tmp_path, LensGRPOTrainer, lens_every=5, sketch_dim=4, lens_gram_source="sketch", reward_funcs=by_prompt
    )
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "trl" / "metrics.jsonl").read_text().splitlines()]
    assert [r[mk.STEP] for r in records] == [1, 2]
    # the batches hold both kinds, so the share below is not 0 = 0
    assert sum(r[mk.DEAD_ALL_CORRECT_GROUPS] + r[mk.DEAD_ALL_WRONG_GROUPS] for r in records) > 0
    assert sum(r[mk.DEAD_MIXED_GROUPS] for r in records) > 0
    for r in records:
        dead = r[mk.DEAD_ALL_CORRECT_GROUPS] + r[mk.DEAD_ALL_WRONG_GROUPS] + r[mk.DEAD_ALL_EQUAL_OTHER_GROUPS]
        assert dead + r[mk.DEAD_MIXED_GROUPS] == 2, r
        assert r[mk.DEAD_ALL_EQUAL_OTHER_GROUPS] == 0  # the parity reward is 0 or 1
        assert r[mk.REWARD_FRAC_ZERO_STD_GROUPS] == pytest.approx(dead / 2)
        assert r[mk.DEAD_NORMALIZER_SHARE] == pytest.approx(dead / 2, abs=1e-9)


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


def test_the_import_order_is_flagged_but_not_warned_about(tmp_path, monkeypatch):
    """LensGRPOTrainer once warned that importing torch before grpo_lens made runs "several times slower";
    the project's own side-by-side measurement on an idle machine found OpenMP's default, passive and
    spinning waits within 10% (docs/benchmarks.md), so the natural order (trl first) is not punished with a warning.
    The flag still says, in fresh interpreters, whether grpo_lens' OMP_WAIT_POLICY=PASSIVE came too late."""
    import os
    import subprocess
    import sys

    import grpo_lens
    from grpo_lens.integrations.trl import LensGRPOTrainer

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    flag = {}
    for order in ("torch, grpo_lens", "grpo_lens, torch"):
        code = f"import {order}; print(grpo_lens.OMP_WAIT_POLICY_TOO_LATE)"
        flag[order] = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()
    assert flag == {"torch, grpo_lens": "True", "grpo_lens, torch": "False"}
    monkeypatch.setattr(grpo_lens, "OMP_WAIT_POLICY_TOO_LATE", True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        make_trainer(tmp_path, LensGRPOTrainer, lens_every=1)
    assert not [w for w in seen if "OMP_WAIT_POLICY" in str(w.message) or "slower" in str(w.message)]


def quickstart_code(tiny) -> str:
    """docs/trl.md's TRL quick start, with the tiny model (a Hugging Face folder) for the default model."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "trl.md").read_text()
    code = re.search(r"## TRL's quick start, with the one-line swap\n.*?```python\n(.*?)```", doc, re.S).group(1)
    assert code.startswith("from datasets import Dataset\nfrom trl import GRPOConfig\n"), "trl is imported first"
    assert "str(model_folder())" in code and "logging_steps" not in code, "TRL's default logging_steps (10)"
    code = code.replace("str(model_folder())", repr(str(tiny)))
    # TRL's defaults of 8 completions of up to 256 tokens per step take minutes on a loaded CPU: smaller batches, the
    # rest (logging_steps=10 above all) as TRL's defaults
    old = 'GRPOConfig(output_dir="runs/quickstart", max_steps=3, bf16=False)'
    assert old in code
    return code.replace(old, old[:-1] + ", num_generations=4, per_device_train_batch_size=4, max_completion_length=8)")


def test_trls_quick_start_with_the_swap_leaves_a_run_that_report_reads(tmp_path):
    """TRL's quick start with GRPOTrainer swapped (logging_steps left at TRL's 10 > max_steps = 3, trl
    imported first) recorded nothing, its console line named a metrics.jsonl never written, ``grpo-lens report``
    found nothing, and a warning claimed the import order made it several times slower. Run as written in a fresh
    interpreter (the import order is real there): both lens steps (global steps 0 and 2, logged as 1 and 3) are in
    metrics.jsonl, every console line naming it is true, no warning mentions OMP, and report reads the folder."""
    import json
    import os
    import subprocess
    import sys

    from grpo_lens.cli import main
    from grpo_lens.models import export_model

    tiny = export_model("tiny", tmp_path / "tiny")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["PYTHONPATH"] = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    done = subprocess.run(
        [sys.executable, "-c", quickstart_code(tiny)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "runs" / "quickstart"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r[mk.STEP] for r in records if "perf/lens_seconds" in r] == [1, 3]
    assert all(mk.RANK_MIXED_GROUPS in r for r in records if "perf/lens_seconds" in r)
    assert "OMP_WAIT_POLICY" not in done.stderr and "slower" not in done.stderr
    assert "metrics.jsonl" in done.stdout  # the console line names the file, which exists
    assert main(["report", str(out)]) == 0
    assert (out / "report.md").read_text().startswith("# grpo-lens report")


def test_the_trl_lens_refuses_a_grpo_lens_train_run_and_a_live_writer(tmp_path):
    """LensGRPOTrainer with output_dir = a folder holding a ``grpo-lens train`` run replaced its
    config.yaml, metrics.jsonl and completions.jsonl without a lock. It now takes the run directory's one-writer
    lock and refuses, in one line naming the folder and before anything is written, a folder holding a run that is
    not a TRL lens run, or one another live process writes (its lock held by a child process here)."""
    import json
    import subprocess
    import sys
    import time

    from grpo_lens.config import TrainConfig
    from grpo_lens.integrations.trl import LensGRPOTrainer
    from grpo_lens.rundir import LOCK_NAME, RunDir, RunDirError, RunDirLockedError

    native = tmp_path / "native"
    run = RunDir(native)
    native.mkdir()
    run.write_config(TrainConfig(model="tiny", out=str(native)).to_dict())
    run.append_metrics({"step": 1, "reward/mean": 0.5})
    before = {p.name: p.read_bytes() for p in native.iterdir()}
    with pytest.raises(RunDirError, match=rf"lens_out {native} holds a grpo-lens run that is not a TRL lens run"):
        make_trainer(tmp_path, LensGRPOTrainer, lens_out=str(native))
    assert {p.name: p.read_bytes() for p in native.iterdir()} == before, "nothing written, no lock file left"

    live = tmp_path / "live"
    live.mkdir()
    holder = (
        "import fcntl, json, os, sys, time\n"
        f"fd = os.open({str(live / LOCK_NAME)!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "os.write(fd, json.dumps({'pid': os.getpid(), 'host': 'h', 'command': 'train'}).encode())\n"
        "print('locked', flush=True)\n"
        "time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirLockedError, match=rf"lens_out {live} is being written by .*pid {child.pid}"):
            make_trainer(tmp_path, LensGRPOTrainer, lens_out=str(live))
    finally:
        child.kill()
        child.wait()
    time.sleep(0.1)
    trainer = make_trainer(tmp_path, LensGRPOTrainer, lens_out=str(live))  # the writer is gone: the stale lock is taken
    assert not (live / LOCK_NAME).exists() or json.loads((live / LOCK_NAME).read_text())["pid"] != child.pid
    assert trainer.lens_run.path == live


def vllm_like_trainer(tmp_path, mode):
    """A LensGRPOTrainer on the float64 tiny model whose loss path runs as with vLLM (importance-sampling correction
    in ``mode``), an off-policy mask and a high-entropy mask, and one generation batch of 2 groups of R as
    ``_generate_and_score_completions`` returns it with vLLM: sampler log-probs that differ from the trainer's, the
    old log-probs, and TRL's importance-sampling ratio computed from them as TRL computes it."""
    from grpo_lens.integrations.trl import LensGRPOTrainer
    from grpo_lens.rollout import completion_logprobs

    trainer = make_trainer(tmp_path, LensGRPOTrainer, lens_every=1, max_steps=1)
    trainer.accelerator.unwrap_model(trainer.model).double()
    trainer.use_vllm = True  # as GRPOConfig(use_vllm=True) sets them; vLLM itself is not needed by the loss path
    trainer.vllm_importance_sampling_correction = True
    trainer.vllm_importance_sampling_mode = mode
    trainer.off_policy_mask_threshold = 0.2
    trainer.top_entropy_quantile = 0.5
    trainer.current_gradient_accumulation_steps = 1
    policy = trainer.accelerator.unwrap_model(trainer.model)

    def float64_logps(model, input_ids, attention_mask, logits_to_keep, compute_entropy=False, **kwargs):
        # TRL's fused LM head computes log-probs in float32 whatever the model's dtype; its loss path then runs on
        # the float64 log-probs of the same definition (grpo_lens.rollout.completion_logprobs), as the lens's rows
        logps, entropy = completion_logprobs(
            policy, input_ids, attention_mask, logits_to_keep, trainer.temperature, return_entropy=True
        )
        return logps, (entropy if compute_entropy else None), None

    trainer._get_per_token_logps_and_entropies = float64_logps
    g = torch.Generator().manual_seed(0)
    n, lp, t = 2 * R, 4, 6
    prompt_ids = torch.randint(3, 250, (n, lp), generator=g)
    prompt_mask = torch.ones(n, lp, dtype=torch.long)
    prompt_mask[1, 0] = 0  # one left-padded prompt
    completion_ids = torch.randint(3, 250, (n, t), generator=g)
    lengths = torch.tensor([6, 3, 5, 6, 2, 6, 4, 5])
    completion_mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    # powers of 2: the reference's backward carries rollout i's gradient scaled by A_i / N, the lens's unscaled, and
    # RMSNorm's backward runs in float32 whatever the model's dtype: a scale that is a power of 2 rounds alike (A_i
    # = 0.9 left its row off by a factor 1 + 8e-8, float32 rounding, not a weight)
    advantages = torch.tensor([0.5, -1.0, 0.25, -0.25, 2.0, -0.5, -0.5, 0.125], dtype=torch.float64)
    ids = torch.cat([prompt_ids, completion_ids], 1)
    # the old log-probs on the grad path the loss's forward takes, so that the first pass's ratio is exactly 1
    attention = torch.cat([prompt_mask, completion_mask], 1)
    old = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attention, t)[0].detach()
    # the sampler's log-probs: per-token noise and a per-rollout drift, so that some IS weights reach the cap / the
    # mask's bounds and the negative-advantage rollouts 1 and 5 drift past the off-policy threshold
    drift = torch.tensor([0.0, 0.5, 0.1, -0.1, 0.3, 0.5, 0.0, -0.4], dtype=torch.float64)
    sampling = old + 0.6 * torch.randn(n, t, generator=g, dtype=torch.float64) + drift[:, None]
    diff = ((old - sampling) * completion_mask).nan_to_num(0.0)
    ratio = torch.exp(diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff)
    if mode.endswith("truncate"):
        ratio = ratio.clamp(max=3.0)  # TRL's vllm_importance_sampling_clip_max default
    else:
        ratio = ratio.masked_fill((ratio < 1 / 3.0) | (ratio > 3.0), 0.0)  # outside [min, max]: the rollout's 0
    trainer.vllm_importance_sampling_clip_min = 1 / 3.0
    output = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "old_per_token_logps": old,
        "sampling_per_token_logps": sampling,
        "importance_sampling_ratio": ratio,
    }
    return trainer, output


def autograd_rows_of_trls_loss(trainer, output):
    """g_i = -N grad L_i / A_i, grad L_i from autograd on TRL's own ``_compute_loss`` with only rollout i's
    advantage kept (every other row's per-token loss is then 0; the masks depend on the entropies and on A_i's
    sign alone, so row i's term is unchanged): [N, P] float64 over every parameter."""
    from grpo_lens.integrations.trl import activation_checkpointing_off

    policy = trainer.accelerator.unwrap_model(trainer.model)
    params = [p for p in policy.parameters() if p.requires_grad]
    a = output["advantages"]
    n = a.numel()
    rows = []
    with activation_checkpointing_off(policy):
        for i in range(n):
            keep = torch.zeros_like(a)
            keep[i] = a[i]
            loss = trainer._compute_loss(trainer.model, {**output, "advantages": keep})
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            flat = torch.cat([(z if z is not None else torch.zeros_like(p)).reshape(-1) for z, p in zip(grads, params)])
            rows.append(-n * flat / a[i])  # TRL's grpo loss: mean over the N rows, h_i = -(A_i / N) g_i
    return torch.stack(rows)


def lens_gram(trainer, output):
    """The lens's Gram of TRL's batch, as measure_lens computes it (NaN between groups)."""
    from grpo_lens.integrations.trl import activation_checkpointing_off, trl_token_weights

    policy = trainer.accelerator.unwrap_model(trainer.model)
    batch, _ = trainer._local_rows(output)
    rewards = torch.tensor([1.0, 0.0] * R)  # both groups mixed
    weights = trl_token_weights(trainer, output)
    with activation_checkpointing_off(policy):
        got = trainer.weighted_lens_rows(policy, batch, rewards, torch.ones(2 * R, dtype=torch.bool), weights)
    return got["gram"][0], weights


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_the_lens_gram_equals_autograd_on_trls_weighted_masked_loss(tmp_path, mode):
    """With vLLM TRL weighs each token's loss by the importance-sampling ratio pi_old / pi_sampler (token
    or sequence, truncated at 3 or masked outside [1/3, 3]), drops negative-advantage rollouts that drifted past
    off_policy_mask_threshold and keeps only the tokens of top entropy; the lens's rows carry all three: its exact Gram
    equals, to 1e-10 in float64, the Gram of the rows -N grad L_i / A_i that autograd gives on TRL's own loss."""
    trainer, output = vllm_like_trainer(tmp_path, mode)
    gram, weights = lens_gram(trainer, output)
    assert weights is not None and 0 < float((weights == 0).double().mean()) < 1 and bool((weights != 1).any())
    g = autograd_rows_of_trls_loss(trainer, output)
    want = g @ g.T
    for b in range(2):  # each group's [R, R] block (the lens reads nothing between groups)
        s = slice(b * R, (b + 1) * R)
        torch.testing.assert_close(gram[s, s], want[s, s], rtol=1e-10, atol=1e-10 * float(want.diag().max()))


@pytest.mark.parametrize("drop", ["importance_sampling_ratio", "off_policy_mask", "entropy_mask"])
def test_the_gram_check_fails_when_a_weight_is_dropped(tmp_path, drop):
    # the check above can fail: the lens's Gram without one of TRL's three factors misses autograd's by far more than
    # its tolerance
    trainer, output = vllm_like_trainer(tmp_path, "token_truncate")
    g = autograd_rows_of_trls_loss(trainer, output)
    want = g @ g.T
    if drop == "importance_sampling_ratio":
        trainer.vllm_importance_sampling_correction = False
    elif drop == "off_policy_mask":
        trainer.off_policy_mask_threshold = None
    else:
        trainer.top_entropy_quantile = 1.0
    gram, _ = lens_gram(trainer, output)
    gap = max(float((gram[s, s] - want[s, s]).abs().max()) for s in (slice(0, R), slice(R, 2 * R)))
    assert gap > 1e-4 * float(want.diag().max())


def test_settings_the_rows_cannot_carry_are_refused_in_one_line(tmp_path):
    from grpo_lens.integrations.trl import LensGRPOTrainer

    with pytest.raises(ValueError, match=r"^LensGRPOTrainer: entropy_coef / use_adaptive_entropy add an entropy bonus"):
        make_trainer(tmp_path, LensGRPOTrainer, entropy_coef=0.01)
    with pytest.raises(ValueError, match=r"^LensGRPOTrainer: top_entropy_quantile=0.5 masks .*steps_per_generation=2"):
        make_trainer(
            tmp_path,
            LensGRPOTrainer,
            top_entropy_quantile=0.5,
            steps_per_generation=2,
            per_device_train_batch_size=R,
        )
    from peft import LoraConfig

    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    with pytest.raises(ValueError, match=r"^LensGRPOTrainer: with a peft model the lens's per-rollout gradients"):
        make_trainer(tmp_path, LensGRPOTrainer, off_policy_mask_threshold=0.5, peft_config=lora)
