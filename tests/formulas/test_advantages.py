"""Closed-form checks of the advantage estimators (docs/theory.md §2)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_lens.formulas.advantages import (
    ADVANTAGE_ESTIMATORS,
    BATCH_ESTIMATORS,
    UNCENTRED_ESTIMATORS,
    ZERO_SUM_ESTIMATORS,
    advantage_bound,
    compute_advantages,
)

EPS = 1e-4


def test_grpo_sample_std_two_of_four():
    # r = [1,0,0,1]: mean 0.5, deviations ±0.5, sum of squares 1.
    # sample std = sqrt(1/3) = 0.57735; A = ±0.5 / (0.57735 + 1e-4) = ±0.86588.
    adv = compute_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), "grpo", std="sample", std_eps=EPS)
    expected = 0.5 / (1 / math.sqrt(3) + EPS)
    assert expected == pytest.approx(0.86588, abs=1e-5)
    torch.testing.assert_close(adv, torch.tensor([[expected, -expected, -expected, expected]]), rtol=0, atol=1e-6)


def test_grpo_population_std_two_of_four():
    # population std = sqrt(1/4) = 0.5; A = ±0.5 / (0.5 + 1e-4) = ±0.99980.
    adv = compute_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), "grpo", std="population", std_eps=EPS)
    e = 0.5 / (0.5 + EPS)
    torch.testing.assert_close(adv, torch.tensor([[e, -e, -e, e]]), rtol=0, atol=1e-6)


def test_dr_grpo_and_rloo_two_of_four():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    # dr_grpo: r - mean = ±0.5.
    torch.testing.assert_close(compute_advantages(r, "dr_grpo"), torch.tensor([[0.5, -0.5, -0.5, 0.5]]))
    # rloo: r_1 - mean(0,0,1) = 1 - 1/3 = 2/3; r_2 - mean(1,0,1) = -2/3.
    t = 2.0 / 3.0
    torch.testing.assert_close(compute_advantages(r, "rloo"), torch.tensor([[t, -t, -t, t]]))


def test_two_rollouts_zero_one():
    # r = [0, 1]: deviations ±0.5. Sample std = sqrt(0.5/1) = 0.7071 -> A = ±0.5/0.7072 = ±0.7070.
    # Population std = 0.5 -> A = ±0.5/0.5001 = ±0.9998 (≈ ±1).
    r = torch.tensor([[0.0, 1.0]])
    s = compute_advantages(r, "grpo", std="sample", std_eps=EPS)
    p = compute_advantages(r, "grpo", std="population", std_eps=EPS)
    es = 0.5 / (math.sqrt(0.5) + EPS)
    ep = 0.5 / (0.5 + EPS)
    torch.testing.assert_close(s, torch.tensor([[-es, es]]), rtol=0, atol=1e-6)
    torch.testing.assert_close(p, torch.tensor([[-ep, ep]]), rtol=0, atol=1e-6)
    assert es == pytest.approx(0.7070, abs=1e-4) and ep == pytest.approx(1.0, abs=2e-4)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "optimal", "grpo_batch", "reinforce_pp_baseline"])
@pytest.mark.parametrize("value", [0.35, 1.0, 0.0, -2.7, 1e-7, 0.1 + 0.2])
def test_all_equal_rewards_give_exact_zero(estimator, value):
    # 0.35 is not representable in fp32; its mean over 7 copies need not equal it bit for bit, but a group without
    # contrast must get exactly 0 (no NaN, no rounding noise divided by eps).
    r = torch.full((3, 7), value, dtype=torch.float32)
    adv = compute_advantages(r, estimator, grad_sq_norms=torch.rand(3, 7) + 0.1)
    assert torch.equal(adv, torch.zeros_like(r))


@pytest.mark.parametrize("std", ["sample", "population"])
def test_near_equal_rewards_stay_bounded(std):
    # Rewards differing by 1e-7 in fp64: std ~ 1e-7 << eps, so A ~ 1e-7/1e-4 = 1e-3, and never above the bound
    # (n-1)/sqrt(n) = 7/sqrt(8) = 2.47 (sample) or sqrt(7) = 2.65 (population).
    r = torch.tensor([[0.5] * 7 + [0.5 + 1e-7]], dtype=torch.float64)
    adv = compute_advantages(r, "grpo", std=std, std_eps=EPS)
    assert torch.isfinite(adv).all()
    assert adv.abs().max() < 1e-2
    # Large contrast with a tiny eps: the bound still holds (one outlier reaches it asymptotically).
    r = torch.tensor([[0.0] * 7 + [1.0]])
    adv = compute_advantages(r, "grpo", std=std, std_eps=1e-12)
    bound = advantage_bound(8, std)
    assert adv.abs().max() <= bound + 1e-6
    assert adv.abs().max() == pytest.approx(bound, rel=1e-5)


def test_masked_rollout_is_left_out():
    # r = [100, 1], only the second valid: it is alone in its group -> 0, not (1 - 50.5)/std = -49.5/...
    r = torch.tensor([[100.0, 1.0]])
    m = torch.tensor([[False, True]])
    for est in ["grpo", "dr_grpo", "rloo"]:
        assert torch.equal(compute_advantages(r, est, mask=m), torch.zeros(1, 2))


def test_mask_excludes_from_mean_and_std():
    # r = [1, 0, NaN, 1] with the NaN invalid: valid rewards [1, 0, 1], mean 2/3, deviations [1/3, -2/3, 1/3];
    # sample var = (1/9 + 4/9 + 1/9)/2 = 1/3. A = dev / (sqrt(1/3) + eps); the invalid one gets 0.
    r = torch.tensor([[1.0, 0.0, float("nan"), 1.0]])
    adv = compute_advantages(r, "grpo", std_eps=EPS)  # default mask = finite rewards
    s = math.sqrt(1 / 3) + EPS
    torch.testing.assert_close(adv, torch.tensor([[1 / 3 / s, -2 / 3 / s, 0.0, 1 / 3 / s]]), rtol=0, atol=1e-6)


def test_reinforce_is_raw_reward():
    r = torch.tensor([[1.0, 1.0], [0.0, 2.0]])
    torch.testing.assert_close(compute_advantages(r, "reinforce"), r)


def test_optimal_baseline_leave_one_out():
    # r = [1, 0, 1], ||g||^2 = [1, 2, 3].
    # b*_{-0} = (2*0 + 3*1)/(2+3) = 0.6 -> A_0 = 0.4;  b*_{-1} = (1 + 3)/4 = 1 -> A_1 = -1;
    # b*_{-2} = (1*1 + 2*0)/3 = 1/3 -> A_2 = 2/3.
    r = torch.tensor([[1.0, 0.0, 1.0]], dtype=torch.float64)
    w = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64)
    adv = compute_advantages(r, "optimal", grad_sq_norms=w)
    torch.testing.assert_close(adv, torch.tensor([[0.4, -1.0, 2 / 3]], dtype=torch.float64))
    # With equal norms b*_{-i} is the leave-one-out mean, so the estimator is exactly rloo.
    same = compute_advantages(r, "optimal", grad_sq_norms=torch.ones_like(r))
    torch.testing.assert_close(same, compute_advantages(r, "rloo"))


def test_optimal_needs_norms():
    with pytest.raises(ValueError, match="grad_sq_norms"):
        compute_advantages(torch.tensor([[1.0, 0.0]]), "optimal")


def test_unknown_names_list_valid_ones():
    with pytest.raises(ValueError, match="dr_grpo, grpo, grpo_batch, optimal, reinforce, reinforce_pp, "):
        compute_advantages(torch.zeros(1, 2), "ppo")
    with pytest.raises(ValueError, match="population"):
        compute_advantages(torch.zeros(1, 2), std="unbiased")
    with pytest.raises(ValueError, match="eps"):
        compute_advantages(torch.zeros(1, 2), std_eps=0.0)
    with pytest.raises(ValueError, match=r"\[B, R\]"):
        compute_advantages(torch.zeros(4))


def test_registry_names():
    assert ADVANTAGE_ESTIMATORS.names() == [
        "dr_grpo",
        "grpo",
        "grpo_batch",
        "optimal",
        "reinforce",
        "reinforce_pp",
        "reinforce_pp_baseline",
        "rloo",
    ]
    assert set(BATCH_ESTIMATORS) | set(UNCENTRED_ESTIMATORS) <= set(ADVANTAGE_ESTIMATORS.names())


# One mixed group (1 of 4 right) and one without contrast (all right): 8 rewards, 5 ones.
# Batch mean 5/8 = 0.625; sample variance (5 x 0.375^2 + 3 x 0.625^2) / 7 = 1.875 / 7, std 0.5175492; eps 1e-4.
BATCH_REWARDS = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
BATCH_STD = math.sqrt(1.875 / 7) + 1e-4


def test_grpo_batch_divides_by_the_batch_std():
    # TRL's scale_rewards="batch": (r - group mean) / (batch std + eps). Group 1: [0.75, -0.25 x 3] / 0.5176492;
    # group 2 has no contrast: exactly 0.
    adv = compute_advantages(BATCH_REWARDS, "grpo_batch")
    expected = torch.tensor([[0.75, -0.25, -0.25, -0.25], [0.0] * 4], dtype=torch.float64) / BATCH_STD
    torch.testing.assert_close(adv, expected, rtol=1e-12, atol=0)


def test_reinforce_pp_whitens_over_the_batch_without_a_group_baseline():
    # REINFORCE++: (r - 0.625) / 0.5176492: a right rollout 0.72443, a wrong one -1.20738, in either group; the
    # all-right group keeps 0.72443 on every rollout (no group baseline).
    adv = compute_advantages(BATCH_REWARDS, "reinforce_pp")
    torch.testing.assert_close(adv, (BATCH_REWARDS - 0.625) / BATCH_STD, rtol=1e-12, atol=0)
    assert float(adv[1, 0]) == pytest.approx(0.72443, abs=1e-5)


def test_reinforce_pp_baseline_whitens_the_group_centred_rewards():
    # x = r - group mean = [0.75, -0.25 x 3, 0 x 4]: batch mean 0, sample variance (0.5625 + 3 x 0.0625) / 7 =
    # 0.75 / 7, std 0.3273268; A = x / (0.3273268 + 1e-4).
    adv = compute_advantages(BATCH_REWARDS, "reinforce_pp_baseline")
    x = torch.tensor([[0.75, -0.25, -0.25, -0.25], [0.0] * 4], dtype=torch.float64)
    torch.testing.assert_close(adv, x / (math.sqrt(0.75 / 7) + 1e-4), rtol=1e-12, atol=0)


@settings(max_examples=60, deadline=None)
@given(
    b=st.integers(1, 4),
    r=st.integers(2, 9),
    seed=st.integers(0, 2**31 - 1),
    binary=st.booleans(),
    estimator=st.sampled_from(ZERO_SUM_ESTIMATORS),
    std=st.sampled_from(["sample", "population"]),
)
def test_zero_sum_property(b, r, seed, binary, estimator, std):
    g = torch.Generator().manual_seed(seed)
    rewards = (torch.rand(b, r, generator=g) > 0.5).double() if binary else torch.randn(b, r, generator=g).double()
    mask = torch.rand(b, r, generator=g) > 0.2
    adv = compute_advantages(rewards, estimator, std=std, mask=mask)
    torch.testing.assert_close(adv.sum(dim=1), torch.zeros(b, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.equal(adv[~mask], torch.zeros_like(adv[~mask]))


def _loop_rloo_and_optimal(rewards, valid, sq_norms):
    """Plain-loop references (verl's test_rloo_and_vectorized_equivalence): for each group and rollout, the mean of
    the other valid rewards, and the leave-one-out b* weighted by the other valid rollouts' squared norms."""
    b, r = rewards.shape
    rloo, opt = torch.zeros(b, r, dtype=torch.float64), torch.zeros(b, r, dtype=torch.float64)
    for g in range(b):
        for i in range(r):
            if not valid[g, i]:
                continue
            others = [j for j in range(r) if j != i and valid[g, j]]
            if not others:
                continue
            mean_others = sum(float(rewards[g, j]) for j in others) / len(others)
            w = sum(float(sq_norms[g, j]) for j in others)
            b_star = (sum(float(sq_norms[g, j] * rewards[g, j]) for j in others) / w) if w > 0 else mean_others
            rloo[g, i] = float(rewards[g, i]) - mean_others
            opt[g, i] = float(rewards[g, i]) - b_star
    return rloo, opt


def test_rloo_and_optimal_match_their_loop_references():
    # the vectorised leave-one-out baselines (formulas.advantages.rloo_baseline / loo_optimal_baseline, the bodies
    # both the estimators and formulas.baselines.BASELINES use) against per-rollout loops, with invalid rollouts,
    # constant groups and a group whose other norms are all zero
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(6, 5, generator=g, dtype=torch.float64).round(decimals=1)
    rewards[1] = 0.5  # constant group: A = 0
    valid = torch.rand(6, 5, generator=g) > 0.2
    valid[2] = torch.tensor([True, True, False, False, False])
    sq = torch.rand(6, 5, generator=g, dtype=torch.float64)
    sq[3, 1:] = 0.0  # rollout 0's others have no norm: b* falls back to their mean
    want_rloo, want_opt = _loop_rloo_and_optimal(rewards, valid, sq)
    constant = torch.tensor(
        [len({float(x) for x in rewards[b][valid[b]]}) <= 1 or int(valid[b].sum()) < 2 for b in range(6)]
    )
    want_rloo[constant], want_opt[constant] = 0.0, 0.0
    masked = torch.where(valid, rewards, torch.full_like(rewards, math.nan))
    torch.testing.assert_close(compute_advantages(masked, "rloo", mask=valid), want_rloo, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        compute_advantages(masked, "optimal", mask=valid, grad_sq_norms=sq), want_opt, rtol=1e-12, atol=1e-12
    )
    # RLOO's closed form n/(n-1) (r_i - mean r) is the same estimator
    n = valid.sum(1, keepdim=True).double()
    mean = torch.where(valid, rewards, 0.0).sum(1, keepdim=True) / n
    closed = torch.where(valid & ~constant.unsqueeze(1), n / (n - 1).clamp(min=1) * (rewards - mean), 0.0)
    torch.testing.assert_close(compute_advantages(masked, "rloo", mask=valid), closed, rtol=1e-12, atol=1e-12)
