"""Readable reference implementations kept beside the tests, each checked against the product's body.

These are no part of the package: the tool computes with the weighted / vectorised functions of
:mod:`grpo_lens.formulas`; the tests compare those with the plain definitions here (STYLE.md §9).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor


def _flat(g: Tensor | Iterable[Tensor]) -> Tensor:
    if isinstance(g, Tensor):
        return g.detach().reshape(-1)
    return torch.cat([t.detach().reshape(-1) for t in g])


def small_entry_share(g: Tensor | Iterable[Tensor], tau: float = 1e-3) -> float:
    """S2 as docs/theory.md §9 defines it: share of entries with |g_j| <= tau * max_j |g_j|.

    The tool prints the tau = 0 case, the share of exact zeros (:func:`grpo_lens.formulas.sparsity.zero_share`).

    Args:
        g: a gradient [P] (any shape, or a list of tensors).  tau: relative threshold in [0, 1].

    Returns:
        float in [0, 1]; 1 for an all-zero g.
    """
    v = _flat(g).abs().double()
    return float((v <= tau * v.max()).double().mean())


def hoyer_sparsity(g: Tensor | Iterable[Tensor]) -> float:
    """S3, Hoyer sparsity (sqrt(n) - ||g||_1/||g||_2) / (sqrt(n) - 1) of every entry (Hoyer, JMLR 5, 2004, eq. 1).

    The reference for :func:`grpo_lens.formulas.sparsity.weighted_hoyer` with unit weights. 1 for an all-zero g;
    ValueError for fewer than 2 entries.
    """
    v = _flat(g).double()
    n = v.numel()
    if n < 2:
        raise ValueError(f"Hoyer sparsity needs at least 2 entries, got {n}")
    l2 = v.norm()
    if l2 == 0:
        return 1.0
    return float((math.sqrt(n) - v.abs().sum() / l2) / (math.sqrt(n) - 1))


def gram_of(grads):
    """The Gram matrix [R, R] float64 of per-rollout gradients [R, K]: what analyse_group takes."""
    g = grads.double()
    return g @ g.T


def dtype_recording_loader(original, seen: dict, other: str, loaded: dict | None = None):
    """A stand-in for ``load_model`` that records the output dtype of layer 0's q_proj in ``seen["generate"]`` while
    ``model.generate`` runs and in ``seen[other]`` otherwise; it asserts the weights load in float32 (bf16-mixed keeps
    float32 weights) and puts the model in ``loaded["model"]``."""

    def load_and_hook(*a, **kw):
        model, tok = original(*a, **kw)
        assert next(model.parameters()).dtype == torch.float32  # bf16-mixed loads float32 weights
        phase = {"now": other}
        gen = model.generate

        def generate(*ga, **gk):
            phase["now"] = "generate"
            try:
                return gen(*ga, **gk)
            finally:
                phase["now"] = other

        model.generate = generate
        model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, a, o: seen[phase["now"]].add(o.dtype))
        if loaded is not None:
            loaded["model"] = model
        return model, tok

    return load_and_hook
