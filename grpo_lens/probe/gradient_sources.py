"""Where the probe's per-rollout gradients come from: the capture set-up of one backward over one group
(:func:`_rollout_grads`) or over the mixed groups of a ``generate`` batch (:func:`_rollout_grads_many`), the
sketch-only pass, the G2 weightings' capture and the sketch check against exact gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from grpo_lens.analysis.group import (
    parameter_category,
    sketch_check_keys,
)
from grpo_lens.formulas.losses import loss_normalizer, rollout_gradient_weights
from grpo_lens.formulas.zero_sum import weightings
from grpo_lens.gradients.exact import exact_rollout_grads
from grpo_lens.gradients.g2 import G2WeightingCapture
from grpo_lens.gradients.gram import exact_rollout_gram
from grpo_lens.gradients.gram_blocks import block_spans
from grpo_lens.gradients.params import (
    is_linear,
    layer_pattern,
    linear_layer_names,
    param_slices,
    select_layers,
)
from grpo_lens.gradients.scores import rollout_scores
from grpo_lens.gradients.sketch import (
    GradientCapture,
    backward_roots,
    sketch_rollout_grads,
    square_sketch,
)
from grpo_lens.probe.config import ProbeConfig
from grpo_lens.rollout import (
    RolloutBatch,
    batch_logprobs,
)
from grpo_lens.runtime.memory import activation_bytes_per_rollout, total_memory_bytes


def default_layer(model: torch.nn.Module, layers: str | None = None) -> str:
    """The middle decoder layer's MLP down projection (GPT-2's ``mlp.c_proj``), or the middle linear layer of any
    model, among the linear layers the ``--layers`` pattern keeps (:func:`grpo_lens.gradients.params.select_layers`).

    Raises:
        ValueError: no linear layer (the classes holding the parameters and the coverage), or none matches."""
    names = select_layers(model, layers)
    down = [n for n in names if n.endswith(("down_proj", "mlp.c_proj"))]
    pool = down or [n for n in names if "lm_head" not in n] or names
    return pool[len(pool) // 2]


def score_weights(sub: RolloutBatch, config: ProbeConfig) -> torch.Tensor:
    """omega_i [n] of the per-rollout term the configured loss aggregation weights, with ``sub`` (a group, or a prompt's
    M rollouts) as the batch (docs/theory.md §3; :func:`grpo_lens.formulas.losses.rollout_gradient_weights`)."""
    mask = sub.completion_mask
    return rollout_gradient_weights(
        mask, config.loss_aggregation, loss_normalizer(mask, config.loss_aggregation, config.max_new_tokens)
    )


@dataclass
class RolloutGradients:
    """One pass's per-rollout gradient measurements of a group (or a prompt's M rollouts), n rollouts.

    gram: [n, n] float64, <g_i, g_j> over the source's parameters (every Gram-based number uses it).
    rows: [n, P] vectors (P_s columns for the sketch) whose G G^T is the Gram or an estimate of it (the sketch with
        the exact Gram; what G3 across groups and the sketch check need), or None when not asked for.
    layer_rows: [n, d_out*d_in] exact rows of the probed layer's weight gradient, or None.
    token_sq: [n, Lp+T] per-position squared norms of the linear weights' gradient, or None.
    coverage: the exact Gram's share of the trainable parameters (None for the sketch and dense modes).
    param_grams: {parameter name: [n, n] float64} the exact Gram's per-parameter terms (exact Gram only), for the
        sketch check.
    """

    gram: torch.Tensor
    rows: torch.Tensor | None
    layer_rows: torch.Tensor | None
    token_sq: torch.Tensor | None
    coverage: float | None = None
    param_grams: dict[str, torch.Tensor] | None = None


def gram_captures(
    policy, config: ProbeConfig, layer: str | None, vectors: bool
) -> tuple[GradientCapture | None, GradientCapture | None]:
    """The probe's one capture set-up for the exact Gram's backward (:func:`_rollout_grads` of one group,
    :func:`_rollout_grads_many` of a ``generate`` batch): the sketch of every linear layer with its token norms
    (None unless ``vectors``) and the probed layer's exact rows (identity projection; None without ``layer``)."""
    sketch = (
        GradientCapture(policy, config.sketch_dim, config.sketch_dim, seed=config.seed, token_norms=True)
        if vectors
        else None
    )
    exact = GradientCapture(policy, include=[layer], projection="identity") if layer else None
    return sketch, exact


