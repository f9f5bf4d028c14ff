"""The exact gradient noise scale at lens steps, dead-group accounting on every step and the opt-in
stop after steps without a mixed group (docs/theory.md §Noise scale and dead groups)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from grpo_lens.rewards import REWARDS
from grpo_lens.train.step_metrics import dead_group_metrics
from tests.train.test_trainer import tiny_config


def zero_reward(prompts, completions, **kwargs):
    """0.0 for every completion: every group is all wrong, none has reward contrast."""
    return [0.0 for _ in completions]


if "test_zero" not in REWARDS:
    REWARDS.register("test_zero")(zero_reward)


def test_dead_group_metrics_split_and_dilution():
    # B = 4 groups of R = 2: all correct, all wrong, all 0.5 (other), mixed; advantages 0 in the first three.
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.5, 0.5, 1.0, 0.0])
    valid = torch.ones(8, dtype=torch.bool)
    adv = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.7, -0.7])
    lengths = torch.tensor([1, 2, 3, 4, 1, 1, 5, 3])
    mask = torch.arange(6).unsqueeze(0) < lengths.unsqueeze(1)  # [8, 6]
    out = dead_group_metrics(rewards, valid, adv, mask, "token-mean", 6, 2)
    assert out["dead/all_correct_groups"] == 1 and out["dead/all_wrong_groups"] == 1
    assert out["dead/all_equal_other_groups"] == 1 and out["dead/mixed_groups"] == 1
    # token-mean: the dead groups hold 1+2+3+4+1+1 = 12 of the 20 completion tokens
    assert out["dead/normalizer_share"] == pytest.approx(12 / 20, abs=1e-12)
    # per sequence (seq-mean-token-mean, and seq-mean-token-sum-norm with its constant T_max): 6 of 8 rollouts
    for agg in ("seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert dead_group_metrics(rewards, valid, adv, mask, agg, 6, 2)["dead/normalizer_share"] == 0.75


def _records(run) -> list[dict]:
    return [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.e2e
def test_lens_noise_scale_own_pass_equals_the_update_norm_route(tmp_path):
    """A lens step's noise scale from the full Gram of the lens's own exact pass (S = sum of the group Gram) equals
    the one from the Gram read off the update's backward (S = the update's first gradient norm squared): the same
    |sum_b G_b|^2 by two routes, to float32 rounding of two backward paths. verl's proxy, taken before the update on
    the fused route, agrees too: both are at the step's starting weights."""
    from grpo_lens.train.loop import train

    runs = {}
    for fused in (False, True):
        cfg = tiny_config(
            tmp_path / f"f{fused}",
            lens_every=1,
            max_steps=2,
            gram_source="exact",
            prompts_per_step=3,
            lens_from_update=fused,
            lens_noise_proxy=True,
            checkpoint_every=10,
        )
        runs[fused] = _records(train(cfg))
    compared = 0
    for own, fused in zip(runs[False], runs[True]):
        for rec in (own, fused):  # every step: the dead-group split covers the B = 3 groups
            split = (
                "dead/all_correct_groups",
                "dead/all_wrong_groups",
                "dead/all_equal_other_groups",
                "dead/mixed_groups",
            )
            assert sum(rec[k] for k in split) == 3
        if own["rank/mixed_groups"] < 1:
            continue
        assert own["noise/groups"] == fused["noise/groups"] == 3
        assert own["noise/from_update"] == 0 and fused["noise/from_update"] == 1
        assert "noise/grad_sq_p" in own and "noise/grad_sq_p" not in fused
        for key in ("noise/grad_sq", "noise/trace_sigma"):
            assert fused[key] == pytest.approx(own[key], rel=1e-3, abs=1e-9), key
            compared += 1
        assert own["noise/trace_sigma"] > 0
        # verl's proxy at the step's weights on both routes (the fused one takes W_i before the update)
        for key in ("noise/proxy_total_power", "noise/exact_total_power", "noise/proxy_rank_corr"):
            assert fused[key] == pytest.approx(own[key], rel=1e-3, abs=1e-6), key
        assert own["noise/proxy_total_power"] > 0 and own["noise/exact_total_power"] > 0
        assert -1 <= own["noise/proxy_rank_corr"] <= 1
        if math.isfinite(own["noise/b_simple"]):
            assert own["noise/snr"] == pytest.approx(3 / own["noise/b_simple"], rel=1e-9)  # SNR = B / B_simple
    assert compared >= 2


