"""S1-S4 against closed-form values."""

import math

import pytest
import torch

from grpo_lens.train.sparsity import Bf16UpdateTracker
from grpo_lens.formulas.sparsity import bf16_unchanged_fraction, hoyer_sparsity, predicted_zero_variance_fraction, predicted_zero_variance_fraction_from_rewards, s1_metrics, small_entry_share, zero_variance_fraction, zero_variance_groups


def test_s1_measured_and_predicted():
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]])
    assert zero_variance_groups(rewards).tolist() == [True, False, True]
    assert zero_variance_fraction(rewards) == pytest.approx(2 / 3)
    # invalid rollouts are ignored: group 1 keeps only its 0 -> fewer than 2 valid -> zero variance
    mask = torch.tensor([[True, True], [True, False], [True, True]])
    assert zero_variance_fraction(rewards, mask) == 1.0
    # p = 0.5, R = 2: 0.25 + 0.25 = 0.5;  p = 0.1, R = 8: 0.1^8 + 0.9^8 = 0.43046731
    assert predicted_zero_variance_fraction(torch.tensor([0.5]), 2) == pytest.approx(0.5)
    assert predicted_zero_variance_fraction(torch.tensor([0.1]), 8) == pytest.approx(0.1**8 + 0.9**8)
    assert predicted_zero_variance_fraction(torch.tensor([0.0, 1.0, 0.5]), 2) == pytest.approx((1 + 1 + 0.5) / 3)
    # plug-in from the rewards above: p = (1, 0.5, 0) -> (1 + 0.5 + 1) / 3
    assert predicted_zero_variance_fraction_from_rewards(rewards) == pytest.approx(2.5 / 3)
    assert s1_metrics(rewards, torch.tensor([0.5, 0.5, 0.5])) == {
        "sparsity/zero_var_frac": pytest.approx(2 / 3), "sparsity/zero_var_pred": pytest.approx(0.5)}
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        predicted_zero_variance_fraction(torch.tensor([1.5]), 2)


def test_s2_small_entry_share():
    g = torch.tensor([10.0, -5.0, 0.01, 0.0, -0.001])
    # tau = 1e-3 -> threshold 0.01: entries 0.01, 0, 0.001 count -> 3/5
    assert small_entry_share(g, 1e-3) == pytest.approx(3 / 5)
    assert small_entry_share([g[:2], g[2:]], 0.6) == pytest.approx(4 / 5)  # threshold 6: all but 10
    assert small_entry_share(torch.zeros(7)) == 1.0


def test_s3_hoyer_closed_form():
    one_hot = torch.zeros(100)
    one_hot[3] = -2.0
    assert hoyer_sparsity(one_hot) == pytest.approx(1.0)
    assert hoyer_sparsity(torch.full((100,), 0.3) * torch.tensor([1.0, -1.0]).repeat(50)) == pytest.approx(0.0, abs=1e-12)
    # (1, 1, 0, 0): l1/l2 = 2/sqrt(2) = sqrt(2), n = 4 -> (2 - sqrt(2)) / (2 - 1) = 0.585786...
    assert hoyer_sparsity(torch.tensor([1.0, 1.0, 0.0, 0.0])) == pytest.approx(2 - math.sqrt(2))
    assert hoyer_sparsity(torch.zeros(5)) == 1.0
    with pytest.raises(ValueError, match="at least 2"):
        hoyer_sparsity(torch.ones(1))


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
