"""S1-S4 against closed-form values."""

import math

import pytest
import torch
from references import small_entry_share

from grpo_lens.formulas.advantages import constant_groups
from grpo_lens.formulas.sparsity import (
    bf16_unchanged_fraction,
    predicted_zero_variance_fraction,
    weighted_hoyer,
    zero_share,
)
from grpo_lens.lens.sparsity import Bf16UpdateTracker
from grpo_lens.train.step_metrics import reward_metrics


def s1_measured(rewards, mask=None):
    """S1 as the trainer prints it (``reward/frac_zero_std_groups``) for rewards [B, R] and a validity mask."""
    valid = torch.ones_like(rewards, dtype=torch.bool) if mask is None else mask
    flat = torch.where(valid, rewards, torch.full_like(rewards, math.nan)).reshape(-1)
    return reward_metrics(flat, valid.reshape(-1), rewards.shape[1])["reward/frac_zero_std_groups"]


def test_s1_measured_and_predicted():
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]])
    ones = torch.ones_like(rewards, dtype=torch.bool)
    assert constant_groups(rewards, ones).tolist() == [True, False, True]
    assert s1_measured(rewards) == pytest.approx(2 / 3)
    # invalid rollouts are ignored: group 1 keeps only its 0 -> fewer than 2 valid -> zero variance
    mask = torch.tensor([[True, True], [True, False], [True, True]])
    assert s1_measured(rewards, mask) == 1.0
    # p = 0.5, R = 2: 0.25 + 0.25 = 0.5;  p = 0.1, R = 8: 0.1^8 + 0.9^8 = 0.43046731
    assert predicted_zero_variance_fraction(torch.tensor([0.5]), 2) == pytest.approx(0.5)
    assert predicted_zero_variance_fraction(torch.tensor([0.1]), 8) == pytest.approx(0.1**8 + 0.9**8)
    assert predicted_zero_variance_fraction(torch.tensor([0.0, 1.0, 0.5]), 2) == pytest.approx((1 + 1 + 0.5) / 3)
    # plug-in from the rewards above: p = (1, 0.5, 0) -> (1 + 0.5 + 1) / 3
    plug_in = (rewards > 0.5).double().mean(1)
    assert predicted_zero_variance_fraction(plug_in, 2) == pytest.approx(2.5 / 3)
    # measured on the rewards, predicted from known success rates
    assert {
        "measured": s1_measured(rewards),
        "predicted": predicted_zero_variance_fraction(torch.tensor([0.5, 0.5, 0.5]), rewards.shape[1]),
    } == {"measured": pytest.approx(2 / 3), "predicted": pytest.approx(0.5)}
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        predicted_zero_variance_fraction(torch.tensor([1.5]), 2)


def test_s2_small_entry_share():
    # the theory's S2 (tests/references.py; the tool prints its tau = 0 case, zero_share)
    g = torch.tensor([10.0, -5.0, 0.01, 0.0, -0.001])
    # tau = 1e-3 -> threshold 0.01: entries 0.01, 0, 0.001 count -> 3/5
    assert small_entry_share(g, 1e-3) == pytest.approx(3 / 5)
    assert small_entry_share([g[:2], g[2:]], 0.6) == pytest.approx(4 / 5)  # threshold 6: all but 10
    assert small_entry_share(torch.zeros(7)) == 1.0
    # agreement with the product at tau = 0: one exact zero of five
    assert small_entry_share(g, 0.0) == zero_share(g) == pytest.approx(1 / 5)


def test_s3_hoyer_closed_form():
    # the product's body, weighted_hoyer, with unit weights (the reference hoyer_sparsity: tests/references.py)
    one_hot = torch.zeros(100)
    one_hot[3] = -2.0
    assert weighted_hoyer(one_hot) == pytest.approx(1.0)
    assert weighted_hoyer(torch.full((100,), 0.3) * torch.tensor([1.0, -1.0]).repeat(50)) == pytest.approx(
        0.0, abs=1e-12
    )
    # (1, 1, 0, 0): l1/l2 = 2/sqrt(2) = sqrt(2), n = 4 -> (2 - sqrt(2)) / (2 - 1) = 0.585786...
    assert weighted_hoyer(torch.tensor([1.0, 1.0, 0.0, 0.0])) == pytest.approx(2 - math.sqrt(2))
    assert math.isnan(weighted_hoyer(torch.zeros(5)))  # 0/0: a zero vector has no sparsity to read (was 1.0)
    with pytest.raises(ValueError, match="at least 2"):
        weighted_hoyer(torch.ones(1))


def test_s4_bf16_update_tracker():
    # bf16 keeps 8 significant bits: around 1.0 its spacing is 2^-7 = 0.0078, so +1e-4 does not change the bf16
    # value while +0.1 does.
    lin = torch.nn.Linear(4, 2, bias=False)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    tracker = Bf16UpdateTracker(lin, device="cpu")
    assert tracker.num_params == 8
    with torch.no_grad():
        lin.weight += 1e-4  # below bf16 resolution
        lin.weight[0, 0] += 0.1  # one visible change
    step1 = tracker.update()
    assert step1 == {"sparsity/update_step": pytest.approx(7 / 8), "sparsity/update_total": pytest.approx(7 / 8)}
    with torch.no_grad():
        lin.weight[1, 0] += 0.1
    step2 = tracker.update()
    # since the previous snapshot only [1, 0] moved; since the start [0, 0] and [1, 0]
    assert step2 == {"sparsity/update_step": pytest.approx(7 / 8), "sparsity/update_total": pytest.approx(6 / 8)}
    assert bf16_unchanged_fraction([torch.ones(3)], [torch.tensor([1.0, 1.001, 2.0])]) == pytest.approx(2 / 3)
