"""``grpo-lens probe``: measure the structure of GRPO's gradient on a model, for several group sizes R.

For each R the probe samples a FIXED number of prompts (``--prompts``; it never stops early at the N-th mixed group,
so S1 and every per-group mean are unbiased over the task's prompts), M = max(2R, 8) completions of each (the first
R form the GRPO group; all M give the prompt's success rate and the baseline-variance resampling). Every mixed group
(all rewards valid, not all equal) goes through the one per-group analysis path,
:func:`grpo_lens.diagnostics.analyse_group` (the function the trainer's lens calls), plus the model-dependent pieces
(one layer's G1, G2, credit) that return keys of the same vocabulary. The probe then only aggregates rows over groups:
means with 95% bootstrap intervals over groups, strata by k (correct count) and by distinct completions, and G3 (one
matrix over the analysed groups).

probe.json::

    {"meta": {model, task, gradients: "sketch"|"exact", sketch_dim, std, eps, layer, seconds, ...},
     "per_group_size": {"<R>": {
         rollouts_per_prompt, prompts_sampled, groups_all_equal, groups_mixed, groups_invalid, s1_measured,
         s1_predicted,
         groups: [{canonical key: value} per analysed group],
         summary: {canonical key: {mean, lo, hi, n}},
         strata: {"correct": {"<k>": {key: {mean, lo, hi, n}}}, "distinct": {"<d>": {...}}},
         g3: {rank/g3_<m>: value, rank/g3_null_<m>: value, groups},
         spectra: {"G1": [[s_1, ...] per group], "G1_no_adv": [...], "G1_null": [...], "G2": [...]},
         baselines: {variance: {...}, relative_variance: {...}, prompts},
         credit: {position_profile},
         timing: {generation_seconds, gradient_seconds (of which g2_weightings_seconds, sketch_check_seconds),
                  seconds}}},
     "studies": {...}}

Keys are documented in docs/metrics.md; formulas in docs/theory.md.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable

import torch

from grpo_lens import diagnostics as dg
from grpo_lens.advantages import ADVANTAGE_ESTIMATORS, STD_CONVENTIONS, compute_advantages
from grpo_lens.config import ConfigError, ConfigFile, option
from grpo_lens.losses import LOSS_AGGREGATIONS, loss_normalizer, rollout_gradient_weights
from grpo_lens.rollout import RolloutBatch, sample_groups

logger = logging.getLogger(__name__)


@dataclass
class ProbeConfig(ConfigFile):
    """Settings of ``grpo-lens probe``; field help is the CLI help."""

    model: str = option("smollm2-135m-instruct", "Model: an alias (smollm2-135m-instruct, tiny), a Hugging Face "
                        "directory (e.g. a trained run's final_model/), a hub id or a .gguf file.")
    task: str = option("arithmetic", "Task: arithmetic, gsm8k, or jsonl (with --dataset).")
    dataset: str | None = option(None, "JSONL file for --task jsonl.")
    task_options: dict = option({}, "Task options as a YAML mapping.")
    rewards: list = option(["correctness"], "Reward functions NAME or NAME:WEIGHT.")
    group_sizes: list = option([2, 4, 8], "Group sizes R to probe.", item_type=int)
    prompts: int = option(0, "Prompts sampled for each R: a fixed number, and every mixed group among them is "
                          "analysed, so S1 and the per-group means are unbiased. 0 = max(24, 128 / R): 64, 32, 24 for "
                          "R = 2, 4, 8.")
    prompts_per_batch: int = option(4, "Prompts sampled per generate call.")
    baseline_prompts: int = option(2, "Mixed prompts per R whose M rollouts are used for the baseline variance.")
    max_new_tokens: int = option(24, "Longest completion in tokens.")
    temperature: float = option(0.7, "Sampling temperature.")
    top_p: float = option(1.0, "Nucleus sampling mass.")
    top_k: int = option(0, "Top-k sampling; 0 disables.")
    estimator: str = option("grpo", "Advantage estimator whose advantages weight the rows: "
                            + ", ".join(ADVANTAGE_ESTIMATORS.names()) + ".")
    loss_aggregation: str = option("seq-mean-token-mean", "Loss aggregation whose per-rollout term is measured "
                                   "(docs/theory.md §3): " + ", ".join(LOSS_AGGREGATIONS.names()) + ".")
    std: str = option("sample", "Std convention of the GRPO advantages: sample or population.")
    eps: float = option(1e-4, "eps of the GRPO advantages.")
    exact: bool = option(False, "Exact per-rollout gradients of all parameters (one backward per rollout; memory "
                         "R x P floats) instead of the sketch.")
    sketch_dim: int = option(16, "Random projection side per linear layer (sketch dims per layer = its square).")
    layer: str | None = option(None, "Linear layer for G1_layer and G2 (default: the middle layer's MLP down "
                               "projection).")
    g2_groups: int = option(1, "Mixed groups per R whose G2 is computed for every linear layer under every weighting "
                            "(A, |A|, A + mean|A|, r, uniform, one rollout), summarised by layer type (one backward "
                            "per weighting). 0 disables.")
    coverage_groups: int = option(1, "Sketch mode: mixed groups per R whose exact gradients (every parameter; memory "
                                  "R x P floats) are also computed, to measure the share of ||g||^2 the sketch covers "
                                  "and its Gram error (docs/theory.md §8). 0 disables.")
    random_draws: int = option(8, "Draws of random zero-sum weights for the G1 control.")
    study_group_size: int = option(4, "R of the baseline and credit studies (docs/theory.md §Baselines at matched "
                                   "expectation, §Token credit).")
    baseline_study_prompts: int = option(8, "Prompts with reward contrast in the baseline study, M = 4R rollouts each "
                                         "(0 skips the study).")
    credit_groups: int = option(8, "Mixed groups whose tokens' signed contributions to the update are measured (0 "
                                "skips the credit study).")
    mc_groups: int = option(0, "Of those, groups with Monte Carlo token advantages for one correct and one wrong "
                            "rollout (about 18 s per group on the default model). 0 skips them: the Monte Carlo credit "
                            "claim needs >= 8 rollouts, i.e. --mc-groups 4, for a verdict.")
    mc_samples: int = option(8, "Continuations per prefix for the Monte Carlo values (K >= 2).")
    resamples: int = option(256, "Resampled groups for the baseline variance.")
    seed: int = option(0, "Random seed.")
    dtype: str = option("float32", "float32 or bfloat16.")
    device: str = option("auto", "cpu, cuda, cuda:N or auto.")
    out: str | None = option(None, "Output directory (probe.json, report.md, PNGs).")
    overwrite: bool = option(False, "Replace an existing probe.json in --out.")
    progress: bool = option(True, "Show a progress bar.")

    def prompts_for(self, group_size: int) -> int:
        """The number of prompts sampled for group size R: ``prompts``, or max(24, 128 // R) when it is 0.

        The default aims at >= 16 mixed groups per R on the default task with about 2 SD to spare: the expected count
        is n (1 - S1), with S1 predicted 0.58 / 0.33 / 0.08 for R = 2 / 4 / 8 on the initial default model (from the
        rollouts outside each group), i.e. 27 / 21 / 22 mixed groups expected from 64 / 32 / 24 prompts."""
        return self.prompts if self.prompts > 0 else max(24, 128 // group_size)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ConfigError(f"probe field '{name}' (flag --{name.replace('_', '-')}) = {getattr(self, name)!r}: "
                              f"{why}")

        if not self.group_sizes or any(not isinstance(r, int) or r < 2 for r in self.group_sizes):
            bad("group_sizes", "each group size must be an integer >= 2")
        if self.prompts < 0:
            bad("prompts", "must be >= 0 (0 = the default max(24, 128 / R))")
        for name in ("prompts_per_batch", "max_new_tokens", "sketch_dim", "random_draws"):
            if getattr(self, name) < 1:
                bad(name, "must be >= 1")
        if self.study_group_size < 2:
            bad("study_group_size", "must be >= 2")
        for name in ("baseline_study_prompts", "credit_groups", "mc_groups"):
            if getattr(self, name) < 0:
                bad(name, "must be >= 0 (0 skips)")
        if self.mc_samples < 2:
            bad("mc_samples", "must be >= 2 (a standard error needs two continuations)")
        if self.g2_groups < 0:
            bad("g2_groups", "must be >= 0")
        if self.coverage_groups < 0:
            bad("coverage_groups", "must be >= 0")
        if self.baseline_prompts < 0:
            bad("baseline_prompts", "must be >= 0")
        if self.resamples < 2:
            bad("resamples", "must be >= 2")
        if self.temperature <= 0:
            bad("temperature", "must be > 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if self.estimator not in ADVANTAGE_ESTIMATORS.names():
            bad("estimator", f"valid names: {', '.join(ADVANTAGE_ESTIMATORS.names())}")
        if self.loss_aggregation not in LOSS_AGGREGATIONS.names():
            bad("loss_aggregation", f"valid names: {', '.join(LOSS_AGGREGATIONS.names())}")
        if self.std not in STD_CONVENTIONS:
            bad("std", f"valid names: {', '.join(STD_CONVENTIONS)}")
        if self.eps <= 0:
            bad("eps", "must be > 0")
        if self.dtype not in ("float32", "bfloat16"):
            bad("dtype", "valid names: bfloat16, float32")


def default_layer(model: torch.nn.Module) -> str:
    """The middle decoder layer's MLP down projection (or the middle linear layer of any model)."""
    names = dg.linear_layer_names(model)
    down = [n for n in names if n.endswith("down_proj")]
    pool = down or [n for n in names if "lm_head" not in n]
    if not pool:
        raise ValueError("the model has no nn.Linear layers to probe")
    return pool[len(pool) // 2]


#: Keys whose summaries the probe also stratifies by k and by distinct completions.
STRATA_KEYS = tuple(f"rank/{m}_{x}" for m in ("g1", "g1_null", "g1_no_adv", "g1_random") for x in ("erank",
                                                                                                      "stable_rank"))\
    + ("rank/g1_erank_vs_null", "rank/g1_stable_rank_vs_null", "grad/identity_residual", "zero_sum/span_energy",
       "zero_sum/span_energy_null", "zero_sum/span_energy_excess", "zero_sum/span_energy_p", "zero_sum/cos_gap",
       "zero_sum/cos_gap_null", "zero_sum/cos_gap_excess", "zero_sum/cos_gap_p", "group/distinct_completions", "group/correct")


def score_weights(sub: RolloutBatch, config: ProbeConfig) -> torch.Tensor:
    """omega_i [n] of the per-rollout term the configured loss aggregation weights, with ``sub`` (a group, or a prompt's
    M rollouts) as the batch (docs/theory.md §3; :func:`grpo_lens.losses.rollout_gradient_weights`)."""
    mask = sub.completion_mask
    return rollout_gradient_weights(mask, config.loss_aggregation,
                                    loss_normalizer(mask, config.loss_aggregation, config.max_new_tokens))


def _rollout_grads(policy, sub: RolloutBatch, config: ProbeConfig, layer: str | None):
    """(all-parameter rows [n, P or K], exact rows of ``layer``'s weight gradient [n, d_out*d_in] or None, token
    squared norms [n, Lp+T] or None), from one pass: in sketch mode the layer's exact rows are captured in the same
    backward as the sketch (identity projection), so G1_layer and G2 need no pass of their own."""
    proc = dict(temperature=config.temperature, score_weights=score_weights(sub, config))
    if config.exact:
        grads = dg.exact_rollout_grads(policy, sub, **proc)
        layer_rows = grads[:, dg.param_slices(policy)[layer + ".weight"]] if layer else None
        return grads, layer_rows, None
    sketch = dg.sketch_rollout_grads(policy, sub, k_in=config.sketch_dim, k_out=config.sketch_dim,
                                     seed=config.seed, token_norms=True, exact_layers=[layer] if layer else (),
                                     **proc)
    return sketch.sketch, sketch.exact_layers.get(layer) if layer else None, sketch.token_sq_norms


def analyse_group(policy, tokenizer, sub: RolloutBatch, rewards: torch.Tensor, config: ProbeConfig, layer: str,
                  seed: int) -> tuple[dict[str, float], dict[str, Any]]:
    """One mixed group of R rollouts (rewards [R]): its row of canonical keys and its extras (spectra, G3 row, profile).

    The row is :func:`grpo_lens.diagnostics.analyse_group` on the group's per-rollout gradients, plus G1 of ``layer``
    (``rank/g1_layer_*``, from the layer's exact per-rollout weight gradients), G2 of ``layer`` (``rank/g2_*``, their
    advantage-weighted sum) and credit (``credit/*``).
    """
    R = sub.num_rollouts
    grads, layer_rows, token_sq = _rollout_grads(policy, sub, config, layer)
    # Gradients come from the model's device; the analysis runs on the CPU with the rewards (a GPU probe works too).
    g, layer_rows = grads.double().cpu(), layer_rows.cpu()
    cmask, cids = sub.completion_mask.cpu(), sub.completion_ids.cpu()
    sq = g.square().sum(-1).view(1, R) if config.estimator == "optimal" else None
    adv = compute_advantages(rewards.view(1, R).double(), config.estimator, std=config.std, eps=config.eps,
                             grad_sq_norms=sq)[0]
    row = dg.analyse_group(g, rewards.double(), adv, estimator=config.estimator, std=config.std, eps=config.eps,
                           completion_mask=cmask, completion_ids=cids,
                           num_random=config.random_draws, seed=seed)
    row.update(dg.g1_rank_keys(layer_rows, adv, "g1_layer"))
    gram = g @ g.T
    extras: dict[str, Any] = {
        "spectra": {"G1": dg.g1_singular_values(g, adv).tolist(),
                    "G1_no_adv": dg.gram_singular_values(gram).tolist(),
                    "G1_null": dg.orthogonal_null_singular_values(gram, adv).tolist()},
        "g3_rows": {name: (w.unsqueeze(1) * g).sum(0) for name, w in dg.weightings(adv, rewards).items()},
        "grads": g, "advantages": adv,
    }

    # G2: the layer's weight gradient of the group loss sum_i A_i s_i, [d_out, d_in].
    weight = dict(policy.named_modules())[layer].weight
    g2_raw = (adv.to(layer_rows.dtype) @ layer_rows).reshape(weight.shape)  # sum_i A_i G2_i, exact
    bound = dg.g2_rank_bound(sub.prompt_mask.cpu(), cids, cmask)
    s2 = dg.singular_values(g2_raw.double(), method="gram")  # one decomposition for every G2 number
    row.update(dg.g2_keys(g2_raw, bound, computed_dtype=g2_raw.dtype, singular_values=s2))
    extras["spectra"]["G2"] = s2[:64].tolist()

    token_adv = dg.token_advantages(adv, cmask)
    if token_sq is None:  # exact mode: the per-token norms come from one more batched backward
        token_sq = dg.token_grad_sq_norms(policy, sub, temperature=config.temperature,
                                          score_weights=score_weights(sub, config))
    comp = dg.completion_positions(token_sq.cpu(), sub.prompt_ids.shape[1])  # [R, T]
    answer = dg.answer_mask_from_tokenizer(tokenizer, cids, cmask)
    row.update(dg.credit_metrics(token_adv, comp, cmask, answer))
    extras["profile"] = dg.position_profile(comp.sqrt(), cmask)
    return row, extras


def g2_weightings(policy, sub: RolloutBatch, extra: dict[str, Any], rewards: torch.Tensor,
                  config: ProbeConfig) -> dict[str, float]:
    """Stable rank of every nn.Linear layer's G2 under every weighting of :data:`grpo_lens.diagnostics.WEIGHTINGS`,
    summarised by layer type, from one backward (:class:`grpo_lens.diagnostics.G2WeightingCapture`)."""
    from grpo_lens.diagnostics.gradients import rollout_scores
    from grpo_lens.rollout import batch_logprobs

    capture = dg.G2WeightingCapture(policy, dg.weightings(extra["advantages"], rewards))
    emb_out: list[torch.Tensor] = []
    handle = policy.get_input_embeddings().register_forward_hook(lambda m, a, o: emb_out.append(o))
    try:
        with capture:
            logp = batch_logprobs(policy, sub, config.temperature)
            loss = rollout_scores(logp, sub.completion_mask, score_weights(sub, config)).sum()
            # differentiate w.r.t. the embedding output: every layer's delta, no weight-gradient GEMMs
            roots = emb_out if emb_out and all(t.requires_grad for t in emb_out) else \
                [m.weight for m in capture.layers.values() if m.weight.requires_grad]
            torch.autograd.grad(loss, roots, allow_unused=True)
    finally:
        handle.remove()
    return capture.result()


def sketch_check(policy, sub: RolloutBatch, extra: dict[str, Any], config: ProbeConfig) -> dict[str, float]:
    """Exact gradients of every parameter for one analysed group, set against its sketch
    (:func:`grpo_lens.diagnostics.sketch_check_keys`: coverage of ||g||^2, Gram error and its bound, erank error)."""
    import torch.nn as nn

    exact = dg.exact_rollout_grads(policy, sub, temperature=config.temperature,
                                   score_weights=score_weights(sub, config)).detach().cpu()
    slices = dg.param_slices(policy)
    modules = dict(policy.named_modules())
    by_id = {id(p): slices[n] for n, p in policy.named_parameters() if n in slices}
    categories: dict[str, list[slice]] = {}
    for name, sl in slices.items():
        module = modules.get(name.rsplit(".", 1)[0])
        categories.setdefault(dg.parameter_category(name, isinstance(module, nn.Linear)), []).append(sl)
    layer_slices = [by_id[id(m.weight)] for n in dg.linear_layer_names(policy) for m in [modules[n]]
                    if id(m.weight) in by_id]
    out = dg.sketch_check_keys(exact, extra["grads"], extra["advantages"], categories, layer_slices,
                               config.sketch_dim, config.sketch_dim)
    del exact
    return out


def probe_group_size(policy, tokenizer, task, reward_fns, R: int, config: ProbeConfig, layer: str,
                     on_prompts: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Sample ``config.prompts_for(R)`` prompts with M rollouts each, analyse every mixed group of R, aggregate over
    groups. ``on_prompts(prompts_just_done, mixed_so_far)`` is called after each batch of prompts (the progress
    bar)."""
    from grpo_lens.rewards import combine_rewards

    t_start = time.perf_counter()

    M = max(2 * R, 8)
    rows: list[dict[str, float]] = []
    extras: list[dict[str, Any]] = []
    checks: list[dict[str, float]] = []  # sketch vs exact on the first coverage_groups groups
    g2w: list[dict[str, float]] = []  # G2 of every layer under every weighting, first g2_groups groups
    sampled = all_equal = invalid = 0
    s1_predictions: list[float] = []  # per prompt, from the rollouts outside its group
    s1_indicators: list[float] = []  # per prompt with all rewards valid: 1 if its group's rewards are all equal
    baseline_var: list[dict[str, float]] = []
    t_gen = t_grad = t_g2 = t_check = 0.0  # t_grad includes t_g2 and t_check
    draw = 0
    n_prompts_r = config.prompts_for(R)
    while sampled < n_prompts_r:
        draw += 1
        seed = (config.seed * 1_000_003 + R * 10_007 + draw * 7_919) % (2**31 - 1)
        n_prompts = min(config.prompts_per_batch, n_prompts_r - sampled)
        examples = task.sample(n_prompts, seed=seed)
        t0 = time.perf_counter()
        batch = sample_groups(policy, tokenizer, examples, M, max_new_tokens=config.max_new_tokens,
                              temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
                              generator_seed=seed)
        t_gen += time.perf_counter() - t0
        prompts = [p for p in batch.prompts for _ in range(M)]
        extras_kw = {k: [v for v in vals for _ in range(M)] for k, vals in batch.extras.items()}
        rewards, valid, _ = combine_rewards(reward_fns, prompts, batch.completions, **extras_kw)
        for j in range(len(examples)):
            sampled += 1
            rows_j = torch.arange(j * M, (j + 1) * M)
            r_all, v_all = rewards[rows_j], valid[rows_j]
            if bool(v_all.all()):  # S1 predicted from the M - R rollouts outside the group (docs/theory.md §S1)
                k_rest = int((r_all[R:] >= 1.0).sum())
                s1_predictions.append(float(dg.unbiased_zero_variance_probability(k_rest, M - R, R)))
            group = rows_j[:R]
            r_g, v_g = rewards[group], valid[group]
            if not bool(v_g.all()):
                invalid += 1
                continue
            equal = bool(dg.zero_variance_groups(r_g.view(1, R)))
            s1_indicators.append(float(equal))
            if equal:
                all_equal += 1
                continue
            t0 = time.perf_counter()
            row, extra = analyse_group(policy, tokenizer, batch.select(group), r_g, config, layer, seed=seed + j)
            rows.append(row)
            extras.append(extra)
            t1 = time.perf_counter()
            if len(g2w) < config.g2_groups:
                g2w.append(g2_weightings(policy, batch.select(group), extra, r_g, config))
            t2 = time.perf_counter()
            if not config.exact and len(checks) < config.coverage_groups:
                checks.append(sketch_check(policy, batch.select(group), extra, config))
            t_g2 += t2 - t1
            t_check += time.perf_counter() - t2
            extra.pop("grads")
            if len(baseline_var) < config.baseline_prompts and bool(v_all.all()):
                grads_m, _, _ = _rollout_grads(policy, batch.select(rows_j), config, None)
                var = dg.estimator_variances(grads_m.double().cpu(), r_all.double(), R, num_resamples=config.resamples,
                                             seed=seed)
                baseline_var.append(var)
            t_grad += time.perf_counter() - t0
        if on_prompts is not None:
            on_prompts(len(examples), len(rows))

    valid_groups = sampled - invalid  # groups whose rollouts all have a valid reward
    g3: dict[str, Any] = {"groups": len(extras)}  # one matrix: no interval (resampled rows would repeat, lowering rank)
    if len(extras) >= 2:
        for name in dg.WEIGHTINGS:
            g3_rows = torch.stack([e["g3_rows"][name] for e in extras])  # [groups, K]
            stem = "g3" if name == "adv" else f"g3_{name}"
            g3.update({f"rank/{stem}_{m}": v for m, v in dg.rank_measures(dg.singular_values(g3_rows)).items()})
            if name == "adv":
                g3.update({f"rank/g3_null_{m}": v for m, v in dg.rank_measures(g3_rows.norm(dim=1)).items()})
    profile: list[float] = []
    if extras:
        T = max(len(e["profile"]) for e in extras)
        for t in range(T):
            vals = [float(e["profile"][t]) for e in extras
                    if len(e["profile"]) > t and math.isfinite(float(e["profile"][t]))]
            profile.append(statistics.fmean(vals) if vals else 0.0)
    variances = {k: statistics.fmean([v[k] for v in baseline_var]) for k in baseline_var[0]} if baseline_var else {}
    ci = dict(seed=config.seed)
    return {
        "rollouts_per_prompt": M,
        "prompts_sampled": sampled,
        "groups_all_equal": all_equal,
        "groups_mixed": len(rows),
        "groups_invalid": invalid,
        "s1_measured": all_equal / valid_groups if valid_groups else None,
        "s1_predicted": statistics.fmean(s1_predictions) if s1_predictions else None,
        "s1_predicted_ci": dg.bootstrap_ci(s1_predictions, seed=config.seed),
        "s1_measured_ci": dg.bootstrap_ci(s1_indicators, seed=config.seed),
        "groups": rows,
        "summary": dg.summarise_rows(rows, **ci),
        "strata": {"correct": dg.stratify_rows(rows, "group/correct", keys=STRATA_KEYS, **ci),
                   "distinct": dg.stratify_rows(rows, "group/distinct_completions", keys=STRATA_KEYS, **ci)},
        "g3": g3,
        "g2_weightings": {"groups": g2w, "summary": dg.summarise_rows(g2w, **ci)} if g2w else None,
        "sketch_check": {"groups": checks, "summary": dg.summarise_rows(checks, **ci)} if checks else None,
        "spectra": {name: [e["spectra"][name] for e in extras] for name in ("G1", "G1_no_adv", "G1_null", "G2")},
        "baselines": {"variance": variances,
                      "relative_variance": dg.variance_relative_to_optimal(variances) if variances else {},
                      "prompts": len(baseline_var)},
        "credit": {"position_profile": profile},
        "timing": {"generation_seconds": t_gen, "gradient_seconds": t_grad, "g2_weightings_seconds": t_g2,
                   "sketch_check_seconds": t_check, "seconds": time.perf_counter() - t_start},
    }


def run_studies(policy, tokenizer, task, reward_fns, config: ProbeConfig) -> dict[str, Any]:
    """The baseline study (with S1 predicted from rollouts outside the group) and the credit study of
    :mod:`grpo_lens.studies`, at R = ``study_group_size``; a study set to 0 is skipped (absent)."""
    from grpo_lens import studies

    common = dict(group_size=config.study_group_size, max_new_tokens=config.max_new_tokens,
                  temperature=config.temperature, top_k=config.top_k, top_p=config.top_p, seed=config.seed,
                  prompts_per_batch=config.prompts_per_batch)
    out: dict[str, Any] = {}
    if config.baseline_study_prompts > 0:
        out["baselines"] = studies.run_baseline_study(
            policy, tokenizer, task, reward_fns, prompts=config.baseline_study_prompts,
            max_prompts=4 * config.baseline_study_prompts, sketch_dim=config.sketch_dim,
            resamples=max(config.resamples, 2), **common)
    if config.credit_groups > 0:
        out["credit"] = studies.run_credit_study(
            policy, tokenizer, task, reward_fns, groups=config.credit_groups,
            max_prompts=6 * config.credit_groups, mc_groups=config.mc_groups, mc_samples=config.mc_samples,
            std=config.std, eps=config.eps, **common)
    return out


def run_probe(config: ProbeConfig, policy=None, tokenizer=None) -> Path:
    """Run the probe and write OUT/probe.json and OUT/report.md; return OUT.

    Args:
        config: probe settings; ``out`` is required.
        policy, tokenizer: an already loaded model (the demo passes the trained one); loaded from config.model if
            None.

    Raises:
        ConfigError: bad settings or --out holding a probe without --overwrite.  ModelNotFoundError: no such model.
    """
    from grpo_lens.models import load_model
    from grpo_lens.report import write_report
    from grpo_lens.rewards import parse_reward_specs
    from grpo_lens.tasks import get_task
    from grpo_lens.seeding import seed_everything

    if not config.out:
        raise ConfigError("probe field 'out' (flag --out) is required: the directory to write probe.json to")
    out = Path(config.out)
    if (out / "probe.json").exists() and not config.overwrite:
        raise ConfigError(f"{out}/probe.json exists; pass --overwrite to replace it or choose another --out")
    task = get_task(config.task, dataset=config.dataset, **config.task_options)
    reward_fns = parse_reward_specs(config.rewards)
    seed_everything(config.seed)
    t0 = time.perf_counter()
    if policy is None:
        from grpo_lens.config import resolve_device

        device = resolve_device(config.device)
        dtype = torch.bfloat16 if config.dtype == "bfloat16" else torch.float32
        policy, tokenizer = load_model(config.model, dtype=dtype, device=device)
    policy.eval()  # no dropout: gradients of the sampling distribution
    layer = config.layer or default_layer(policy)
    if layer not in dg.linear_layer_names(policy):
        raise ConfigError(f"probe field 'layer' = {layer!r} is not a linear layer of the model; e.g. "
                          f"{', '.join(dg.linear_layer_names(policy)[:4])}, ...")
    per_r = {}
    progress = None
    if config.progress:
        from tqdm.auto import tqdm

        progress = tqdm(total=sum(config.prompts_for(R) for R in config.group_sizes), desc="probe", unit="prompt")
    for R in config.group_sizes:
        def on_prompts(done: int, mixed: int, R: int = R) -> None:
            if progress is not None:
                progress.set_postfix(R=R, mixed=mixed, refresh=False)
                progress.update(done)

        per_r[str(R)] = probe_group_size(policy, tokenizer, task, reward_fns, R, config, layer, on_prompts)
        logger.info("probe R = %d: %d mixed groups of %d prompts in %.0f s", R, per_r[str(R)]["groups_mixed"],
                    per_r[str(R)]["prompts_sampled"], per_r[str(R)]["timing"]["seconds"])
    if progress is not None:
        progress.close()
    t_studies = time.perf_counter()
    if config.baseline_study_prompts or config.credit_groups:
        logger.info("probe studies at R = %d: baselines on %d prompts, token credit on %d groups (about 100 s on the "
                    "default model and CPU)", config.study_group_size, config.baseline_study_prompts,
                    config.credit_groups)
    studies = run_studies(policy, tokenizer, task, reward_fns, config)
    t_studies = time.perf_counter() - t_studies
    checks = [c for d in per_r.values() if d.get("sketch_check") for c in d["sketch_check"]["groups"]]
    check_summary = dg.summarise_rows(checks, seed=config.seed) if checks else {}
    meta = {"model": config.model, "task": config.task, "gradients": "exact" if config.exact else "sketch",
            "sketch_coverage": (check_summary.get("sketch/coverage") or {}).get("mean"),
            "sketch_check": check_summary,
            "estimator": config.estimator, "loss_aggregation": config.loss_aggregation,
            "sketch_dim": None if config.exact else config.sketch_dim, "std": config.std, "eps": config.eps,
            "layer": layer, "parameters": sum(p.numel() for p in policy.parameters()),
            "seconds": time.perf_counter() - t0, "studies_seconds": t_studies,
            "config": {f.name: getattr(config, f.name) for f in fields(config)}}
    out.mkdir(parents=True, exist_ok=True)
    from grpo_lens.rundir import atomic_write_text

    atomic_write_text(out / "probe.json", json.dumps({"meta": meta, "per_group_size": per_r, "studies": studies},
                                                     indent=1))
    write_report(out)
    return out
