"""LoGra sketches of per-rollout gradients from ONE batched backward (docs/theory.md §8, §Lens sketch from the update).

Notation: N rollouts, L = Lp + T input positions, d_in / d_out a linear layer's sizes, sketch_in / sketch_out sketch
sizes. Hooks on linear layers (``nn.Linear``, ``Conv1D``) capture each layer's input x_t [d_in] and output gradient
delta_t [d_out] during one backward. For a linear layer the per-rollout weight gradient is
sum_{t in row i} delta_t x_t^T; its two-sided random projection P_out (sum_t delta_t x_t^T) P_in^T =
sum_t (P_out delta_t)(P_in x_t)^T is formed from the projected vectors only (LoGra, Choe et al. 2024, arXiv
2405.13954, §3; TRAK, Park et al. 2023), never materialising the [N, P] matrix.
Sketched inner products are unbiased; their error is :mod:`grpo_lens.formulas.sketch_error`.

- :class:`GradientCapture`: the context manager that sketches whatever backward runs inside it (the lens opens it
  around the trainer's own first on-policy pass); :class:`GradientSketch` its result.
- :func:`sketch_rollout_grads`: sketched g_i of a batch (backward with respect to the input-embedding output,
  :func:`backward_roots`, so no weight gradient is computed); :func:`token_grad_sq_norms`: exact per-position
  squared norms from the same hooks.
- :func:`sketched_rollout_sq_norms`: ||c_i g_i||^2 per rollout, the weights of ``--estimator optimal``'s b*.

Only weights of linear layers are sketched (``nn.Linear``, and transformers' ``Conv1D`` of GPT-2, whose weight is the
transpose: :func:`grpo_lens.gradients.params.is_linear`): embeddings, norms and biases are not. With tied embeddings
the ``lm_head`` sketch covers the output-projection use of the shared matrix only. The exact oracle is
:mod:`grpo_lens.gradients.exact`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypedDict

import torch
from torch import Tensor, nn

from grpo_lens.formulas.losses import aggregation_rollout_weights
from grpo_lens.formulas.spectrum import nll_weights, weighted_row_sum
from grpo_lens.gradients.params import (
    LayerFilter,
    linear_layer_names,
    linear_shape,
    no_linear_layer_message,
    weight_transposed,
)
from grpo_lens.gradients.scores import rollout_scores
from grpo_lens.rollout import RolloutBatch, batch_logprobs
from grpo_lens.seeding import derive_seed

Projection = Literal["gaussian", "identity"]


@dataclass
class GradientSketch:
    """Per-rollout gradient sketches of linear layers, as returned by :meth:`GradientCapture.result`.

    Attributes:
        per_layer: {layer name: [N, sketch_out*sketch_in] float}, row i = vec(P_out G_{i,l} P_in^T) with
            G_{i,l} = sum_{t in row i} delta_t x_t^T the row's weight gradient of layer l (row-major over
            [sketch_out, sketch_in]; over [sketch_in, sketch_out] for a ``Conv1D``, whose weight is [d_in, d_out]: so
            with identity projections it is ``weight_grad.flatten()`` in either layout).
        sketch_in, sketch_out: sketch sizes per side (None for identity projections, where they are the layer's
            d_in, d_out); grpo-lens passes ``sketch_dim`` d_s to both, so a layer's row has d_s^2 entries.
        token_sq_norms: [N, L] float or None: sum over layers of ||delta_t||^2 ||x_t||^2, the squared Frobenius norm
            of position t's rank-1 contribution delta_t x_t^T to the weight gradients (exact, not sketched).
        exact_layers: {layer name: [N, d_out*d_in]} exact per-row weight gradients of the layers asked for with
            ``exact_layers=`` in :func:`sketch_rollout_grads` (the same pass, identity projection), else empty.
    """

    per_layer: dict[str, Tensor]
    sketch_in: int | None = None
    sketch_out: int | None = None
    token_sq_norms: Tensor | None = None
    layer_names: list[str] = field(default_factory=list)
    exact_layers: dict[str, Tensor] = field(default_factory=dict)

    @property
    def sketch(self) -> Tensor:
        """[N, P_s] the per-layer sketches side by side (P_s = L * sketch_out * sketch_in), in ``layer_names`` order."""
        return torch.cat([self.per_layer[n] for n in self.layer_names], dim=1)

    @property
    def num_rollouts(self) -> int:
        """N."""
        return next(iter(self.per_layer.values())).shape[0] if self.per_layer else 0

    def gram(self) -> Tensor:
        """[N, N] sketched Gram matrix sum_l S_l S_l^T, an unbiased estimate of (<g_i, g_j>) over the sketched
        layers."""
        s = self.sketch
        return s @ s.T

    def weighted_sum(self, weights: Tensor) -> Tensor:
        """[P_s] sketch of sum_i w_i g_i (``weights`` [N]; A for the policy gradient, :func:`nll_weights` for NLL)."""
        return weighted_row_sum(self.sketch, weights)


class _PassState:
    """Results of one forward pass (micro-batch) of the model: rows, per-layer sums, token norms."""

    def __init__(self) -> None:
        self.rows: int | None = None
        self.length: int | None = None
        self.layers: dict[str, Tensor] = {}
        self.token_sq: Tensor | None = None


class GradientCapture:
    """Context manager that sketches per-row weight gradients of linear layers (``nn.Linear``, ``Conv1D``) during a
    backward.

    Inside the context every grad-enabled forward of ``model`` is a "pass"; a forward hook projects each linear
    layer's input x [n, L, d_in] to P_in x [n, L, sketch_in], and a hook on the layer's output tensor receives
    delta = d loss / d output [n, L, d_out] during backward and adds

        S_{r, l} = sum_t (P_out delta_{r,t}) (P_in x_{r,t})^T   [sketch_out, sketch_in]  (batched matmul per layer)

    for every row r of the pass. Rows never interact inside a transformer, so S_r is the sketch of the gradient of
    the loss's row-r term: backpropagating sum_i s_i gives the g_i, the trainer's loss gives its per-rollout terms.
    All positions of a row contribute (prompt activations feed the completion through attention). Rows of several
    passes (micro-batches) are concatenated in forward order; a pass that never receives a gradient is dropped.

    Projections are fixed seeded Gaussians with N(0, 1/sketch_in) and N(0, 1/sketch_out) entries, one pair per layer,
    seeded by (seed, crc32(layer name)), so that E[<S(A), S(B)>] = <A, B> (error:
    :func:`grpo_lens.formulas.sketch_error.sketch_gram_error_bound`).
    Cost per layer: two thin matmuls (n L d_in sketch_in and n L d_out sketch_out) and one [sketch_out, n L] x [n L,
    sketch_in] product, against n L d_in d_out for the layer itself. Layer calls under ``torch.no_grad`` are ignored.
    A module called several times in one pass (shared weights) gets the sum of its calls' sketches. Not compatible with
    activation checkpointing.

    Args:
        model: the module whose linear layers are hooked (its forward marks passes).
        sketch_in: sketch size on the layer-input side (ignored with ``projection="identity"``).
        sketch_out: sketch size on the layer-output side (likewise).
        include: layer filter (:func:`linear_layer_names`).
        projection: ``"gaussian"`` or ``"identity"`` (P = I: the exact per-row weight gradient; for tests).
        seed: projection seed.
        token_norms: also accumulate [N, L] per-position squared norms (:attr:`GradientSketch.token_sq_norms`).
        dtype: dtype of the stored sketches (float32; float64 for exactness tests).

    Raises:
        ValueError: unknown projection, sketch_in or sketch_out < 1, or no linear layer matches ``include`` (for a
            model without any: the classes holding its parameters and the linear layers' coverage, 0 %).

    Example::

        with GradientCapture(model, sketch_in=16, sketch_out=16) as cap:
            loss = policy_loss(model, batch)      # the trainer's own forward ...
            loss.backward()                       # ... and backward
        sketch = cap.result()                     # per-rollout rows of its loss gradient
    """

    def __init__(
        self,
        model: nn.Module,
        sketch_in: int = 16,
        sketch_out: int = 16,
        include: LayerFilter = None,
        *,
        projection: Projection = "gaussian",
        seed: int = 0,
        token_norms: bool = False,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if projection not in ("gaussian", "identity"):
            raise ValueError(f"unknown projection {projection!r}; valid names: gaussian, identity")
        if projection == "gaussian" and (sketch_in < 1 or sketch_out < 1):
            raise ValueError(f"sketch sizes must be >= 1, got sketch_in={sketch_in}, sketch_out={sketch_out}")
        self.model = model
        self.projection = projection
        # None for the identity projection, which has no sketch sizes
        self.sketch_in, self.sketch_out = (sketch_in, sketch_out) if projection == "gaussian" else (None, None)  # type: ignore[var-annotated]
        self.seed = seed
        self.token_norms = token_norms
        self.dtype = dtype
        modules = dict(model.named_modules())
        self.layer_names = linear_layer_names(model, include)
        if not self.layer_names:
            raise ValueError(
                no_linear_layer_message(model, "to sketch")
                if not linear_layer_names(model)
                else f"no linear layer of the model matches include={include!r}"
            )
        self._modules = {n: modules[n] for n in self.layer_names}
        self._transposed = {n for n in self.layer_names if weight_transposed(modules[n])}
        self._proj: dict[str, tuple[Tensor, Tensor]] = {}
        self._cast: dict[tuple[str, torch.dtype, torch.device], tuple[Tensor, Tensor]] = {}
        self._handles: list = []
        self._passes: list[_PassState] = []
        self._current: _PassState | None = None

    # -- projections ------------------------------------------------------------------------------------------

    def projections(self, name: str) -> tuple[Tensor, Tensor]:
        """(P_in [sketch_in, d_in], P_out [sketch_out, d_out]) float32 of layer ``name`` (Gaussian, N(0, 1/sketch_in)
        and N(0, 1/sketch_out) entries)."""
        if name not in self._proj:
            d_out, d_in = linear_shape(self._modules[name])
            gen = torch.Generator().manual_seed(derive_seed(self.seed, name, modulus=2**63))
            p_in = torch.randn(self.sketch_in, d_in, generator=gen) / math.sqrt(self.sketch_in)
            p_out = torch.randn(self.sketch_out, d_out, generator=gen) / math.sqrt(self.sketch_out)
            self._proj[name] = (p_in, p_out)
        return self._proj[name]

    def _projections_like(self, name: str, t: Tensor) -> tuple[Tensor, Tensor]:
        key = (name, t.dtype, t.device)
        if key not in self._cast:
            p_in, p_out = self.projections(name)
            # Transposed once, so the hooks do x @ P_in^T as a plain matmul.
            self._cast[key] = (p_in.to(t.device, t.dtype).T.contiguous(), p_out.to(t.device, t.dtype).T.contiguous())
        return self._cast[key]

    # -- hooks --------------------------------------------------------------------------------------------------

    def _on_model_forward(self, module, args, kwargs) -> None:
        if torch.is_grad_enabled():
            self._current = _PassState()
            self._passes.append(self._current)

    def _on_linear_forward(self, name: str, module: nn.Module, args, output) -> None:
        state = self._current
        if state is None or not torch.is_grad_enabled() or not isinstance(output, Tensor) or not output.requires_grad:
            return
        x = args[0]
        x3 = x.reshape(x.shape[0], -1, x.shape[-1]) if x.dim() != 2 else x.unsqueeze(1)  # [n, L, d_in]
        if state.rows is None:
            state.rows, state.length = x3.shape[0], x3.shape[1]
        if self.projection == "gaussian":
            p_in_t, _ = self._projections_like(name, x3)
            xp = (x3 @ p_in_t).to(self.dtype)  # [n, L, sketch_in]
        else:
            xp = x3.detach().to(self.dtype)
        xnorm_sq = x3.detach().float().square().sum(-1) if self.token_norms else None  # [n, L]

        def on_grad(grad: Tensor) -> None:
            d3 = grad.reshape(xp.shape[0], xp.shape[1], grad.shape[-1])  # [n, L, d_out]
            if self.projection == "gaussian":
                _, p_out_t = self._projections_like(name, d3)
                dp = (d3 @ p_out_t).to(self.dtype)  # [n, L, sketch_out]
            else:
                dp = d3.to(self.dtype)
            if name in self._transposed:  # Conv1D: the weight's own layout [d_in, d_out]
                rows = torch.bmm(xp.transpose(1, 2), dp).flatten(1)  # [n, sketch_in * sketch_out]
            else:
                rows = torch.bmm(dp.transpose(1, 2), xp).flatten(1)  # [n, sketch_out * sketch_in]
            prev = state.layers.get(name)
            state.layers[name] = rows if prev is None else prev + rows
            if xnorm_sq is not None:
                tok = d3.float().square().sum(-1) * xnorm_sq  # [n, L'] ||delta_t||^2 ||x_t||^2
                if tok.shape[1] < state.length:  # a layer run on the last L' positions only (the LM head under
                    tok = torch.nn.functional.pad(tok, (state.length - tok.shape[1], 0))  # logits_to_keep)
                state.token_sq = tok if state.token_sq is None else state.token_sq + tok

        output.register_hook(on_grad)

    # -- context ------------------------------------------------------------------------------------------------

    def __enter__(self) -> GradientCapture:
        self._handles.append(self.model.register_forward_pre_hook(self._on_model_forward, with_kwargs=True))
        for name, module in self._modules.items():
            self._handles.append(
                module.register_forward_hook(lambda m, a, o, _name=name: self._on_linear_forward(_name, m, a, o))
            )
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._current = None

    def clear(self) -> None:
        """Forget captured passes (e.g. between steps of a capture kept open)."""
        self._passes.clear()
        self._current = None

    def result(self) -> GradientSketch:
        """The sketches of all passes that received a gradient, rows in forward order.

        Returns:
            :class:`GradientSketch` with ``per_layer`` [N, sketch_out*sketch_in] (identity: [N, d_out*d_in]) and, with
            ``token_norms``, ``token_sq_norms`` [N, L_max] (zero-padded on the right if passes differ in length).

        Raises:
            RuntimeError: no pass received a gradient (no backward ran inside the context).
        """
        passes = [p for p in self._passes if p.layers]
        if not passes:
            raise RuntimeError("no gradient was captured: run the forward and backward inside the GradientCapture")
        per_layer = {}
        for name in self.layer_names:
            blocks = []
            for p in passes:
                if name in p.layers:
                    blocks.append(p.layers[name])
                else:  # the layer's output did not reach the loss in this pass: zero gradient
                    d_out, d_in = linear_shape(self._modules[name])
                    width = (self.sketch_out * self.sketch_in) if self.projection == "gaussian" else d_out * d_in
                    blocks.append(
                        # the gaussian sketch has sketch_in, sketch_out
                        torch.zeros(p.rows, width, dtype=self.dtype, device=self._modules[name].weight.device)  # type: ignore[arg-type]
                    )
            per_layer[name] = torch.cat(blocks)
        token_sq = None
        if self.token_norms:
            # token_norms: each pass has its length
            width = max(p.length for p in passes)  # type: ignore[type-var]
            token_sq = torch.cat(
                [
                    # token_norms: each pass has its length
                    torch.nn.functional.pad(p.token_sq, (0, width - p.token_sq.shape[1]))  # type: ignore[operator]
                    if p.token_sq is not None
                    else torch.zeros(p.rows, width)  # type: ignore[arg-type]
                    for p in passes
                ]
            )
        return GradientSketch(per_layer, self.sketch_in, self.sketch_out, token_sq, list(self.layer_names))


def backward_roots(emb_out: list[Tensor], layers: Iterable[nn.Module]) -> list[Tensor]:
    """Tensors to differentiate the loss with respect to so that every hooked layer output gets its gradient but no
    parameter gradient (dW) is computed: the input-embedding outputs ``emb_out`` (collected by a forward hook on
    ``model.get_input_embeddings()``) when they all require grad, else the weights of ``layers`` that do."""
    if emb_out and all(t.requires_grad for t in emb_out):
        return emb_out
    # nn.Module types a layer's attribute as Tensor | Module
    return [m.weight for m in layers if m.weight.requires_grad]  # type: ignore[misc]


class SketchSides(TypedDict):
    """``sketch_in`` and ``sketch_out`` of :func:`sketch_rollout_grads` (:class:`GradientCapture`)."""

    sketch_in: int
    sketch_out: int


def square_sketch(sketch_dim: int) -> SketchSides:
    """sketch_in = sketch_out = sketch_dim (``--sketch-dim``): the square sketch of every linear weight that the lens,
    the probe and its studies take; pass it as ``**square_sketch(sketch_dim)``."""
    return SketchSides(sketch_in=sketch_dim, sketch_out=sketch_dim)


def sketch_rollout_grads(
    model: nn.Module,
    batch: RolloutBatch,
    *,
    sketch_in: int = 16,
    sketch_out: int = 16,
    include: LayerFilter = None,
    projection: Projection = "gaussian",
    seed: int = 0,
    weights: Tensor | None = None,
    score_weights: Tensor | None = None,
    token_norms: bool = False,
    dtype: torch.dtype = torch.float32,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    exact_layers: Sequence[str] = (),
) -> GradientSketch:
    """Sketched per-rollout gradients w_i g_i of all (filtered) linear layers from ONE batched forward + backward.

    Backpropagates sum_i w_i s_i (s_i from :func:`rollout_scores`, w = 1 unless ``weights``) inside a
    :class:`GradientCapture`. The backward is taken with respect to the input-embedding output, so autograd
    computes every layer's delta but no weight gradient: ``.grad`` is untouched and the weight-gradient GEMMs of
    a plain backward are skipped.

    Args:
        model: causal LM.
        batch: N rollouts.
        sketch_in: see :class:`GradientCapture`.
        sketch_out: see :class:`GradientCapture`.
        include: see :class:`GradientCapture`.
        projection: see :class:`GradientCapture`.
        seed: see :class:`GradientCapture`.
        token_norms: see :class:`GradientCapture`.
        dtype: see :class:`GradientCapture`.
        weights: [N] row weights (``A`` gives sketched G1 rows A_i g_i).
        score_weights: [N] omega_i of :func:`rollout_scores` (default 1/|o_i|; docs/theory.md §3).
        exact_layers: linear layer names whose exact per-row weight gradients are captured in the same pass (a second
            capture with identity projection; [N, d_out*d_in] each, in ``GradientSketch.exact_layers``).
        temperature: the sampling temperature. top_k, top_p: ignored (docs/theory.md §Log-probabilities).

    Returns:
        :class:`GradientSketch`: ``per_layer`` [N, sketch_out*sketch_in], ``sketch`` [N, L*sketch_out*sketch_in],
        optional ``token_sq_norms`` [N, Lp+T].

    Raises:
        ValueError: see :class:`GradientCapture`.
        RuntimeError: nothing in the model requires grad.
    """
    n = batch.num_rollouts
    if weights is not None:
        assert weights.shape == (n,), (weights.shape, n)
    capture = GradientCapture(
        model, sketch_in, sketch_out, include, projection=projection, seed=seed, token_norms=token_norms, dtype=dtype
    )
    emb_out: list[Tensor] = []
    # nn.Module types a transformers model's attribute as Tensor | Module
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None  # type: ignore[operator]
    handle = emb.register_forward_hook(lambda m, a, o: emb_out.append(o)) if emb is not None else None
    exact = (
        GradientCapture(model, include=list(exact_layers), projection="identity", dtype=dtype) if exact_layers else None
    )
    try:
        with capture, exact if exact is not None else contextlib.nullcontext():
            logp = batch_logprobs(model, batch, temperature)
            scores = rollout_scores(logp, batch.completion_mask, score_weights)
            loss = scores.sum() if weights is None else (scores * weights.to(scores.dtype)).sum()
            roots = backward_roots(emb_out, capture._modules.values())
            if not loss.requires_grad or not roots:
                raise RuntimeError("the model's outputs do not require grad; nothing to sketch")
            torch.autograd.grad(loss, roots, allow_unused=True)
    finally:
        if handle is not None:
            handle.remove()
    result = capture.result()
    if exact is not None:
        result.exact_layers = exact.result().per_layer
    return result


def token_grad_sq_norms(
    model: nn.Module, batch: RolloutBatch, *, include: LayerFilter = None, weights: Tensor | None = None, **processing
) -> Tensor:
    """Per-position squared gradient norms [N, Lp+T] of the linear weights (one batched backward).

    Entry (i, t) = sum_l ||delta_{i,t,l}||^2 ||x_{i,t,l}||^2 = sum_l ||delta x^T||_F^2, exact because each
    position's contribution to a linear layer's weight gradient is the rank-one matrix delta_t x_t^T. Position
    Lp - 1 + t is where log pi(o_t) is computed (see :func:`grpo_lens.formulas.credit.completion_positions`).
    """
    # token_norms=True: token_sq is set
    return sketch_rollout_grads(  # type: ignore[return-value]
        model, batch, sketch_in=1, sketch_out=1, include=include, weights=weights, token_norms=True, **processing
    ).token_sq_norms


def sketch_policy_grad(sketch: GradientSketch, advantages: Tensor) -> Tensor:
    """[P_s] sketch of sum_i A_i g_i from per-rollout sketches of g_i (advantages [N] or [B, R])."""
    return sketch.weighted_sum(advantages.reshape(-1))


def sketch_nll_grad(sketch: GradientSketch, completion_mask: Tensor) -> Tensor:
    """[P_s] sketch of the token-mean NLL gradient of the same completions (completion_mask [N, T])."""
    return sketch.weighted_sum(nll_weights(completion_mask))


def sketched_rollout_sq_norms(
    model: torch.nn.Module,
    batch: RolloutBatch,
    need: Tensor,
    *,
    aggregation: str = "seq-mean-token-mean",
    sketch_dim: int = 16,
    seed: int = 0,
    projection: str = "gaussian",
    temperature: float = 1.0,
) -> Tensor:
    """||c_i g_i||^2 per rollout from one sketched batched backward: the weights of the leave-one-out b*.

    Only the rollouts with ``need`` True are sketched (the trainer passes the rollouts of groups with reward
    contrast; the others get advantage 0 whatever their norm). The norms are those of every linear-layer weight
    (embeddings and norms are not sketched), estimated from the two-sided Gaussian sketch of
    :func:`sketch_rollout_grads` (unbiased per layer; relative error bounded by
    :func:`grpo_lens.formulas.sketch_error.kronecker_sketch_variance_factor`), or exact with ``projection="identity"``.
    The projections are fixed by ``seed`` and independent of the rollouts, so b*_{-i} stays independent of
    rollout i and the policy-gradient estimate stays unbiased whatever the sketch error.

    Args:
        model: the policy, in the mode the loss is computed in.
        batch: N rollouts.
        need: [N] bool.
        aggregation: the trainer's loss aggregation (gives c_i,
            :func:`grpo_lens.formulas.losses.aggregation_rollout_weights`).
        sketch_dim: the sketch side d_s, sketch_in = sketch_out = d_s per linear layer.
        seed: projection seed.
        projection: "gaussian" or "identity" (exact; for tests and small models).
        temperature: the sampling temperature (the policy's log-probs, docs/theory.md §Log-probabilities).

    Returns:
        [N] float64 in squared gradient units (0 where ``need`` is False).

    Raises:
        ValueError: the model has no linear layer, or an unknown aggregation / projection.
    """

    n = batch.num_rollouts
    assert need.shape == (n,), (need.shape, n)
    out = torch.zeros(n, dtype=torch.float64)
    idx = need.nonzero().reshape(-1).cpu()
    if len(idx) == 0:
        return out
    sub = batch.select(idx)
    c = aggregation_rollout_weights(sub.completion_mask, aggregation)
    # the config's check allows only these names
    sketch = sketch_rollout_grads(
        model,
        sub,
        **square_sketch(sketch_dim),
        projection=projection,  # type: ignore[arg-type]
        seed=seed,
        temperature=temperature,
    )
    sq = sum(t.detach().double().square().sum(-1).cpu() for t in sketch.per_layer.values())
    out[idx] = sq * c.square()
    return out
