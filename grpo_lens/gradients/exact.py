"""Exact per-rollout gradients g_i: one forward and one backward per rollout, the oracle (docs/theory.md §1, §8).

Notation: B prompts, R group size, N = B*R rollouts, T completion tokens, P parameters. g_i = grad_theta s_i with
s_i the rollout's score (:func:`grpo_lens.gradients.scores.rollout_scores`); a rollout with an empty completion has
g_i = 0.

- :func:`exact_rollout_grads`: the dense [N, P] matrix (columns: :func:`grpo_lens.gradients.params.param_slices`),
  for tests, small models, the probe's ``--dense-oracle`` mode and the LoRA adapter space.
- :func:`exact_weighted_grad` (and :func:`exact_policy_grad`, :func:`exact_nll_grad`): sum_i w_i g_i from one
  batched backward.
- :func:`layer_weight_grads`: G2, each linear layer's weight gradient of sum_i w_i s_i, via autograd.

The sketched path, one batched backward for every rollout, is :mod:`grpo_lens.gradients.sketch`; tests check it
against these.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from grpo_lens.formulas.spectrum import nll_weights
from grpo_lens.gradients.params import (
    LayerFilter,
    linear_layer_names,
    select_parameters,
)
from grpo_lens.gradients.scores import rollout_scores
from grpo_lens.rollout import RolloutBatch, batch_logprobs


def _flat_grad(scalar: Tensor, params: list[nn.Parameter], out: Tensor | None = None) -> Tensor:
    """The gradient of ``scalar`` w.r.t. ``params``, flattened and concatenated ([P]); written into ``out`` ([P]) when
    given, so that a caller filling an [N, P] matrix row by row never holds a second copy of it."""
    grads = torch.autograd.grad(scalar, params, allow_unused=True) if scalar.requires_grad else [None] * len(params)
    if out is None:
        return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(grads, params)])
    start = 0
    for g, p in zip(grads, params):
        dst = out[start : start + p.numel()]
        if g is None:
            dst.zero_()
        else:
            dst.copy_(g.reshape(-1))
        start += p.numel()
    return out


def exact_rollout_grads(
    model: nn.Module,
    batch: RolloutBatch,
    params: Sequence[str] | None = None,
    *,
    weights: Tensor | None = None,
    score_weights: Tensor | None = None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> Tensor:
    """Dense per-rollout gradients, one forward + backward per rollout (the oracle).

    Row i is w_i g_i with g_i = grad of (1/|o_i|) sum_t log pi(o_{i,t}|q, o_{i,<t}) (docs/theory.md §1), w_i = 1 unless
    ``weights`` is given (``weights = A`` gives the rows of G1, docs/theory.md §5). Parameters' ``.grad`` is untouched.

    Args:
        model: causal LM.
        batch: N rollouts.
        params: parameter names (see :func:`select_parameters`); None = all trainable parameters.
        weights: [N] row weights, optional.
        score_weights: [N] omega_i of :func:`rollout_scores` (default 1/|o_i|; docs/theory.md §3).
        temperature: the sampling temperature (:func:`grpo_lens.rollout.token_logprobs`). top_k, top_p: accepted for
            callers that pass the sampler's settings; log-probs do not depend on them
            (docs/theory.md §Log-probabilities).

    Returns:
        [N, P] in the parameters' dtype; columns follow :func:`param_slices`.

    Raises:
        ValueError: unknown parameter names.
    """
    chosen = [p for _, p in select_parameters(model, params)]
    n = batch.num_rollouts
    if weights is not None:
        assert weights.shape == (n,), (weights.shape, n)
    # filled row by row: stacking a list of rows would hold the [N, P] matrix twice (GBs for a 135M model at N = 8)
    out = torch.empty(n, sum(p.numel() for p in chosen), dtype=chosen[0].dtype, device=chosen[0].device)
    for i in range(n):
        sub = batch.select([i])
        logp = batch_logprobs(model, sub, temperature)
        score = rollout_scores(logp, sub.completion_mask, None if score_weights is None else score_weights[i : i + 1])[
            0
        ]
        _flat_grad(score, chosen, out=out[i])
        if weights is not None:
            out[i].mul_(weights[i].to(out.dtype))
    return out


def exact_weighted_grad(
    model: nn.Module,
    batch: RolloutBatch,
    weights: Tensor,
    params: Sequence[str] | None = None,
    *,
    score_weights: Tensor | None = None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> Tensor:
    """sum_i w_i g_i with one batched backward (``.grad`` untouched).

    With ``weights = A`` this is the on-policy GRPO direction sum_i A_i g_i (R times grad J of docs/theory.md §3 for one
    group); with ``weights = nll_weights(mask)`` it is the supervised NLL gradient of the same completions.

    Args:
        weights: [N] float.
        model: as in :func:`exact_rollout_grads`.
        batch: as in :func:`exact_rollout_grads`.
        params: as in :func:`exact_rollout_grads`.
        score_weights: as in :func:`exact_rollout_grads`.
        temperature: as in :func:`exact_rollout_grads`.
        top_k: as in :func:`exact_rollout_grads`.
        top_p: as in :func:`exact_rollout_grads`.

    Returns:
        [P] in the parameters' dtype.
    """
    assert weights.shape == (batch.num_rollouts,), (weights.shape, batch.num_rollouts)
    chosen = [p for _, p in select_parameters(model, params)]
    logp = batch_logprobs(model, batch, temperature)
    scores = rollout_scores(logp, batch.completion_mask, score_weights)
    return _flat_grad((scores * weights.to(scores.dtype)).sum(), chosen)


def exact_policy_grad(
    model: nn.Module, batch: RolloutBatch, advantages: Tensor, params: Sequence[str] | None = None, **processing
) -> Tensor:
    """sum_i A_i g_i, exactly (docs/theory.md §3, on-policy first step). advantages: [N] (flatten [B, R]).
    Returns [P]."""
    return exact_weighted_grad(model, batch, advantages.reshape(-1), params, **processing)


def exact_nll_grad(model: nn.Module, batch: RolloutBatch, params: Sequence[str] | None = None, **processing) -> Tensor:
    """Gradient of the token-mean NLL of the batch's completions (the supervised control). Returns [P]."""
    return exact_weighted_grad(model, batch, nll_weights(batch.completion_mask), params, **processing)


