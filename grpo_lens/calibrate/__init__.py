"""``grpo-lens calibrate``: the level and power of every primary verdict rule on planted cases, each case with ONE
truth, what was planted (docs/calibration.md).

Every planted group goes through the path a real group takes: its Gram matrix [R, R], rewards [R] and GRPO
advantages [R] into :func:`grpo_lens.analysis.group.analyse_group` (``null_dim`` = the planted dimension P), the rows
into a probe-shaped dict and that into the registered claim (:data:`grpo_lens.claims.base.CLAIMS`). Training-run
rules get metrics.jsonl-shaped records. Per (family, R) a pool of planted groups is analysed once; each trial draws
n groups per R from the pools without replacement and the claim decides once across R, as the probe's table does.

Truth, per family and claim, from what was planted (never from where one measure's mean falls):

- rank ≈ 2: a planted rank-2 signal (two class means, or a label-free rank-2 signal) whose population E₂ > 0.9 > E₁
  (the mean over 1500 planted groups of G1's top-2 / top-1 energy shares); every other family is "not rank 2",
  including the boundary family whose population E₂ is tuned to 0.9 (not above it);
- the labels structure G1: directions that depend on the labels (class means) with population θ̄ >= 0.1 (the mean
  over the pool's informative groups of θ_g on the cosine Gram; every such family has θ̄ >= 0.199); label-free
  families (including label effects on norms alone) are false, and so is ``a0``, whose groups carry no label
  information (no θ̄; it sets no *does not hold* power);
- trends: rising cases true; flat cases (with autocorrelated steps, or a falling count of mixed groups) false.

Level = the share of the wrong verdict under that truth (*holds* where false, *does not hold* where true); power =
the share of the right one. :func:`rule_levels` reduces the rows to {rule: {n: worst level, lowest power}}, which
``--out`` writes as levels.json; the package ships a copy (grpo_lens/data/calibration_levels.json) that the report
reads for each row's calibrated level and power. ``--planted FILE.npz`` runs your own Gram matrices through the same
path (:func:`run_planted`).

The package by job: :mod:`.families` (the planted families, their truth, pools), :mod:`.cells` (the cells per rule
group), :mod:`.run` (the run, levels.json, the markdown), :mod:`.planted` (``--planted``); every name is
re-exported here.
"""

from grpo_lens.calibrate.budgets import (
    PRIMARY_RULES,
    TARGET_POWER,
    budget,
    holm_summary,
    holm_verdicts,
    rule_budgets,
)
from grpo_lens.calibrate.cells import (
    LENS_STEPS,
    PLANTED_UPDATE_WEIGHTS,
    S4_SAMPLE,
    calibrate_baseline_rules,
    calibrate_credit_rules,
    calibrate_group_rules,
    calibrate_stays_rules,
    calibrate_training_rules,
    calibrate_update_rules,
    interval_coverage,
    lens_steps,
    planted_prompt,
    planted_update_model,
)
from grpo_lens.calibrate.families import (
    BASELINE_FAMILIES,
    BASELINE_M_WRONG,
    BASELINE_PROMPTS,
    DEFAULT_GROUP_COUNTS,
    FAMILIES,
    GROUP_CELLS,
    LABEL_FAMILIES,
    MC_FAMILIES,
    MC_ROLLOUTS,
    PLANTED_DIM,
    PLANTED_WARMUP,
    S1_TRENDS,
    S4_FAMILIES,
    SPARSITY_TRENDS,
    STAYS_FAMILIES,
    STAYS_SEEDS_FAMILIES,
    TREND_BUDGETS,
    CalibrationConfig,
    analysed_pool,
    at_margin,
    baseline_noise_scale,
    boundary_noise,
    has_rank2_signal,
    label_directions,
    parallel_map,
    planted_group,
    planted_norm_ratio,
    population_shares,
    probe_of,
)
from grpo_lens.calibrate.planted import (
    MAX_PLANTED_BYTES,
    PlantedFileError,
    check_npz_sizes,
    read_planted,
    run_planted,
)
from grpo_lens.calibrate.run import (
    render,
    rule_levels,
    run_calibration,
    write_outputs,
)

__all__ = [
    "BASELINE_FAMILIES",
    "BASELINE_M_WRONG",
    "BASELINE_PROMPTS",
    "CalibrationConfig",
    "DEFAULT_GROUP_COUNTS",
    "FAMILIES",
    "GROUP_CELLS",
    "LABEL_FAMILIES",
    "LENS_STEPS",
    "MAX_PLANTED_BYTES",
    "MC_FAMILIES",
    "MC_ROLLOUTS",
    "PLANTED_DIM",
    "PLANTED_UPDATE_WEIGHTS",
    "PLANTED_WARMUP",
    "PRIMARY_RULES",
    "PlantedFileError",
    "S1_TRENDS",
    "S4_FAMILIES",
    "S4_SAMPLE",
    "SPARSITY_TRENDS",
    "STAYS_FAMILIES",
    "STAYS_SEEDS_FAMILIES",
    "TARGET_POWER",
    "TREND_BUDGETS",
    "analysed_pool",
    "at_margin",
    "baseline_noise_scale",
    "boundary_noise",
    "budget",
    "calibrate_baseline_rules",
    "calibrate_credit_rules",
    "calibrate_group_rules",
    "calibrate_stays_rules",
    "calibrate_training_rules",
    "calibrate_update_rules",
    "check_npz_sizes",
    "has_rank2_signal",
    "holm_summary",
    "holm_verdicts",
    "interval_coverage",
    "label_directions",
    "lens_steps",
    "parallel_map",
    "planted_group",
    "planted_norm_ratio",
    "planted_prompt",
    "planted_update_model",
    "population_shares",
    "probe_of",
    "read_planted",
    "render",
    "rule_budgets",
    "rule_levels",
    "run_calibration",
    "run_planted",
    "write_outputs",
]
