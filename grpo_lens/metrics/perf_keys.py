"""perf/ (wall times, memory, learning rate, step) and eval/ keys."""

from __future__ import annotations

from grpo_lens.metrics.entry import (
    COUNT,
    LEARNING_RATE,
    MEGABYTES,
    SECONDS,
    SHARE,
    STEP_UNITS,
    TOKENS_PER_SECOND,
    Section,
    with_interval,
)

# The docs/metrics.md tables this module's rows sit in, with the source and scopes each run of rows shares
_perf = Section("perf")
_eval = Section("eval")

# ---------------------------------------------------------------------------------------------------------------------
# perf/ and others
# ---------------------------------------------------------------------------------------------------------------------
PERF_STEP_SECONDS = _perf.key(
    "perf/step_seconds",
    SECONDS,
    "wall time of the whole step (sampling, rewards, lens, update)",
)
PERF_GENERATION_SECONDS = _perf.key(
    "perf/generation_seconds",
    SECONDS,
    "wall time of sampling",
)
PERF_OPTIMAL_BASELINE_SECONDS = _perf.key(
    "perf/optimal_baseline_seconds",
    SECONDS,
    "`--estimator optimal` only: wall time of the sketched backward that gives b*'s squared gradient norms (this "
    "process)",
)
PERF_LENS_SECONDS = _perf.key(
    "perf/lens_seconds",
    SECONDS,
    "wall time of the lens measurement (lens steps): its own forward + backward and the analysis; when the exact Gram "
    "comes from the update's own backward (`--lens-from-update`, docs/theory.md §Lens inside the update's backward), "
    "its hooks' time inside that backward and the analysis; when the sketch comes from the update's first pass "
    "(docs/theory.md §Lens sketch from the update), the analysis alone",
)
PERF_LENS_SPARSITY_SECONDS = _perf.key(
    "perf/lens_sparsity_seconds",
    SECONDS,
    "wall time of the lens's snapshots and sparsity measures around the optimizer step (lens steps). With "
    "`lens_from_update` the lens's gradient capture runs inside the update's first pass and is in neither lens key: "
    "measured on the default model (2-core CPU, shared machine, 4 steps, same rollouts with and without the lens) the "
    "lens cost 2.06 s per lens step, of which these two keys held 1.6 s, on 12.2 s steps: 3.9% of a 30-step run at "
    "`lens_every` = 5 (7 lens steps), 17% at `lens_every` = 1",
)
PERF_REWARD_SECONDS = _perf.template(
    "perf/reward_{name}_seconds",
    SECONDS,
    "wall time of reward function `<name>` this step (a timed-out call counts up to `reward_timeout`)",
)
PERF_TOKENS_PER_SECOND = _perf.key(
    "perf/tokens_per_second",
    TOKENS_PER_SECOND,
    "completion tokens of the step / step seconds",
)
PERF_PEAK_MEMORY_MB = _perf.key(
    "perf/peak_memory_mb",
    MEGABYTES,
    "peak GPU memory allocated, or the process's peak resident memory on CPU",
)
LR = _perf.key(
    "lr",
    LEARNING_RATE,
    "learning rate of the step",
)
STEP = _perf.key(
    "step",
    STEP_UNITS,
    "the optimizer step (sampling round), from 1",
)

# ---------------------------------------------------------------------------------------------------------------------
# eval/: held-out accuracy every --eval-every steps (grpo_lens.train.evaluate)
# ---------------------------------------------------------------------------------------------------------------------
(
    EVAL_GREEDY_ACCURACY,
    EVAL_GREEDY_ACCURACY_LO,
    EVAL_GREEDY_ACCURACY_HI,
) = _eval.keys(
    with_interval("eval/greedy_accuracy"),
    SHARE,
    "share of the `eval_prompts` held-out prompts whose greedy completion (temperature 0) the task's own verdict "
    "marks correct, and its 95% Wilson interval over prompts (`grpo_lens.formulas.stats.wilson_interval`)",
)
(
    EVAL_SAMPLED_ACCURACY,
    EVAL_SAMPLED_ACCURACY_LO,
    EVAL_SAMPLED_ACCURACY_HI,
) = _eval.keys(
    with_interval("eval/sampled_accuracy"),
    SHARE,
    "share of correct completions among `eval_samples` sampled ones per held-out prompt (the training temperature), "
    "and its 95% Wilson interval over the completions (they share prompts, so it is narrower than one over prompts)",
)
EVAL_PROMPTS = _eval.key(
    "eval/prompts",
    COUNT,
    "held-out prompts the evaluation scored",
)
EVAL_SECONDS = _eval.key(
    "eval/seconds",
    SECONDS,
    "wall time of the evaluation (not in perf/step_seconds)",
)
