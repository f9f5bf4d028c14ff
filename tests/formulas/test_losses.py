"""Closed-form checks of the clipped surrogate, KL estimators and loss aggregation (docs/theory.md §3)."""

import math

import pytest
import torch

from grpo_lens.formulas.losses import (
    LOSS_AGGREGATIONS,
    aggregate_loss,
    aggregation_rollout_weights,
    clipped_surrogate,
    grpo_loss,
    kl_penalty,
    loss_normalizer,
    rollout_gradient_weights,
)

MODES = LOSS_AGGREGATIONS.names()


def _lengths_mask(lengths, T):
    return torch.arange(T).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)


@pytest.mark.parametrize(
    "name,value,grad",
    [
        # logp = log 0.5, ref = log 0.25, x = ref - logp = -ln 2 = -0.693147.
        # k1 = -x = ln 2;            d k1 / d logp = k1 = ln 2: the score-function gradient of the KL
        # (differentiating k1 itself gave 1, whose on-policy expectation is 0).
        ("k1", math.log(2), math.log(2)),
        # k2 = x^2 / 2 = 0.240227;   d k2 / d logp = x * dx/dlogp = -x = ln 2.
        ("k2", math.log(2) ** 2 / 2, math.log(2)),
        # k3 = e^x - x - 1 = 0.5 + ln 2 - 1 = 0.193147;  d k3 / d logp = -(e^x - 1) = 1 - 0.5 = 0.5.
        ("k3", 0.5 + math.log(2) - 1.0, 0.5),
    ],
)
def test_kl_estimators_values_and_gradients(name, value, grad):
    logp = torch.tensor([[math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[math.log(0.25)]], dtype=torch.float64)
    kl = kl_penalty(logp, ref, name)
    (g,) = torch.autograd.grad(kl.sum(), logp)
    assert kl.item() == pytest.approx(value, abs=1e-12)
    assert g.item() == pytest.approx(grad, abs=1e-12)


def test_case5_k1_pulls_towards_the_reference():
    """Beta = 1, A = 0, one rollout of 20 tokens (seq-mean-token-mean, Z = 1), so dL/dlogp_t =
    (1/20) d k / d logp. pi_ref 0 nats away: 0 for every estimator; 3 nats below pi_theta (logp - ref = 3):
    k1 -> 3/20 = 0.15 (main: 0.05 at 0 and 3 nats alike), k2 -> 3/20 = 0.15, k3 -> (1 - e^-3)/20 = 0.04751."""
    want = {"k1": (0.0, 0.15), "k2": (0.0, 0.15), "k3": (0.0, (1 - math.exp(-3)) / 20)}
    mask = torch.ones(1, 20, dtype=torch.bool)
    for name, expected in want.items():
        for gap, g_want in zip((0.0, 3.0), expected):
            logp = torch.full((1, 20), -1.0, dtype=torch.float64, requires_grad=True)
            loss, _ = grpo_loss(
                logp,
                logp.detach(),
                torch.zeros(1),
                mask,
                normalizer=1.0,
                beta=1.0,
                ref_logp=logp.detach() - gap,
                kl_estimator=name,
            )
            (g,) = torch.autograd.grad(loss, logp)
            assert g[0, 0].item() == pytest.approx(g_want, abs=1e-12), (name, gap)


def test_case5_k1_expected_gradient_is_the_kl_gradient():
    """The constructed case: on a 5-token categorical pi_theta = softmax(theta), the on-policy expectation
    sum_a pi(a) grad k1(a) equals grad KL(pi_theta || pi_ref) computed exactly by autograd (differentiating k1
    itself gives sum_a pi(a) grad log pi(a) = 0)."""
    theta = torch.tensor([0.3, -1.0, 0.5, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.tensor([1.0, 0.0, -0.5, 0.2, 0.4], dtype=torch.float64), -1)
    logp = torch.log_softmax(theta, -1)
    exact = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), theta, retain_graph=True)[0]
    probs = logp.exp().detach()
    expected = torch.autograd.grad((probs * kl_penalty(logp.unsqueeze(0), ref.unsqueeze(0), "k1")[0]).sum(), theta)[0]
    torch.testing.assert_close(expected, exact, rtol=1e-12, atol=1e-14)
    assert exact.abs().max() > 0.1


def test_kl_estimators_are_zero_at_equality():
    x = torch.randn(3, 4)
    for name in ["k1", "k2", "k3"]:
        assert torch.equal(kl_penalty(x, x, name), torch.zeros_like(x))


