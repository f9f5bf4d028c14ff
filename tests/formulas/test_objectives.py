"""The objectives the field trains with: GSPO, CISPO, SAPO and GPG in POLICY_LOSSES, verl's
seq-mean-token-sum aggregation, and the per-token weights of each loss's gradient (policy_token_weights, the lens's
rows) at ratio 1 and off it. Each loss has a hand-computed 2-rollout, 3-token example (derivations in comments)."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_lens.formulas.losses import (
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    ZERO_AT_ZERO_ADVANTAGE,
    aggregate_loss,
    cispo_loss,
    gpg_loss,
    grpo_loss,
    gspo_surrogate,
    loss_normalizer,
    policy_token_weights,
    rollout_gradient_weights,
    sapo_loss,
)

# Two rollouts, T = 3: rollout 1 has 3 tokens, rollout 2 has 2 (its third position is padding). A = [+1, -1].
MASK = torch.tensor([[True, True, True], [True, True, False]])
ADV = torch.tensor([1.0, -1.0], dtype=torch.float64)
OLD = torch.full((2, 3), -1.0, dtype=torch.float64)


def _logp(log_ratios):
    return (OLD + torch.tensor(log_ratios, dtype=torch.float64)).requires_grad_(True)


def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def test_gspo_closed_form():
    # Rollout 1: log-ratios [0.3, 0.3, 0.0], mean 0.2, s_1 = e^0.2 = 1.22140 > 1.2 with A = +1: clipped, every
    # token's loss -1.2 and no gradient. Rollout 2: log-ratios [-0.1, -0.3], mean -0.2, s_2 = e^-0.2 = 0.81873 inside
    # [0.8, 1.2] with A = -1: loss -min(-s_2, -s_2) = s_2 on each token, d/dlogp_{2,t} = s_2 (GSPO-token).
    # seq-mean-token-mean (Z = N = 2): L = (1/2) [(1/3)(3 x -1.2) + (1/2)(2 x 0.81873)] = (-1.2 + 0.81873) / 2
    # = -0.190635; dL/dlogp_{2,t} = (1/2)(1/2) s_2 = 0.204683.
    logp = _logp([[0.3, 0.3, 0.0], [-0.1, -0.3, 0.0]])
    loss, ratio = gspo_surrogate(logp, OLD, ADV, 0.2, 0.2, mask=MASK)
    s1, s2 = math.exp(0.2), math.exp(-0.2)
    torch.testing.assert_close(ratio, torch.tensor([[s1] * 3, [s2] * 3], dtype=torch.float64))
    torch.testing.assert_close(loss[0], torch.full((3,), -1.2, dtype=torch.float64))
    torch.testing.assert_close(loss[1, :2], torch.full((2,), s2, dtype=torch.float64))
    total = aggregate_loss(loss, MASK, "seq-mean-token-mean", 2.0)
    assert float(total.detach()) == pytest.approx(-0.190635, abs=1e-6)
    (g,) = torch.autograd.grad(total, logp)
    torch.testing.assert_close(g, torch.tensor([[0.0] * 3, [s2 / 4, s2 / 4, 0.0]], dtype=torch.float64))
    with pytest.raises(ValueError, match="gspo.*mask"):
        gspo_surrogate(logp, OLD, ADV, 0.2, 0.2)


@pytest.mark.parametrize("mode", sorted(LOSS_AGGREGATIONS))
def test_gspo_token_form_equals_the_broadcast_sequence_loss(mode):
    # TRL's form: one loss -min(s_i A_i, clip(s_i) A_i) per rollout, s_i carrying the gradient of the mean log-ratio,
    # broadcast over the rollout's tokens and aggregated like any token loss. verl's token form must agree in value
    # and gradient under every aggregation (rollout 1 unclipped here, so a wrong token weight would show).
    logp = _logp([[0.05, 0.1, -0.02], [0.2, -0.1, 0.0]])
    norm = loss_normalizer(MASK, mode, 3)
    ours = aggregate_loss(gspo_surrogate(logp, OLD, ADV, 0.2, 0.2, mask=MASK)[0], MASK, mode, norm)
    (g_ours,) = torch.autograd.grad(ours, logp)
    log_s = ((logp - OLD) * MASK).sum(1, keepdim=True) / MASK.sum(1, keepdim=True)
    s = torch.exp(log_s)
    a = ADV.unsqueeze(1)
    broadcast = (-torch.minimum(s * a, torch.clamp(s, 0.8, 1.2) * a)).expand(2, 3)
    theirs = aggregate_loss(broadcast, MASK, mode, norm)
    (g_theirs,) = torch.autograd.grad(theirs, logp)
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), abs=1e-12)
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-12, atol=1e-12)


def test_cispo_closed_form():
    # Rollout 1 (A = +1): rho = e^[0.3, 0, -0.3] = [1.34986, 1, 0.74082], clipped to [0.8, 1.2] and detached:
    # w = [1.2, 1.0, 0.8]; logp = [-0.7, -1.0, -1.3]; loss = -w A logp = [0.84, 1.0, 1.04]; d/dlogp = -w A.
    # Rollout 2 (A = -1): rho = e^[0.1, -0.1] = [1.10517, 0.90484], inside: w = rho; logp = [-0.9, -1.1];
    # loss = w logp = [-0.994654, -0.995321]; d/dlogp = w (no gradient through the detached weight).
    logp = _logp([[0.3, 0.0, -0.3], [0.1, -0.1, 0.0]])
    loss, ratio = cispo_loss(logp, OLD, ADV, 0.2, 0.2)
    torch.testing.assert_close(
        loss[:, :3] * MASK, torch.tensor([[0.84, 1.0, 1.04], [-0.994654, -0.995321, 0.0]], dtype=torch.float64)
    )
    (g,) = torch.autograd.grad((loss * MASK).sum(), logp)
    e = math.exp
    torch.testing.assert_close(g, torch.tensor([[-1.2, -1.0, -0.8], [e(0.1), e(-0.1), 0.0]], dtype=torch.float64))
    assert float(ratio[0, 0]) == pytest.approx(e(0.3))


def test_sapo_closed_form():
    # f(r) = (4 / tau) sigmoid(tau (r - 1)); loss -f(rho) A; d/dlogp = -A 4 sigma (1 - sigma) rho.
    # Rollout 1 (A = +1, tau_pos = 1): rho = e^0.3 = 1.349859, sigma = sigmoid(0.349859) = 0.586583:
    #   loss = -4 x 0.586583 = -2.346333; d/dlogp = -4 x 0.586583 x 0.413417 x 1.349859 = -1.309381.
    # Rollout 2 (A = -1, tau_neg = 1.05): rho = e^-0.2 = 0.818731, sigma = sigmoid(1.05 x -0.181269):
    #   loss = +(4 / 1.05) sigma = 1.724038; d/dlogp = +4 sigma (1 - sigma) rho = 0.811360.
    # At rho = 1 (token 3 of rollout 1): loss -2 / tau = -2, d/dlogp = -1, the clipped surrogate's.
    logp = _logp([[0.3, 0.3, 0.0], [-0.2, -0.2, 0.0]])
    loss, _ = sapo_loss(logp, OLD, ADV, sapo_tau_pos=1.0, sapo_tau_neg=1.05)
    torch.testing.assert_close(
        loss[:, :3] * MASK,
        torch.tensor([[-2.346333, -2.346333, -2.0], [1.724038, 1.724038, 0.0]], dtype=torch.float64),
        rtol=0,
        atol=1e-6,
    )
    (g,) = torch.autograd.grad((loss * MASK).sum(), logp)
    torch.testing.assert_close(
        g,
        torch.tensor([[-1.309381, -1.309381, -1.0], [0.811360, 0.811360, 0.0]], dtype=torch.float64),
        rtol=0,
        atol=1e-6,
    )
    with pytest.raises(ValueError, match="temperatures"):
        sapo_loss(logp, OLD, ADV, sapo_tau_pos=0.0)


def test_gpg_closed_form():
    # loss = -A logp at any ratio: rollout 1 [0.7, 1.0, 1.3] (logp = [-0.7, -1, -1.3], A = +1), rollout 2
    # [-0.9, -1.1] (A = -1); d/dlogp = -A = [-1, -1, -1], [1, 1].
    logp = _logp([[0.3, 0.0, -0.3], [0.1, -0.1, 0.0]])
    loss, _ = gpg_loss(logp, OLD, ADV)
    torch.testing.assert_close(loss * MASK, torch.tensor([[0.7, 1.0, 1.3], [-0.9, -1.1, 0.0]], dtype=torch.float64))
    (g,) = torch.autograd.grad((loss * MASK).sum(), logp)
    torch.testing.assert_close(g, torch.tensor([[-1.0, -1.0, -1.0], [1.0, 1.0, 0.0]], dtype=torch.float64))


def test_seq_mean_token_sum_closed_form():
    # verl's seq-mean-token-sum: (1/N) sum_i sum_t l_{i,t}. Losses [1, 2, 3] and [4, 5, (pad 100)], N = 2:
    # (6 + 9) / 2 = 7.5; the per-rollout gradient weight omega_i = (N / Z) v_i = (2 / 2) x 1 = 1 for both.
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 100.0]])
    norm = loss_normalizer(MASK, "seq-mean-token-sum", 3)
    assert norm == 2.0
    assert float(aggregate_loss(loss, MASK, "seq-mean-token-sum", norm)) == pytest.approx(7.5)
    torch.testing.assert_close(
        rollout_gradient_weights(MASK, "seq-mean-token-sum", norm), torch.ones(2, dtype=torch.float64)
    )


@pytest.mark.parametrize("mode", sorted(LOSS_AGGREGATIONS))
@pytest.mark.parametrize("name", ["vanilla", "gspo", "cispo", "sapo", "gpg"])
def test_every_loss_at_ratio_one_has_the_clipped_surrogates_rows(name, mode):
    # On the first pass (old = logp) each loss's gradient is -(1/N) sum_i A_i omega_i sum_t grad logp with the
    # aggregation's omega_i (GSPO: d s_i = s_i / |o_i| sum_t d logp summed over |o_i| tokens; CISPO: clip(1) = 1;
    # SAPO: f'(1) = 1; GPG: 1): the lens's first-pass rows are the same for every objective.
    logp = _logp([[0.1, -0.2, 0.3], [0.0, 0.2, 0.0]])
    norm = loss_normalizer(MASK, mode, 3)
    w = policy_token_weights(
        logp, logp.detach(), torch.tensor([0.7, -1.3]), MASK, aggregation=mode, normalizer=norm, policy_loss=name
    )
    expected = rollout_gradient_weights(MASK, mode, norm).unsqueeze(1) * MASK
    torch.testing.assert_close(w, expected, rtol=1e-12, atol=1e-12)


def test_token_weights_off_policy_closed_form():
    # Ratio != 1 (a later pass with mu > 1), token-mean (Z = 5 tokens, N = 2): omega = -N dL/dlogp / A.
    # vanilla: rho_1 = e^[0.3, 0, -0.3] with A = +1 -> token 1 clipped (1.35 > 1.2): omega = (2/5) rho x [0, 1, 1]
    #   = [0, 0.4, 0.296327]; rho_2 = e^[0.1, -0.1] with A = -1, inside: omega = (2/5) rho = [0.442068, 0.361935].
    # cispo: omega = (2/5) clip(rho) = [0.48, 0.4, 0.32], [0.442068, 0.361935].
    # gpg: omega = 2/5 everywhere on the mask.
    logp = _logp([[0.3, 0.0, -0.3], [0.1, -0.1, 0.0]]).detach()
    kw = dict(aggregation="token-mean", normalizer=5.0)
    e = math.exp
    vanilla = policy_token_weights(logp, OLD, ADV, MASK, policy_loss="vanilla", **kw)
    torch.testing.assert_close(
        vanilla, torch.tensor([[0.0, 0.4, 0.4 * e(-0.3)], [0.4 * e(0.1), 0.4 * e(-0.1), 0.0]], dtype=torch.float64)
    )
    cispo = policy_token_weights(logp, OLD, ADV, MASK, policy_loss="cispo", **kw)
    torch.testing.assert_close(
        cispo, torch.tensor([[0.48, 0.4, 0.32], [0.4 * e(0.1), 0.4 * e(-0.1), 0.0]], dtype=torch.float64)
    )
    gpg = policy_token_weights(logp, OLD, ADV, MASK, policy_loss="gpg", **kw)
    torch.testing.assert_close(gpg, 0.4 * MASK.double())
    # The weights do not depend on |A_i| (only on its sign): A = [5, -0.1] gives the same.
    torch.testing.assert_close(
        policy_token_weights(logp, OLD, torch.tensor([5.0, -0.1]), MASK, policy_loss="vanilla", **kw), vanilla
    )


@pytest.mark.parametrize("name", ZERO_AT_ZERO_ADVANTAGE)
def test_zero_advantage_rows_have_no_loss_and_no_gradient(name):
    # still_rows forwards a group whose every A_i = 0 without gradient: every listed loss must be 0 there in value
    # and gradient, off policy too (CISPO's -w A logp and GPG's -A logp vanish with A).
    logp = _logp([[0.3, 0.0, -0.3], [0.1, -0.1, 0.0]])
    loss, _ = grpo_loss(logp, OLD, torch.zeros(2, dtype=torch.float64), MASK, normalizer=2.0, policy_loss=name)
    (g,) = torch.autograd.grad(loss, logp)
    assert float(loss.detach()) == 0.0 and float(g.abs().max()) == 0.0


def test_registry_names_and_bad_input():
    assert {"vanilla", "gspo", "cispo", "sapo", "gpg"} <= set(POLICY_LOSSES.names())
    assert set(ZERO_AT_ZERO_ADVANTAGE) <= set(POLICY_LOSSES.names())
    with pytest.raises(ValueError, match="unknown policy loss 'grpo'; valid names: .*gspo"):
        policy_token_weights(OLD, OLD, ADV, MASK, aggregation="token-mean", normalizer=5.0, policy_loss="grpo")
    with pytest.raises(ValueError, match="normalizer"):
        policy_token_weights(OLD, OLD, ADV, MASK, aggregation="token-mean", normalizer=0.0)
