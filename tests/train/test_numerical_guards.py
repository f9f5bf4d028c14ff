"""Numerical guards: the KL log-ratio clamp, and non-finite steps
skipped, counted and stopped after ``max_consecutive_skips`` with the last checkpoint intact
(docs/theory.md §Numerical guards)."""

from __future__ import annotations

import json
import math

import helpers_rewards  # noqa: F401 - registers the test_* reward functions
import pytest
import torch

from grpo_lens.cli import main
from grpo_lens.config import TrainConfig
from grpo_lens.formulas.losses import LOG_RATIO_CLAMP, grpo_loss, kl_penalty
from grpo_lens.train.loop import NonFiniteUpdateError, train


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_k3_with_a_far_reference_stays_finite_through_adamw(dtype):
    # Case 5: log pi = -95 against log pi_ref = -2, beta 0.04: x = 93 and e^93 = 2.5e40 overflows float32 (max 3.4e38)
    # and bfloat16 (same exponent range) to inf. Clamped, x = 20: k3 = e^20 - 20 - 1.
    # One more: the same in bfloat16 (the second parameter).
    z = torch.tensor([[-95.0, 0.0]], dtype=dtype, requires_grad=True)  # logits of a 2-token vocabulary
    logp = torch.log_softmax(z.float(), -1)[:, :1].to(dtype)  # [1, 1], ~ -95
    ref = torch.full((1, 1), -2.0, dtype=dtype)
    k3 = kl_penalty(logp, ref, "k3")
    assert float(k3.detach()) == pytest.approx(math.expm1(LOG_RATIO_CLAMP) - LOG_RATIO_CLAMP, rel=1e-2)
    unclamped = torch.expm1((ref - logp).float()) - (ref - logp).float()
    assert torch.isinf(unclamped).all()  # what the clamp prevents
    loss, m = grpo_loss(
        logp,
        logp.detach(),
        torch.zeros(1),
        torch.ones(1, 1, dtype=torch.bool),
        normalizer=1.0,
        beta=0.04,
        ref_logp=ref,
        kl_estimator="k3",
    )
    assert math.isfinite(float(loss.detach())) and math.isfinite(m["kl/mean"])
    opt = torch.optim.AdamW([z], lr=0.1)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([z], 1.0)
    opt.step()
    assert torch.isfinite(z).all()


def tiny_config(tmp_path, name="run", **overrides) -> TrainConfig:
    values = dict(
        model="tiny",
        task="arithmetic",
        rewards=["test_alternating"],
        group_size=4,
        prompts_per_step=2,
        max_new_tokens=4,
        max_steps=6,
        checkpoint_every=1,
        keep_checkpoints=10,
        lens_every=0,
        progress=False,
        device="cpu",
        save_final_model=False,
        log_completions=0,
        micro_batch_size=8,
        seed=0,
        learning_rate=1e-3,
    )
    values.update(overrides)
    return TrainConfig(out=str(tmp_path / name), **values)


def _poison_after(monkeypatch, good_calls: int, what: str):
    """Make grpo_loss (as the trainer calls it) non-finite after ``good_calls`` calls: the loss itself ("loss") or only
    its gradient ("grad": a finite loss whose backward gives NaN)."""
    calls = {"n": 0}
    original = grpo_loss

    def poisoned(logp, *args, **kwargs):
        calls["n"] += 1
        loss, m = original(logp, *args, **kwargs)
        if calls["n"] > good_calls:
            if what == "loss":
                loss = loss * float("nan")
            else:  # sqrt'(0) = inf, times 0 -> NaN in the gradient, value unchanged
                loss = loss + 0.0 * torch.sqrt(logp.sum() * 0.0)
        return loss, m

    monkeypatch.setattr("grpo_lens.train.update.grpo_loss", poisoned)


def _metrics(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def _load(path, step):
    from safetensors.torch import load_file

    ckpt = path / "checkpoints" / f"step-{step:06d}"
    return load_file(str(ckpt / "model.safetensors")), torch.load(ckpt / "optimizer.pt", weights_only=False)


@pytest.mark.e2e
@pytest.mark.parametrize("what", ["loss", "grad"])
def test_non_finite_steps_are_skipped_counted_and_stop_the_run(tmp_path, monkeypatch, what):
    # Step 1 is finite (one micro-batch: one grpo_loss call); from step 2 on every step is non-finite. With
    # max_consecutive_skips = 2: step 2 is skipped (weights and AdamW state untouched, checkpoint 2 = checkpoint 1),
    # step 3 is skipped and the run stops before writing checkpoint 3. "loss" is case 5's kind (a NaN loss);
    # "grad" is one more: a finite loss whose gradient is NaN.
    _poison_after(monkeypatch, 1, what)
    config = tiny_config(tmp_path, max_consecutive_skips=2)
    with pytest.raises(NonFiniteUpdateError, match="2 consecutive steps") as err:
        train(config)
    assert "\n" not in str(err.value)
    rows = _metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["guard/step_skipped"] for r in rows] == [0, 1, 1]
    assert [r["guard/skipped_steps"] for r in rows] == [0, 1, 2]
    assert [r["guard/consecutive_skipped"] for r in rows] == [0, 1, 2]
    assert [r["grad/optimizer_steps"] for r in rows] == [1, 0, 0]
    ckpts = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*"))
    assert ckpts == ["step-000001", "step-000002"]
    (w1, o1), (w2, o2) = _load(tmp_path / "run", 1), _load(tmp_path / "run", 2)
    for name in w1:
        assert torch.equal(w1[name], w2[name]) and torch.isfinite(w2[name]).all()
    s1, s2 = o1["state"], o2["state"]
    assert s1.keys() == s2.keys()
    for k in s1:
        assert float(s1[k]["step"]) == float(s2[k]["step"]) == 1.0  # AdamW took exactly one step
        assert torch.equal(s1[k]["exp_avg"], s2[k]["exp_avg"])


@pytest.mark.e2e
def test_cli_stops_with_one_line_and_resume_from_the_intact_checkpoint(tmp_path, monkeypatch, capsys):
    _poison_after(monkeypatch, 1, "loss")
    out = tmp_path / "cli"
    args = [
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
        "4",
        "--checkpoint-every",
        "1",
        "--lens-every",
        "0",
        "--no-progress",
        "--device",
        "cpu",
        "--no-save-final-model",
        "--max-consecutive-skips",
        "1",
        "--out",
        str(out),
    ]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "non-finite for 1 consecutive steps" in err[0]
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-000001"]
    monkeypatch.undo()  # the fault is gone: the run resumes from step 1 and finishes (the limit may change on resume)
    assert main(["train", "--resume", "--out", str(out), "--max-consecutive-skips", "2"]) == 0
    assert [r["step"] for r in _metrics(out)] == [1, 2, 3, 4]
