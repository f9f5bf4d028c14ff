"""Nothing lost, no one in. One test (or a few) per reported failure and partial, each failing
on the main branch before the fix: crafted checkpoints, one writer per run directory, TRL's reward conventions, a
resume on the run's own data, and clear stops.

Tiny model (2-layer Llama built in code), CPU float32; rewards from tests/helpers_rewards.py depend only on the
rollout's position, so groups are mixed whatever the model writes.
"""

from __future__ import annotations

import helpers_rewards  # noqa: F401 - registers the test_* reward functions
import pytest
import torch

import grpo_lens.train.checks as checks
import grpo_lens.train.loop as loop
from grpo_lens.config import TrainConfig
from grpo_lens.rundir import RunDirError

R = 4


def tiny_config(tmp_path, name="run", **overrides) -> TrainConfig:
    """A short run of the tiny model: B = 2 prompts, R = 4, T_max = 4."""
    values = dict(
        model="tiny",
        task="arithmetic",
        rewards=["test_alternating"],
        group_size=R,
        prompts_per_step=2,
        max_new_tokens=4,
        max_steps=1,
        checkpoint_every=1,
        lens_every=0,
        progress=False,
        device="cpu",
        save_final_model=False,
        log_completions=0,
        micro_batch_size=2 * R,
        seed=0,
    )
    values.update(overrides)
    return TrainConfig(out=str(tmp_path / name), **values)


class _CreatesFile:
    """Unpickling this calls open(path, "w"): a crafted checkpoint that would create a file when loaded."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


# ---------------------------------------------------------------------------------------------------------------------
# 1. a crafted checkpoint runs no code on --resume
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.parametrize("name", ["state.pt", "optimizer.pt"])
def test_crafted_checkpoint_is_refused_and_runs_nothing(tmp_path, name):
    """A state.pt / optimizer.pt whose pickle would create a file on load: --resume refuses it in one line naming the
    file, and the file is never created (main loaded both with weights_only=False: the file appeared)."""
    loop.train(tiny_config(tmp_path))
    ckpt = tmp_path / "run" / "checkpoints" / "step-000001"
    marker = tmp_path / "pwned"
    torch.save({"step": 1, "x": _CreatesFile(marker)}, ckpt / name)
    with pytest.raises(RunDirError) as err:
        loop.train(tiny_config(tmp_path, max_steps=2, resume=True))
    message = str(err.value)
    assert not marker.exists()
    assert str(ckpt / name) in message and "\n" not in message
    assert "weights_only" in message


@pytest.mark.e2e
def test_checkpoint_loads_with_weights_only(tmp_path):
    """Every file of a checkpoint grpo-lens writes loads with weights_only=True, the NumPy random state included."""
    loop.train(tiny_config(tmp_path))
    ckpt = tmp_path / "run" / "checkpoints" / "step-000001"
    state = torch.load(ckpt / "state.pt", weights_only=True)
    torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert state["step"] == 1 and state["rng"]["numpy"]["keys"].shape == (624,)


# ---------------------------------------------------------------------------------------------------------------------
# 3. one writer per run directory
# ---------------------------------------------------------------------------------------------------------------------
_HOLDER = (
    "import sys, time\nfrom grpo_lens.rundir import acquire_run_lock\nacquire_run_lock(sys.argv[1], 'train')\n"
    "print('locked', flush=True)\ntime.sleep(120)\n"
)


def _hold_lock(path):
    """Another process that takes the run directory's lock (as a live train does) and keeps it."""
    import os
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.stdout.readline().strip() == "locked"
    return proc


