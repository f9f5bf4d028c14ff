"""Which parameters and linear layers the per-rollout gradients cover, and where each lives in a gradient row.

Shapes: P parameters (the columns of an exact per-rollout gradient matrix [N, P]). :func:`select_parameters` picks
(name, parameter) pairs (default: every trainable parameter), :func:`param_slices` maps each to its columns of P,
:func:`linear_layer_names` lists the linear layers a :data:`LayerFilter` keeps (the layers the sketch and G2 cover).

A *linear layer* is an ``nn.Linear`` (y = x W^T + b, weight [d_out, d_in]) or a transformers ``Conv1D`` (GPT-2's,
y = x W + b, weight [d_in, d_out]): the same map with the weight transposed (:func:`is_linear`,
:func:`weight_transposed`, :func:`linear_shape`). Every hook reads a layer's input x [.., d_in] and output gradient
delta [.., d_out]; the per-rollout weight gradient is sum_t delta_t x_t^T in ``nn.Linear``'s layout and its
transpose in ``Conv1D``'s, so inner products, norms and singular values are the same in both.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Callable, Sequence

from torch import nn
from transformers.pytorch_utils import Conv1D

#: The module classes whose weight is a linear map of the layer input (hooked by the Gram, the sketch and G2).
LINEAR_CLASSES: tuple[type, ...] = (nn.Linear, Conv1D)


def is_linear(module: nn.Module | None) -> bool:
    """Whether ``module`` is a linear layer: an ``nn.Linear`` or a transformers ``Conv1D`` (module docstring)."""
    return isinstance(module, LINEAR_CLASSES)


def weight_transposed(module: nn.Module) -> bool:
    """True for a ``Conv1D`` (weight [d_in, d_out], y = x W + b), False for an ``nn.Linear`` (weight [d_out, d_in])."""
    return isinstance(module, Conv1D)


def linear_shape(module: nn.Module) -> tuple[int, int]:
    """(d_out, d_in) of a linear layer, whatever its weight's layout."""
    d0, d1 = module.weight.shape  # type: ignore[misc]  # a linear layer's weight: nn.Module types it Tensor | Module
    return (d1, d0) if weight_transposed(module) else (d0, d1)


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
    """Names of the linear layers (``nn.Linear`` and ``Conv1D``, :func:`is_linear`) of ``model`` (module order) that
    pass ``include``.

    Args:
        model: any module.
        include: None (all), a regex searched in the module name, a predicate ``name -> bool``, or a list of names.
    """
    return [name for name, m in model.named_modules() if is_linear(m) and _matches(name, include)]


def linear_coverage(model: nn.Module) -> tuple[float, dict[str, int]]:
    """(share of the trainable parameter count held by linear-layer weights -- what the sketch and G2 see --,
    {module class: trainable parameters of that class's modules outside those weights}, largest first).

    A parameter shared by several modules counts once, under its first user."""
    seen: set[int] = set()
    linear = total = 0
    other: dict[str, int] = {}
    for m in model.modules():
        for attr, p in m.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            total += p.numel()
            if is_linear(m) and attr == "weight":
                linear += p.numel()
            else:
                other[type(m).__name__] = other.get(type(m).__name__, 0) + p.numel()
    return (linear / total if total else 0.0), dict(sorted(other.items(), key=lambda kv: -kv[1]))


def no_linear_layer_message(model: nn.Module, what: str = "to probe") -> str:
    """One line for a model without a linear layer the sketch / G2 / probe could hook: the classes that hold its
    parameters and the linear layers' coverage (0 %), e.g. ``the model has no linear layer (nn.Linear or
    transformers Conv1D) to probe: its parameters are in MyProj (4096), Embedding (1024); linear layers cover 0.0%
    of its 5120 trainable parameters``."""
    share, other = linear_coverage(model)
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    classes = ", ".join(f"{c} ({n})" for c, n in list(other.items())[:6]) or "no trainable module"
    return (
        f"the model has no linear layer (nn.Linear or transformers Conv1D) {what}: its parameters are in "
        f"{classes}; linear layers cover {100 * share:.1f}% of its {total} trainable parameters"
    )


def layer_pattern(pattern: str) -> Callable[[str], bool]:
    """The predicate of ``--layers PATTERN`` over module names: a name matches when the pattern matches the whole
    name as a glob (:func:`fnmatch.fnmatchcase`: ``*``, ``?``, ``[...]``) or is found in it as a regular expression
    (:func:`re.search`; a pattern that is no valid regex is a glob only). E.g. ``*.mlp.*``, ``layers\\.1\\.``,
    ``c_attn|c_proj``."""
    try:
        rx = re.compile(pattern)
    except re.error:
        rx = None
    return lambda name: fnmatch.fnmatchcase(name, pattern) or (rx is not None and rx.search(name) is not None)


def select_layers(model: nn.Module, pattern: str | None) -> list[str]:
    """The linear layers :func:`layer_pattern` keeps (all of them for None), in module order.

    Raises:
        ValueError: no linear layer matches (the message lists a few valid names), or the model has none.
    """
    names = linear_layer_names(model)
    if not names:
        raise ValueError(no_linear_layer_message(model))
    if pattern is None:
        return names
    kept = [n for n in names if layer_pattern(pattern)(n)]
    if not kept:
        shown = ", ".join(names[:3] + names[-2:] if len(names) > 5 else names)
        raise ValueError(
            f"--layers {pattern!r} matches no linear layer of the model (a glob over the whole name or "
            f"a regex searched in it); its {len(names)} linear layers include {shown}"
        )
    return kept


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


def trainable_count(model: nn.Module) -> int:
    """P: the number of trainable parameters of ``model`` (the dimension the exact per-rollout gradients g_i live in;
    the claims' simulated null draws directions in R^P, docs/theory.md §11). Counts the whole model also when FSDP2
    shards it: a DTensor's ``shape`` is the global one."""
    return sum(math.prod(p.shape) for p in model.parameters() if p.requires_grad)
