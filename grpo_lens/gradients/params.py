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

import re
from typing import Callable, Sequence

from torch import nn

LayerFilter = str | Callable[[str], bool] | Sequence[str] | None


def _matches(name: str, include: LayerFilter) -> bool:
    if include is None:
        return True
    if isinstance(include, str):
        return re.search(include, name) is not None
    if callable(include):
        return bool(include(name))
    return name in set(include)


def linear_layer_names(model: nn.Module, include: LayerFilter = None) -> list[str]:
    """Names of the ``nn.Linear`` modules of ``model`` (module order) that pass ``include``.

    Args:
        model: any module.
        include: None (all), a regex searched in the module name, a predicate ``name -> bool``, or a list of names.
    """
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and _matches(name, include)]


def select_parameters(model: nn.Module, params: Sequence[str] | None = None) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) pairs in ``model.named_parameters()`` order.

    Args:
        model: the model.
        params: parameter names to keep; None keeps every parameter with ``requires_grad``.

    Raises:
        ValueError: a name in ``params`` is not a parameter of ``model`` (the message lists some valid names).
    """
    named = list(model.named_parameters())
    if params is None:
        return [(n, p) for n, p in named if p.requires_grad]
    wanted = set(params)
    known = {n for n, _ in named}
    unknown = sorted(wanted - known)
    if unknown:
        shown = ", ".join(n for n, _ in named[:8])
        raise ValueError(f"unknown parameter names {unknown}; valid names include: {shown}, ... ({len(named)} in all)")
    return [(n, p) for n, p in named if n in wanted]


def param_slices(model: nn.Module, params: Sequence[str] | None = None) -> dict[str, slice]:
    """Where each selected parameter lives in a row of :func:`exact_rollout_grads` ([N, P]): name -> slice of P."""
    out, start = {}, 0
    for name, p in select_parameters(model, params):
        out[name] = slice(start, start + p.numel())
        start += p.numel()
    return out