@pytest.mark.e2e
def test_live_run_cannot_be_overwritten_or_resumed_and_a_stale_lock_is_taken_over(tmp_path, caplog):
    """While another process holds DIR, --overwrite and --resume are refused naming its pid, and DIR keeps its run
    (on main --overwrite deleted it and both exited 0); once that process is SIGKILLed its lock is stale: a resume
    takes it over with a warning naming the dead pid."""
    import signal

    loop.train(tiny_config(tmp_path))
    run = tmp_path / "run"
    before = sorted(p.name for p in run.iterdir())
    holder = _hold_lock(run)
    try:
        for flags in ({"overwrite": True}, {"resume": True, "max_steps": 2}):
            with pytest.raises(RunDirError) as err:
                loop.train(tiny_config(tmp_path, **flags))
            assert f"pid {holder.pid} on host" in str(err.value) and "being written" in str(err.value)
        assert sorted(p.name for p in run.iterdir() if p.name != ".grpo-lens.lock") == before
        assert [r["step"] for r in loop.RunDir(run).read_metrics()] == [1]
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with caplog.at_level("WARNING", logger="grpo_lens.rundir"):
        loop.train(tiny_config(tmp_path, resume=True, max_steps=2))
    assert f"stale lock of pid {holder.pid}" in caplog.text and "is no longer running" in caplog.text
    assert [r["step"] for r in loop.RunDir(run).read_metrics()] == [1, 2]
    assert not (run / ".grpo-lens.lock").exists()  # released (and deleted) at the end of the run


def test_lock_of_a_new_directory_leaves_nothing_on_a_failed_start(tmp_path):
    """A new --out is created to hold the lock and removed again when the start fails before writing."""
    from grpo_lens.rundir import acquire_run_lock

    release = acquire_run_lock(tmp_path / "new", "train")
    assert (tmp_path / "new" / ".grpo-lens.lock").is_file()
    release()
    assert not (tmp_path / "new").exists()


# ---------------------------------------------------------------------------------------------------------------------
# 2, 5, 7. TRL's reward conventions: copies of the columns, sys.exit, returns that are not a list of numbers
# ---------------------------------------------------------------------------------------------------------------------
def test_reward_function_gets_copies_of_the_columns():
    """A function that edits ``answer`` in place changes nothing the next function sees (main: it did)."""
    from grpo_lens.rewards import combine_rewards

    seen = []

    def vandal(prompts, completions, answer, **kw):
        answer[0] = "999"
        answer.append("x")
        return [0.0] * len(completions)

    def reader(prompts, completions, answer, **kw):
        seen.append(list(answer))
        return [1.0] * len(completions)

    answers = ["5", "7"]
    combine_rewards([vandal, reader], ["q", "q"], ["a", "b"], columns={"answer": answers})
    assert seen == [["5", "7"]] and answers == ["5", "7"]


def _exits(prompts, completions, **kw):
    import sys

    sys.exit(0)


@pytest.mark.parametrize("timeout", [None, 5.0])
def test_sys_exit_in_a_reward_function_is_an_error_naming_it(timeout):
    """SystemExit inside a reward is an error naming the function, at the start check and during the run (main: the
    run ended with exit 0, an empty log and only config.yaml)."""
    from grpo_lens.rewards import (
        RewardFunctionError,
        check_rewards_on_example,
        combine_rewards,
    )

    with pytest.raises(ValueError, match=r"reward '_exits' called sys.exit\(0\)"):
        check_rewards_on_example([_exits], "q", {"answer": "1"}, timeout)
    with pytest.raises(RewardFunctionError, match="'_exits'"):
        combine_rewards([_exits], ["q"], ["a"], timeout)


def _generator(prompts, completions, **kw):
    return (1.0 for _ in completions)


@pytest.mark.parametrize(
    "returned, shown",
    [
        (lambda p, c, **kw: 1.0, "returned float 1.0, not a list"),
        (_generator, "returned generator"),
        (lambda p, c, **kw: ["abc"] * len(c), "holding str 'abc', which is neither a number nor None"),
        (lambda p, c, **kw: {"r": 1.0}, "returned dict"),
        (lambda p, c, **kw: [1.0, 0.0], "returned 2 values for 1 completions"),
    ],
)
def test_reward_return_that_is_not_a_list_of_numbers_is_refused_at_start(returned, shown):
    """A scalar, a generator, strings, a mapping or the wrong length is refused by the start check, naming the
    function and what it returned (main: TypeError traceback for scalar/generator; strings: all invalid, exit 0)."""
    from grpo_lens.rewards import check_rewards_on_example

    returned.__name__ = "odd_reward"
    with pytest.raises(ValueError) as err:
        check_rewards_on_example([returned], "q", {"answer": "1"})
    assert "reward 'odd_reward'" in str(err.value) and shown in str(err.value)


