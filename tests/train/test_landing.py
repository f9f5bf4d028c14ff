"""Per-token landing shares of the update's own gradient at lens steps and the KL-only gradient of the
groups without reward contrast (docs/theory.md §Landing shares and the dead groups' KL gradient)."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_lens.formulas.landing import gradient_norm_ratio, landing_shares, token_update_weights
from grpo_lens.formulas.losses import grpo_loss, loss_normalizer, rollout_gradient_weights


def test_landing_shares_closed_form():
    s = torch.tensor([[0.5, 0.25, 0.0], [0.5, -0.25, 7.0]])
    labels = torch.tensor([[0, 1, -1], [0, -1, -1]])
    shares, closure = landing_shares(s, labels, 2)
    # measured: 0.5 + 0.25 + 0.5 = 1.25 (the -0.25 and the 7.0 unlabelled); label 0: 1.0 / 1.25, label 1: 0.25 / 1.25
    assert closure == pytest.approx(1.25, abs=1e-15)
    torch.testing.assert_close(shares, torch.tensor([0.8, 0.2], dtype=torch.float64), rtol=0, atol=1e-15)
    assert float(shares.sum()) == pytest.approx(1.0, abs=1e-15)
    # signed: a label whose tokens pull against the update gets a negative share, the other one above 1
    shares, _ = landing_shares(torch.tensor([[1.5, -0.5]]), torch.tensor([[0, 1]]), 2)
    torch.testing.assert_close(shares, torch.tensor([1.5, -0.5], dtype=torch.float64), rtol=0, atol=1e-15)
    zero, total = landing_shares(torch.zeros(1, 2), torch.tensor([[0, 1]]), 2)
    assert total == 0.0 and bool(zero.isnan().all())
    with pytest.raises(ValueError, match="labels must lie in"):
        landing_shares(s, torch.full((2, 3), 2), 2)
    with pytest.raises(ValueError, match="differ"):
        landing_shares(s, labels[:, :2], 2)


def test_token_update_weights_and_norm_ratio():
    mask = torch.tensor([[True, True, False], [True, False, False]])
    w = token_update_weights(torch.tensor([2.0, -1.0]), torch.tensor([0.5, 1.0]), mask, 4)
    # A_i omega_i / N on the loss's tokens: 2 * 0.5 / 4 = 0.25, -1 * 1 / 4 = -0.25
    want = torch.tensor([[0.25, 0.25, 0.0], [-0.25, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(w, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="num_rollouts"):
        token_update_weights(torch.ones(2), torch.ones(2), mask, 0)
    with pytest.raises(ValueError, match="must be"):
        token_update_weights(torch.ones(3), torch.ones(2), mask, 2)
    assert gradient_norm_ratio(9.0, 16.0) == 0.75  # sqrt(9 / 16)
    assert math.isnan(gradient_norm_ratio(1.0, 0.0))


@pytest.fixture(scope="module")
def model_batch():
    from grpo_lens.models import build_tiny_model
    from grpo_lens.rollout import sample_groups

    model, tok = build_tiny_model(seed=0)
    model = model.double()
    batch = sample_groups(
        model, tok, ["What is 2 + 3?", "Say 7."], 3, max_new_tokens=6, temperature=1.0, generator_seed=0
    )
    return model, tok, batch


def _lens(**overrides):
    from grpo_lens.config import TrainConfig
    from grpo_lens.lens.settings import LensSettings

    return LensSettings.from_train_config(TrainConfig(seed=0, **overrides))


def _update_grad(model, batch, adv, settings, beta=0.0, ref_logp=None, rows=None):
    """The update's first-pass loss over ``rows`` (all: None) with the whole batch's normaliser; its gradient."""
    from grpo_lens.rollout import batch_logprobs

    params = [p for p in model.parameters() if p.requires_grad]
    mask = batch.completion_mask
    z = loss_normalizer(mask, settings.loss_aggregation, settings.max_new_tokens)
    rows = torch.arange(batch.num_rollouts) if rows is None else rows
    logp = batch_logprobs(model, batch.select(rows), settings.temperature)
    loss, _ = grpo_loss(
        logp,
        logp.detach(),
        adv[rows].double(),
        mask[rows],
        normalizer=z,
        aggregation=settings.loss_aggregation,
        beta=beta,
        ref_logp=None if ref_logp is None else ref_logp[rows],
    )
    return torch.autograd.grad(loss, params)


@pytest.mark.e2e
def test_landing_shares_match_per_token_autograd(model_batch):
    from grpo_lens.formulas.credit import TOKEN_CLASSES, token_classes
    from grpo_lens.lens.trainer_lens import TrainerLens
    from grpo_lens.rollout import batch_logprobs

    model, tok, batch = model_batch
    settings = _lens(lens_landing=True)
    adv = torch.tensor([1.0, -0.5, -0.5, 0.0, 0.0, 0.0])  # group 0 mixed, group 1 dead
    params = [p for p in model.parameters() if p.requires_grad]
    for p, g in zip(params, _update_grad(model, batch, adv, settings)):
        p.grad = g.clone()
    lens = TrainerLens(model, settings, tokenizer=tok)
    lens.before_update(model, batch, adv)
    lens.before_step(model)
    out = lens.after_step(1, model, lens_step=False)
    for p in params:
        p.grad = None

    # brute force: u = -grad L; s_it = w_it <grad log pi(o_it), u> / |u|^2, w_it = A_i omega_i / N (docs/theory.md §3)
    u = [-g for g in _update_grad(model, batch, adv, settings)]
    u_sq = sum(float(x.square().sum()) for x in u)
    mask = batch.completion_mask
    omega = rollout_gradient_weights(
        mask, settings.loss_aggregation, loss_normalizer(mask, settings.loss_aggregation, settings.max_new_tokens)
    )
    w = adv.double().unsqueeze(1) * omega.unsqueeze(1) / batch.num_rollouts * mask.double()
    logp = batch_logprobs(model, batch, settings.temperature)
    s = torch.zeros_like(w)
    for i, t in mask.nonzero().tolist():
        if w[i, t] != 0:
            g = torch.autograd.grad(logp[i, t], params, retain_graph=True, allow_unused=True)
            s[i, t] = w[i, t] * sum(float((a * b).sum()) for a, b in zip(g, u) if a is not None) / u_sq
    # the brute force's closure is 1 up to the float32 inside LlamaRMSNorm (~3e-8 here): the w_it are the loss's own
    # token weights (a wrong omega or N would move it by the factor it is off)
    assert float(s.sum()) == pytest.approx(1.0, abs=1e-6)
    # the lens's derivatives are Richardson differences: O(e^4) plus float32 round-off inside LlamaRMSNorm (~3e-4,
    # tests/gradients/test_token_credit.py); a share that mixed the rollouts' signs would be off by O(1)
    assert out["landing/closure"] == pytest.approx(1.0, abs=3e-3)
    assert out["landing/positive_share"] == pytest.approx(float(s[0].sum() / s.sum()), abs=3e-3)
    assert out["landing/tokens"] == float(mask[:3].sum())
    classes = token_classes(tok, batch.completion_ids[:3], mask[:3])
    total = 0.0
    for k, name in enumerate(TOKEN_CLASSES):
        want = float(s[:3][classes == k].sum() / s.sum())
        assert out[f"landing/{name}_share"] == pytest.approx(want, abs=3e-3), name
        assert out[f"landing/{name}_token_share"] == int((classes == k).sum()) / int((classes >= 0).sum())
        total += out[f"landing/{name}_share"]
    assert total == pytest.approx(1.0, abs=1e-12)  # the class shares sum to 1 by construction
    assert out["perf/lens_landing_seconds"] > 0


@pytest.mark.e2e
def test_dead_groups_kl_gradient_is_the_update_minus_the_mixed_rows(model_batch):
    from grpo_lens.lens.trainer_lens import TrainerLens
    from grpo_lens.rollout import batch_logprobs

    model, _, batch = model_batch
    settings = _lens(lens_dead_kl=True)
    adv = torch.tensor([1.0, -0.5, -0.5, 0.0, 0.0, 0.0])
    with torch.no_grad():  # a reference the policy has moved away from: log pi_ref = log pi - 0.3 (t + 1) / T
        ref = batch_logprobs(model, batch, settings.temperature) - 0.3 * torch.arange(1, 7, dtype=torch.float64) / 6
    params = [p for p in model.parameters() if p.requires_grad]
    full = _update_grad(model, batch, adv, settings, beta=0.2, ref_logp=ref)
    for p, g in zip(params, full):
        p.grad = g.clone()
    lens = TrainerLens(model, settings)
    lens.before_update(model, batch, adv, ref, beta=0.2, kl_estimator="k3")
    lens.before_step(model)
    out = lens.after_step(1, model, lens_step=False)
    for p in params:
        p.grad = None
    # the loss is a sum over rows with one normaliser: grad L = grad L_mixed + grad L_dead, and the dead rows (A = 0)
    # carry only beta grad KL; so the dead groups' gradient is the full update's minus the mixed rows' alone
    mixed = _update_grad(model, batch, adv, settings, beta=0.2, ref_logp=ref, rows=torch.arange(3))
    dead_sq = sum(float((a - b).square().sum()) for a, b in zip(full, mixed))
    full_sq = sum(float(a.square().sum()) for a in full)
    assert dead_sq > 1e-8  # the KL term moves the dead rows
    assert out["dead/kl_grad_norm"] == pytest.approx(math.sqrt(dead_sq), rel=1e-8)
    assert out["dead/kl_grad_ratio"] == pytest.approx(math.sqrt(dead_sq / full_sq), rel=1e-8)
    assert "landing/closure" not in out  # --lens-landing off
    lens.before_update(model, batch, adv, ref, beta=0.0)  # beta 0: no KL gradient to measure, nothing written
    assert lens.after_step(2, model, lens_step=False) == {}


@pytest.mark.e2e
def test_trainer_writes_landing_and_dead_kl_at_lens_steps(tmp_path):
    from grpo_lens.train.loop import train
    from tests.train.test_trainer import tiny_config

    cfg = tiny_config(tmp_path, max_steps=2, mu=1, lens_every=1, beta=0.1, lens_landing=True, lens_dead_kl=True)
    records = [r for r in train(cfg).read_metrics() if "step" in r]
    assert len(records) == 2
    for r in records:
        if r["rank/mixed_groups"] > 0:  # one process, one mini-batch; the KL term's push is outside the measured rows
            assert math.isfinite(r["landing/closure"]) and r["landing/tokens"] > 0
            shares = [r[f"landing/{c}_share"] for c in ("answer", "format", "reasoning")]
            assert sum(shares) == pytest.approx(1.0, abs=1e-9)
        assert r["dead/kl_grad_norm"] >= 0 and r["perf/lens_landing_seconds"] > 0


@pytest.mark.e2e
def test_landing_reads_the_first_mini_batch_only(model_batch):
    from grpo_lens.lens.trainer_lens import TrainerLens

    model, tok, batch = model_batch
    settings = _lens(lens_landing=True)
    adv = torch.tensor([1.0, -0.5, -0.5, 0.5, -1.0, 0.5])  # both groups mixed; mini-batches {group 0}, {group 1}
    first = torch.arange(3)
    params = [p for p in model.parameters() if p.requires_grad]
    # the first optimizer step's gradient: mini-batch 0's loss with its own normaliser
    for p, g in zip(params, _update_grad(model, batch.select(first), adv[first], settings)):
        p.grad = g.clone()
    lens = TrainerLens(model, settings)
    lens.before_update(model, batch, adv, first=first)
    lens.before_step(model)
    out = lens.after_step(1, model, lens_step=False)
    for p in params:
        p.grad = None
    # u is group 0's alone, so its tokens close the sum; reading group 1's too would add their <grad log pi, u> terms
    # (and halve the w through the whole batch's N), far from 1
    assert out["landing/closure"] == pytest.approx(1.0, abs=3e-3)
    assert out["landing/tokens"] == float(batch.completion_mask[:3].sum())
    assert "landing/answer_share" not in out  # no tokenizer, no token classes
