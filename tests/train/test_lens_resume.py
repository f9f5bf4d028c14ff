"""The lens must not change the run it measures through its schedule.

A run of 2 steps resumed to 4 must train exactly as a straight 4-step run, whatever ``lens_every``: the lens's
measurement of a run's last step (:func:`grpo_lens.train.loop.is_lens_step`) falls on step 2 of the short run but
not of the long one, so that measurement must leave the update as a lens-off step computes it, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from test_trainer import tiny_config

from grpo_lens.train import loop


def final_state(run) -> tuple[dict, dict]:
    """(parameters, optimizer state tensors) of the run's last checkpoint."""
    from safetensors.torch import load_file

    ckpt = run.path / "checkpoints" / (run.path / "checkpoints" / "latest").read_text().strip()
    optim = torch.load(ckpt / "optimizer.pt", weights_only=False)["state"]
    return load_file(str(ckpt / "model.safetensors")), {(i, k): v for i, s in optim.items() for k, v in s.items()}


UPDATE_KEYS = ("reward/mean", "loss/policy", "grad/norm", "policy/entropy", "completions/mean_length")


def test_the_last_step_is_measured_off_the_cadence():
    # lens_every 3 over 4 steps: the cadence is steps 1 and 3; step 4 is measured as the last, off the cadence; over 2
    # steps, step 2 is the last (off the cadence) and is no lens step of the 4-step run
    assert [s for s in range(1, 5) if loop.is_lens_step(s, 3, 4)] == [1, 3, 4]
    assert [s for s in range(1, 5) if loop.on_lens_cadence(s, 3)] == [1, 3]
    assert [s for s in range(1, 3) if loop.is_lens_step(s, 3, 2)] == [1, 2]
    assert [s for s in range(1, 7) if loop.on_lens_cadence(s, 2)] == [1, 2, 4, 6]
    assert not any(loop.on_lens_cadence(s, 0) for s in range(1, 5))  # lens off


@pytest.mark.e2e
@pytest.mark.parametrize("lens_every", [3])
def test_resume_equals_the_straight_run_whatever_the_lens_cadence(tmp_path, lens_every):
    """--max-steps 2, then --resume --max-steps 4 == a straight 4-step run, every weight and AdamW moment bit for bit
    (step 2 ran as a lens step in the short run only, and every weight differed by rounding)."""
    straight = loop.train(tiny_config(tmp_path / "straight", lens_every=lens_every, max_steps=4))
    loop.train(tiny_config(tmp_path / "split", lens_every=lens_every, max_steps=2))  # the lens measures step 2
    split = loop.train(tiny_config(tmp_path / "split", lens_every=lens_every, max_steps=4, resume=True))
    records = {r["step"]: r for r in split.read_metrics()}
    assert any(k.startswith("rank/") for k in records[2])  # the short run's last step was a lens step
    assert not any(k.startswith("rank/") for k in {r["step"]: r for r in straight.read_metrics()}[2])
    params, optim = final_state(split)
    ref_params, ref_optim = final_state(straight)
    assert params.keys() == ref_params.keys() and optim.keys() == ref_optim.keys()
    assert [name for name in ref_params if not torch.equal(params[name], ref_params[name])] == []
    assert [key for key in ref_optim if not torch.equal(optim[key], ref_optim[key])] == []
    ref_records = {r["step"]: r for r in straight.read_metrics()}
    for step in (1, 2, 3, 4):
        assert [records[step][k] for k in UPDATE_KEYS] == [ref_records[step][k] for k in UPDATE_KEYS], step
