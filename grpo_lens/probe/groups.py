"""One group's measurement: its gradients through :func:`grpo_lens.analysis.group.analyse_group` plus the
model-dependent pieces (G1 of one layer, G2, credit), one row of canonical keys per mixed group, a backward per
group (:func:`measure_group`) or one per ``generate`` batch (:func:`measure_groups`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from grpo_lens.analysis.group import (
    analyse_group,
    g1_rank_keys,
    g2_keys,
)
from grpo_lens.formulas.advantages import compute_advantages
from grpo_lens.formulas.baselines import estimator_variances
from grpo_lens.formulas.credit import (
    answer_mask_from_tokenizer,
    completion_positions,
    credit_metrics,
    position_profile,
    token_advantages,
)
from grpo_lens.formulas.spectrum import (
    g2_rank_bound,
    gram_singular_values,
    group_row_sums,
    orthogonal_null_singular_values,
    singular_values,
    weighted_gram_singular_values,
    weighted_row_sum,
)
from grpo_lens.formulas.zero_sum import weightings
from grpo_lens.gradients.gram_blocks import gram_factor
from grpo_lens.gradients.params import trainable_count
from grpo_lens.gradients.sketch import token_grad_sq_norms
from grpo_lens.probe.config import ProbeConfig
from grpo_lens.probe.draws import DrawnPrompts, prompt_status
from grpo_lens.probe.gradient_sources import (
    RolloutGradients,
    _rollout_grads,
    _rollout_grads_many,
    can_fuse_g2,
    g2_capture,
    g2_weightings,
    pass_chunks,
    rows_per_pass,
    score_weights,
    sketch_check,
)
from grpo_lens.probe.partial import PromptRecord
from grpo_lens.rollout import RolloutBatch


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

    The row is :func:`group_row` of the group's per-rollout gradients
    (:func:`grpo_lens.probe.gradient_sources._rollout_grads`). With ``g2`` and a
    pass that can carry it (:func:`grpo_lens.probe.gradient_sources.can_fuse_g2`), the extras also hold
    ``g2_weightings`` (:func:`grpo_lens.probe.gradient_sources.g2_weightings`'
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
    gradient norms: :func:`grpo_lens.probe.gradient_sources.can_fuse_g2`)."""
    R = rewards.shape[0]
    # the config's check allows only these names
    return compute_advantages(rewards.view(1, R).double(), config.estimator, std=config.std, std_eps=config.std_eps)[0]  # type: ignore[arg-type]


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
    # the probe asks for the layer's rows
    gram, g, layer_rows, token_sq = measured.gram, measured.rows, measured.layer_rows.cpu(), measured.token_sq  # type: ignore[union-attr]
    cmask, cids = sub.completion_mask.cpu(), sub.completion_ids.cpu()
    sq = gram.diagonal().view(1, R) if config.estimator == "optimal" else None
    # the config's check allows only these names
    adv = compute_advantages(
        rewards.view(1, R).double(),
        config.estimator,
        std=config.std,  # type: ignore[arg-type]
        std_eps=config.std_eps,
        grad_sq_norms=sq,
    )[0]
    # gram [R, R]: every per-group key is a function of it
    # P for the claims' simulated null: the sketch's dimension, else every trainable parameter
    dim = (
        g.shape[1]
        if g is not None and not config.dense_oracle and config.gram_source != "exact"
        else trainable_count(policy)
    )
    row = analyse_group(
        gram,
        rewards.double(),
        adv,
        estimator=config.estimator,
        std=config.std,
        std_eps=config.std_eps,
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
        # rows are kept for the G3 study
        "g3_rows": {name: group_row_sums(g, R, w)[0] for name, w in weightings(adv, rewards).items()},  # type: ignore[arg-type]
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


def measure_groups(
    policy, tokenizer, batch: RolloutBatch, jobs: list[GroupJob], config: ProbeConfig, layer: str
) -> list[tuple[dict[str, float], dict[str, Any]]]:
    """:func:`measure_group` of several mixed groups of ``batch``, their gradients from one batched backward per
    :func:`grpo_lens.probe.gradient_sources.rows_per_pass` rollouts
    (:func:`grpo_lens.probe.gradient_sources._rollout_grads_many`; the G2 captures of the groups that want them ride
    it too, each cut to its group's rows) instead of one backward per group. Each group's row and extras are
    :func:`group_row` of its own block: the same numbers as :func:`measure_group` (tests), float rounding aside.
    ``exact`` (the dense oracle) measures each group in its own pass. Per group, ``extras["pass_seconds"]`` is its
    share (by rows) of the batched pass's seconds."""
    if config.dense_oracle:
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


def analyse_prompt(
    policy, tokenizer, drawn: DrawnPrompts, j: int, config: ProbeConfig, layer: str, done: list[PromptRecord]
) -> PromptRecord:
    """Prompt ``j`` of ``drawn`` (its M rollouts; the first R form the group): what it counts for S1 and, for a mixed
    group, its analysis (:func:`measure_group`), plus the G2 weightings, the sketch check and the baseline variances
    while fewer than their configured counts are in ``done`` (the R's earlier prompts)."""
    R = drawn.group_size
    rewards, valid = drawn.rewards[j], drawn.valid[j]  # [M] each
    M = rewards.shape[0]
    rows_j = torch.arange(j * M, (j + 1) * M)
    all_valid = bool(valid.all())
    status, s1_prediction = prompt_status(rewards, valid, R)
    if status != "mixed":
        return PromptRecord(status, s1_prediction)
    r_g = rewards[:R]
    t0 = time.perf_counter()
    sub = drawn.batch.select(rows_j[:R])
    want_g2 = sum(d.g2_weightings is not None for d in done) < config.g2_groups
    row, extra = measure_group(policy, tokenizer, sub, r_g, config, layer, seed=drawn.seed + j, g2=want_g2)
    t1 = time.perf_counter()
    g2w, g2_seconds = extra.pop("g2_weightings", None), extra.pop("g2_seconds", 0.0)
    if want_g2 and g2w is None:
        g2w = g2_weightings(policy, sub, extra, r_g, config)
    t2 = time.perf_counter()
    check = None
    if not config.dense_oracle and sum(d.check is not None for d in done) < config.coverage_groups:
        check = sketch_check(policy, sub, extra, config)
    t3 = time.perf_counter()
    extra.pop("grads")
    extra.pop("param_grams")
    variance = None
    if sum(d.baseline_variance is not None for d in done) < config.baseline_prompts and all_valid:
        m = _rollout_grads(policy, drawn.batch.select(rows_j), config, None, vectors=False)
        # the trace variance depends on inner products alone: rows of any factor of the Gram give it
        grads_m = m.rows if m.rows is not None else gram_factor(m.gram)
        variance = estimator_variances(grads_m, rewards.double(), R, num_resamples=config.resamples, seed=drawn.seed)
    # a fused G2's share: its eigen-solves (its kernels ran inside the group's pass)
    seconds = {"gradient": time.perf_counter() - t0, "g2_weightings": t2 - t1 + g2_seconds, "sketch_check": t3 - t2}
    return PromptRecord("mixed", s1_prediction, row, extra, check, g2w, variance, seconds)
