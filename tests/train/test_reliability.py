"""Issue 32: nothing lost, no one in. One test (or a few) per numbered failure and partial of the issue, each failing
on the main branch before the fix: crafted checkpoints, one writer per run directory, TRL's reward conventions, a
resume on the run's own data, and clear stops.

Tiny model (2-layer Llama built in code), CPU float32; rewards from tests/helpers_rewards.py depend only on the
rollout's position, so groups are mixed whatever the model writes.
"""

from __future__ import annotations

import helpers_rewards  # noqa: F401 - registers the test_* reward functions
import pytest
import torch

import grpo_lens.train.loop as loop
from grpo_lens.config import TrainConfig
from grpo_lens.rundir import RunDirError

R = 4


def tiny_config(tmp_path, name="run", **overrides) -> TrainConfig:
    """A short run of the tiny model: B = 2 prompts, R = 4, T_max = 4."""
    values = dict(model="tiny", task="arithmetic", rewards=["test_alternating"], group_size=R, prompts_per_step=2,
                  max_new_tokens=4, max_steps=1, checkpoint_every=1, lens_every=0, progress=False, device="cpu",
                  save_final_model=False, log_completions=0, micro_batch_size=2 * R, seed=0)
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
_HOLDER = ("import sys, time\nfrom grpo_lens.rundir import acquire_run_lock\nacquire_run_lock(sys.argv[1], 'train')\n"
           "print('locked', flush=True)\ntime.sleep(120)\n")


def _hold_lock(path):
    """Another process that takes the run directory's lock (as a live train does) and keeps it."""
    import os
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
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
    from grpo_lens.rewards import RewardFunctionError, check_rewards_on_example, combine_rewards

    with pytest.raises(ValueError, match=r"reward '_exits' called sys.exit\(0\)"):
        check_rewards_on_example([_exits], "q", {"answer": "1"}, timeout)
    with pytest.raises(RewardFunctionError, match="'_exits'"):
        combine_rewards([_exits], ["q"], ["a"], timeout)


def _generator(prompts, completions, **kw):
    return (1.0 for _ in completions)


@pytest.mark.parametrize("returned, shown", [
    (lambda p, c, **kw: 1.0, "returned float 1.0, not a list"),
    (_generator, "returned generator"),
    (lambda p, c, **kw: ["abc"] * len(c), "holding str 'abc', which is neither a number nor None"),
    (lambda p, c, **kw: {"r": 1.0}, "returned dict"),
    (lambda p, c, **kw: [1.0, 0.0], "returned 2 values for 1 completions"),
])
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
