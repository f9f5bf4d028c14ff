"""The per-rollout gradient spaces of a LoRA policy, for the lens (``--lens-space``; docs/theory.md
§LoRA parameter spaces).

- ``trainable`` (default): the gradient of every trainable parameter -- with LoRA the adapter's A and B, measured
  exactly (:func:`grpo_lens.gradients.exact.exact_rollout_grads`; the adapter is small), the space the update moves in;
- ``full``: the gradient with respect to every frozen base weight W of the linear layers, as full fine-tuning would
  follow it, sketched (:func:`grpo_lens.gradients.sketch.sketch_rollout_grads` on :func:`base_layers`). Because the
  frozen W sits in the same forward pass, its gradient is delta^T x of the base layer, read by hooks on the base
  layers without updating W.

Wrapping the policy, saving it merged and adapter-only is :mod:`grpo_lens.lora`.
"""

from __future__ import annotations

import torch

from grpo_lens.gradients.exact import exact_rollout_grads
from grpo_lens.gradients.sketch import sketch_rollout_grads, square_sketch
from grpo_lens.lora import ADAPTER_MARK
from grpo_lens.rollout import RolloutBatch


def adapter_layers(name: str) -> bool:
    """Layer filter (for :func:`grpo_lens.gradients.sketch.sketch_rollout_grads`) of the LoRA adapter's linear maps."""
    return ADAPTER_MARK in name


def base_layers(name: str) -> bool:
    """Layer filter of the frozen base model's linear layers (the full fine-tuning space)."""
    return ADAPTER_MARK not in name


def lora_rollout_grads(
    model: torch.nn.Module,
    batch: RolloutBatch,
    lens_space: str,
    *,
    sketch_dim: int = 16,
    seed: int = 0,
    projection: str = "gaussian",
    dtype: torch.dtype = torch.float32,
    score_weights: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Per-rollout gradients g_i of a LoRA policy's rollouts (g_i = grad of omega_i times the rollout's log-prob sum,
    omega_i = 1/|o_i| unless ``score_weights``; docs/theory.md §3) in the adapter space or the full space.

    Args:
        model: a policy wrapped by :func:`grpo_lens.lora.apply_lora`.
        batch: N rollouts (:class:`grpo_lens.rollout.RolloutBatch`).
        lens_space: ``trainable`` -- exact gradients of the adapter's A and B ([N, P_adapter], one backward per
            rollout);
            ``full`` -- gradients of every frozen base linear weight W, sketched with d_s x d_s Kronecker projections
            per layer, d_s = ``sketch_dim`` ([N, P_s], P_s = layers * d_s^2; ``projection="identity"`` gives them
            exactly, [N, sum d_out d_in]).
        sketch_dim: the sketch side d_s (sketch_in = sketch_out of
            :func:`grpo_lens.gradients.sketch.sketch_rollout_grads`).
        seed: the sketch's seed (:func:`grpo_lens.gradients.sketch.sketch_rollout_grads`).
        projection: the sketch's projection.
        dtype: the sketch's dtype.
        score_weights: [N] omega_i (:func:`grpo_lens.gradients.scores.rollout_scores`).
        temperature: the sampler's.

    Returns:
        [N, P_adapter] in the model's dtype (exact) or [N, P_s] in ``dtype`` (sketch).

    Raises:
        ValueError: an unknown ``lens_space``.

    The two spaces are tied by the chain rule: with the update s B A (s = lora_alpha / lora_rank) added to W,
    grad_B = s grad_W A^T and grad_A = s B^T grad_W (tests/gradients/test_lora.py checks this).
    """
    if lens_space == "trainable":
        return exact_rollout_grads(model, batch, score_weights=score_weights, temperature=temperature)
    if lens_space != "full":
        raise ValueError(f"unknown lens space {lens_space!r}; valid names: full, trainable")
    # A frozen base layer's output carries a gradient only once the input embeddings' output requires one
    # (transformers' enable_input_require_grads); the sketch then differentiates with respect to it alone.
    # nn.Module types a transformers model's attribute as Tensor | Module
    model.enable_input_require_grads()  # type: ignore[operator]
    try:
        return sketch_rollout_grads(
            model,
            batch,
            **square_sketch(sketch_dim),
            include=base_layers,
            seed=seed,
            # the config's check allows only these names
            projection=projection,  # type: ignore[arg-type]
            dtype=dtype,
            score_weights=score_weights,
            temperature=temperature,
        ).sketch
    finally:
        # nn.Module types a transformers model's attribute as Tensor | Module
        model.disable_input_require_grads()  # type: ignore[operator]
