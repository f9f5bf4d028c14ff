"""The probe's estimate for one group size R: every prompt drawn and analysed (:func:`analyse_prompts`), then the
rows aggregated over groups into means with intervals, strata, G3 and S1 (:func:`aggregate_group_size`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from grpo_lens import metrics as mk
from grpo_lens.formulas.baselines import (
    estimator_variances,
    variance_relative_to_optimal,
)
from grpo_lens.formulas.spectrum import (
    rank_measures,
    singular_values,
)
from grpo_lens.formulas.stats import mean_interval, stratify_rows, summarise_rows
from grpo_lens.formulas.zero_sum import WEIGHTINGS
from grpo_lens.gradients.gram_blocks import gram_factor
from grpo_lens.probe.config import ProbeConfig
from grpo_lens.probe.draws import (
    DrawnPrompts,
    PromptPool,
    draw_plan,
    prompt_status,
    prompt_view,
    rollouts_per_prompt,
)
from grpo_lens.probe.gradient_sources import (
    _rollout_grads,
    _rollout_grads_many,
    g2_weightings,
    sketch_check,
)
from grpo_lens.probe.groups import GroupJob, analyse_prompt, measure_groups
from grpo_lens.probe.partial import PartialProbe, PromptRecord

#: Keys whose summaries the probe also stratifies by k and by distinct completions.
STRATA_KEYS = (
    tuple(mk.rank_key(m, x) for m in ("g1", "g1_null", "g1_no_adv", "g1_random") for x in ("erank", "stable_rank"))
    + tuple(mk.RANK_G1_VS_NULL.format(m=x) for x in ("erank", "stable_rank"))
    + (mk.GRAD_IDENTITY_RESIDUAL,)
    + tuple(mk.zero_sum_key(s, part) for s in mk.ZERO_SUM_STATS for part in ("", "null", "excess", "p"))
    + (mk.GROUP_DISTINCT_COMPLETIONS, mk.GROUP_CORRECT)
)


def probe_strata(rows: list[dict[str, Any]], seed: int) -> dict[str, Any]:
    """probe.json's ``strata`` of one group size: the summaries of :data:`STRATA_KEYS` over the group rows, per
    stratum of the correct-rollout count k and of the distinct completions (:func:`stratify_rows`; ``seed`` seeds the
    intervals' resampling)."""
    return {
        "correct": stratify_rows(rows, mk.GROUP_CORRECT, keys=STRATA_KEYS, seed=seed),
        "distinct": stratify_rows(rows, mk.GROUP_DISTINCT_COMPLETIONS, keys=STRATA_KEYS, seed=seed),
    }


def analyse_prompts(
    policy, tokenizer, drawn: DrawnPrompts, first: int, config: ProbeConfig, layer: str, done: list[PromptRecord]
) -> list[PromptRecord]:
    """:func:`grpo_lens.probe.groups.analyse_prompt` of prompts ``first`` .. B - 1 of ``drawn``, the mixed groups'
    gradients from one batched backward (:func:`grpo_lens.probe.groups.measure_groups`) and the baseline prompts' M
    rollouts from another (block-diagonal Gram), instead of a backward per group and per baseline prompt: the same
    records (tests)."""
    R, batch, rewards, valid, seed = drawn.group_size, drawn.batch, drawn.rewards, drawn.valid, drawn.seed
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
            "check": not config.dense_oracle and counts["check"] < config.coverage_groups,
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
        if config.dense_oracle:
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
    (``--resume``). ``per_group_passes`` measures each group in its own backward
    (:func:`grpo_lens.probe.groups.analyse_prompt`, the reference) instead of :func:`analyse_prompts`' batched one.
    ``on_first_batch(seconds per generated rollout, seconds per analysed rollout row, success share of each
    prompt)`` is called once, after the first batch this call generated and analysed (the probe's time estimate,
    :func:`grpo_lens.probe.run.estimate_seconds`)."""
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
        batch, rewards_all, valid_all, generation = pool.get(spec)
        prompts = DrawnPrompts(*prompt_view(batch, rewards_all, valid_all, 0, hi, M), group_size=R, seed=spec.seed)
        t_batch, done_before = time.perf_counter(), len(records)
        if config.per_group_passes:  # the reference: a backward per group, each record kept before the next
            analysed: Iterable[PromptRecord] = (
                analyse_prompt(policy, tokenizer, prompts, j, config, layer, records) for j in range(first, hi)
            )
        else:
            analysed = analyse_prompts(policy, tokenizer, prompts, first, config, layer, records)
        for new in analysed:
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
    out[mk.PROBE_TIMING]["seconds"] = time.perf_counter() - t_start + restored_seconds  # + the killed run's measuring
    return out


def aggregate_group_size(records: list[PromptRecord], M: int, config: ProbeConfig) -> dict[str, Any]:
    """R's probe.json entry from its prompts' records (in sampling order): counts, S1, summaries and strata over the
    analysed groups, G3 (one matrix over them), spectra, baseline variances, the credit profile, and the summed
    timings (``seconds`` is the records' sum; :func:`probe_group_size` replaces it by the wall time, plus the
    measuring time of the records a killed probe left)."""
    mixed = [r for r in records if r.status == "mixed"]
    # a mixed group's record has its row and extra
    rows: list[dict[str, float]] = [r.row for r in mixed]  # type: ignore[misc]
    extras: list[dict[str, Any]] = [r.extra for r in mixed]  # type: ignore[misc]
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
    g3: dict[str, Any] = {mk.G3_GROUPS: len(extras)}
    if len(extras) >= 2:
        for name in WEIGHTINGS:
            g3_rows = torch.stack([e["g3_rows"][name] for e in extras])  # [groups, P_s]
            stem = "g3" if name == "adv" else f"g3_{name}"
            g3.update({mk.rank_key(stem, m): v for m, v in rank_measures(singular_values(g3_rows)).items()})
            if name == "adv":
                g3.update({mk.rank_key("g3_null", m): v for m, v in rank_measures(g3_rows.norm(dim=1)).items()})
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
    ci: dict[str, Any] = dict(seed=config.seed)
    return {
        mk.ROLLOUTS_PER_PROMPT: M,
        mk.PROMPTS_SAMPLED: sampled,
        mk.GROUPS_ALL_EQUAL: all_equal,
        mk.GROUPS_MIXED: len(rows),
        mk.GROUPS_INVALID: invalid,
        mk.S1_MEASURED: all_equal / valid_groups if valid_groups else None,
        mk.S1_PREDICTED: statistics.fmean(s1_predictions) if s1_predictions else None,
        mk.S1_PREDICTED_CI: mean_interval(s1_predictions),
        mk.S1_MEASURED_CI: mean_interval(s1_indicators),
        mk.PROBE_GROUPS: rows,
        mk.PROBE_SUMMARY: summarise_rows(rows, **ci),
        mk.PROBE_STRATA: probe_strata(rows, config.seed),
        mk.PROBE_G3: g3,
        mk.PROBE_G2_WEIGHTINGS: {mk.PROBE_GROUPS: g2w, mk.PROBE_SUMMARY: summarise_rows(g2w, **ci)} if g2w else None,
        mk.PROBE_SKETCH_CHECK: {mk.PROBE_GROUPS: checks, mk.PROBE_SUMMARY: summarise_rows(checks, **ci)}
        if checks
        else None,
        mk.PROBE_SPECTRA: {name: [e["spectra"][name] for e in extras] for name in ("G1", "G1_no_adv", "G1_null", "G2")},
        mk.PROBE_BASELINES: {
            "variance": variances,
            "relative_variance": variance_relative_to_optimal(variances) if variances else {},
            "prompts": len(baseline_var),
        },
        mk.PROBE_CREDIT: {"position_profile": profile},
        mk.PROBE_GRAM_COVERAGE: min(covs)
        if (covs := [e["gram_coverage"] for e in extras if e["gram_coverage"] is not None])
        else None,
        mk.PROBE_TIMING: {
            "generation_seconds": seconds["generation"],
            "gradient_seconds": seconds["gradient"],
            "g2_weightings_seconds": seconds["g2_weightings"],
            "sketch_check_seconds": seconds["sketch_check"],
            "seconds": seconds["generation"] + seconds["gradient"],
        },  # gradient includes G2 and check
    }
