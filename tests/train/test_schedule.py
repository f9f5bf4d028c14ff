"""--lr-scheduler with warm-up: the LR of every step is transformers' schedule (closed form below), and a run
stopped after a checkpoint and resumed has the unbroken run's LR sequence; --eval-every writes greedy and sampled
held-out accuracy with Wilson intervals at the due steps."""

from __future__ import annotations

import math

import pytest

import grpo_lens.train.loop as loop
from grpo_lens import metrics as mk
from grpo_lens.config import TrainConfig
from grpo_lens.train.evaluate import accuracy_with_interval
from grpo_lens.train.schedule import warmup_steps

pytestmark = pytest.mark.e2e  # the tests here train the tiny model

LR0, STEPS, WARMUP = 1e-2, 6, 2


def config(out, **overrides) -> TrainConfig:
    values = dict(
        model="tiny",
        rewards=["test_parity"],
        group_size=2,
        prompts_per_step=2,
        max_new_tokens=4,
        max_steps=STEPS,
        learning_rate=LR0,
        lens_every=0,
        seed=0,
        device="cpu",
        out=str(out),
        progress=False,
        save_final_model=False,
        log_completions=0,
        checkpoint_every=3,
        lr_scheduler="cosine",
        warmup_steps=WARMUP,
    )
    values.update(overrides)
    return TrainConfig(**values)


def cosine_lr(step: int) -> float:
    """transformers' cosine schedule with warm-up at index i = step - 1: LR0 i / W during the warm-up, then
    LR0 (1 + cos(pi (i - W) / (S - W))) / 2, S = max_steps."""
    i = step - 1
    if i < WARMUP:
        return LR0 * i / WARMUP
    return LR0 * 0.5 * (1 + math.cos(math.pi * (i - WARMUP) / (STEPS - WARMUP)))


def lrs(run) -> list[float]:
    return [r[mk.LR] for r in run.read_metrics() if mk.STEP in r]


def test_cosine_schedule_with_warmup_and_resume_equal_the_unbroken_run(tmp_path, monkeypatch):
    unbroken = lrs(loop.train(config(tmp_path / "unbroken")))
    # [0, 0.005, 0.01, 0.00854, 0.005, 0.00146]: 0 and LR0/2 in the warm-up, then the cosine from LR0
    assert unbroken == pytest.approx([cosine_lr(s) for s in range(1, STEPS + 1)], rel=1e-12, abs=1e-15)

    class Killed(Exception):
        pass

    def kill_after_step_5(point, step, module=None):
        if point == "after_metrics_write" and step == 5:
            raise Killed  # the checkpoint of step 3 is the last one; step 4 and 5's records are redone

    monkeypatch.setattr(loop, "crash_point", kill_after_step_5)
    with pytest.raises(Killed):
        loop.train(config(tmp_path / "resumed"))
    monkeypatch.undo()
    resumed = lrs(loop.train(config(tmp_path / "resumed", resume=True)))
    assert resumed == unbroken  # exactly: a schedule restarted on resume would give step 4 the LR of step 1


def test_linear_and_constant_schedules_and_a_warmup_share():
    import torch

    from grpo_lens.train.schedule import LRSchedule

    def sequence(**kw):
        c = TrainConfig(max_steps=4, learning_rate=1.0, **kw)
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=123.0)
        return [LRSchedule(opt, c).apply(s) for s in range(1, 5)]

    assert sequence(lr_scheduler="constant") == [1.0, 1.0, 1.0, 1.0]
    assert sequence(lr_scheduler="linear") == pytest.approx([1.0, 0.75, 0.5, 0.25])  # (S - i) / S
    # a share 0.3 of 4 steps -> ceil(1.2) = 2 warm-up steps: 0, 1/2, then constant (TRL's old warmup_ratio too)
    assert warmup_steps(TrainConfig(max_steps=4, warmup_steps=0.3)) == 2
    assert warmup_steps(TrainConfig.from_dict({"max_steps": 4, "warmup_ratio": 0.3})) == 2
    assert warmup_steps(TrainConfig(max_steps=4, warmup_steps=3)) == 3
    assert sequence(lr_scheduler="constant", warmup_steps=0.3) == pytest.approx([0.0, 0.5, 1.0, 1.0])


def test_accuracy_interval_is_wilsons():
    import torch

    # 3 of 4 known verdicts (one NaN left out): p = 0.75, z = 1.96, Wilson 95%: centre (p + z^2/2n) / (1 + z^2/n)
    # = 1.2302 / 1.9604 = 0.6275, half width z sqrt(p(1-p)/n + z^2/4n^2) / (1 + z^2/n) = 0.6408 / 1.9604 = 0.3269
    # -> [0.3006, 0.9544]
    share, lo, hi, n = accuracy_with_interval(torch.tensor([1.0, 1.0, float("nan"), 0.0, 1.0]))
    assert (share, n) == (0.75, 4)
    assert lo == pytest.approx(0.3006, abs=1e-4) and hi == pytest.approx(0.9544, abs=1e-4)


def test_eval_every_writes_held_out_accuracy_at_due_steps(tmp_path, caplog):
    # a new user waited 2 minutes on a silent evaluation: it logs a line when it starts and its accuracy when done
    with caplog.at_level("INFO", logger="grpo_lens.train.evaluate"):
        run = loop.train(
            config(
                tmp_path / "eval",
                max_steps=3,
                eval_every=2,
                eval_prompts=4,
                eval_samples=2,
                lr_scheduler="constant",
                warmup_steps=0,
                task_options={"max_operand": 3},
            )
        )
    said = [r.getMessage() for r in caplog.records if r.name == "grpo_lens.train.evaluate"]
    assert [m.split(":")[0] for m in said] == ["step 2", "step 2", "step 3", "step 3"]
    assert "evaluating the policy on 4 held-out prompts" in said[0] and "held-out greedy accuracy" in said[1]
    records = [r for r in run.read_metrics() if mk.STEP in r]
    assert [r[mk.STEP] for r in records if mk.EVAL_GREEDY_ACCURACY in r] == [2, 3]  # every 2nd step and the last
    for r in records[1:]:
        assert r[mk.EVAL_PROMPTS] == 4
        for mid, lo, hi in (
            (mk.EVAL_GREEDY_ACCURACY, mk.EVAL_GREEDY_ACCURACY_LO, mk.EVAL_GREEDY_ACCURACY_HI),
            (mk.EVAL_SAMPLED_ACCURACY, mk.EVAL_SAMPLED_ACCURACY_LO, mk.EVAL_SAMPLED_ACCURACY_HI),
        ):
            assert 0 <= r[lo] <= r[mid] <= r[hi] <= 1 and r[hi] - r[lo] > 0.2  # 4 or 8 verdicts: a wide interval


def test_eval_split_must_exist(tmp_path):
    with pytest.raises(ValueError, match="valid splits"):
        loop.train(config(tmp_path / "bad", eval_every=1, eval_split="validation"))
    assert not (tmp_path / "bad").exists(), "checked before --out is written"


def test_no_progress_prints_one_compact_line_per_step():
    line = loop.step_line(
        {mk.STEP: 3, mk.REWARD_MEAN: 0.25, mk.LR: 5e-6, mk.PERF_STEP_SECONDS: 3.21, mk.EVAL_GREEDY_ACCURACY: 0.5}, 30
    )
    assert line == "step 3/30  reward 0.250  lr 5.00e-06  eval greedy 0.500  s 3.2"
