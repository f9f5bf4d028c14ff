"""``grpo-lens probe``: measure the structure of GRPO's gradient on a model, for several group sizes R.

For each R the probe samples a FIXED number of prompts (``--prompts``; it never stops early at the N-th mixed group,
so S1 and every per-group mean are unbiased over the task's prompts), M = max(2R, 8) completions of each (the first
R form the GRPO group; all M give the prompt's success rate and the baseline-variance resampling). By default the
prompts are drawn once for every R (:func:`draw_plan`, docs/theory.md §Shared draws): each prompt's largest M once,
R's group the first R of them, nested across R; ``--independent-draws`` draws each R apart. Every mixed group
(all rewards valid, not all equal) goes through the one per-group analysis path,
:func:`grpo_lens.analysis.group.analyse_group` (the function the trainer's lens calls), plus the model-dependent pieces
(one layer's G1, G2, credit) that return keys of the same vocabulary. The probe then only aggregates rows over groups:
means with 95% intervals (Hall's transformed t) over groups, strata by k (correct count) and by distinct completions,
and G3 (one
matrix over the analysed groups). The mixed groups of one ``generate`` batch share one backward
(:func:`measure_groups`: the block-diagonal exact Gram, each group's [R, R] block); ``--per-group-passes`` runs the
readable reference, a backward per group (:func:`measure_group`), with the same numbers.

probe.json::

    {"meta": {model, task, gradients: "exact_gram"|"sketch"|"exact", gram_coverage, g3_source, sketch_dim, std, eps,
              layer, seconds, resumed (continued a killed probe: ``--resume``), ...},
     "per_group_size": {"<R>": {
         rollouts_per_prompt, prompts_sampled, groups_all_equal, groups_mixed, groups_invalid, s1_measured,
         s1_predicted,
         groups: [{canonical key: value} per analysed group],
         summary: {canonical key: {mean, lo, hi, n}},
         strata: {"correct": {"<k>": {key: {mean, lo, hi, n}}}, "distinct": {"<d>": {...}}},
         g3: {rank/g3_<m>: value, rank/g3_null_<m>: value, groups},  (from the sketch unless --exact)
         gram_coverage,
         spectra: {"G1": [[s_1, ...] per group], "G1_no_adv": [...], "G1_null": [...], "G2": [...]},
         baselines: {variance: {...}, relative_variance: {...}, prompts},
         credit: {position_profile},
         timing: {generation_seconds, gradient_seconds (of which g2_weightings_seconds, sketch_check_seconds),
                  seconds}}},
     "studies": {...}}

While it runs, the probe keeps every finished prompt, group size and study in OUT/probe_partial/
(:mod:`grpo_lens.probe.partial`), so ``--resume`` continues a killed probe with the same numbers.

Keys are named in :mod:`grpo_lens.metrics` (documented in docs/metrics.md); formulas are in docs/theory.md.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from grpo_lens.analysis.group import (
    analyse_group,
    g1_rank_keys,
    g2_keys,
    parameter_category,
    sketch_check_keys,
)
from grpo_lens.config import ConfigError, resolve_device
from grpo_lens.formulas.advantages import compute_advantages, constant_groups
from grpo_lens.formulas.baselines import (
    estimator_variances,
    variance_relative_to_optimal,
)
from grpo_lens.formulas.credit import (
    answer_mask_from_tokenizer,
    completion_positions,
    credit_metrics,
    position_profile,
    token_advantages,
)
from grpo_lens.formulas.losses import loss_normalizer, rollout_gradient_weights
from grpo_lens.formulas.sparsity import s1_predicted_outside_group
from grpo_lens.formulas.spectrum import (
    g2_rank_bound,
    gram_singular_values,
    group_row_sums,
    orthogonal_null_singular_values,
    rank_measures,
    singular_values,
    weighted_gram_singular_values,
    weighted_row_sum,
)
from grpo_lens.formulas.stats import bootstrap_ci, stratify_rows, summarise_rows
from grpo_lens.formulas.zero_sum import WEIGHTINGS, weightings
from grpo_lens.gradients.exact import exact_rollout_grads
from grpo_lens.gradients.g2 import G2WeightingCapture
from grpo_lens.gradients.gram import block_spans, exact_rollout_gram, gram_factor
from grpo_lens.gradients.params import (
    is_linear,
    layer_pattern,
    linear_layer_names,
    param_slices,
    select_layers,
    trainable_count,
)
from grpo_lens.gradients.scores import rollout_scores
from grpo_lens.gradients.sketch import (
    GradientCapture,
    backward_roots,
    sketch_rollout_grads,
    token_grad_sq_norms,
)
from grpo_lens.metrics import (
    G3_GROUPS,
    GRAD_IDENTITY_RESIDUAL,
    GROUP_CORRECT,
    GROUP_DISTINCT_COMPLETIONS,
    GROUPS_ALL_EQUAL,
    GROUPS_INVALID,
    GROUPS_MIXED,
    PROBE_BASELINES,
    PROBE_CREDIT,
    PROBE_G2_WEIGHTINGS,
    PROBE_G3,
    PROBE_GRAM_COVERAGE,
    PROBE_GROUPS,
    PROBE_SKETCH_CHECK,
    PROBE_SPECTRA,
    PROBE_STRATA,
    PROBE_SUMMARY,
    PROBE_TIMING,
    PROMPTS_SAMPLED,
    RANK_G1_VS_NULL,
    ROLLOUTS_PER_PROMPT,
    S1_MEASURED,
    S1_MEASURED_CI,
    S1_PREDICTED,
    S1_PREDICTED_CI,
    SKETCH_COVERAGE,
    ZERO_SUM_STATS,
    rank_key,
    zero_sum_key,
)
from grpo_lens.models import load_model
from grpo_lens.probe.config import ProbeConfig
from grpo_lens.probe.partial import PartialProbe, PromptRecord
from grpo_lens.probe.studies import run_baseline_study, run_credit_study
from grpo_lens.probe.tracking import log_probe
from grpo_lens.report import write_report
from grpo_lens.rewards import parse_reward_specs, score_batch
from grpo_lens.rollout import (
    RolloutBatch,
    batch_logprobs,
    forward_precision,
    sample_groups,
)
from grpo_lens.rundir import atomic_write_text, holds_run_dir
from grpo_lens.runtime.memory import activation_bytes_per_rollout, keep_freed_memory, total_memory_bytes
from grpo_lens.seeding import derive_seed, seed_everything
from grpo_lens.tasks import get_task
from grpo_lens.trackers import check_trackers

logger = logging.getLogger(__name__)


def default_layer(model: torch.nn.Module, layers: str | None = None) -> str:
    """The middle decoder layer's MLP down projection (GPT-2's ``mlp.c_proj``), or the middle linear layer of any
    model, among the linear layers the ``--layers`` pattern keeps (:func:`grpo_lens.gradients.params.select_layers`).

    Raises:
        ValueError: no linear layer (the classes holding the parameters and the coverage), or none matches."""
    names = select_layers(model, layers)
    down = [n for n in names if n.endswith(("down_proj", "mlp.c_proj"))]
    pool = down or [n for n in names if "lm_head" not in n] or names
    return pool[len(pool) // 2]


#: Keys whose summaries the probe also stratifies by k and by distinct completions.
STRATA_KEYS = (
    tuple(rank_key(m, x) for m in ("g1", "g1_null", "g1_no_adv", "g1_random") for x in ("erank", "stable_rank"))
    + tuple(RANK_G1_VS_NULL.format(m=x) for x in ("erank", "stable_rank"))
    + (GRAD_IDENTITY_RESIDUAL,)
    + tuple(zero_sum_key(s, part) for s in ZERO_SUM_STATS for part in ("", "null", "excess", "p"))
    + (GROUP_DISTINCT_COMPLETIONS, GROUP_CORRECT)
)


def score_weights(sub: RolloutBatch, config: ProbeConfig) -> torch.Tensor:
    """omega_i [n] of the per-rollout term the configured loss aggregation weights, with ``sub`` (a group, or a prompt's
    M rollouts) as the batch (docs/theory.md §3; :func:`grpo_lens.losses.rollout_gradient_weights`)."""
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


def _rollout_grads(
    policy, sub: RolloutBatch, config: ProbeConfig, layer: str | None, vectors: bool = True, captures: tuple = ()
) -> RolloutGradients:
    """The per-rollout gradients of ``sub`` in the configured source, from one pass where possible.

    ``exact`` (dense, the oracle): one backward per rollout, every parameter. ``gram_source: exact``: the exact Gram
    of every parameter from one batched backward (:func:`grpo_lens.gradients.gram.exact_rollout_gram`), with the
    sketch (vectors), the layer's exact rows (identity projection) and the token norms captured in the same backward.
    ``gram_source: sketch``: the sketch, its Gram G G^T, the layer's rows in the same pass. ``captures``: more
    context managers opened around the exact Gram's forward and backward (:func:`g2_capture`); only with
    ``gram_source: exact`` and not ``exact`` (ValueError otherwise)."""
    proc = dict(temperature=config.temperature, score_weights=score_weights(sub, config))
    if captures and (config.exact or config.gram_source != "exact"):
        raise ValueError("extra captures ride the exact Gram's pass only (gram_source: exact, not exact)")
    if config.exact:
        grads = exact_rollout_grads(policy, sub, **proc).double().cpu()
        layer_rows = grads[:, param_slices(policy)[layer + ".weight"]] if layer else None
        return RolloutGradients(grads @ grads.T, grads, layer_rows, None)
    if config.gram_source == "exact":
        sketch = (
            GradientCapture(policy, config.sketch_dim, config.sketch_dim, seed=config.seed, token_norms=True)
            if vectors
            else None
        )
        exact = GradientCapture(policy, include=[layer], projection="identity") if layer else None
        captures = [c for c in (sketch, exact, *captures) if c is not None]
        gram, info = exact_rollout_gram(policy, sub, captures=captures, keep_param_grams=True, **proc)
        sk = sketch.result() if sketch is not None else None
        return RolloutGradients(
            gram,
            sk.sketch.double().cpu() if sk else None,
            exact.result().per_layer[layer].cpu() if exact else None,
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
        k_in=config.sketch_dim,
        k_out=config.sketch_dim,
        seed=config.seed,
        token_norms=True,
        exact_layers=[layer] if layer else (),
        **proc,
    )
    g = sk.sketch.double().cpu()
    layer_rows = sk.exact_layers.get(layer) if layer else None
    return [
        RolloutGradients(
            g[a:b] @ g[a:b].T, g[a:b], layer_rows[a:b] if layer_rows is not None else None, sk.token_sq_norms[a:b]
        )
        for a, b in spans
    ]


def measure_group(
    policy,
    tokenizer,
    sub: RolloutBatch,
    rewards: torch.Tensor,
    config: ProbeConfig,
    layer: str,
    seed: int,
    g2: bool = False,
) -> tuple[dict[str, float], dict[str, Any]]:
    """One mixed group of R rollouts (rewards [R]) in a pass of its own: its row of canonical keys and its extras
    (spectra, G3 row, profile); the readable reference of :func:`measure_groups` (tests check that they agree).

    The row is :func:`group_row` of the group's per-rollout gradients (:func:`_rollout_grads`). With ``g2`` and a
    pass that can carry it (:func:`can_fuse_g2`), the extras also hold ``g2_weightings`` (:func:`g2_weightings`'
    keys, from the same backward) and the seconds of its eigen-solves, ``g2_seconds``.
    """
    fused = (
        g2_capture(policy, sub, fused_advantages(rewards, config), rewards, config.layers)
        if g2 and can_fuse_g2(config)
        else None
    )
    measured = _rollout_grads(policy, sub, config, layer, captures=(fused,) if fused is not None else ())
    row, extras = group_row(policy, tokenizer, sub, rewards, measured, config, layer, seed)
    if fused is not None:
        t0 = time.perf_counter()
        extras["g2_weightings"] = fused.result()
        extras["g2_seconds"] = time.perf_counter() - t0
    return row, extras


def fused_advantages(rewards: torch.Tensor, config: ProbeConfig) -> torch.Tensor:
    """A_i [R] of a group's rewards [R] for a G2 capture that rides the group's pass (estimators that need no
    gradient norms: :func:`can_fuse_g2`)."""
    R = rewards.shape[0]
    return compute_advantages(rewards.view(1, R).double(), config.estimator, std=config.std, eps=config.std_eps)[0]


def group_row(
    policy,
    tokenizer,
    sub: RolloutBatch,
    rewards: torch.Tensor,
    measured: RolloutGradients,
    config: ProbeConfig,
    layer: str,
    seed: int,
) -> tuple[dict[str, float], dict[str, Any]]:
    """A mixed group's row of canonical keys and extras from its measured per-rollout gradients (R rollouts, rewards
    [R]), whichever pass measured them (its own, :func:`measure_group`, or one shared with other groups,
    :func:`measure_groups`).

    The row is :func:`grpo_lens.analysis.group.analyse_group` on the group's per-rollout gradients, plus G1 of ``layer``
    (``rank/g1_layer_*``, from the layer's exact per-rollout weight gradients), G2 of ``layer`` (``rank/g2_*``, their
    advantage-weighted sum) and credit (``credit/*``).
    """
    R = sub.num_rollouts
    # Gradients come from the model's device; the analysis runs on the CPU with the rewards (a GPU probe works too).
    gram, g, layer_rows, token_sq = measured.gram, measured.rows, measured.layer_rows.cpu(), measured.token_sq
    cmask, cids = sub.completion_mask.cpu(), sub.completion_ids.cpu()
    sq = gram.diagonal().view(1, R) if config.estimator == "optimal" else None
    adv = compute_advantages(
        rewards.view(1, R).double(), config.estimator, std=config.std, eps=config.std_eps, grad_sq_norms=sq
    )[0]
    # gram [R, R]: every per-group key is a function of it
    # P for the claims' simulated null (issue 29): the sketch's dimension, else every trainable parameter
    dim = (
        g.shape[1] if g is not None and not config.exact and config.gram_source != "exact" else trainable_count(policy)
    )
    row = analyse_group(
        gram,
        rewards.double(),
        adv,
        estimator=config.estimator,
        std=config.std,
        eps=config.std_eps,
        completion_mask=cmask,
        completion_ids=cids,
        num_random=config.random_draws,
        null_dim=dim,
        seed=seed,
    )
    layer_g = layer_rows.double()
    row.update(g1_rank_keys(layer_g @ layer_g.T, adv, "g1_layer"))
    extras: dict[str, Any] = {
        "spectra": {
            "G1": weighted_gram_singular_values(gram, adv).tolist(),
            "G1_no_adv": gram_singular_values(gram).tolist(),
            "G1_null": orthogonal_null_singular_values(gram, adv).tolist(),
        },
        "g3_rows": {name: group_row_sums(g, R, w)[0] for name, w in weightings(adv, rewards).items()},
        "grads": g,
        "advantages": adv,
        "gram_coverage": measured.coverage,
        "param_grams": measured.param_grams,
    }

    # G2: the layer's weight gradient of the group loss sum_i A_i s_i, [d_out, d_in].
    weight = dict(policy.named_modules())[layer].weight
    g2_raw = weighted_row_sum(layer_rows, adv).reshape(weight.shape)  # sum_i A_i G2_i, exact
    bound = g2_rank_bound(sub.prompt_mask.cpu(), cids, cmask)
    s2 = singular_values(g2_raw.double(), method="gram")  # one decomposition for every G2 number
    row.update(g2_keys(g2_raw, bound, computed_dtype=g2_raw.dtype, singular_values=s2))
    extras["spectra"]["G2"] = s2[:64].tolist()

    token_adv = token_advantages(adv, cmask)
    if token_sq is None:  # exact mode: the per-token norms come from one more batched backward
        token_sq = token_grad_sq_norms(
            policy, sub, temperature=config.temperature, score_weights=score_weights(sub, config)
        )
    comp = completion_positions(token_sq.cpu(), sub.prompt_ids.shape[1])  # [R, T]
    answer = answer_mask_from_tokenizer(tokenizer, cids, cmask)
    row.update(credit_metrics(token_adv, comp, cmask, answer))
    extras["profile"] = position_profile(comp.sqrt(), cmask)
    return row, extras


@dataclass
class GroupJob:
    """One mixed group for :func:`measure_groups`: its rows in the batch ([R] long), rewards [R], the seed of its
    analysis and whether its G2 weightings are wanted."""

    rows: torch.Tensor
    rewards: torch.Tensor
    seed: int
    g2: bool = False


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
    if config.exact:
        raise ValueError("_rollout_grads_many: the dense oracle (exact) runs per block, with _rollout_grads")
    spans = block_spans(sizes, big.num_rollouts)
    omega = torch.cat([score_weights(big.select(torch.arange(r0, r1)), config) for r0, r1 in spans])
    proc = dict(temperature=config.temperature, score_weights=omega)
    if config.gram_source == "exact":
        sketch = (
            GradientCapture(policy, config.sketch_dim, config.sketch_dim, seed=config.seed, token_norms=True)
            if vectors
            else None
        )
        exact = GradientCapture(policy, include=[layer], projection="identity") if layer else None
        caps = [c for c in (sketch, exact, *captures) if c is not None]
        gram, info = exact_rollout_gram(policy, big, captures=caps, keep_param_grams=True, blocks=sizes, **proc)
        sk = sketch.result() if sketch is not None else None
        rows = sk.sketch.double().cpu() if sk else None
        layer_rows = exact.result().per_layer[layer].cpu() if exact else None
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


def measure_groups(
    policy, tokenizer, batch: RolloutBatch, jobs: list[GroupJob], config: ProbeConfig, layer: str
) -> list[tuple[dict[str, float], dict[str, Any]]]:
    """:func:`measure_group` of several mixed groups of ``batch``, their gradients from one batched backward per
    :func:`rows_per_pass` rollouts (:func:`_rollout_grads_many`; the G2 captures of the groups that want them ride
    it too, each cut to its group's rows) instead of one backward per group. Each group's row and extras are
    :func:`group_row` of its own block: the same numbers as :func:`measure_group` (tests), float rounding aside.
    ``exact`` (the dense oracle) measures each group in its own pass. Per group, ``extras["pass_seconds"]`` is its
    share (by rows) of the batched pass's seconds."""
    if config.exact:
        out = []
        for job in jobs:
            t0 = time.perf_counter()
            row, extras = measure_group(
                policy, tokenizer, batch.select(job.rows), job.rewards, config, layer, seed=job.seed, g2=job.g2
            )
            extras["pass_seconds"] = time.perf_counter() - t0
            out.append((row, extras))
        return out
    L = batch.prompt_ids.shape[1] + batch.completion_ids.shape[1]
    max_rows = rows_per_pass(policy, L, batch.completion_ids.shape[1], layer, config)
    results: list[tuple[dict[str, float], dict[str, Any]]] = []
    for chunk in pass_chunks([len(j.rows) for j in jobs], max_rows):
        t0 = time.perf_counter()
        part = [jobs[i] for i in chunk]
        big = batch.select(torch.cat([j.rows for j in part]))
        sizes = [len(j.rows) for j in part]
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        fused = {
            k: g2_capture(
                policy,
                big,
                fused_advantages(j.rewards, config),
                j.rewards,
                config.layers,
                rows=(starts[k], starts[k] + sizes[k]),
            )
            for k, j in enumerate(part)
            if j.g2 and can_fuse_g2(config)
        }
        measured = _rollout_grads_many(policy, big, sizes, config, layer, captures=tuple(fused.values()))
        for k, (job, m) in enumerate(zip(part, measured)):
            row, extras = group_row(policy, tokenizer, batch.select(job.rows), job.rewards, m, config, layer, job.seed)
            if k in fused:
                t1 = time.perf_counter()
                extras["g2_weightings"] = fused[k].result()
                extras["g2_seconds"] = time.perf_counter() - t1
            results.append((row, extras))
        seconds = time.perf_counter() - t0
        for k in range(len(part)):  # the pass (and the analyses) shared by rows
            results[len(results) - len(part) + k][1]["pass_seconds"] = seconds * sizes[k] / sum(sizes)
    return results


def can_fuse_g2(config: ProbeConfig) -> bool:
    """Whether the G2 weightings can ride the group's own pass: the exact Gram's backward (``gram_source: exact``,
    not ``exact``) with advantages that do not depend on the gradients (every estimator but ``optimal``)."""
    return config.gram_source == "exact" and not config.exact and config.estimator != "optimal"


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


def batch_seed(seed: int, group_size: int, draw: int) -> int:
    """The seed of the ``draw``-th batch of prompts (1-based) of group size R: the prompts' sampling, their
    completions' sampling and every random number of their analysis derive from it, so a batch is the same whenever
    it is drawn (what ``--resume`` relies on)."""
    return derive_seed(seed, group_size=group_size, draw=draw)


def analyse_prompt(
    policy,
    tokenizer,
    batch: RolloutBatch,
    j: int,
    rewards: torch.Tensor,
    valid: torch.Tensor,
    group_size: int,
    config: ProbeConfig,
    layer: str,
    seed: int,
    done: list[PromptRecord],
) -> PromptRecord:
    """Prompt ``j`` of ``batch`` (its M rollouts, rewards [M], valid [M] bool; the first R form the group): what it
    counts for S1 and, for a mixed group, its analysis (:func:`measure_group`), plus the G2 weightings, the sketch
    check and the baseline variances while fewer than their configured counts are in ``done`` (the R's earlier
    prompts)."""
    R = group_size
    M = rewards.shape[0]
    rows_j = torch.arange(j * M, (j + 1) * M)
    all_valid = bool(valid.all())
    # S1 predicted from the M - R rollouts outside the group (docs/theory.md §S1)
    s1_prediction = float(s1_predicted_outside_group(rewards.view(1, M) >= 1.0, R)[0]) if all_valid else None
    group = rows_j[:R]
    r_g, v_g = rewards[:R], valid[:R]
    if not bool(v_g.all()):
        return PromptRecord("invalid", s1_prediction)
    if bool(constant_groups(r_g.view(1, R), v_g.view(1, R))):
        return PromptRecord("all_equal", s1_prediction)
    t0 = time.perf_counter()
    sub = batch.select(group)
    want_g2 = sum(d.g2_weightings is not None for d in done) < config.g2_groups
    row, extra = measure_group(policy, tokenizer, sub, r_g, config, layer, seed=seed + j, g2=want_g2)
    t1 = time.perf_counter()
    g2w, g2_seconds = extra.pop("g2_weightings", None), extra.pop("g2_seconds", 0.0)
    if want_g2 and g2w is None:
        g2w = g2_weightings(policy, sub, extra, r_g, config)
    t2 = time.perf_counter()
    check = None
    if not config.exact and sum(d.check is not None for d in done) < config.coverage_groups:
        check = sketch_check(policy, sub, extra, config)
    t3 = time.perf_counter()
    extra.pop("grads")
    extra.pop("param_grams")
    variance = None
    if sum(d.baseline_variance is not None for d in done) < config.baseline_prompts and all_valid:
        m = _rollout_grads(policy, batch.select(rows_j), config, None, vectors=False)
        # the trace variance depends on inner products alone: rows of any factor of the Gram give it
        grads_m = m.rows if m.rows is not None else gram_factor(m.gram)
        variance = estimator_variances(grads_m, rewards.double(), R, num_resamples=config.resamples, seed=seed)
    # a fused G2's share: its eigen-solves (its kernels ran inside the group's pass)
    seconds = {"gradient": time.perf_counter() - t0, "g2_weightings": t2 - t1 + g2_seconds, "sketch_check": t3 - t2}
    return PromptRecord("mixed", s1_prediction, row, extra, check, g2w, variance, seconds)


def rollouts_per_prompt(group_size: int) -> int:
    """M = max(2R, 8): the rollouts sampled per prompt for group size R (the first R form the group; all M give the
    prompt's success rate, S1 predicted from the M - R others and the baseline-variance resampling)."""
    R = group_size
    return max(2 * R, 8)


def generation_prompts_per_call(policy, M: int, config: ProbeConfig) -> int:
    """Prompts per ``generate`` call: ``prompts_per_batch``, or with 0 as many as a tenth of the memory holds (as
    ``--micro-batch-size`` is chosen from :func:`grpo_lens.runtime.memory.total_memory_bytes`: total memory, so the
    choice, and so the draws, are the same whenever the probe runs on this machine), at most 16. A rollout's
    ``generate`` keeps two float32 vocabulary rows (raw logits and scores) per new token, which dominates its
    memory: M T V 8 bytes per prompt."""
    if config.prompts_per_batch:
        return config.prompts_per_batch
    total = total_memory_bytes(next(policy.parameters()).device)
    vocab = int(getattr(getattr(policy, "config", None), "vocab_size", 50_000) or 50_000)
    per_prompt = M * config.max_new_tokens * vocab * 8
    return 4 if total is None else int(max(1, min(16, (0.1 * total) // max(per_prompt, 1))))


@dataclass(frozen=True)
class DrawBatch:
    """One ``generate`` call of the probe: ``n`` prompts drawn with ``seed``, M rollouts each; they are prompts
    first .. first + n - 1 of the draws they belong to (``key``: ("pool", draw) shared by every R, or ("R", R,
    draw) for one R's independent draws)."""

    key: tuple
    seed: int
    n: int
    M: int
    first: int


def draw_plan(config: ProbeConfig, policy, group_size: int | None = None) -> list[DrawBatch]:
    """The generate calls behind the probe's prompts, in order (docs/theory.md §Shared draws).

    Shared draws (R None; the default): one pool of max_R prompts_for(R) prompts; prompt p gets M_p = the largest
    M_R of the group sizes that use it (R uses prompts 0 .. prompts_for(R) - 1), so its rollouts serve every R as
    nested prefixes. Consecutive prompts with the same M_p are drawn together, :func:`generation_prompts_per_call`
    at a time, batch ``d`` (1-based) seeded by ``batch_seed(seed, 0, d)``. Independent draws (R given): R's
    prompts_for(R) prompts with M_R rollouts, batch ``d`` seeded by ``batch_seed(seed, R, d)``."""
    R = group_size
    if R is not None:
        M, n_r = rollouts_per_prompt(R), config.prompts_for(R)
        per = generation_prompts_per_call(policy, M, config)
        return [
            DrawBatch(("R", R, d + 1), batch_seed(config.seed, R, d + 1), min(per, n_r - a), M, a)
            for d, a in enumerate(range(0, n_r, per))
        ]
    sizes = sorted(config.group_sizes)
    total = max(config.prompts_for(R) for R in sizes)
    m_of = [max(rollouts_per_prompt(R) for R in sizes if p < config.prompts_for(R)) for p in range(total)]
    plan: list[DrawBatch] = []
    p = 0
    while p < total:
        M = m_of[p]
        run_end = p
        while run_end < total and m_of[run_end] == M:
            run_end += 1
        per = generation_prompts_per_call(policy, M, config)
        for a in range(p, run_end, per):
            d = len(plan) + 1
            plan.append(DrawBatch(("pool", d), batch_seed(config.seed, 0, d), min(per, run_end - a), M, a))
        p = run_end
    return plan


class PromptPool:
    """The probe's sampled prompts and rollouts, each :class:`DrawBatch` generated once and kept (tokens and rewards
    only), so every R, and the baseline study, read the same draws (docs/theory.md §Shared draws)."""

    def __init__(self, policy, tokenizer, task, reward_fns, config: ProbeConfig):
        self.policy, self.tokenizer, self.task, self.reward_fns, self.config = (
            policy,
            tokenizer,
            task,
            reward_fns,
            config,
        )
        self.kept: dict[tuple, tuple[RolloutBatch, torch.Tensor, torch.Tensor]] = {}
        self.generation_seconds = 0.0
        self.rollouts = 0  # sampled (the FLOP count of generation: bench_probe)
        self.tokens = 0  # completion tokens plus each distinct prompt's tokens once (what generate runs)
        self.positions = 0  # prompt + completion positions of the rollouts (what a backward over them runs)

    def get(self, spec: DrawBatch) -> tuple[RolloutBatch, torch.Tensor, torch.Tensor, float]:
        """(batch, rewards [n, M], valid [n, M], seconds per prompt of its generation if it ran now, else 0)."""
        if spec.key in self.kept:
            return (*self.kept[spec.key], 0.0)
        c = self.config
        examples = self.task.sample(spec.n, seed=spec.seed)
        t0 = time.perf_counter()
        batch = sample_groups(
            self.policy,
            self.tokenizer,
            examples,
            spec.M,
            max_new_tokens=c.max_new_tokens,
            temperature=c.temperature,
            top_p=c.top_p,
            top_k=c.top_k,
            generator_seed=spec.seed,
        )
        seconds = time.perf_counter() - t0
        rewards, valid, _ = score_batch(batch, self.reward_fns)  # [n, M]
        self.kept[spec.key] = (batch, rewards, valid)
        self.generation_seconds += seconds
        self.rollouts += batch.num_rollouts
        self.tokens += int(batch.completion_mask.sum()) + int(batch.prompt_mask[:: spec.M].sum())
        self.positions += int(batch.attention_mask().sum())
        return batch, rewards, valid, seconds / spec.n


def estimate_seconds(
    config: ProbeConfig, policy, gen_per_rollout: float, grad_per_row: float, success: list[float]
) -> dict[str, float]:
    """The probe's expected seconds per part from the first batch's measured costs: ``gen_per_rollout`` (seconds per
    sampled rollout), ``grad_per_row`` (seconds of analysis per rollout in a backward) and ``success`` (each first-batch
    prompt's share of correct rollouts, p_hat). A plug-in model, not a promise: R's mixed groups n_R (1 - mean(p^R +
    (1-p)^R)), each R rows; the baseline prompts' M rows; the baseline study's 16 prompts x M = 4R_s rows (sketch
    passes) and the credit study's groups (two backwards and four forwards per group: about 3 rows' cost per
    rollout) plus its Monte Carlo continuations (mc_groups x 2 rollouts x 4 prefixes x mc_samples, each a rollout to
    generate, in calls as large as the first batch's). Generation: every rollout of :func:`draw_plan` (shared draws
    once, independent draws per R).

    Returns:
        {"R=<R>": seconds, ..., "generation": seconds (shared draws; else inside each R), "studies": seconds}.
    """
    out: dict[str, float] = {}
    shared = not config.independent_draws
    if shared:
        out["generation"] = gen_per_rollout * sum(b.n * b.M for b in draw_plan(config, policy))
    ps = success or [0.5]
    for R in config.group_sizes:
        mixed = config.prompts_for(R) * (1 - statistics.fmean(p**R + (1 - p) ** R for p in ps))
        rows = mixed * R + min(config.baseline_prompts, mixed) * rollouts_per_prompt(R)
        gen = 0.0 if shared else gen_per_rollout * config.prompts_for(R) * rollouts_per_prompt(R)
        out[f"R={R}"] = gen + grad_per_row * rows
    rs = config.study_group_size
    base = grad_per_row * config.baseline_study_prompts * 4 * rs
    if not shared or max(rollouts_per_prompt(R) for R in config.group_sizes) < 4 * rs:
        base += gen_per_rollout * config.baseline_study_prompts * 4 * rs * 1.3  # prompts without contrast too
    credit = grad_per_row * 3 * config.credit_groups * rs + gen_per_rollout * (
        config.credit_groups * 1.5 * rs + config.mc_groups * 2 * 4 * config.mc_samples
    )
    out["studies"] = base + (credit if config.credit_groups else 0.0)
    return out


def format_estimate(parts: dict[str, float]) -> str:
    """'about 7 min: generation 150 s, R = 2 60 s, ..., studies 140 s' of :func:`estimate_seconds`' parts."""
    total = sum(parts.values())
    shown = ", ".join(f"{k.replace('=', ' = ')} {v:.0f} s" for k, v in parts.items())
    about = f"{total:.0f} s" if total < 90 else f"{round(total / 60)} min"
    return f"about {about}: {shown}"


def prompt_view(
    batch: RolloutBatch, rewards: torch.Tensor, valid: torch.Tensor, lo: int, hi: int, M: int
) -> tuple[RolloutBatch, torch.Tensor, torch.Tensor]:
    """Prompts lo .. hi - 1 of a drawn batch with the first M of their rollouts (nested draws: R's group and its
    M_R rollouts are a prefix of the prompt's M_p): (batch of (hi - lo) M rollouts, rewards [hi - lo, M], valid)."""
    mp = rewards.shape[1]
    if lo == 0 and hi == rewards.shape[0] and M == mp:
        return batch, rewards, valid
    rows = torch.cat([torch.arange(j * mp, j * mp + M) for j in range(lo, hi)])
    view = replace(
        batch.select(rows),
        group_size=M,
        prompts=batch.prompts[lo:hi],
        extras={k: v[lo:hi] for k, v in batch.extras.items()},
    )
    return view, rewards[lo:hi, :M], valid[lo:hi, :M]


def prompt_status(rewards: torch.Tensor, valid: torch.Tensor, group_size: int) -> tuple[str, float | None]:
    """(status, S1 prediction) of a prompt's M rollouts (rewards [M], valid [M]; the first R its group): "invalid",
    "all_equal" or "mixed", and S1 predicted from the M - R others when all M are valid (docs/theory.md §S1)."""
    R = group_size
    M = rewards.shape[0]
    s1 = float(s1_predicted_outside_group(rewards.view(1, M) >= 1.0, R)[0]) if bool(valid.all()) else None
    r_g, v_g = rewards[:R], valid[:R]
    if not bool(v_g.all()):
        return "invalid", s1
    if bool(constant_groups(r_g.view(1, R), v_g.view(1, R))):
        return "all_equal", s1
    return "mixed", s1


def analyse_prompts(
    policy,
    tokenizer,
    batch: RolloutBatch,
    first: int,
    rewards: torch.Tensor,
    valid: torch.Tensor,
    group_size: int,
    config: ProbeConfig,
    layer: str,
    seed: int,
    done: list[PromptRecord],
) -> list[PromptRecord]:
    """:func:`analyse_prompt` of prompts ``first`` .. B - 1 of ``batch`` (rewards, valid [B, M]), the mixed groups'
    gradients from one batched backward (:func:`measure_groups`) and the baseline prompts' M rollouts from another
    (block-diagonal Gram), instead of a backward per group and per baseline prompt: the same records (tests)."""
    R = group_size
    M = rewards.shape[1]
    counts = {
        "g2": sum(d.g2_weightings is not None for d in done),
        "check": sum(d.check is not None for d in done),
        "base": sum(d.baseline_variance is not None for d in done),
    }
    records: dict[int, PromptRecord] = {}
    jobs: list[tuple[int, GroupJob, bool, bool]] = []  # (j, job, check, baseline)
    for j in range(first, rewards.shape[0]):
        status, s1 = prompt_status(rewards[j], valid[j], R)
        records[j] = PromptRecord(status, s1)
        if status != "mixed":
            continue
        want = {
            "g2": counts["g2"] < config.g2_groups,
            "check": not config.exact and counts["check"] < config.coverage_groups,
            "base": counts["base"] < config.baseline_prompts and bool(valid[j].all()),
        }
        for k, v in want.items():
            counts[k] += int(v)
        jobs.append(
            (
                j,
                GroupJob(torch.arange(j * M, j * M + R), rewards[j][:R], seed + j, want["g2"]),
                want["check"],
                want["base"],
            )
        )
    # 1) every mixed group's gradients and analysis from one batched backward (per rows_per_pass rollouts)
    measured = measure_groups(policy, tokenizer, batch, [job for _, job, _, _ in jobs], config, layer)
    # 2) the baseline prompts' M rollouts: their block-diagonal Gram from one more backward
    base_j = [j for j, _, _, b in jobs if b]
    variances: dict[int, dict[str, float]] = {}
    t0 = time.perf_counter()
    if base_j:
        rows = [torch.arange(j * M, (j + 1) * M) for j in base_j]
        if config.exact:
            grads = [_rollout_grads(policy, batch.select(r), config, None, vectors=False) for r in rows]
        else:
            grads = _rollout_grads_many(
                policy, batch.select(torch.cat(rows)), [M] * len(rows), config, None, vectors=False
            )
        for j, m in zip(base_j, grads):
            # the trace variance depends on inner products alone: rows of any factor of the Gram give it
            grads_m = m.rows if m.rows is not None else gram_factor(m.gram)
            variances[j] = estimator_variances(
                grads_m, rewards[j].double(), R, num_resamples=config.resamples, seed=seed
            )
    base_seconds = (time.perf_counter() - t0) / max(1, len(base_j))
    # 3) per group: the G2 weightings a pass could not carry, the sketch check
    for (j, job, check_wanted, _), (row, extra) in zip(jobs, measured):
        sub = batch.select(job.rows)
        t1 = time.perf_counter()
        g2w, g2_seconds = extra.pop("g2_weightings", None), extra.pop("g2_seconds", 0.0)
        if job.g2 and g2w is None:
            g2w = g2_weightings(policy, sub, extra, job.rewards, config)
        t2 = time.perf_counter()
        check = sketch_check(policy, sub, extra, config) if check_wanted else None
        t3 = time.perf_counter()
        extra.pop("grads")
        extra.pop("param_grams")
        pass_seconds = extra.pop("pass_seconds")
        seconds = {
            "gradient": pass_seconds + t3 - t1 + (base_seconds if j in variances else 0.0),
            "g2_weightings": t2 - t1 + g2_seconds,
            "sketch_check": t3 - t2,
        }
        records[j] = PromptRecord("mixed", records[j].s1_prediction, row, extra, check, g2w, variances.get(j), seconds)
    return [records[j] for j in range(first, rewards.shape[0])]


def probe_group_size(
    policy,
    tokenizer,
    task,
    reward_fns,
    group_size: int,
    config: ProbeConfig,
    layer: str,
    on_prompts: Callable[[int, int], None] | None = None,
    partial: PartialProbe | None = None,
    pool: PromptPool | None = None,
    on_first_batch: Callable[[float, float, list[float]], None] | None = None,
) -> dict[str, Any]:
    """Sample ``config.prompts_for(R)`` prompts with M rollouts each (from ``pool``: shared draws, nested across R,
    unless ``independent_draws``), analyse every mixed group of R, aggregate over groups. ``on_prompts(
    prompts_just_done, mixed_so_far)`` is called after each batch of prompts (the progress bar). With ``partial``,
    each prompt's record is kept there when done, and the prompts it already holds are not measured again
    (``--resume``). ``per_group_passes`` measures each group in its own backward (:func:`analyse_prompt`, the
    reference) instead of :func:`analyse_prompts`' batched one. ``on_first_batch(seconds per generated rollout,
    seconds per analysed rollout row, success share of each prompt)`` is called once, after the first batch this
    call generated and analysed (the probe's time estimate, :func:`estimate_seconds`)."""
    R = group_size
    t_start = time.perf_counter()
    M = rollouts_per_prompt(R)
    n_prompts_r = config.prompts_for(R)
    pool = pool if pool is not None else PromptPool(policy, tokenizer, task, reward_fns, config)
    plan = draw_plan(config, policy, R if config.independent_draws else None)

    # 1) the prompts a killed probe finished
    records = partial.prompt_records(R) if partial is not None else []
    restored_seconds = sum((r.seconds or {}).get(k, 0.0) for r in records for k in ("generation", "gradient"))
    if records and on_prompts is not None:
        on_prompts(len(records), sum(r.status == "mixed" for r in records))
    # 2) the other prompts, batch by batch; a resumed probe may start inside a batch (it draws the batch again)
    for spec in plan:
        hi = min(spec.first + spec.n, n_prompts_r) - spec.first  # R's prompts of this batch: 0 .. hi - 1
        first = len(records) - spec.first
        if hi <= 0 or first >= hi:
            continue
        drawn, rewards_all, valid_all, generation = pool.get(spec)
        batch, rewards, valid = prompt_view(drawn, rewards_all, valid_all, 0, hi, M)
        t_batch, done_before = time.perf_counter(), len(records)
        if config.per_group_passes:
            for j in range(first, hi):
                new = analyse_prompt(
                    policy, tokenizer, batch, j, rewards[j], valid[j], R, config, layer, spec.seed, records
                )
                new.seconds = {**(new.seconds or {}), "generation": generation}
                if partial is not None:
                    partial.save_prompt(R, len(records), new)
                records.append(new)
        else:
            for new in analyse_prompts(
                policy, tokenizer, batch, first, rewards, valid, R, config, layer, spec.seed, records
            ):
                new.seconds = {**(new.seconds or {}), "generation": generation}
                if partial is not None:
                    partial.save_prompt(R, len(records), new)
                records.append(new)
        if on_first_batch is not None and generation > 0:
            new = records[done_before:]
            rows = sum(R + (M if r.baseline_variance is not None else 0) for r in new if r.status == "mixed")
            success = [float((rewards_all[j] >= 1.0).double().mean()) for j in range(rewards_all.shape[0])]
            on_first_batch(generation / spec.M, (time.perf_counter() - t_batch) / max(rows, 1), success)
            on_first_batch = None
        if on_prompts is not None:
            on_prompts(hi - first, sum(r.status == "mixed" for r in records))
    # 3) aggregate over prompts and groups
    out = aggregate_group_size(records, M, config)
    out[PROBE_TIMING]["seconds"] = time.perf_counter() - t_start + restored_seconds  # + the killed run's measuring
    return out


def aggregate_group_size(records: list[PromptRecord], M: int, config: ProbeConfig) -> dict[str, Any]:
    """R's probe.json entry from its prompts' records (in sampling order): counts, S1, summaries and strata over the
    analysed groups, G3 (one matrix over them), spectra, baseline variances, the credit profile, and the summed
    timings (``seconds`` is the records' sum; :func:`probe_group_size` replaces it by the wall time, plus the
    measuring time of the records a killed probe left)."""
    mixed = [r for r in records if r.status == "mixed"]
    rows = [r.row for r in mixed]
    extras = [r.extra for r in mixed]
    checks = [r.check for r in mixed if r.check is not None]
    g2w = [r.g2_weightings for r in mixed if r.g2_weightings is not None]
    baseline_var = [r.baseline_variance for r in mixed if r.baseline_variance is not None]
    sampled = len(records)
    invalid = sum(r.status == "invalid" for r in records)
    all_equal = sum(r.status == "all_equal" for r in records)
    s1_predictions = [r.s1_prediction for r in records if r.s1_prediction is not None]
    # per prompt with all group rewards valid: 1 if its group's rewards are all equal
    s1_indicators = [float(r.status == "all_equal") for r in records if r.status != "invalid"]
    valid_groups = sampled - invalid  # groups whose rollouts all have a valid reward
    # one matrix: no interval (resampled rows would repeat, lowering rank)
    g3: dict[str, Any] = {G3_GROUPS: len(extras)}
    if len(extras) >= 2:
        for name in WEIGHTINGS:
            g3_rows = torch.stack([e["g3_rows"][name] for e in extras])  # [groups, P_s]
            stem = "g3" if name == "adv" else f"g3_{name}"
            g3.update({rank_key(stem, m): v for m, v in rank_measures(singular_values(g3_rows)).items()})
            if name == "adv":
                g3.update({rank_key("g3_null", m): v for m, v in rank_measures(g3_rows.norm(dim=1)).items()})
    profile: list[float] = []
    if extras:
        T = max(len(e["profile"]) for e in extras)
        for t in range(T):
            vals = [
                float(e["profile"][t])
                for e in extras
                if len(e["profile"]) > t and math.isfinite(float(e["profile"][t]))
            ]
            profile.append(statistics.fmean(vals) if vals else 0.0)
    variances = {k: statistics.fmean([v[k] for v in baseline_var]) for k in baseline_var[0]} if baseline_var else {}
    seconds = {
        k: sum((r.seconds or {}).get(k, 0.0) for r in records)
        for k in ("generation", "gradient", "g2_weightings", "sketch_check")
    }
    ci = dict(seed=config.seed)
    return {
        ROLLOUTS_PER_PROMPT: M,
        PROMPTS_SAMPLED: sampled,
        GROUPS_ALL_EQUAL: all_equal,
        GROUPS_MIXED: len(rows),
        GROUPS_INVALID: invalid,
        S1_MEASURED: all_equal / valid_groups if valid_groups else None,
        S1_PREDICTED: statistics.fmean(s1_predictions) if s1_predictions else None,
        S1_PREDICTED_CI: bootstrap_ci(s1_predictions, seed=config.seed),
        S1_MEASURED_CI: bootstrap_ci(s1_indicators, seed=config.seed),
        PROBE_GROUPS: rows,
        PROBE_SUMMARY: summarise_rows(rows, **ci),
        PROBE_STRATA: {
            "correct": stratify_rows(rows, GROUP_CORRECT, keys=STRATA_KEYS, **ci),
            "distinct": stratify_rows(rows, GROUP_DISTINCT_COMPLETIONS, keys=STRATA_KEYS, **ci),
        },
        PROBE_G3: g3,
        PROBE_G2_WEIGHTINGS: {PROBE_GROUPS: g2w, PROBE_SUMMARY: summarise_rows(g2w, **ci)} if g2w else None,
        PROBE_SKETCH_CHECK: {PROBE_GROUPS: checks, PROBE_SUMMARY: summarise_rows(checks, **ci)} if checks else None,
        PROBE_SPECTRA: {name: [e["spectra"][name] for e in extras] for name in ("G1", "G1_no_adv", "G1_null", "G2")},
        PROBE_BASELINES: {
            "variance": variances,
            "relative_variance": variance_relative_to_optimal(variances) if variances else {},
            "prompts": len(baseline_var),
        },
        PROBE_CREDIT: {"position_profile": profile},
        PROBE_GRAM_COVERAGE: min(covs)
        if (covs := [e["gram_coverage"] for e in extras if e["gram_coverage"] is not None])
        else None,
        PROBE_TIMING: {
            "generation_seconds": seconds["generation"],
            "gradient_seconds": seconds["gradient"],
            "g2_weightings_seconds": seconds["g2_weightings"],
            "sketch_check_seconds": seconds["sketch_check"],
            "seconds": seconds["generation"] + seconds["gradient"],
        },  # gradient includes G2 and check
    }


def study_presampled(policy, config: ProbeConfig, pool: PromptPool | None) -> list[tuple]:
    """The shared draws the baseline study reuses (docs/theory.md §Shared draws): every drawn batch with at least M =
    4 R_s rollouts per prompt (R_s = ``study_group_size``), cut to the first M of them, in drawing order; none with
    ``independent_draws`` (the study then draws its own prompts, as before)."""
    if pool is None or config.independent_draws or not config.baseline_study_prompts:
        return []
    M = 4 * config.study_group_size
    out = []
    for spec in draw_plan(config, policy):
        if spec.M >= M:
            batch, rewards, valid, _ = pool.get(spec)
            out.append(prompt_view(batch, rewards, valid, 0, spec.n, M))
    return out


def run_studies(
    policy,
    tokenizer,
    task,
    reward_fns,
    config: ProbeConfig,
    partial: PartialProbe | None = None,
    pool: PromptPool | None = None,
) -> dict[str, Any]:
    """The baseline study (with S1 predicted from rollouts outside the group) and the credit study of
    :mod:`grpo_lens.probe.studies`, at R = ``study_group_size``; a study set to 0 is skipped (absent). With
    ``partial``, a finished study is kept there, and one it already holds is not run again (``--resume``). With
    ``pool`` (shared draws), the baseline study first takes the prompts the R phases drew with enough rollouts
    (:func:`study_presampled`)."""
    common = dict(
        group_size=config.study_group_size,
        max_new_tokens=config.max_new_tokens,
        temperature=config.temperature,
        top_k=config.top_k,
        top_p=config.top_p,
        seed=config.seed,
        prompts_per_batch=generation_prompts_per_call(policy, 4 * config.study_group_size, config),
    )
    studies: dict[str, tuple[int, Callable[[Any], dict[str, Any]]]] = {
        "baselines": (
            config.baseline_study_prompts,
            lambda bar: run_baseline_study(
                policy,
                tokenizer,
                task,
                reward_fns,
                prompts=config.baseline_study_prompts,
                max_prompts=4 * config.baseline_study_prompts,
                sketch_dim=config.sketch_dim,
                resamples=max(config.resamples, 2),
                progress=bar,
                presampled=study_presampled(policy, config, pool),
                **common,
            ),
        ),
        "credit": (
            config.credit_groups,
            lambda bar: run_credit_study(
                policy,
                tokenizer,
                task,
                reward_fns,
                groups=config.credit_groups,
                max_prompts=6 * config.credit_groups,
                mc_groups=config.mc_groups,
                mc_samples=config.mc_samples,
                std=config.std,
                eps=config.std_eps,
                progress=bar,
                **common,
            ),
        ),
    }
    out: dict[str, Any] = {
        name: kept
        for name, (size, _) in studies.items()
        if size > 0 and partial is not None and (kept := partial.study(name)) is not None
    }
    # one bar over the studies left: a tick per analysed prompt (baselines) or group (credit), with tqdm's estimate
    bar = tqdm(
        total=sum(size for name, (size, _) in studies.items() if name not in out),
        desc="probe studies",
        unit="group",
        disable=not config.progress,
    )
    for name, (size, run) in studies.items():
        if size > 0 and name not in out:
            out[name] = run(bar)
            if partial is not None:
                partial.save_study(name, out[name])
    bar.close()
    return {name: out[name] for name in studies if name in out}


def prepare_out(config: ProbeConfig) -> PartialProbe:
    """Check what --out holds against --resume / --overwrite, before anything is written; return its partial probe
    (OUT/probe_partial/, :mod:`grpo_lens.probe.partial`).

    A new probe needs an OUT without probe.json or a partial probe, or ``overwrite`` (:func:`run_probe` deletes the
    partial probe once the model has loaded and the layer is checked). ``resume`` needs a partial probe whose
    settings equal ``config``'s but for the resumable ones.

    Raises:
        ConfigError: what OUT holds does not allow what was asked, saying what to pass instead.
    """
    if not config.out:
        raise ConfigError("probe field 'out' (flag --out) is required: the directory to write probe.json to")
    out = Path(config.out)
    partial = PartialProbe(out)
    if config.resume:
        if not partial.exists():
            held = "a finished probe (probe.json)" if (out / "probe.json").exists() else "no partial probe"
            raise ConfigError(
                f"--resume: {out} holds {held}, nothing to resume (no {partial.config_path}); run "
                f"without --resume to start a probe (with --overwrite to replace probe.json)"
            )
        partial.check_config(config.to_dict())
    elif partial.exists() and not config.overwrite:
        raise ConfigError(
            f"{out} holds a probe that did not finish ({partial.path}); pass --resume to continue it "
            f"from its last finished group, --overwrite to start over, or choose another --out"
        )
    elif (out / "probe.json").exists() and not config.overwrite:
        raise ConfigError(f"{out}/probe.json exists; pass --overwrite to replace it or choose another --out")
    return partial


@holds_run_dir("probe")  # one writer per --out (grpo_lens.rundir.acquire_run_lock)
def run_probe(config: ProbeConfig, policy=None, tokenizer=None) -> Path:
    """Run the probe and write OUT/probe.json and OUT/report.md; return OUT.

    What is measured is kept in OUT/probe_partial/ as it is measured (:mod:`grpo_lens.probe.partial`), so a killed
    probe continues from its last finished prompt with ``config.resume`` and writes the probe.json an uninterrupted
    probe would (timings aside); the folder is deleted once probe.json is written.

    Args:
        config: probe settings; ``out`` is required.
        policy, tokenizer: an already loaded model (the demo passes the trained one); loaded from config.model if
            None.

    Raises:
        ConfigError: bad settings, --out holding a probe without --overwrite (or a partial one without --resume or
            --overwrite), --resume without a partial probe or with other settings than it.
        ModelNotFoundError: no such model.
    """
    check_trackers(config.report_to)  # a missing tracker library fails before --out is touched
    keep_freed_memory()  # each pass's activations are reused, not page-faulted in again
    partial = prepare_out(config)
    out = Path(config.out)
    task = get_task(config.task, dataset=config.dataset, **config.task_options)
    reward_fns = parse_reward_specs(config.rewards)
    seed_everything(config.seed)
    t0 = time.perf_counter()
    if policy is None:
        device = resolve_device(config.device)
        dtype = torch.bfloat16 if config.dtype == "bfloat16" else torch.float32  # bf16-mixed: float32 weights
        policy, tokenizer = load_model(config.model, dtype=dtype, device=device)
    policy.eval()  # no dropout: gradients of the sampling distribution
    try:  # a model without linear layers, or --layers matching none: one line, before anything is written
        layer = config.layer or default_layer(policy, config.layers)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if layer not in linear_layer_names(policy):
        raise ConfigError(
            f"probe field 'layer' = {layer!r} is not a linear layer of the model; e.g. "
            f"{', '.join(linear_layer_names(policy)[:4])}, ..."
        )
    if not config.resume:  # a new probe (--overwrite: over a partial one)
        partial.remove()
        partial.start(config.to_dict())
    per_group_size = {}
    pool = PromptPool(policy, tokenizer, task, reward_fns, config)  # every R's draws (shared unless independent)
    estimated: dict[str, float] = {}

    def on_first_batch(gen_per_rollout: float, grad_per_row: float, success: list[float]) -> None:
        if not estimated:  # once, from the first batch the probe measured
            estimated.update(estimate_seconds(config, policy, gen_per_rollout, grad_per_row, success))
            logger.info(
                "probe: %s (estimated from the first batch: %.2f s per generated rollout, %.2f s per analysed rollout)",
                format_estimate(estimated),
                gen_per_rollout,
                grad_per_row,
            )

    progress = None
    if config.progress:
        progress = tqdm(total=sum(config.prompts_for(R) for R in config.group_sizes), desc="probe", unit="prompt")
    for R in config.group_sizes:

        def on_prompts(done: int, mixed: int, group_size: int = R) -> None:
            if progress is not None:
                progress.set_postfix(R=group_size, mixed=mixed, refresh=False)
                progress.update(done)

        if (finished := partial.group_size_result(R)) is not None:  # measured before the probe was killed
            per_group_size[str(R)] = finished
            on_prompts(finished[PROMPTS_SAMPLED], finished[GROUPS_MIXED])
            continue
        with forward_precision(next(policy.parameters()).device, config.dtype):  # bf16-mixed: bf16 autocast
            per_group_size[str(R)] = probe_group_size(
                policy, tokenizer, task, reward_fns, R, config, layer, on_prompts, partial, pool, on_first_batch
            )
        partial.save_group_size_result(R, per_group_size[str(R)])
        logger.info(
            "probe R = %d: %d mixed groups of %d prompts in %.0f s",
            R,
            per_group_size[str(R)][GROUPS_MIXED],
            per_group_size[str(R)][PROMPTS_SAMPLED],
            per_group_size[str(R)][PROBE_TIMING]["seconds"],
        )
    if progress is not None:
        progress.close()
    t_studies = time.perf_counter()
    if config.baseline_study_prompts or config.credit_groups:
        logger.info(
            "probe studies at R = %d: baselines on %d prompts, token credit on %d groups",
            config.study_group_size,
            config.baseline_study_prompts,
            config.credit_groups,
        )
    with forward_precision(next(policy.parameters()).device, config.dtype):
        studies = run_studies(policy, tokenizer, task, reward_fns, config, partial, pool)
    t_studies = time.perf_counter() - t_studies
    checks = [
        c for d in per_group_size.values() if d.get(PROBE_SKETCH_CHECK) for c in d[PROBE_SKETCH_CHECK][PROBE_GROUPS]
    ]
    check_summary = summarise_rows(checks, seed=config.seed) if checks else {}
    covs = [d[PROBE_GRAM_COVERAGE] for d in per_group_size.values() if d.get(PROBE_GRAM_COVERAGE) is not None]
    gradients = "exact" if config.exact else ("exact_gram" if config.gram_source == "exact" else "sketch")
    meta = {
        "model": config.model,
        "task": config.task,
        "gradients": gradients,
        "gram_coverage": min(covs) if covs else None,
        "g3_source": "exact" if config.exact else "sketch",
        "sketch_coverage": (check_summary.get(SKETCH_COVERAGE) or {}).get("mean"),
        "sketch_check": check_summary,
        "estimator": config.estimator,
        "loss_aggregation": config.loss_aggregation,
        "sketch_dim": None if config.exact else config.sketch_dim,
        "std": config.std,
        "eps": config.std_eps,
        "layer": layer,
        "parameters": sum(p.numel() for p in policy.parameters()),
        "seconds": time.perf_counter() - t0,
        "studies_seconds": t_studies,
        "resumed": config.resume,  # continued a killed probe (OUT/probe_partial/); its numbers are the same
        # how the prompts were drawn: "nested" (once for every R, docs/theory.md §Shared draws) or "independent"
        "draws": "independent" if config.independent_draws else "nested",
        "prompts_per_batch": {
            str(R): generation_prompts_per_call(policy, rollouts_per_prompt(R), config) for R in config.group_sizes
        },
        # what this process sampled (a resumed probe: only what it drew again), for bench_probe's FLOP floor
        "timing": {
            "generation_rollouts": pool.rollouts,
            "generation_tokens": pool.tokens,
            "rollout_positions": pool.positions,
            "generation_seconds": pool.generation_seconds,
            "estimate_seconds": estimated,
        },
        # how this command treated --out is not what the probe is: stored as False (as train's config.yaml)
        "config": {**{f.name: getattr(config, f.name) for f in fields(config)}, "resume": False, "overwrite": False},
    }
    out.mkdir(parents=True, exist_ok=True)

    atomic_write_text(
        out / "probe.json", json.dumps({"meta": meta, "per_group_size": per_group_size, "studies": studies}, indent=1)
    )
    partial.remove()
    write_report(out)
    log_probe(out, config.report_to, meta["config"])  # --report-to: the numbers of probe.json to the trackers
    return out
