"""``grpo-lens probe``: measure the structure of GRPO's gradient on a model, for several group sizes R.

For each R the probe samples prompts, M = max(2R, 8) completions of each (the first R form the GRPO group; all M give
the prompt's success rate and the baseline-variance resampling), counts all-equal groups (S1), and for each mixed
group up to ``groups`` computes, from per-rollout gradients g_i (sketched by default, exact with ``--exact``):

- rank measures of G1 (rows A_i g_i) and its controls on the same tokens: G1_no_adv (rows g_i), G1_random_zero_sum
  (rows w_i g_i, random zero-sum w with ||w|| = ||A||), G1_nll (rows of the supervised NLL gradient); G1_layer (one
  layer only); G2 (the weight gradient of the group loss for that layer, [d_out, d_in], with its numerical rank and the
  bound prompt tokens + distinct completion prefixes); G3 (rows = the groups' policy gradients);
- the rank-2 identity residual, the number of distinct completions;
- baselines: m_C, m_W, b* vs the group mean, and the variance of the gradient estimate under none / mean / rloo /
  optimal baselines by resampling groups of R from the prompt's M rollouts;
- credit: within-rollout advantage variance, the per-position gradient-norm profile, the answer tokens' share.

It writes OUT/probe.json (schema below), and OUT/report.md with plots via :func:`grpo_lens.report.write_report`.

probe.json::

    {"meta": {model, task, gradients: "sketch"|"exact", sketch_dim, std, eps, layer, seconds, ...},
     "per_group_size": {"<R>": {
         groups_sampled, groups_all_equal, groups_mixed, s1_measured, s1_predicted, distinct_completions_mean,
         rank: {matrix: {measure: {mean, std}, groups}}, spectra: {matrix: [[s_1, ...] per group]},
         identity_residual: {max, mean, per_group}, g2: {numerical_rank, rank_bound, shape},
         baselines: {b_star, group_mean, m_correct, m_wrong, variance: {...}, relative_variance: {...}, prompts},
         credit: {within_rollout_adv_var_max, answer_grad_share, answer_token_share, position_profile},
         timing: {generation_seconds, gradient_seconds}}}}
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from grpo_lens import diagnostics as dg
from grpo_lens.advantages import STD_CONVENTIONS, compute_advantages
from grpo_lens.config import ConfigError, ConfigFile, option
from grpo_lens.rollout import RolloutBatch, sample_groups

MATRIX_NAMES = {"policy": "G1", "score": "G1_no_adv", "random": "G1_random_zero_sum", "nll": "G1_nll"}


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
    groups: int = option(4, "Mixed groups (not all rewards equal) to analyse per R.")
    max_groups: int = option(24, "Give up on an R after sampling this many groups (all-equal ones are counted).")
    prompts_per_batch: int = option(4, "Prompts sampled per generate call.")
    baseline_prompts: int = option(2, "Mixed prompts per R whose M rollouts are used for the baseline variance.")
    max_new_tokens: int = option(24, "Longest completion in tokens.")
    temperature: float = option(0.7, "Sampling temperature.")
    top_p: float = option(1.0, "Nucleus sampling mass.")
    top_k: int = option(0, "Top-k sampling; 0 disables.")
    std: str = option("sample", "Std convention of the GRPO advantages: sample or population.")
    eps: float = option(1e-4, "eps of the GRPO advantages.")
    exact: bool = option(False, "Exact per-rollout gradients of all parameters (one backward per rollout; memory "
                         "R x P floats) instead of the sketch.")
    sketch_dim: int = option(16, "Random projection side per linear layer (sketch dims per layer = its square).")
    layer: str | None = option(None, "Linear layer for G1_layer and G2 (default: the middle layer's MLP down "
                               "projection).")
    random_draws: int = option(8, "Draws of random zero-sum weights for the G1 control.")
    resamples: int = option(256, "Resampled groups for the baseline variance.")
    seed: int = option(0, "Random seed.")
    dtype: str = option("float32", "float32 or bfloat16.")
    device: str = option("auto", "cpu, cuda, cuda:N or auto.")
    out: str | None = option(None, "Output directory (probe.json, report.md, PNGs).")
    overwrite: bool = option(False, "Replace an existing probe.json in --out.")

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ConfigError(f"probe field '{name}' (flag --{name.replace('_', '-')}) = {getattr(self, name)!r}: "
                              f"{why}")

        if not self.group_sizes or any(not isinstance(r, int) or r < 2 for r in self.group_sizes):
            bad("group_sizes", "each group size must be an integer >= 2")
        for name in ("groups", "max_groups", "prompts_per_batch", "max_new_tokens", "sketch_dim", "random_draws"):
            if getattr(self, name) < 1:
                bad(name, "must be >= 1")
        if self.baseline_prompts < 0:
            bad("baseline_prompts", "must be >= 0")
        if self.resamples < 2:
            bad("resamples", "must be >= 2")
        if self.temperature <= 0:
            bad("temperature", "must be > 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if self.std not in STD_CONVENTIONS:
            bad("std", f"valid names: {', '.join(STD_CONVENTIONS)}")
        if self.eps <= 0:
            bad("eps", "must be > 0")
        if self.dtype not in ("float32", "bfloat16"):
            bad("dtype", "valid names: bfloat16, float32")


def _stats(xs: list[float | None]) -> dict[str, float | None]:
    xs = [float(x) for x in xs if x is not None and math.isfinite(float(x))]
    if not xs:
        return {"mean": None, "std": None}
    return {"mean": statistics.fmean(xs), "std": statistics.pstdev(xs) if len(xs) > 1 else 0.0}


def default_layer(model: torch.nn.Module) -> str:
    """The middle decoder layer's MLP down projection (or the middle linear layer of any model)."""
    names = dg.linear_layer_names(model)
    down = [n for n in names if n.endswith("down_proj")]
    pool = down or [n for n in names if "lm_head" not in n]
    if not pool:
        raise ValueError("the model has no nn.Linear layers to probe")
    return pool[len(pool) // 2]


class GroupAnalysis:
    """Accumulates per-group results of one R."""

    def __init__(self) -> None:
        self.rank: dict[str, list[dict[str, float]]] = {}
        self.spectra: dict[str, list[list[float]]] = {}
        self.residuals: list[float] = []
        self.distinct: list[int] = []
        self.policy_rows: list[torch.Tensor] = []
        self.baseline_rows: list[dict[str, float]] = []
        self.credit: list[dict[str, float]] = []
        self.profiles: list[torch.Tensor] = []
        self.g2: list[dict[str, Any]] = []

    def add_rank(self, matrix: str, measures: dict[str, float], spectrum: list[float] | None = None) -> None:
        """Record one group's rank measures (and optionally its singular values) for ``matrix``."""
        self.rank.setdefault(matrix, []).append(measures)
        if spectrum is not None:
            self.spectra.setdefault(matrix, []).append(spectrum)


def _rollout_grads(policy, sub: RolloutBatch, config: ProbeConfig, layer: str):
    """(all-parameter rows [n, P or K], layer rows [n, *], token squared norms [n, Lp+T] or None)."""
    proc = dict(temperature=config.temperature, top_k=config.top_k, top_p=config.top_p)
    if config.exact:
        grads = dg.exact_rollout_grads(policy, sub, **proc)
        slices = dg.param_slices(policy)
        layer_rows = grads[:, slices[layer + ".weight"]]
        return grads, layer_rows, None
    sketch = dg.sketch_rollout_grads(policy, sub, k_in=config.sketch_dim, k_out=config.sketch_dim,
                                     seed=config.seed, token_norms=True, **proc)
    return sketch.sketch, sketch.per_layer[layer], sketch.token_sq_norms


def analyse_group(policy, tokenizer, sub: RolloutBatch, rewards: torch.Tensor, config: ProbeConfig, layer: str,
                  acc: GroupAnalysis, seed: int) -> None:
    """Everything the probe measures on one mixed group of R rollouts (rewards [R])."""
    R = sub.num_rollouts
    adv = compute_advantages(rewards.view(1, R).double(), "grpo", std=config.std, eps=config.eps)[0]
    grads, layer_rows, token_sq = _rollout_grads(policy, sub, config, layer)
    g = grads.double()

    spectra = dg.g1_spectra(g, adv, sub.completion_mask, num_random=config.random_draws, seed=seed)
    gram = g @ g.T
    for key, name in MATRIX_NAMES.items():
        if key in spectra:
            spectrum = None
            if key == "policy":
                spectrum = dg.gram_singular_values(gram * torch.outer(adv, adv)).tolist()
            elif key == "score":
                spectrum = dg.gram_singular_values(gram).tolist()
            acc.add_rank(name, spectra[key], spectrum)
    lg = layer_rows.double() * adv.unsqueeze(1)
    acc.add_rank("G1_layer", dg.rank_measures(dg.gram_singular_values(lg @ lg.T)))
    acc.policy_rows.append((adv.unsqueeze(1) * g).sum(0))

    # G2: the layer's weight gradient of the group loss sum_i A_i s_i, [d_out, d_in].
    g2_raw = dg.layer_weight_grads(policy, sub, adv.float(), [layer], temperature=config.temperature,
                                   top_k=config.top_k, top_p=config.top_p)[layer]
    g2 = g2_raw.double()
    s2 = dg.singular_values(g2)
    acc.add_rank("G2", dg.rank_measures(s2), s2[:64].tolist())
    # the rank tolerance follows the precision the gradient was computed in, not the float64 copy
    acc.g2.append({"numerical_rank": dg.numerical_rank(s2, shape=tuple(g2.shape), dtype=g2_raw.dtype),
                   "rank_bound": dg.g2_rank_bound(sub.prompt_mask, sub.completion_ids, sub.completion_mask),
                   "shape": list(g2.shape)})

    if bool(torch.all((rewards == 0) | (rewards == 1))):
        acc.residuals.append(dg.rank2_residual(g, rewards.double(), std=config.std, eps=config.eps, advantages=adv))
        acc.baseline_rows.append(dg.baseline_metrics(g, rewards.double()))
    acc.distinct.append(int(dg.distinct_completions(sub.completion_ids, sub.completion_mask)))

    token_adv = dg.token_advantages(adv, sub.completion_mask)
    if token_sq is None:  # exact mode: the per-token norms come from one more batched backward
        token_sq = dg.token_grad_sq_norms(policy, sub, temperature=config.temperature, top_k=config.top_k,
                                          top_p=config.top_p)
    comp = dg.completion_positions(token_sq, sub.prompt_ids.shape[1])  # [R, T]
    answer = dg.answer_mask_from_tokenizer(tokenizer, sub.completion_ids, sub.completion_mask)
    acc.credit.append(dg.credit_metrics(token_adv, comp, sub.completion_mask, answer))
    acc.profiles.append(dg.position_profile(comp.sqrt(), sub.completion_mask))


def probe_group_size(policy, tokenizer, task, reward_fns, R: int, config: ProbeConfig, layer: str) -> dict[str, Any]:
    """Sample until ``config.groups`` mixed groups of size R are found (or ``max_groups`` sampled); measure them."""
    from grpo_lens.rewards import combine_rewards

    M = max(2 * R, 8)
    acc = GroupAnalysis()
    sampled = all_equal = mixed = mixed_seen = invalid = 0
    success_rates: list[float] = []
    baseline_var: list[dict[str, float]] = []
    t_gen = t_grad = 0.0
    draw = 0
    while mixed < config.groups and sampled < config.max_groups:
        draw += 1
        seed = (config.seed * 1_000_003 + R * 10_007 + draw * 7_919) % (2**31 - 1)
        n_prompts = min(config.prompts_per_batch, config.max_groups - sampled)
        examples = task.sample(n_prompts, seed=seed)
        t0 = time.perf_counter()
        batch = sample_groups(policy, tokenizer, examples, M, max_new_tokens=config.max_new_tokens,
                              temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
                              generator_seed=seed)
        t_gen += time.perf_counter() - t0
        prompts = [p for p in batch.prompts for _ in range(M)]
        extras = {k: [v for v in vals for _ in range(M)] for k, vals in batch.extras.items()}
        rewards, valid, _ = combine_rewards(reward_fns, prompts, batch.completions, **extras)
        for j in range(len(examples)):
            sampled += 1
            rows = torch.arange(j * M, (j + 1) * M)
            r_all, v_all = rewards[rows], valid[rows]
            if v_all.any():
                success_rates.append(float(r_all[v_all].clamp(0, 1).mean()))
            group = rows[:R]
            r_g, v_g = rewards[group], valid[group]
            if not bool(v_g.all()):
                invalid += 1
                continue
            if bool(dg.zero_variance_groups(r_g.view(1, R))):
                all_equal += 1
                continue
            mixed_seen += 1
            if mixed >= config.groups:
                continue
            mixed += 1
            t0 = time.perf_counter()
            analyse_group(policy, tokenizer, batch.select(group), r_g, config, layer, acc, seed=seed + j)
            if len(baseline_var) < config.baseline_prompts and bool(v_all.all()):
                grads_m, _, _ = _rollout_grads(policy, batch.select(rows), config, layer)
                var = dg.estimator_variances(grads_m.double(), r_all.double(), R, num_resamples=config.resamples,
                                             seed=seed)
                baseline_var.append(var)
            t_grad += time.perf_counter() - t0

    valid_groups = max(sampled - invalid, 1)  # groups whose rollouts all have a valid reward
    rank = {m: {**{k: _stats([d.get(k) for d in rows]) for k in list(dg.RANK_MEASURES.names()) + ["fro_norm"]
                   if any(k in d for d in rows)}, "groups": len(rows)} for m, rows in acc.rank.items()}
    if len(acc.policy_rows) >= 2:
        g3 = torch.stack(acc.policy_rows)
        rank["G3"] = {k: {"mean": v, "std": None} for k, v in dg.matrix_rank_measures(g3).items()}
        rank["G3"]["groups"] = len(acc.policy_rows)
    profile: list[float] = []
    if acc.profiles:
        T = max(len(p) for p in acc.profiles)
        for t in range(T):
            vals = [float(p[t]) for p in acc.profiles if len(p) > t and math.isfinite(float(p[t]))]
            profile.append(statistics.fmean(vals) if vals else 0.0)
    variances = {k: statistics.fmean([v[k] for v in baseline_var]) for k in baseline_var[0]} if baseline_var else {}
    return {
        "rollouts_per_prompt": M,
        "groups_sampled": sampled,
        "groups_all_equal": all_equal,
        "groups_mixed": mixed,
        "groups_mixed_seen": mixed_seen,
        "groups_invalid": invalid,
        "s1_measured": all_equal / valid_groups if sampled else None,
        "s1_predicted": dg.predicted_zero_variance_fraction(torch.tensor(success_rates), R) if success_rates
        else None,
        "distinct_completions_mean": statistics.fmean(acc.distinct) if acc.distinct else None,
        "rank": rank,
        "spectra": acc.spectra,
        "identity_residual": {"max": max(acc.residuals) if acc.residuals else None,
                              "mean": statistics.fmean(acc.residuals) if acc.residuals else None,
                              "per_group": acc.residuals},
        "g2": {"numerical_rank": [d["numerical_rank"] for d in acc.g2],
               "rank_bound": [d["rank_bound"] for d in acc.g2], "shape": acc.g2[0]["shape"] if acc.g2 else None},
        "baselines": {
            **{k.split("/")[1]: _stats([b.get(k) for b in acc.baseline_rows])["mean"]
               for k in ("baseline/b_star", "baseline/m_correct", "baseline/m_wrong")},
            "group_mean": _stats([b.get("baseline/mean") for b in acc.baseline_rows])["mean"],
            "variance": variances,
            "relative_variance": dg.variance_relative_to_optimal(variances) if variances else {},
            "prompts": len(baseline_var),
        },
        "credit": {
            "within_rollout_adv_var_max": max((c.get("credit/adv_var_within_max", 0.0) for c in acc.credit),
                                              default=None),
            "answer_grad_share": _stats([c.get("credit/answer_share_mean") for c in acc.credit])["mean"],
            "answer_token_share": _stats([c.get("credit/answer_token_frac") for c in acc.credit])["mean"],
            "position_profile": profile,
        },
        "timing": {"generation_seconds": t_gen, "gradient_seconds": t_grad},
    }


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
    from grpo_lens.trainer import seed_everything

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
    try:
        from tqdm.auto import tqdm

        progress = tqdm(config.group_sizes, desc="probe", unit="R")
    except ImportError:
        pass
    for R in config.group_sizes:
        per_r[str(R)] = probe_group_size(policy, tokenizer, task, reward_fns, R, config, layer)
        if progress is not None:
            progress.set_postfix(R=R, mixed=per_r[str(R)]["groups_mixed"])
            progress.update(1)
    if progress is not None:
        progress.close()
    meta = {"model": config.model, "task": config.task, "gradients": "exact" if config.exact else "sketch",
            "sketch_dim": None if config.exact else config.sketch_dim, "std": config.std, "eps": config.eps,
            "layer": layer, "parameters": sum(p.numel() for p in policy.parameters()),
            "seconds": time.perf_counter() - t0, "config": {f.name: getattr(config, f.name) for f in fields(config)}}
    out.mkdir(parents=True, exist_ok=True)
    from grpo_lens.rundir import atomic_write_text

    atomic_write_text(out / "probe.json", json.dumps({"meta": meta, "per_group_size": per_r}, indent=1))
    write_report(out)
    return out