def test_clipped_surrogate_closed_form():
    # A = +1: rho = 1.5 > 1 + 0.2 -> clipped, loss = -1.2.  rho = 0.5 -> min(0.5, 0.8) = 0.5, loss = -0.5.
    # A = -1: rho = 0.5 < 0.8 -> min(-0.5, -0.8) = -0.8, loss = 0.8.  rho = 1.5 -> min(-1.5, -1.2) -> loss = 1.5.
    logp = torch.log(torch.tensor([[1.5, 0.5], [0.5, 1.5]]))
    old = torch.zeros(2, 2)
    adv = torch.tensor([1.0, -1.0])
    loss, ratio = clipped_surrogate(logp, old, adv, 0.2, 0.2)
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -0.5], [0.8, 1.5]]))
    torch.testing.assert_close(ratio, torch.tensor([[1.5, 0.5], [0.5, 1.5]]))
    # Clip-higher (eps_high = 0.28): A = +1, rho = 1.5 -> clip at 1.28.
    loss, _ = clipped_surrogate(logp, old, adv, 0.2, 0.28)
    assert loss[0, 0].item() == pytest.approx(-1.28)
    # Dual clip c = 1.3: A = -1, rho = 1.5 gives 1.5 > 1.3 * 1 -> bounded to 1.3.
    loss, _ = clipped_surrogate(logp, old, adv, 0.2, 0.2, dual_clip=1.3)
    assert loss[1, 1].item() == pytest.approx(1.3)
    with pytest.raises(ValueError, match="dual_clip"):
        clipped_surrogate(logp, old, adv, dual_clip=0.9)


def test_on_policy_centred_loss_is_zero_but_gradient_is_not():
    # rho = exp(logp - logp.detach()) = 1, beta = 0, seq-mean-token-mean:
    # loss = -(1/N) sum_i A_i (1/|o_i|) sum_t 1 = -(1/N) sum_i A_i = 0 since A sums to 0.
    # grad = -(1/N) sum_i A_i (1/|o_i|) sum_t grad logp_{i,t}, which is not 0 for distinct rollouts.
    torch.manual_seed(0)
    logits = torch.randn(4, 5, 7, requires_grad=True)
    tokens = torch.randint(0, 7, (4, 5))
    logp = torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    mask = _lengths_mask([5, 3, 4, 2], 5)
    adv = torch.tensor([0.8660, -0.8660, 0.8660, -0.8660])
    norm = loss_normalizer(mask, "seq-mean-token-mean", 5)
    loss, metrics = grpo_loss(logp, logp.detach(), adv, mask, normalizer=norm)
    (g,) = torch.autograd.grad(loss, logits)
    assert abs(loss.item()) < 1e-7
    assert g.abs().max() > 1e-3
    assert metrics["clip/ratio_region"] == 0.0 and metrics["ratio/mean"] == pytest.approx(1.0)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("mode", MODES)
def test_zero_variance_group_moves_only_through_kl(mode, estimator):
    # A = 0 for every rollout (all-equal rewards): the surrogate -min(rho*0, clip(rho)*0) = 0 has zero gradient,
    # so grad loss = beta * grad(aggregated KL) exactly.
    torch.manual_seed(1)
    logits = torch.randn(3, 6, 11, requires_grad=True)
    tokens = torch.randint(0, 11, (3, 6))
    logp = torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    ref = logp.detach() + 0.3 * torch.randn(3, 6)
    old = logp.detach() + 0.1 * torch.randn(3, 6)  # off-policy too, so rho != 1
    mask = _lengths_mask([6, 2, 4], 6)
    beta = 0.04
    norm = loss_normalizer(mask, mode, 6)
    loss, _ = grpo_loss(
        logp,
        old,
        torch.zeros(3),
        mask,
        normalizer=norm,
        aggregation=mode,
        beta=beta,
        ref_logp=ref,
        kl_estimator=estimator,
    )
    (g,) = torch.autograd.grad(loss, logits, retain_graph=True)
    kl = aggregate_loss(kl_penalty(logp, ref, estimator), mask.float(), mode, norm)
    (g_kl,) = torch.autograd.grad(beta * kl, logits)
    torch.testing.assert_close(g, g_kl, rtol=0, atol=1e-7)
    assert g.abs().max() > 1e-5  # the KL term does move the policy


def test_aggregation_closed_form():
    # Two rollouts: lengths 2 and 1 (T = 3), per-token loss l = [[1, 3, x], [5, x, x]].
    # seq-mean-token-mean = (1/2) * ((1+3)/2 + 5/1) = 3.5.   token-mean = (1+3+5)/3 = 3.
    # seq-mean-token-sum-norm with T_max = 4: (1+3+5)/(2*4) = 1.125.
    loss = torch.tensor([[1.0, 3.0, 100.0], [5.0, 100.0, 100.0]])
    mask = _lengths_mask([2, 1], 3)
    expect = {"seq-mean-token-mean": 3.5, "token-mean": 3.0, "seq-mean-token-sum-norm": 1.125}
    for mode, value in expect.items():
        norm = loss_normalizer(mask, mode, 4)
        assert aggregate_loss(loss, mask.float(), mode, norm).item() == pytest.approx(value)