def test_reward_return_of_numbers_and_none_passes_the_start_check():
    """What TRL accepts passes: a list, tuple, NumPy array or tensor of numbers or None."""
    import numpy as np

    from grpo_lens.rewards import check_rewards_on_example

    for value in ([None], (1,), np.array([0.5]), torch.tensor([1.0]), [True], [np.float32(1.0)]):

        def ok(prompts, completions, _v=value, **kw):
            return _v

        check_rewards_on_example([ok], "q", {"answer": "1"})


# ---------------------------------------------------------------------------------------------------------------------
# 4. a resume trains on the run's own data
# ---------------------------------------------------------------------------------------------------------------------
def _write_data(path, answers):
    import json

    path.write_text("".join(json.dumps({"prompt": f"What is {a} + 0?", "answer": str(a)}) + "\n" for a in answers))
    return path


def _saved(run):
    import yaml

    return yaml.safe_load((run / "config.yaml").read_text())


@pytest.mark.e2e
def test_resume_refuses_a_changed_dataset_unless_allowed(tmp_path, monkeypatch):
    """config.yaml records the dataset's absolute path, sha256 and rows; a resume on an edited file is refused naming
    both hashes (main used it silently), and --allow-dataset-change resumes and records the new hash."""
    import hashlib

    monkeypatch.chdir(tmp_path)
    data = _write_data(tmp_path / "data.jsonl", [1, 2, 3, 4])
    loop.train(tiny_config(tmp_path, task="jsonl", dataset="data.jsonl"))
    saved = _saved(tmp_path / "run")
    old = hashlib.sha256(data.read_bytes()).hexdigest()
    assert saved["dataset"] == str(data.resolve()) and saved["dataset_sha256"] == old and saved["dataset_rows"] == 4
    _write_data(data, [1, 2, 3, 5])
    new = hashlib.sha256(data.read_bytes()).hexdigest()
    with pytest.raises(RunDirError) as err:
        loop.train(tiny_config(tmp_path, task="jsonl", dataset=saved["dataset"], resume=True, max_steps=2))
    assert old in str(err.value) and new in str(err.value) and "--allow-dataset-change" in str(err.value)
    loop.train(
        tiny_config(
            tmp_path, task="jsonl", dataset=saved["dataset"], resume=True, max_steps=2, allow_dataset_change=True
        )
    )
    saved = _saved(tmp_path / "run")
    assert saved["dataset_sha256"] == new and saved["allow_dataset_change"] is True


@pytest.mark.e2e
def test_resume_from_another_folder_reads_the_runs_own_file(tmp_path, monkeypatch):
    """The CLI resume from another folder holding its own data.jsonl trains on the run's file (main re-read the
    relative path there); naming the other folder's file is refused as a changed dataset."""
    from grpo_lens.cli import main

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _write_data(tmp_path / "a" / "data.jsonl", [1, 2, 3, 4])
    _write_data(tmp_path / "b" / "data.jsonl", [7, 8, 9])
    monkeypatch.chdir(tmp_path / "a")
    loop.train(tiny_config(tmp_path, task="jsonl", dataset="data.jsonl"))
    monkeypatch.chdir(tmp_path / "b")
    out = str(tmp_path / "run")
    assert main(["train", "--resume", "--out", out, "--max-steps", "2"]) == 0
    assert _saved(tmp_path / "run")["dataset"] == str(tmp_path / "a" / "data.jsonl")
    assert main(["train", "--resume", "--out", out, "--max-steps", "3", "--dataset", "data.jsonl"]) == 2