def _rollout_grads(
    policy, sub: RolloutBatch, config: ProbeConfig, layer: str | None, vectors: bool = True, captures: Sequence = ()
) -> RolloutGradients:
    """The per-rollout gradients of ``sub`` in the configured source, from one pass where possible.

    ``exact`` (dense, the oracle): one backward per rollout, every parameter. ``gram_source: exact``: the exact Gram
    of every parameter from one batched backward (:func:`grpo_lens.gradients.gram.exact_rollout_gram`), with the
    sketch (vectors), the layer's exact rows (identity projection) and the token norms captured in the same backward.
    ``gram_source: sketch``: the sketch, its Gram G G^T, the layer's rows in the same pass. ``captures``: more
    context managers opened around the exact Gram's forward and backward (:func:`g2_capture`); only with
    ``gram_source: exact`` and not ``exact`` (ValueError otherwise)."""
    proc: dict[str, Any] = dict(temperature=config.temperature, score_weights=score_weights(sub, config))
    if captures and (config.dense_oracle or config.gram_source != "exact"):
        raise ValueError("extra captures ride the exact Gram's pass only (gram_source: exact, not exact)")
    if config.dense_oracle:
        grads = exact_rollout_grads(policy, sub, **proc).double().cpu()
        layer_rows = grads[:, param_slices(policy)[layer + ".weight"]] if layer else None
        return RolloutGradients(grads @ grads.T, grads, layer_rows, None)
    if config.gram_source == "exact":
        sketch, exact = gram_captures(policy, config, layer, vectors)
        captures = [c for c in (sketch, exact, *captures) if c is not None]
        gram, info = exact_rollout_gram(policy, sub, captures=captures, keep_param_grams=True, **proc)
        sk = sketch.result() if sketch is not None else None
        return RolloutGradients(
            gram,
            sk.sketch.double().cpu() if sk else None,
            exact.result().per_layer[layer].cpu() if exact else None,  # type: ignore[index]  # exact: layer is set
            sk.token_sq_norms if sk else None,
            info["coverage"],
            info["param_grams"],
        )
    return sketch_gradients(policy, sub, [(0, sub.num_rollouts)], config, layer, proc)[0]


def sketch_gradients(
    policy, batch: RolloutBatch, spans: list[tuple[int, int]], config: ProbeConfig, layer: str | None, proc: dict
) -> list[RolloutGradients]:
    """Each group's sketched :class:`RolloutGradients` (Gram = rows rows^T) from one sketch pass over ``batch``.

    Args:
        batch: N rollouts.  spans: each group's row range [(a, b)] in it.  layer: the probed layer, whose exact rows
            ride the pass (None: none).  proc: the pass's temperature and score_weights ([N] omega_i).

    Returns:
        per span, :class:`RolloutGradients` with the sketched Gram [n, n] (an estimate: the sketch covers the linear
        weights, docs/theory.md §8), its rows [n, P_s], the layer's exact rows [n, d_out*d_in] or None and the token
        norms [n, Lp+T]; no coverage or per-parameter Grams (the sketch has none).

    Raises:
        ValueError: see :func:`grpo_lens.gradients.sketch.sketch_rollout_grads`.
    """
    sk = sketch_rollout_grads(
        policy,
        batch,
        **square_sketch(config.sketch_dim),
        seed=config.seed,
        token_norms=True,
        exact_layers=[layer] if layer else (),
        **proc,
    )
    g = sk.sketch.double().cpu()
    layer_rows = sk.exact_layers.get(layer) if layer else None
    return [
        RolloutGradients(
            g[a:b] @ g[a:b].T,
            g[a:b],
            layer_rows[a:b] if layer_rows is not None else None,
            sk.token_sq_norms[a:b],  # type: ignore[index]  # token_norms=True: the sketch holds them
        )
        for a, b in spans
    ]


