"""Which parameters and linear layers the per-rollout gradients cover, and where each lives in a gradient row.

Shapes: P parameters (the columns of an exact per-rollout gradient matrix [N, P]). :func:`select_parameters` picks
(name, parameter) pairs (default: every trainable parameter), :func:`param_slices` maps each to its columns of P,
:func:`linear_layer_names` lists the ``nn.Linear`` modules a :data:`LayerFilter` keeps (the layers the sketch covers).
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