@pytest.mark.e2e
def test_resume_with_metrics_missing_is_refused(tmp_path):
    """metrics.jsonl deleted: the resume is refused naming it (main lost the history silently)."""
    loop.train(tiny_config(tmp_path))
    (tmp_path / "run" / "metrics.jsonl").unlink()
    with pytest.raises(RunDirError, match=r"metrics.jsonl is missing, but the checkpoint step-000001 is at step 1"):
        loop.train(tiny_config(tmp_path, resume=True, max_steps=2))


# ---------------------------------------------------------------------------------------------------------------------
# 6, 7. clear stops
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("weight", ["nan", "inf", "-inf"])
def test_reward_weight_must_be_finite_with_the_flags(weight):
    """format:nan is a ConfigError when the config is built, before anything is written (main: it passed the start
    checks and failed after config.yaml was written)."""
    from grpo_lens.config import ConfigError
    from grpo_lens.rewards import parse_reward_specs

    with pytest.raises(ConfigError, match="finite number"):
        TrainConfig(rewards=["correctness", f"format:{weight}"])
    with pytest.raises(ValueError, match="finite number"):
        parse_reward_specs([f"format:{weight}"])


def test_warmup_as_long_as_the_run_is_warned(caplog):
    """--warmup-steps 1000 --max-steps 1: the LR is 0 for the whole run; a warning says so at start (main: silent)."""
    with caplog.at_level("WARNING", logger="grpo_lens.train.loop"):
        checks.warn_long_warmup(TrainConfig(warmup_steps=1000, max_steps=1))
    assert "never reaches --learning-rate" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="grpo_lens.train.loop"):
        checks.warn_long_warmup(TrainConfig(warmup_steps=2, max_steps=10))
    assert caplog.text == ""


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
def test_nan_and_inf_in_masked_positions_reach_neither_loss_nor_gradient(aggregation):
    """NaN / -inf / inf at masked-out positions of logp, old_logp and ref_logp: the loss and its gradient equal those
    with zeros there (main: (loss * mask).sum() made the loss NaN in all three aggregations, as in verl PR 6349)."""
    from grpo_lens.formulas.losses import grpo_loss, kl_reward_penalty, loss_normalizer

    torch.manual_seed(0)
    mask = torch.tensor([[True, True, False, False], [True, True, True, False]])
    clean = torch.randn(2, 4).double() - 2.0
    old = clean + 0.1 * torch.randn(2, 4).double()
    ref = clean - 0.05
    adv = torch.tensor([1.0, -0.5]).double()
    dirty = [t.clone() for t in (clean, old, ref)]
    for t, junk in zip(dirty, (float("nan"), float("-inf"), float("inf"))):
        t[~mask] = junk
    z = loss_normalizer(mask, aggregation, 4)
    results = []
    for logp, old_logp, ref_logp in ((clean, old, ref), dirty):
        x = logp.clone().requires_grad_(True)
        loss, metrics = grpo_loss(
            x, old_logp, adv, mask, normalizer=z, aggregation=aggregation, beta=0.1, ref_logp=ref_logp
        )
        loss.backward()
        results.append((loss.detach(), x.grad, metrics["kl/mean"], metrics["ratio/mean"]))
    (l0, g0, k0, r0), (l1, g1, k1, r1) = results
    assert torch.isfinite(l1) and torch.isfinite(g1).all()
    assert torch.equal(l0, l1) and torch.equal(g0, g1) and k0 == k1 and r0 == r1
    assert (g1[~mask] == 0).all() and (g1[mask] != 0).any()
    assert torch.isfinite(kl_reward_penalty(dirty[0], dirty[2], mask, 0.1)).all()


@pytest.mark.e2e
@pytest.mark.parametrize("steps", [1, 2])
def test_a_run_where_nothing_scores_fails_whatever_its_length(tmp_path, steps):
    """Every reward call fails in training: a run of 1 or 2 steps (fewer than --max-consecutive-skips 3) stops with
    NoScorableRolloutError at its last step (main: exit 0)."""
    with pytest.raises(loop.NoScorableRolloutError, match=f"for {steps} consecutive steps"):
        loop.train(tiny_config(tmp_path, rewards=["test_raises_in_training"], max_steps=steps))


