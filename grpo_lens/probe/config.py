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

from dataclasses import dataclass

from grpo_lens.config import ConfigError, ConfigFile, option
from grpo_lens.formulas.advantages import ADVANTAGE_ESTIMATORS, STD_CONVENTIONS
from grpo_lens.formulas.losses import LOSS_AGGREGATIONS


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