def layer_weight_grads(
    model: nn.Module,
    batch: RolloutBatch,
    weights: Tensor,
    layers: LayerFilter = None,
    *,
    score_weights: Tensor | None = None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> dict[str, Tensor]:
    """G2 (docs/theory.md §5): the weight gradient of the loss sum_i w_i s_i for each linear layer, via autograd.

    For a linear layer this equals sum_i (w_i/|o_i|) sum_t delta_t x_t^T, summed over all positions of each row.
    ``.grad`` is untouched.

    Args:
        weights: [N] float (A_i for the group/batch policy loss).
        layers: filter on linear layer names (:func:`linear_layer_names`: ``nn.Linear`` and ``Conv1D``).
        score_weights: [N] omega_i of :func:`rollout_scores` (default 1/|o_i|).

    Returns:
        {layer name: the weight's gradient, [d_out, d_in] ([d_in, d_out] for a ``Conv1D``)} in the weights' dtype.
    """
    assert weights.shape == (batch.num_rollouts,), (weights.shape, batch.num_rollouts)
    names = linear_layer_names(model, layers)
    modules = dict(model.named_modules())
    logp = batch_logprobs(model, batch, temperature)
    loss = (
        rollout_scores(logp, batch.completion_mask, score_weights) * weights.to(device=logp.device, dtype=logp.dtype)
    ).sum()
    grads = torch.autograd.grad(loss, [modules[n].weight for n in names], allow_unused=True)
    return {n: (torch.zeros_like(modules[n].weight) if g is None else g) for n, g in zip(names, grads)}