@pytest.mark.e2e
def test_a_learning_rate_that_blows_up_the_weights_stops_in_one_line(tmp_path):
    """--learning-rate 1e9: the run stops with NonFiniteWeightsError naming the step, the learning rate and how to
    resume, before a generate fails on the weights (main: a traceback inside generate, 'probability tensor contains
    inf/nan')."""
    with pytest.raises(loop.NonFiniteWeightsError) as err:
        loop.train(tiny_config(tmp_path, learning_rate=1e9, max_steps=6))
    message = str(err.value)
    assert "\n" not in message and "lower --learning-rate" in message and "1e+09" in message
    assert message.startswith("step ") and "resume from step " in message


@pytest.mark.e2e
def test_disk_full_while_writing_a_checkpoint_is_one_line(tmp_path, monkeypatch, capsys):
    """torch.save's zip writer on a full disk raises RuntimeError("... file write failed", no errno): the command
    prints one line "disk full while writing FILE; nothing lost ..." and exits 2, and the half-written checkpoint is
    gone (main: a RuntimeError traceback)."""
    import os
    from types import SimpleNamespace

    import grpo_lens.rundir as rundir
    from grpo_lens.cli import main

    def full(*args, **kwargs):
        raise RuntimeError(
            "[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file "
            "data/0: file write failed"
        )

    monkeypatch.setattr(rundir.torch, "save", full)
    monkeypatch.setattr(rundir.os, "statvfs", lambda path: SimpleNamespace(f_bavail=0, f_frsize=4096))
    out = tmp_path / "run"
    rc = main(
        [
            "train",
            "--model",
            "tiny",
            "--rewards",
            "test_alternating",
            "--group-size",
            "4",
            "--prompts-per-step",
            "2",
            "--max-new-tokens",
            "4",
            "--max-steps",
            "1",
            "--lens-every",
            "0",
            "--no-progress",
            "--device",
            "cpu",
            "--no-save-final-model",
            "--out",
            str(out),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert f"disk full while writing {out / 'checkpoints'}" in err[0] and "optimizer.pt; nothing lost" in err[0]
    assert "resume" in err[0]
    assert not list((out / "checkpoints").glob(".step-*")) and os.path.isfile(out / "metrics.jsonl")


def test_yaml_duplicate_keys_are_refused(tmp_path):
    """A config file with group_size twice is a ConfigError naming the key and both lines (main: the last won)."""
    from grpo_lens.config import ConfigError

    path = tmp_path / "c.yaml"
    path.write_text("group_size: 8\nmax_steps: 2\ngroup_size: 4\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'group_size' \(first on line 1\).*line 3"):
        TrainConfig.read(path)


@pytest.mark.parametrize(
    "content, shown",
    [
        (b'{"prompt": "caf\xe9 2 + 2?", "answer": "4"}\n', "row 1: not UTF-8 text"),
        (b"\x1f\x8b\x08\x00rest-of-a-gzip-stream", "gzip-compressed"),
        (b'{"prompt": "2 + 2?", "answer": "4", "answer": "5"}\n', "row 1: the key 'answer' appears twice"),
    ],
)
def test_data_file_errors_name_the_file(tmp_path, content, shown):
    """Non-UTF-8, gzip and duplicate JSON keys: one ValueError naming the file (main: a message without the file for
    the first two, and the last 'answer' silently for the third)."""
    from grpo_lens.tasks import get_task

    path = tmp_path / "data.jsonl"
    path.write_bytes(content)
    with pytest.raises(ValueError) as err:
        get_task("jsonl", dataset=str(path))
    assert str(path) in str(err.value) and shown in str(err.value)


def test_plugins_are_imported_from_pythonpath_as_given(tmp_path, monkeypatch):
    """load_plugins puts no folder in front of sys.path: a stray math_verify.py in the working directory stays
    unimported (main inserted the working directory first). The working directory may follow the
    rest, so that a plugin beside the user loads (tests/test_plugins.py), but nothing goes before what was there."""
    import sys

    from grpo_lens.cli import load_plugins

    (tmp_path / "plugin_dir").mkdir()
    (tmp_path / "plugin_dir" / "cwd_plugin.py").write_text("LOADED = True\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(
        sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))] + [str(tmp_path / "plugin_dir")]
    )
    before = list(sys.path)
    assert load_plugins("cwd_plugin") == ["cwd_plugin"]
    assert sys.path[: len(before)] == before and sys.path[len(before) :] in ([], [str(tmp_path)])


