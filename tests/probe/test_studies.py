"""Probe-side studies end to end on the tiny model (random policy, parity reward: groups are mixed)."""

import json
import math

import pytest
import torch

from grpo_lens.probe.studies import (
    BaselineStudySettings,
    CreditStudySettings,
    run_baseline_study,
    run_credit_study,
    s1_measured_and_predicted,
)


@pytest.fixture(scope="module")
def setup():
    from grpo_lens.models import build_tiny_model
    from grpo_lens.rewards import parse_reward_specs
    from grpo_lens.tasks import get_task

    model, tok = build_tiny_model(seed=0)
    return model, tok, get_task("arithmetic"), parse_reward_specs(["test_parity"])


def test_s1_measured_and_predicted_closed_form():
    # prompt 0: group (1, 1) all equal; others (1, 0, 1, 1): k' = 3 of M' = 4, R = 2: [C(3,2) + C(1,2)] / C(4,2) = 1/2
    # prompt 1: group (1, 0) mixed; others all 0: prediction 1
    correct = torch.tensor([[1, 1, 1, 0, 1, 1], [1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    out = s1_measured_and_predicted(correct, torch.ones(2, 6, dtype=torch.bool), 2)
    assert out["measured"]["mean"] == pytest.approx(0.5)
    assert out["predicted"]["mean"] == pytest.approx(0.75)
    assert out["difference"]["mean"] == pytest.approx(-0.25)
    with pytest.raises(ValueError, match="M >= 2R"):
        s1_measured_and_predicted(correct[:, :3], torch.ones(2, 3, dtype=torch.bool), 2)


@pytest.mark.e2e
def test_baseline_study_runs_and_is_json(setup):
    model, tok, task, rewards = setup
    out = run_baseline_study(
        model,
        tok,
        task,
        rewards,
        BaselineStudySettings(
            group_size=2, prompts=3, max_prompts=6, max_new_tokens=6, sketch_dim=4, resamples=64, temperature=1.0
        ),
    )
    json.dumps(out)  # probe.json stores it as is
    assert out["meta"]["rollouts_per_prompt"] == 8 and out["baselines"]["prompts"] == 3
    s = out["baselines"]["summary"]
    assert s["rloo"]["mse_ratio_to_rloo"]["mean"] == pytest.approx(1.0)
    assert s["mean_rescaled"]["mse_ratio_to_rloo"]["mean"] == pytest.approx(1.0, abs=1e-9)
    assert 0 <= out["s1"]["measured"]["mean"] <= 1 and out["s1"]["prompts"] >= 3


@pytest.mark.e2e
def test_credit_study_runs_and_is_json(setup):
    model, tok, task, rewards = setup
    out = run_credit_study(
        model,
        tok,
        task,
        rewards,
        CreditStudySettings(
            group_size=2, groups=2, mc_groups=1, mc_samples=2, segments=2, max_new_tokens=6, temperature=1.0, bins=4
        ),
    )
    json.dumps(out)
    c = out["contributions"]
    assert c["groups"] == 2 and len(c["position_profile"]) == 4
    assert c["closure"] < 1e-2  # the shares of each group sum to 1 (float32 model: finite-difference error)
    # the profile bins of a group sum to its total share 1, so the bin means sum to 1 too
    assert sum(b["mean"] for b in c["position_profile"]) == pytest.approx(1.0, abs=2e-2)
    # the NLL control on the same tokens: class shares of its update sum to 1 too, so its ratios weighted by the token
    # shares sum to 1 (per group; 2 groups give means, no interval), and the paired difference is A's minus NLL's
    nll = c["classes_nll"]
    assert set(nll) == {"answer", "format", "reasoning"}
    assert all(set(v) == {"ratio", "ratio_minus_nll"} and v["ratio"]["n"] <= 2 for v in nll.values())
    measured = [k for k in nll if nll[k]["ratio"]["n"] == 2 and c["classes"][k]["ratio"]["n"] == 2]
    for k in measured:
        assert nll[k]["ratio_minus_nll"]["mean"] == pytest.approx(
            c["classes"][k]["ratio"]["mean"] - nll[k]["ratio"]["mean"], abs=1e-9
        )
    assert len(out["monte_carlo"]["rollouts"]) == 2
    row = out["monte_carlo"]["rollouts"][0]
    assert math.isclose(sum(row["advantages"]), row["reward"] - row["values"][0], abs_tol=1e-9)  # telescopes