def rows_per_pass(policy, seq_len: int, scored_len: int, layer: str | None, config: ProbeConfig) -> int:
    """Rollouts one batched backward of the probe may hold, from the memory available (as ``--micro-batch-size``
    is chosen: :func:`grpo_lens.runtime.memory.auto_micro_batch_size`, a quarter of what the weights leave), counting
    per rollout its activations and the probed layer's exact row (float32, and a float64 copy); at least 1."""
    device = next(policy.parameters()).device
    total = total_memory_bytes(device)
    per_row = activation_bytes_per_rollout(policy, seq_len, scored_len)
    if layer:
        per_row += 12 * dict(policy.named_modules())[layer].weight.numel()
    if total is None:
        return 8
    params = sum(p.numel() * p.element_size() for p in policy.parameters())
    return int(max(1, (0.25 * (total - 4 * params)) // max(per_row, 1)))


def pass_chunks(sizes: list[int], max_rows: int) -> list[list[int]]:
    """Consecutive items (sizes: rows of each) into chunks of at most ``max_rows`` rows (an item larger than that is
    a chunk alone): the groups of each batched backward."""
    chunks: list[list[int]] = []
    rows = 0
    for i, n in enumerate(sizes):
        if not chunks or rows + n > max_rows:
            chunks.append([])
            rows = 0
        chunks[-1].append(i)
        rows += n
    return chunks


def _rollout_grads_many(
    policy,
    big: RolloutBatch,
    sizes: list[int],
    config: ProbeConfig,
    layer: str | None,
    vectors: bool = True,
    captures: tuple = (),
) -> list[RolloutGradients]:
    """:func:`_rollout_grads` of consecutive row blocks of ``big`` (sizes, summing to its N rows: groups, or a
    prompt's M rollouts) from ONE batched pass: with ``gram_source: exact`` the block-diagonal exact Gram
    (:func:`grpo_lens.gradients.gram.exact_rollout_gram` with ``blocks``: each block's [n, n] Gram, nothing across
    blocks), with the sketch its rows (per rollout, so per block alike). Each block's omega_i are its own
    (:func:`score_weights` of the block as the batch), so every block's numbers are those of its own pass. Not for
    ``exact`` (one backward per rollout: :func:`_rollout_grads` per block)."""
    if config.dense_oracle:
        raise ValueError("_rollout_grads_many: the dense oracle (exact) runs per block, with _rollout_grads")
    spans = block_spans(sizes, big.num_rollouts)
    omega = torch.cat([score_weights(big.select(torch.arange(r0, r1)), config) for r0, r1 in spans])
    proc: dict[str, Any] = dict(temperature=config.temperature, score_weights=omega)
    if config.gram_source == "exact":
        sketch, exact = gram_captures(policy, config, layer, vectors)
        caps = [c for c in (sketch, exact, *captures) if c is not None]
        gram, info = exact_rollout_gram(policy, big, captures=caps, keep_param_grams=True, blocks=sizes, **proc)
        sk = sketch.result() if sketch is not None else None
        rows = sk.sketch.double().cpu() if sk else None
        layer_rows = exact.result().per_layer[layer].cpu() if exact else None  # type: ignore[index]  # exact: layer set
        token_sq = sk.token_sq_norms if sk else None
        pg = info["param_grams"]
        return [
            RolloutGradients(
                gram[a:b, a:b].clone(),
                rows[a:b] if rows is not None else None,
                layer_rows[a:b] if layer_rows is not None else None,
                token_sq[a:b] if token_sq is not None else None,
                info["coverage"],
                {k: v[a:b, a:b].clone() for k, v in pg.items()},
            )
            for a, b in spans
        ]
    if captures:
        raise ValueError("extra captures ride the exact Gram's pass only (gram_source: exact, not exact)")
    return sketch_gradients(policy, big, spans, config, layer, proc)


def can_fuse_g2(config: ProbeConfig) -> bool:
    """Whether the G2 weightings can ride the group's own pass: the exact Gram's backward (``gram_source: exact``,
    not ``exact``) with advantages that do not depend on the gradients (every estimator but ``optimal``)."""
    return config.gram_source == "exact" and not config.dense_oracle and config.estimator != "optimal"


def g2_capture(
    policy,
    sub: RolloutBatch,
    advantages: torch.Tensor,
    rewards: torch.Tensor,
    layers: str | None = None,
    rows: tuple[int, int] | None = None,
) -> G2WeightingCapture:
    """The G2 capture of one group (advantages, rewards [R]): every weighting of
    :data:`grpo_lens.formulas.zero_sum.WEIGHTINGS`, the group's prompt folded as its shared prefix, over the linear
    layers the ``--layers`` pattern keeps (all for None). ``rows``: the group's rows (r0, r1) in a pass over ``sub``
    that holds several groups; None: ``sub`` is the group."""
    lp = sub.prompt_ids.shape[1]
    return G2WeightingCapture(
        policy,
        weightings(advantages, rewards),
        shared_prefix=lp,
        seq_len=lp + sub.completion_ids.shape[1],
        include=layer_pattern(layers) if layers else None,
        rows=rows,
    )


def g2_weightings(
    policy, sub: RolloutBatch, extra: dict[str, Any], rewards: torch.Tensor, config: ProbeConfig
) -> dict[str, float]:
    """Stable rank of every linear layer's G2 under every weighting of
    :data:`grpo_lens.formulas.zero_sum.WEIGHTINGS`, summarised by module kind, from one backward
    (:class:`grpo_lens.gradients.g2.G2WeightingCapture`), for a pass that could not carry it (:func:`can_fuse_g2`)."""
    capture = g2_capture(policy, sub, extra["advantages"], rewards, config.layers)
    emb_out: list[torch.Tensor] = []
    handle = policy.get_input_embeddings().register_forward_hook(lambda m, a, o: emb_out.append(o))
    try:
        with capture:
            logp = batch_logprobs(policy, sub, config.temperature)
            loss = rollout_scores(logp, sub.completion_mask, score_weights(sub, config)).sum()
            # differentiate w.r.t. the embedding output: every layer's delta, no weight-gradient GEMMs
            roots = backward_roots(emb_out, capture.layers.values())
            torch.autograd.grad(loss, roots, allow_unused=True)
    finally:
        handle.remove()
    return capture.result()


def sketch_check(policy, sub: RolloutBatch, extra: dict[str, Any], config: ProbeConfig) -> dict[str, float]:
    """The exact Gram of every parameter for one analysed group, set against its sketch
    (:func:`grpo_lens.analysis.group.sketch_check_keys`: coverage of ||g||^2, Gram error and its bound, erank error).

    The per-parameter exact Grams come from the group's own pass with ``gram_source: exact`` (``extra["param_grams"]``)
    or, with the sketch, from one more batched backward (:func:`grpo_lens.gradients.gram.exact_rollout_gram`), never
    from [R, P] vectors."""
    param_grams = extra.get("param_grams")
    if param_grams is None:
        _, info = exact_rollout_gram(
            policy, sub, temperature=config.temperature, score_weights=score_weights(sub, config), keep_param_grams=True
        )
        param_grams = info["param_grams"]
    modules = dict(policy.named_modules())
    category_sq: dict[str, float] = {}
    for name, g in param_grams.items():
        cat = parameter_category(name, is_linear(modules.get(name.rsplit(".", 1)[0])))
        category_sq[cat] = category_sq.get(cat, 0.0) + float(g.trace())
    names = {id(p): n for n, p in policy.named_parameters()}
    weights = [names.get(id(modules[n].weight)) for n in linear_layer_names(policy)]
    layer_grams = [param_grams[n] for n in dict.fromkeys(weights) if n in param_grams]
    gram = torch.stack(list(param_grams.values())).sum(0)
    return sketch_check_keys(
        gram, extra["grads"], extra["advantages"], category_sq, layer_grams, config.sketch_dim, config.sketch_dim
    )