def test_scientific_answer_and_list_reference():
    """'#### 1e3' equals 1000 (main: None); a reference [2] is not scored from its repr '[2]' (main: scored 1.0 for
    a completion '2'), neither by correctness nor by the accuracy verdict."""
    from grpo_lens.rewards import (
        correctness,
        extract_answer,
        math_correctness_verdict,
        parse_number,
    )
    from grpo_lens.tasks.user_data import row_to_example

    assert extract_answer("so #### 1e3") == 1000 and parse_number("2.5E-2") * 40 == 1
    assert correctness(["q"], ["#### 1e3"], answer=["1000"]) == [1.0]
    example = row_to_example({"prompt": "p", "answer": [2]}, "data.jsonl", 1)
    assert example.answer == [2]
    assert correctness(["q"], ["#### 2"], answer=[example.answer]) == [None]
    assert math_correctness_verdict(["#### 2"], [example.answer]) == [None]


@pytest.mark.slow
def test_fault_injection_script_finds_every_run_identical(tmp_path):
    """benchmarks/faults.py with 2 random SIGKILLs, the ENOSPC plugin and two writers (a few minutes; not in CI)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [
            sys.executable,
            str(repo / "benchmarks" / "faults.py"),
            "--kills",
            "2",
            "--no-tmpfs",
            "--only",
            "sigkill",
            "disk-full",
            "two-writers",
            "--keep",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=1200,
        env={**os.environ, "PYTHONPATH": str(repo)},
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "sigkill      2 / 2 identical" in result.stdout and "disk-full    1 / 1 identical" in result.stdout


def test_probe_and_demo_hold_their_out_too(tmp_path):
    """probe and demo take the same lock: with another process holding --out, both are refused naming it before
    anything loads or is written."""
    import signal

    from grpo_lens.demo import DemoConfig, run_demo
    from grpo_lens.probe.config import ProbeConfig
    from grpo_lens.probe.run import run_probe

    out = tmp_path / "out"
    out.mkdir()
    holder = _hold_lock(out)
    try:
        for call in (
            lambda: run_probe(ProbeConfig(model="tiny", out=str(out), device="cpu")),
            lambda: run_demo(DemoConfig(model="tiny", out=str(out), device="cpu")),
        ):
            with pytest.raises(RunDirError, match=f"being written by pid {holder.pid} on host"):
                call()
        assert [p.name for p in out.iterdir()] == [".grpo-lens.lock"]
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


@pytest.mark.e2e
def test_nan_weights_after_an_update_stop_before_the_next_generate(tmp_path, monkeypatch):
    """An update that leaves a NaN weight stops the run at that step, before step 2 samples anything and before its
    checkpoint, naming the step and the learning rate (main: the next generate raised inside transformers)."""
    real_update, sampled = loop.policy_update, []

    def nan_update(policy, *args, **kwargs):
        metrics = real_update(policy, *args, **kwargs)
        with torch.no_grad():
            next(policy.parameters()).view(-1)[0] = float("nan")
        return metrics

    real_sample = loop.sample_step
    monkeypatch.setattr(loop, "policy_update", nan_update)
    monkeypatch.setattr(loop, "sample_step", lambda *a, **k: sampled.append(a[-1]) or real_sample(*a, **k))
    with pytest.raises(loop.NonFiniteWeightsError) as err:
        loop.train(tiny_config(tmp_path, max_steps=3, learning_rate=1e-3))
    assert sampled == [1]
    assert str(err.value).startswith("step 1: the weights are NaN/inf after the update at learning rate 0.001")
    assert "resume from step 0 with a lower --learning-rate" in str(err.value)
    assert not (tmp_path / "run" / "checkpoints").exists()
