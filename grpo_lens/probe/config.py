"""``ProbeConfig``: the settings of ``grpo-lens probe`` (what the probe samples and measures; see
:mod:`grpo_lens.probe.run` for what it does and the layout of probe.json).

Shared fields come from the option groups (:mod:`grpo_lens.config.groups`), the probe's own ones are written here,
each with its help (the CLI help), default and check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from grpo_lens.config.base import ConfigFile, Names, at_least, option
from grpo_lens.config.groups import (
    EPS_NOTE,
    EXACT_REFUSAL,
    Advantage,
    Lens,
    Model,
    Output,
    Probing,
    Runtime,
    Sampling,
    TaskData,
    check_task_dataset,
)
from grpo_lens.registry import declared_constant


@dataclass
class ProbeConfig(ConfigFile):
    """Settings of ``grpo-lens probe``; field help is the CLI help."""

    kind: ClassVar[str] = "probe"
    names: ClassVar[Names] = Names(
        renamed={"eps": "std_eps"},  # 0.2 name, until 0.3
        notes={"eps": EPS_NOTE},
        refused={"exact": EXACT_REFUSAL},
    )

    model: str = Model.model()
    task: str = TaskData.task()
    dataset: str | None = TaskData.dataset()
    task_options: dict = TaskData.task_options()
    rewards: list = TaskData.rewards()
    group_sizes: list = Probing.group_sizes()
    prompts: int = Probing.prompts()
    prompts_per_batch: int = option(
        0,
        "Prompts sampled per generate call; 0: as many as a tenth of the memory holds "
        "(their logits dominate it), at most 16 (the former fixed default was 4).",
        check=at_least(0, "must be >= 0 (0 chooses from the memory)"),
    )
    independent_draws: bool = option(
        False,
        "Sample each group size's prompts and rollouts on their own (the draws "
        "before 0.3) instead of once for every R: the default draws each prompt's "
        "largest M once and takes every R's group as the first R of them (nested, "
        "paired across R), and the baseline study reuses those rollouts "
        "(docs/theory.md §Shared draws).",
    )
    per_group_passes: bool = option(
        False,
        "Measure each group in a backward of its own (the readable reference of "
        "the batched pass, same numbers, slower) instead of many groups' block-diagonal "
        "Gram from one backward.",
    )
    baseline_prompts: int = option(
        2, "Mixed prompts per R whose M rollouts are used for the baseline variance.", check=at_least(0)
    )
    max_new_tokens: int = Sampling.max_new_tokens()
    temperature: float = Sampling.temperature()
    top_p: float = Sampling.top_p()
    top_k: int = Sampling.top_k()
    estimator: str = Advantage.estimator()
    loss_aggregation: str = Advantage.loss_aggregation()
    std: str = Advantage.std()
    std_eps: float = Advantage.std_eps()
    dense_oracle: bool = Lens.dense_oracle()
    sketch_dim: int = Lens.sketch_dim()
    gram_source: str = Lens.gram_source()
    layer: str | None = option(
        None,
        "Linear layer for G1_layer and G2 (default: the middle layer's MLP down "
        "projection, among those --layers keeps).",
    )
    layers: str | None = option(
        None,
        "Restrict G2 under the weightings and its per-layer-type rows to the linear "
        "layers (nn.Linear, GPT-2's Conv1D) whose module name matches the pattern: a glob over "
        "the whole name (*.mlp.*) or a regex searched in it (layers\\.[01]\\.|c_attn); "
        "the default --layer is then picked among them. A pattern that matches no layer "
        "stops the probe before anything is written, listing valid names. Default: every "
        "linear layer.",
    )
    g2_groups: int = option(
        8,
        "Mixed groups per R whose G2 is computed for every linear layer under every weighting "
        "(A, |A|, A + mean|A|, r, uniform, one rollout), summarised by layer type, inside the "
        "group's own backward (adding about 0.4 of its time; docs/theory.md §6). The zero-sum G2 "
        "claim needs >= 8 for a verdict. 0 disables.",
        check=at_least(0),
    )
    coverage_groups: int = option(
        1,
        "Mixed groups per R whose sketch is checked against the exact Gram of every "
        "parameter (per-parameter [R, R] Grams; one more batched backward with --gram-source "
        "sketch): the share of ||g||^2 the sketch covers and its Gram error (docs/theory.md "
        "§8). 0 disables.",
        check=at_least(0),
    )
    random_draws: int = option(8, "Draws of random zero-sum weights for the G1 control.", check=at_least(1))
    study_group_size: int = option(
        4,
        "R of the baseline and credit studies (docs/theory.md §Baselines at matched expectation, §Token credit).",
        check=at_least(2),
    )
    baseline_study_prompts: int = option(
        16,
        "Prompts with reward contrast in the baseline study, M = 4R rollouts "
        "each; its claim needs >= 8 testable ones and reaches holds from about 16 "
        "(docs/calibration.md). 0 skips the study.",
        check=at_least(0, "must be >= 0 (0 skips)"),
    )
    credit_groups: int = option(
        8,
        "Mixed groups whose tokens' signed contributions to the update are measured (0 skips the credit study).",
        check=at_least(0, "must be >= 0 (0 skips)"),
    )
    mc_groups: int = option(
        4,
        "Of those, groups with Monte Carlo token advantages for one correct and one wrong "
        "rollout (about 8 s per group on the default model). The Monte Carlo credit claim needs "
        ">= 8 rollouts, i.e. >= 4 groups, for a verdict. 0 skips them.",
        check=at_least(0, "must be >= 0 (0 skips)"),
    )
    mc_samples: int = option(
        8,
        "Continuations per prefix for the Monte Carlo values (K_mc >= 2).",
        check=at_least(2, "must be >= 2 (a standard error needs two continuations)"),
    )
    resamples: int = option(256, "Resampled groups for the baseline variance.", check=at_least(2))
    seed: int = Runtime.seed()
    dtype: str = Runtime.dtype()
    device: str = Runtime.device()
    out: str | None = Output.out(contents="probe.json, report.md, PNGs")
    overwrite: bool = Output.overwrite(what="an existing probe.json (or a probe that did not finish)")
    resume: bool = Output.resume(
        what="the probe a killed `grpo-lens probe` left in --out (OUT/probe_partial/) "
        "from its last finished group, with its settings (flags need not be repeated); it "
        "writes the probe.json an uninterrupted probe would, timings aside"
    )
    progress: bool = Output.progress()
    report_to: list = Output.report_to()

    def prompts_for(self, group_size: int) -> int:
        """The number of prompts sampled for group size R: ``prompts``, or max(24, 128 // R) when it is 0.

        The default aims at >= 16 mixed groups per R on the default task with about 2 SD to spare: the expected count
        is n (1 - S1), with S1 predicted 0.58 / 0.33 / 0.08 for R = 2 / 4 / 8 on the initial default model (from the
        rollouts outside each group), i.e. 27 / 21 / 22 mixed groups expected from 64 / 32 / 24 prompts."""
        return self.prompts if self.prompts > 0 else max(24, 128 // group_size)

    def check(self) -> None:
        """The check of two fields together (each field's own check ran before)."""
        check_task_dataset(self)
        if self.estimator in declared_constant("grpo_lens.formulas.advantages", "BATCH_ESTIMATORS"):
            self.bad(
                "estimator",
                "a batch-level estimator's statistics span a training step's groups; the probe analyses one group "
                "at a time (use grpo, dr_grpo or rloo here, the batch-level one in grpo-lens train)",
            )
        if self.resume and self.overwrite:
            self.bad("overwrite", "--resume continues the probe in --out and --overwrite replaces it: pass one of them")
