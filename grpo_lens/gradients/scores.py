"""Per-rollout gradients g_i: an exact oracle (one backward per rollout) and LoGra sketches (one batched backward).

Notation (docs/theory.md §1): B prompts, R group size, N = B*R rollouts, L = Lp + T input positions (prompt + completion),
T completion tokens, P parameters, k sketch dimension. The quantity everything here differentiates is the
length-normalised score of rollout i,

    s_i = (1/|o_i|) sum_t log pi_theta(o_{i,t} | q, o_{i,<t}),      g_i = grad_theta s_i,

computed with grpo-lens' one log-prob definition (temperature-scaled, docs/theory.md §Log-probabilities) by
:func:`grpo_lens.rollout.completion_logprobs`.
A rollout with an empty completion (|o_i| = 0) has s_i = 0 and g_i = 0.

Two paths:

- exact (:func:`exact_rollout_grads`): one forward and one backward per rollout; returns the dense [N, P] matrix.
  The oracle for tests and for small models.
- sketched (:class:`GradientCapture`, :func:`sketch_rollout_grads`): hooks on ``nn.Linear`` modules capture each
  layer's input x_t [d_in] and output gradient delta_t [d_out] during ONE batched backward. For a linear layer the
  per-rollout weight gradient is sum_{t in row i} delta_t x_t^T; its two-sided random projection
  P_out (sum_t delta_t x_t^T) P_in^T = sum_t (P_out delta_t)(P_in x_t)^T is formed from the projected vectors only
  (LoGra, Choe et al. 2024, arXiv 2405.13954, §3; TRAK, Park et al. 2023), never materialising the [N, P] matrix.

Only weights of ``nn.Linear`` modules are sketched: embeddings, norms and biases are not. With tied embeddings the
``lm_head`` sketch covers the output-projection use of the shared matrix only.
"""

from __future__ import annotations

from torch import Tensor


def rollout_scores(logprobs: Tensor, completion_mask: Tensor, score_weights: Tensor | None = None) -> Tensor:
    """Per-rollout scores s_i = omega_i sum_t log pi(o_{i,t}|.), whose gradients are the per-rollout terms g_i.

    By default omega_i = 1/|o_i| (the length-normalised score of docs/theory.md §1, the term GRPO's
    seq-mean-token-mean loss weights). Pass ``score_weights`` = :func:`grpo_lens.losses.rollout_gradient_weights` to
    get the term the configured loss aggregation weights (docs/theory.md §3: summed token scores times the batch
    constant N/Z for token-mean and seq-mean-token-sum-norm).

    Args:
        logprobs: [N, T] float, per-token log-probs (positions outside the mask may hold anything finite).
        completion_mask: [N, T] bool/0-1.
        score_weights: [N] omega_i, optional.

    Returns:
        [N] float; 0 for an empty completion.
    """
    assert logprobs.shape == completion_mask.shape, (logprobs.shape, completion_mask.shape)
    mask = completion_mask.to(logprobs.dtype)
    if score_weights is not None:
        assert score_weights.shape == logprobs.shape[:1], (score_weights.shape, logprobs.shape)
        return (logprobs * mask).sum(-1) * score_weights.to(device=logprobs.device, dtype=logprobs.dtype)
    return (logprobs * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
