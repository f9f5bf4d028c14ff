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
        assert sorted(p.name for p in run.iterdir()) == before
        assert [r["step"] for r in loop.RunDir(run).read_metrics()] == [1]
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with caplog.at_level("WARNING", logger="grpo_lens.rundir"):
        loop.train(tiny_config(tmp_path, resume=True, max_steps=2))
    assert f"stale lock of pid {holder.pid}" in caplog.text and "is no longer running" in caplog.text
    assert [r["step"] for r in loop.RunDir(run).read_metrics()] == [1, 2]
    assert (run / ".grpo-lens.lock").read_text() == ""  # released at the end of the run


def test_lock_of_a_new_directory_leaves_nothing_on_a_failed_start(tmp_path):
    """A new --out is created to hold the lock and removed again when the start fails before writing."""
    from grpo_lens.rundir import acquire_run_lock

    release = acquire_run_lock(tmp_path / "new", "train")
    assert (tmp_path / "new" / ".grpo-lens.lock").is_file()
    release()
    assert not (tmp_path / "new").exists()