@pytest.mark.e2e
def test_stop_after_dead_steps_records_and_resumes(tmp_path):
    """Every reward 0: no mixed group on any step. --stop-after-dead-steps 2 stops at step 2 with a checkpoint and
    RUN/stopped.json; a resume carries the count (2) on, so its first step (3) stops it again."""
    from grpo_lens.train.loop import train

    cfg = dict(rewards=["test_zero"], max_steps=6, stop_after_dead_steps=2, checkpoint_every=10)
    run = train(tiny_config(tmp_path, **cfg))
    recs = _records(run)
    assert [r["step"] for r in recs] == [1, 2]
    assert [r["dead/steps_without_mixed"] for r in recs] == [1, 2]
    assert all(r["dead/all_wrong_groups"] == 2 and r["dead/normalizer_share"] == 1.0 for r in recs)
    stopped = json.loads((run.path / "stopped.json").read_text())
    assert stopped["step"] == 2 and stopped["steps_without_mixed"] == 2
    assert (run.path / "checkpoints" / "step-000002").is_dir()
    run = train(tiny_config(tmp_path, resume=True, **cfg))
    recs = _records(run)
    assert [r["step"] for r in recs] == [1, 2, 3] and recs[-1]["dead/steps_without_mixed"] == 3
    assert json.loads((run.path / "stopped.json").read_text())["step"] == 3


def test_noise_metrics_routes_and_refusals():
    """TrainerLens.noise_metrics without a model: the full-Gram route, the update-norm route, and the cases it
    refuses (a group outside the Gram with a nonzero advantage, a sketched Gram, the own pass on 2 processes)."""
    from types import SimpleNamespace

    from grpo_lens.lens.trainer_lens import TrainerLens

    # G_b = e_b + (1, 1, 1): |G_b|^2 = 4 + 1 + 1 = 6, <G_b, G_c> = 2 + 2 + 1 = 5, so M = I + 5 (11^T): D = 18,
    # S = 9 * 5 + 3 = 48, B = 3
    g = torch.eye(3, dtype=torch.float64) + 1.0
    m = g @ g.T
    part = {"groups": 3, "sum_sq": float(m.diagonal().sum()), "m": m, "exact": True, "zero_rest": True}
    lens = SimpleNamespace(_grad_sq=None)
    full = TrainerLens.noise_metrics(lens, [part], from_update=False, seed=0)
    # |G|^2 = (S - D) / (B (B - 1)) = (48 - 18) / 6 = 5; tr(Sigma) = (D - S / B) / (B - 1) = (18 - 16) / 2 = 1
    assert full["noise/grad_sq"] == pytest.approx(5.0) and full["noise/trace_sigma"] == pytest.approx(1.0)
    assert full["noise/b_simple"] == pytest.approx(0.2) and full["noise/snr"] == pytest.approx(15.0)  # 3 / 0.2
    assert full["noise/from_update"] == 0.0 and "noise/grad_sq_lo" not in full  # 3 groups: no interval
    # the update route: D from the blocks, S from the update's own gradient norm squared
    lens = SimpleNamespace(_grad_sq=48.0)
    fused = TrainerLens.noise_metrics(lens, [{**part, "m": None}], from_update=True, seed=0)
    assert fused["noise/grad_sq"] == pytest.approx(5.0) and fused["noise/from_update"] == 1.0
    assert TrainerLens.noise_metrics(SimpleNamespace(_grad_sq=None), [part], from_update=True, seed=0) == {}
    for bad in ({"zero_rest": False}, {"exact": False}):
        assert TrainerLens.noise_metrics(lens, [{**part, **bad}], from_update=False, seed=0) == {}
    assert TrainerLens.noise_metrics(lens, [part, part], from_update=False, seed=0) == {}  # cross blocks unknown
