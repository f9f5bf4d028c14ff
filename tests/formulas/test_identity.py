"""The rank-2 identity sum_i A_i g_i = c(k, R) (gbar_C - gbar_W) on real gradients of a tiny model (float32)."""

import math

import pytest
import torch
from references import gram_of
from transformers import LlamaConfig, LlamaForCausalLM

from grpo_lens.analysis.group import analyse_group
from grpo_lens.formulas.advantages import grpo_advantages
from grpo_lens.formulas.identity import (
    binary_group_std,
    identity_residual,
    rank2_constant,
    rank2_residual,
)
from grpo_lens.gradients.exact import exact_rollout_grads
from grpo_lens.gradients.sketch import sketch_rollout_grads
from grpo_lens.rollout import RolloutBatch

R = 4
REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])


def grpo_group_advantages(rewards, std="sample", std_eps=1e-4):
    """The product's grpo estimator on one group [R] (any std_eps >= 0; compute_advantages asks for std_eps > 0)."""
    r = rewards.double().view(1, -1)
    return grpo_advantages(r, torch.ones_like(r, dtype=torch.bool), std=std, std_eps=std_eps)[0].to(rewards.dtype)


def identity_residuals(grads, rewards, std="sample", std_eps=1e-4):
    """identity_residual (the body analyse_group reports) of every group [B] of a batch, in the gradients' dtype,
    with grpo's advantages and c; NaN for groups without a residual (k = 0 or k = R)."""
    b, r = rewards.shape
    out = torch.full((b,), math.nan, dtype=torch.float64)
    for j in range(b):
        k = int((rewards[j] == 1).sum())
        if 0 < k < r:
            g = grads[j * r : (j + 1) * r]
            adv = grpo_group_advantages(rewards[j], std, std_eps).to(g.dtype)
            out[j] = identity_residual(g @ g.T, rewards[j] == 1, adv, rank2_constant(k, r, std, std_eps))
    return out


@pytest.fixture(scope="module")
def grads():
    """Exact per-rollout gradients [12, P] of a float32 tiny Llama on 3 groups of R = 4 random rollouts."""
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=50,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(0)
    n, lp, t = 3 * R, 4, 5
    prompt_ids = torch.randint(1, 50, (3, lp), generator=g).repeat_interleave(R, 0)
    completion_ids = torch.randint(1, 50, (n, t), generator=g)
    completion_mask = torch.arange(t) < torch.randint(2, t + 1, (n, 1), generator=g)
    batch = RolloutBatch(
        prompt_ids,
        torch.ones(n, lp, dtype=torch.long),
        completion_ids,
        completion_mask,
        torch.zeros(n, t),
        torch.zeros(n, dtype=torch.bool),
        R,
    )
    return model, batch, exact_rollout_grads(model, batch)


def test_constants_closed_form():
    # k = 1, R = 4: population std sqrt(3)/4, sample std sqrt(3/12) = 1/2;
    # c = (k(R-k)/R) / std = (3/4) / std -> sqrt(3) (population), 3/2 = sqrt(3 * 3 / 4) (sample).
    assert binary_group_std(1, 4, "population") == pytest.approx(math.sqrt(3) / 4)
    assert binary_group_std(1, 4, "sample") == pytest.approx(0.5)
    assert rank2_constant(1, 4, "population") == pytest.approx(math.sqrt(3))
    assert rank2_constant(1, 4, "sample") == pytest.approx(1.5)
    assert rank2_constant(2, 4, "sample") == pytest.approx(math.sqrt(2 * 2 * 3 / 4))
    # eps scales c by std / (std + eps)
    assert rank2_constant(1, 4, "sample", std_eps=0.5) == pytest.approx(1.5 * 0.5 / 1.0)
    # advantages of [1, 0, 0, 0], sample std 1/2, eps 0: (3/4, -1/4, -1/4, -1/4) / (1/2)
    torch.testing.assert_close(
        grpo_group_advantages(torch.tensor([1.0, 0, 0, 0]), "sample", std_eps=0.0),
        torch.tensor([1.5, -0.5, -0.5, -0.5]),
    )


@pytest.mark.parametrize("std", ["sample", "population"])
@pytest.mark.parametrize("eps", [0.0, 1e-4])
def test_identity_holds_to_float32_precision(grads, std, eps):
    _, _, g = grads
    res = identity_residuals(g, REWARDS, std=std, std_eps=eps)
    assert res.shape == (3,)
    assert bool((res[:2] <= 1e-5).all()), res
    assert math.isnan(res[2])  # k = 0: no identity, no policy gradient
    # the 0.1 entry point and the per-group analysis report the same residual
    for j in range(2):
        adv = grpo_group_advantages(REWARDS[j], std, eps)
        assert rank2_residual(g[j * R : (j + 1) * R], REWARDS[j], std=std, std_eps=eps) == pytest.approx(
            float(res[j]), rel=1e-6, abs=1e-9
        )
        row = analyse_group(gram_of(g[j * R : (j + 1) * R]), REWARDS[j], adv, estimator="grpo", std=std, std_eps=eps)
        assert row["grad/identity_residual"] <= 1e-5  # analyse_group works in float64
    assert "grad/identity_residual" not in analyse_group(
        gram_of(g[2 * R :]), REWARDS[2], grpo_group_advantages(REWARDS[2])
    )


def test_identity_holds_for_sketches(grads):
    model, batch, _ = grads
    sk = sketch_rollout_grads(model, batch, sketch_in=8, sketch_out=8).sketch  # sketches are linear in g
    assert bool((identity_residuals(sk, REWARDS)[:2] <= 1e-5).all())


def test_wrong_convention_leaves_a_large_residual(grads):
    # Advantages with the population std (eps 0) but c of the sample std: the left side is c_pop (gC - gW),
    # the right c_samp (gC - gW), so the residual is 1 - c_samp/c_pop = 1 - sqrt((R-1)/R) = 0.1340 for R = 4.
    _, _, g = grads
    rewards = REWARDS[0]
    adv = grpo_group_advantages(rewards, "population", std_eps=0.0)
    res = rank2_residual(g[:R], rewards, std="sample", std_eps=0.0, advantages=adv)
    assert res == pytest.approx(1 - math.sqrt(3 / 4), abs=1e-5)
    assert res > 1e3 * 1e-5


def test_input_errors():
    g = torch.randn(4, 3)
    with pytest.raises(ValueError, match="0/1"):
        rank2_residual(g, torch.tensor([1.0, 0.5, 0.0, 0.0]))
    with pytest.raises(ValueError, match="0 < k < R"):
        rank2_residual(g, torch.ones(4))
    with pytest.raises(ValueError, match="population, sample"):
        rank2_constant(1, 4, "unbiased")
