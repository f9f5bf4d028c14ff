"""``grpo-lens probe``: measure the structure of GRPO's gradient on a model, for several group sizes R.

For each R the probe samples a FIXED number of prompts (``--prompts``; it never stops early at the N-th mixed group,
so S1 and every per-group mean are unbiased over the task's prompts), M = max(2R, 8) completions of each (the first
R form the GRPO group; all M give the prompt's success rate and the baseline-variance resampling). By default the
prompts are drawn once for every R (:func:`grpo_lens.probe.draws.draw_plan`, docs/theory.md §Shared draws): each
prompt's largest M once, R's group the first R of them, nested across R; ``--independent-draws`` draws each R apart.
Every mixed group (all rewards valid, not all equal) goes through the one per-group analysis path,
:func:`grpo_lens.analysis.group.analyse_group` (the function the trainer's lens calls), plus the model-dependent pieces
(one layer's G1, G2, credit) that return keys of the same vocabulary. The probe then only aggregates rows over groups:
means with 95% intervals (Hall's transformed t) over groups, strata by k (correct count) and by distinct completions,
and G3 (one matrix over the analysed groups). The mixed groups of one ``generate`` batch share one backward
(:func:`grpo_lens.probe.groups.measure_groups`: the block-diagonal exact Gram, each group's [R, R] block);
``--per-group-passes`` runs the readable reference, a backward per group (:func:`grpo_lens.probe.groups.measure_group`),
with the same numbers.

This module is the orchestration (:func:`run_probe`, the studies, the time estimate); the jobs it calls live beside it:
the draws and prompt pools in :mod:`grpo_lens.probe.draws`, the gradient capture in
:mod:`grpo_lens.probe.gradient_sources`, one group's measurement in :mod:`grpo_lens.probe.groups` and one R's estimate
in :mod:`grpo_lens.probe.estimate`.

probe.json::

    {"meta": {model, task, gradients: "exact_gram"|"sketch"|"exact", gram_coverage, g3_source, sketch_dim, std, eps,
              layer, seconds, resumed (continued a killed probe: ``--resume``), ...},
     "per_group_size": {"<R>": {
         rollouts_per_prompt, prompts_sampled, groups_all_equal, groups_mixed, groups_invalid, s1_measured,
         s1_predicted,
         groups: [{canonical key: value} per analysed group],
         summary: {canonical key: {mean, lo, hi, n}},
         strata: {"correct": {"<k>": {key: {mean, lo, hi, n}}}, "distinct": {"<d>": {...}}},
         g3: {rank/g3_<m>: value, rank/g3_null_<m>: value, groups},  (from the sketch unless --dense-oracle)
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
import statistics
import time
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from grpo_lens import metrics as mk
from grpo_lens.config import ConfigError, resolve_device
from grpo_lens.formulas.stats import summarise_rows
from grpo_lens.gradients.params import linear_layer_names
from grpo_lens.models import load_model
from grpo_lens.probe.config import ProbeConfig
from grpo_lens.probe.draws import PromptPool, draw_plan, generation_prompts_per_call, prompt_view, rollouts_per_prompt
from grpo_lens.probe.estimate import probe_group_size
from grpo_lens.probe.gradient_sources import default_layer
from grpo_lens.probe.partial import PartialProbe
from grpo_lens.probe.studies import (
    BaselineStudySettings,
    CreditStudySettings,
    run_baseline_study,
    run_credit_study,
)
from grpo_lens.probe.tracking import log_probe
from grpo_lens.report import write_report
from grpo_lens.rewards import parse_reward_specs
from grpo_lens.rollout import forward_precision
from grpo_lens.rundir import atomic_write_text, holds_run_dir
from grpo_lens.runtime.memory import keep_freed_memory
from grpo_lens.seeding import seed_everything
from grpo_lens.tasks import get_task
from grpo_lens.trackers import check_trackers

logger = logging.getLogger(__name__)


def estimate_seconds(
    config: ProbeConfig, policy, gen_per_rollout: float, grad_per_row: float, success: list[float]
) -> dict[str, float]:
    """The probe's expected seconds per part from the first batch's measured costs: ``gen_per_rollout`` (seconds per
    sampled rollout), ``grad_per_row`` (seconds of analysis per rollout in a backward) and ``success`` (each first-batch
    prompt's share of correct rollouts, p_hat). A plug-in model, not a promise: R's mixed groups n_R (1 - mean(p^R +
    (1-p)^R)), each R rows; the baseline prompts' M rows; the baseline study's 16 prompts x M = 4R_s rows (sketch
    passes) and the credit study's groups (two backwards and four forwards per group: about 3 rows' cost per
    rollout) plus its Monte Carlo continuations (mc_groups x 2 rollouts x 4 prefixes x mc_samples, each a rollout to
    generate, in calls as large as the first batch's). Generation: every rollout of
    :func:`grpo_lens.probe.draws.draw_plan` (shared draws
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
    per_call = generation_prompts_per_call(policy, 4 * config.study_group_size, config)
    baselines = BaselineStudySettings.from_probe_config(config, per_call)
    credit = CreditStudySettings.from_probe_config(config, per_call)
    studies: dict[str, tuple[int, Callable[[Any], dict[str, Any]]]] = {
        "baselines": (
            config.baseline_study_prompts,
            lambda bar: run_baseline_study(
                policy,
                tokenizer,
                task,
                reward_fns,
                baselines,
                progress=bar,
                presampled=study_presampled(policy, config, pool),
            ),
        ),
        "credit": (
            config.credit_groups,
            lambda bar: run_credit_study(policy, tokenizer, task, reward_fns, credit, progress=bar),
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


def probe_layer(config: ProbeConfig, policy: torch.nn.Module) -> str:
    """The layer the probe's one-layer measurements read: ``config.layer``, else
    :func:`grpo_lens.probe.gradient_sources.default_layer`.

    Raises:
        ConfigError: a model without linear layers, --layers matching none, or ``layer`` not a linear layer of the
            model; one line, before anything is written.
    """
    try:  # a model without linear layers, or --layers matching none: one line, before anything is written
        layer = config.layer or default_layer(policy, config.layers)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if layer not in linear_layer_names(policy):
        raise ConfigError(
            f"probe field 'layer' = {layer!r} is not a linear layer of the model; e.g. "
            f"{', '.join(linear_layer_names(policy)[:4])}, ..."
        )
    return layer


def probe_meta(
    config: ProbeConfig,
    policy: torch.nn.Module,
    layer: str,
    per_group_size: dict[str, dict[str, Any]],
    pool: PromptPool,
    estimated: dict[str, float],
    seconds: float,
    t_studies: float,
) -> dict[str, Any]:
    """probe.json's ``meta``: how the probe measured (gradients, Gram coverage, the sketch check over every R, the
    settings), ``seconds`` the whole probe's wall time and ``t_studies`` the studies' (s), the pool's generation
    counts and the first batch's time estimate ``estimated``."""
    checks = [
        c
        for d in per_group_size.values()
        if d.get(mk.PROBE_SKETCH_CHECK)
        for c in d[mk.PROBE_SKETCH_CHECK][mk.PROBE_GROUPS]
    ]
    check_summary = summarise_rows(checks, seed=config.seed) if checks else {}
    covs = [d[mk.PROBE_GRAM_COVERAGE] for d in per_group_size.values() if d.get(mk.PROBE_GRAM_COVERAGE) is not None]
    gradients = "exact" if config.dense_oracle else ("exact_gram" if config.gram_source == "exact" else "sketch")
    meta = {
        "model": config.model,
        "task": config.task,
        "gradients": gradients,
        "gram_coverage": min(covs) if covs else None,
        "g3_source": "exact" if config.dense_oracle else "sketch",
        "sketch_coverage": (check_summary.get(mk.SKETCH_COVERAGE) or {}).get("mean"),
        "sketch_check": check_summary,
        "estimator": config.estimator,
        "loss_aggregation": config.loss_aggregation,
        "sketch_dim": None if config.dense_oracle else config.sketch_dim,
        "std": config.std,
        "eps": config.std_eps,
        "layer": layer,
        "parameters": sum(p.numel() for p in policy.parameters()),
        "seconds": seconds,
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
    return meta


@holds_run_dir("probe")  # one writer per --out (grpo_lens.rundir.acquire_run_lock)
def run_probe(config: ProbeConfig, policy=None, tokenizer=None) -> Path:
    """Run the probe and write OUT/probe.json and OUT/report.md; return OUT.

    What is measured is kept in OUT/probe_partial/ as it is measured (:mod:`grpo_lens.probe.partial`), so a killed
    probe continues from its last finished prompt with ``config.resume`` and writes the probe.json an uninterrupted
    probe would (timings aside); the folder is deleted once probe.json is written.

    Args:
        config: probe settings; ``out`` is required.
        policy (torch.nn.Module | None): an already loaded model (the demo passes the trained one); loaded from
            config.model if None.
        tokenizer (Any): its tokenizer; loaded with the model if None.

    Raises:
        ConfigError: bad settings, --out holding a probe without --overwrite (or a partial one without --resume or
            --overwrite), --resume without a partial probe or with other settings than it.
        ModelNotFoundError: no such model.
    """
    check_trackers(config.report_to)  # a missing tracker library fails before --out is touched
    keep_freed_memory()  # each pass's activations are reused, not page-faulted in again
    partial = prepare_out(config)
    # resolved before the run: out is set
    out = Path(config.out).absolute()  # type: ignore[arg-type]  # a reward function may os.chdir (code sandboxes)
    task = get_task(config.task, dataset=config.dataset, **config.task_options)
    reward_fns = parse_reward_specs(config.rewards)
    seed_everything(config.seed)
    t0 = time.perf_counter()
    if policy is None:
        device = resolve_device(config.device)
        dtype = torch.bfloat16 if config.dtype == "bfloat16" else torch.float32  # bf16-mixed: float32 weights
        policy, tokenizer = load_model(config.model, dtype=dtype, device=device)
    policy.eval()  # no dropout: gradients of the sampling distribution
    layer = probe_layer(config, policy)
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
            on_prompts(finished[mk.PROMPTS_SAMPLED], finished[mk.GROUPS_MIXED])
            continue
        with forward_precision(next(policy.parameters()).device, config.dtype):  # bf16-mixed: bf16 autocast
            per_group_size[str(R)] = probe_group_size(
                policy, tokenizer, task, reward_fns, R, config, layer, on_prompts, partial, pool, on_first_batch
            )
        partial.save_group_size_result(R, per_group_size[str(R)])
        logger.info(
            "probe R = %d: %d mixed groups of %d prompts in %.0f s",
            R,
            per_group_size[str(R)][mk.GROUPS_MIXED],
            per_group_size[str(R)][mk.PROMPTS_SAMPLED],
            per_group_size[str(R)][mk.PROBE_TIMING]["seconds"],
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
    meta = probe_meta(config, policy, layer, per_group_size, pool, estimated, time.perf_counter() - t0, t_studies)
    out.mkdir(parents=True, exist_ok=True)

    atomic_write_text(
        out / "probe.json", json.dumps({"meta": meta, "per_group_size": per_group_size, "studies": studies}, indent=1)
    )
    partial.remove()
    write_report(out)
    log_probe(out, config.report_to, meta["config"])  # --report-to: the numbers of probe.json to the trackers
    return out