@pytest.mark.parametrize("mode", MODES)
def test_micro_batch_invariance(mode):
    # Split 6 rollouts of unequal lengths into micro-batches of 1, 2 and 3 rollouts: with the normaliser fixed on the
    # whole batch, the summed micro-batch losses and gradients equal the whole batch's. A naive per-micro-batch
    # token-mean (dividing by the micro-batch's own token count) would fail this for token-mean.
    torch.manual_seed(2)
    N, T, V = 6, 7, 5
    logits = torch.randn(N, T, V, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, V, (N, T))
    mask = _lengths_mask([7, 1, 3, 6, 2, 5], T)
    adv = torch.randn(N, dtype=torch.float64)
    old = torch.randn(N, T, dtype=torch.float64) * 0.1 - 1.6
    ref = torch.randn(N, T, dtype=torch.float64) * 0.1 - 1.6
    norm = loss_normalizer(mask, mode, T)

    def loss_of(idx):
        logp = torch.log_softmax(logits[idx], -1).gather(-1, tokens[idx].unsqueeze(-1)).squeeze(-1)
        loss, _ = grpo_loss(
            logp, old[idx], adv[idx], mask[idx], normalizer=norm, aggregation=mode, beta=0.1, ref_logp=ref[idx]
        )
        return loss

    whole = loss_of(torch.arange(N))
    (g_whole,) = torch.autograd.grad(whole, logits)
    parts = [torch.tensor([0]), torch.tensor([1, 2]), torch.tensor([3, 4, 5])]
    total = sum(loss_of(p) for p in parts)
    (g_parts,) = torch.autograd.grad(total, logits)
    torch.testing.assert_close(total, whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_parts, g_whole, rtol=1e-12, atol=1e-12)


def test_clip_metrics():
    # 4 tokens: (rho, A) = (1.5, +1) high-clipped, (0.5, -1) low-clipped, (1.5, -1) unclipped, (1.0, +1) unclipped.
    logp = torch.log(torch.tensor([[1.5], [0.5], [1.5], [1.0]]))
    mask = torch.ones(4, 1, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    _, m = grpo_loss(logp, torch.zeros(4, 1), adv, mask, normalizer=4.0, dual_clip=1.4)
    assert m["clip/ratio_high"] == 0.25 and m["clip/ratio_low"] == 0.25 and m["clip/ratio_region"] == 0.5
    assert m["clip/ratio_dual"] == 0.25  # (1.5, -1): rho > 1.4
    assert m["ratio/max"] == pytest.approx(1.5) and m["tokens"] == 4.0


def test_bad_input():
    x = torch.zeros(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(x, x, torch.zeros(2), m, normalizer=1.0, beta=0.1)
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(x, x, torch.zeros(3), m, normalizer=1.0)
    with pytest.raises(
        ValueError, match="seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm, token-mean"
    ):
        loss_normalizer(m, "sum", 3)
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(x, x, "k4")


@pytest.mark.parametrize("mode", MODES)
def test_the_two_rollout_weights_of_an_aggregation_agree(mode):
    # omega_i (rollout_gradient_weights: on rollout i's summed log-prob gradient, with N/Z) and c_i
    # (aggregation_rollout_weights: on its length-normalised score gradient) are read off the registry by two
    # paths; for a rollout with tokens omega_i = (N/Z) c_i / |o_i|.
    mask = _lengths_mask([7, 3, 1, 5, 0], 7)
    z = loss_normalizer(mask, mode, 7)
    omega = rollout_gradient_weights(mask, mode, z)
    c = aggregation_rollout_weights(mask, mode)
    lengths = mask.sum(1).double()
    has = lengths > 0
    torch.testing.assert_close(omega[has], (4 / z) * c[has] / lengths[has], rtol=1e-12, atol=0.0)
    assert c[~has].tolist() == [0.0]


def test_kl_reward_penalty_closed_form():
    """beta * sum_t (logp - ref) over the completion: rollout 0 has log-ratios 0.5, 1.0 (a padded third token
    ignored), rollout 1 has -0.2; beta = 0.1 gives 0.15 and -0.02."""
    from grpo_lens.formulas.losses import kl_reward_penalty

    logp = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, 0.0, 0.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -3.0, 0.0], [-0.3, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    want = torch.tensor([0.15, -0.02], dtype=torch.float64)
    torch.testing.assert_close(kl_reward_penalty(logp, ref, mask, 0.1), want, rtol=0, atol=1e-15)
