"""The lens's rows of each policy loss against autograd of that loss restricted to one rollout (float64, tiny
model), at ratio 1 (the first pass) and at ratio != 1 (perturbed pi_old, as on a later pass with mu > 1): the
per-token weights of :func:`grpo_lens.formulas.losses.policy_token_weights` in the score of
:func:`grpo_lens.gradients.scores.rollout_scores` give rows g_i with grad L_i = -(A_i / N) g_i, and the exact Gram
of those rows (:func:`grpo_lens.gradients.gram.exact_rollout_gram`) is theirs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from grpo_lens.formulas.losses import grpo_loss, loss_normalizer, policy_token_weights
from grpo_lens.gradients.gram import exact_rollout_gram
from grpo_lens.gradients.scores import rollout_scores
from grpo_lens.rollout import batch_logprobs

sys.path.insert(0, str(Path(__file__).parent))
from test_gradients import tiny_batch, tiny_model  # noqa: E402

LOSSES = ["vanilla", "gspo", "cispo", "sapo", "gpg"]
# 2 groups of 3; A_i nonzero (the last rollout's completion is empty: its row is 0 whatever A_i).
ADV = torch.tensor([1.1, -0.4, -0.7, 0.9, -1.3, 0.5], dtype=torch.float64)


def _flat_grad(value, params):
    grads = torch.autograd.grad(value, params, retain_graph=True, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads)])


@pytest.mark.e2e
@pytest.mark.parametrize("off_policy", [False, True], ids=["ratio1", "ratio_off"])
@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean"])
@pytest.mark.parametrize("name", LOSSES)
def test_lens_rows_are_the_losss_per_rollout_gradient(name, mode, off_policy):
    model = tiny_model()
    batch = tiny_batch()
    params = [p for p in model.parameters() if p.requires_grad]
    mask = batch.completion_mask
    logp = batch_logprobs(model, batch)  # [6, T] float64, with gradient
    old = logp.detach()
    if off_policy:  # ratios e^{+-0.25} on average: outside the clip range for some tokens, inside for others
        old = old + 0.25 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1), dtype=old.dtype)
    n = float(mask.any(dim=1).sum())  # 5 rollouts with a token
    z = loss_normalizer(mask, mode, mask.shape[1])
    # GSPO's sequence ratio needs a clip range it can sit inside for some rollouts: its paper's 3e-4 would clip all.
    eps = dict(eps_low=0.2, eps_high=0.2) if name != "gspo" else dict(eps_low=0.1, eps_high=0.1)
    omega = policy_token_weights(
        logp, old, ADV, mask, aggregation=mode, normalizer=z, num_rollouts=n, policy_loss=name, **eps
    )
    scores = rollout_scores(logp, mask, omega)
    rows, lens_rows = [], []
    for i in range(batch.num_rollouts):
        loss_i, _ = grpo_loss(
            logp[i : i + 1],
            old[i : i + 1],
            ADV[i : i + 1],
            mask[i : i + 1],
            normalizer=z,
            aggregation=mode,
            policy_loss=name,
            **eps,
        )
        rows.append(_flat_grad(loss_i, params))
        lens_rows.append(_flat_grad(scores[i], params))
    grads, g = torch.stack(rows), torch.stack(lens_rows)
    # grad L_i = -(A_i / N) g_i, row by row. Tolerance: the two paths' upstream gradients differ by float64
    # round-off, which a float32 step of the tiny Llama's backward can round to a neighbouring float32 (~1e-7 of
    # entries ~0.3, as test_gradients' FP32_TOL); a wrong weight (a missed s_i = e^(+-0.25 or less) or a clipped token
    # kept) moves rows by percents.
    torch.testing.assert_close(grads, -(ADV / n).unsqueeze(1) * g, rtol=1e-6, atol=1e-7)
    if off_policy and name in ("vanilla", "gspo"):
        # some rows lose tokens (vanilla) or whole rollouts (gspo) to the clip: the test covers a binding clip
        assert bool((omega[mask] == 0).any()) and bool((omega[mask] != 0).any())
    # The lens's exact Gram with per-token weights is the Gram of these rows.
    gram, _ = exact_rollout_gram(model, batch, score_weights=omega)
    torch.testing.assert_close(gram, g @ g.T, rtol=1e-6, atol=1e-7)
