"""The quantity every per-rollout gradient differentiates: the score s_i of rollout i (docs/theory.md §1, §3).

    s_i = omega_i sum_t log pi_theta(o_{i,t} | q, o_{i,<t}),      g_i = grad_theta s_i,

with omega_i = 1/|o_i| by default (the length-normalised score GRPO's seq-mean-token-mean loss weights) or the loss
aggregation's own weights (:func:`grpo_lens.formulas.losses.rollout_gradient_weights`). The log-probs come from
grpo-lens' one log-prob definition (temperature-scaled, :func:`grpo_lens.rollout.batch_logprobs`). Shapes: N
rollouts, T completion tokens. The NLL control's row weights are :func:`grpo_lens.formulas.spectrum.nll_weights`.
Per-token weights s_i = sum_t omega_{i,t} log pi_theta(o_{i,t} | ...) give a policy loss's row at any ratio
(:func:`grpo_lens.formulas.losses.policy_token_weights`).
"""

from __future__ import annotations

from torch import Tensor


def rollout_scores(logprobs: Tensor, completion_mask: Tensor, score_weights: Tensor | None = None) -> Tensor:
    """Per-rollout scores s_i = omega_i sum_t log pi(o_{i,t}|.), whose gradients are the per-rollout terms g_i.

    By default omega_i = 1/|o_i| (the length-normalised score of docs/theory.md §1, the term GRPO's
    seq-mean-token-mean loss weights). Pass ``score_weights`` =
    :func:`grpo_lens.formulas.losses.rollout_gradient_weights` to get the term the configured loss aggregation weights
    (docs/theory.md §3: summed token scores times the batch constant N/Z for token-mean and seq-mean-token-sum-norm).

    Args:
        logprobs: [N, T] float, per-token log-probs (positions outside the mask may hold anything finite).
        completion_mask: [N, T] bool/0-1.
        score_weights: [N] omega_i, or [N, T] per-token omega_{i,t} (s_i = sum_t omega_{i,t} log pi(o_{i,t}),
            a policy loss's row at ratios != 1: :func:`grpo_lens.formulas.losses.policy_token_weights`); optional.

    Returns:
        [N] float; 0 for an empty completion.
    """
    assert logprobs.shape == completion_mask.shape, (logprobs.shape, completion_mask.shape)
    mask = completion_mask.to(logprobs.dtype)
    if score_weights is not None and score_weights.dim() == 2:
        assert score_weights.shape == logprobs.shape, (score_weights.shape, logprobs.shape)
        w = score_weights.to(device=logprobs.device, dtype=logprobs.dtype)
        return (logprobs * mask * w).sum(-1)
    if score_weights is not None:
        assert score_weights.shape == logprobs.shape[:1], (score_weights.shape, logprobs.shape)
        return (logprobs * mask).sum(-1) * score_weights.to(device=logprobs.device, dtype=logprobs.dtype)
    return (logprobs * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
