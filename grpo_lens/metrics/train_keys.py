"""metrics.jsonl keys of every training step: reward/, adv/, completions/, loss/, kl/, clip/, ratio/, mismatch/,
policy/, dynamic/, grad/, guard/.
"""

from __future__ import annotations

from grpo_lens.metrics.entry import (
    ADVANTAGE_UNITS,
    COUNT,
    FLAG,
    GRAD_NORM_UNITS,
    LENS,
    LOSS_UNITS,
    NATS,
    NATS_PER_TOKEN,
    RATIO,
    RELATIVE_ERROR,
    REWARD_UNITS,
    SHARE,
    TOKENS,
    Section,
)

# The docs/metrics.md tables this module's rows sit in, with the source and scopes each run of rows shares
_reward = Section("reward")
_adv = Section("adv", source="§The variance-optimal baseline in training")
_completions = Section("completions")
_loss = Section("loss", source="§3")
_mismatch = Section("mismatch", source="§Sampler-trainer mismatch")
_policy = Section("policy", source="§Policy entropy")
_dynamic = Section("dynamic", source="§Dynamic sampling")
_grad = Section("grad")
_guard = Section("guard", source="§Numerical guards")

# ---------------------------------------------------------------------------------------------------------------------
# metrics.jsonl: reward/
# ---------------------------------------------------------------------------------------------------------------------
REWARD_MEAN, REWARD_STD = _reward.keys(
    (
        "reward/mean",
        "reward/std",
    ),
    REWARD_UNITS,
    "mean and (population) std of the valid rewards of the step's N rollouts",
)
REWARD_ACCURACY = _reward.key(
    "reward/accuracy",
    SHARE,
    "mean over the step's rollouts of the task's own 0/1 correctness verdict (`grpo_lens.tasks.correctness_verdict`: "
    "the marked final answer against the reference; math-verify for gsm8k when installed), independent of the "
    "configured reward functions and weights; absent when no rollout has a reference answer",
)
REWARD_KL_PENALTY = _reward.key(
    "reward/kl_penalty",
    REWARD_UNITS,
    "with `--kl-in-reward`: mean over the step's valid rollouts of beta * sum_t (log pi_old - log pi_ref), the KL "
    "penalty subtracted from their rewards before the advantages; `reward/mean` includes it",
    source="§Losses, aggregation, KL and the gradient the trainer follows",
)
REWARD_OVERLONG_PENALTY = _reward.key(
    "reward/overlong_penalty",
    REWARD_UNITS,
    "with `--overlong soft-punish`: mean over the step's rollouts of DAPO's length penalty R_length in [−1, 0] added "
    "to their rewards (docs/theory.md §Overlong handling); `reward/mean` includes it",
    source="§Overlong handling",
)
REWARD_FRAC_ZERO_STD_GROUPS = _reward.key(
    "reward/frac_zero_std_groups",
    SHARE,
    "**S1 measured** (§9): share of the B groups whose valid rewards are all equal (or with < 2 valid rollouts). "
    "These groups contribute exactly zero policy gradient",
    source="§S1",
    concept="S1",
)
REWARD_INVALID_FRAC, REWARD_INVALID_COUNT = _reward.keys(
    (
        "reward/invalid_frac",
        "reward/invalid_count",
    ),
    (SHARE, COUNT),
    "share / number of rollouts whose reward was invalid (None, NaN, error, timeout); they get advantage 0 and are "
    "left out of group statistics",
    source="§2",
)
REWARD_ERROR_COUNT, REWARD_TIMEOUT_COUNT = _reward.keys(
    (
        "reward/error_count",
        "reward/timeout_count",
    ),
    COUNT,
    "reward-function calls that raised / exceeded `reward_timeout`",
)
REWARD_FUNCTION = _reward.template(
    "reward/{name}",
    REWARD_UNITS,
    "mean of reward function `<name>` (before its weight) over valid rollouts",
)
REWARD_FUNCTION_INVALID_COUNT = _reward.template(
    "reward/{name}/invalid_count",
    COUNT,
    "rollouts that function could not score this step (None, NaN, error, timeout)",
)
REWARD_LOGGED = _reward.template(
    "reward/logged/{name}",
    "as logged",
    "a value a reward function logged with TRL's `log_metric(name, value)` keyword (`grpo_lens.rewards."
    "call_reward_function`), averaged over this step's calls",
)

# ---------------------------------------------------------------------------------------------------------------------
# adv/, completions/
# ---------------------------------------------------------------------------------------------------------------------
(
    ADV_MEAN,
    ADV_ABS_MEAN,
    ADV_MAX,
    ADV_MIN,
) = _adv.keys(
    (
        "adv/mean",
        "adv/abs_mean",
        "adv/max",
        "adv/min",
    ),
    ADVANTAGE_UNITS,
    "statistics of the N advantages A_i (§2). `adv/mean` is 0 up to rounding for zero-sum estimators",
    source="§2",
)
ADV_OPTIMAL_BASELINE = _adv.key(
    "adv/optimal_baseline",
    REWARD_UNITS,
    "`--estimator optimal` only: mean over the valid rollouts of groups with reward contrast (all processes) of the "
    "leave-one-out b*_{-i} = r_i − A_i, from sketched squared gradient norms (docs/theory.md §The variance-optimal "
    "baseline in training)",
)
ADV_OPTIMAL_MINUS_RLOO = _adv.key(
    "adv/optimal_minus_rloo",
    REWARD_UNITS,
    "`--estimator optimal` only: mean over the same rollouts of b*_{-i} − mean_{j≠i} r_j; 0 means the optimal "
    "baseline reduced to RLOO's on this step (m_C = m_W)",
)
COMPLETIONS_MEAN_LENGTH, COMPLETIONS_MAX_LENGTH = _completions.keys(
    (
        "completions/mean_length",
        "completions/max_length",
    ),
    TOKENS,
    "completion length in tokens (up to and including EOS)",
)
COMPLETIONS_TRUNCATED_FRAC = _completions.key(
    "completions/truncated_frac",
    SHARE,
    "share of completions cut at `max_new_tokens` without EOS (what happens to them is `--overlong`: none, mask, "
    "filter or soft-punish; in every mode they still count in their group's mean and std; docs/theory.md "
    "§Overlong handling)",
    source="§Overlong handling",
)

# ---------------------------------------------------------------------------------------------------------------------
# loss/, kl/, clip/, ratio/, mismatch/, policy/
# ---------------------------------------------------------------------------------------------------------------------
LOSS_POLICY = _loss.key(
    "loss/policy",
    LOSS_UNITS,
    "the clipped-surrogate part of the aggregated loss (§3), averaged over the step's optimizer steps. With ratio 1 "
    "and centred advantages it is ~0 even though its gradient is not",
)
LOSS_KL = _loss.key(
    "loss/kl",
    LOSS_UNITS,
    "beta × aggregated KL part of the loss",
)
KL_MEAN = _loss.key(
    "kl/mean",
    NATS_PER_TOKEN,
    "token mean of the per-token KL estimate (`kl_estimator`) between policy and reference model; 0 when beta = 0",
)
CLIP_RATIO_LOW = _loss.key(
    "clip/ratio_low",
    SHARE,
    "share of completion tokens where rho < 1 − eps_low and A < 0 (the lower clip binds)",
)
CLIP_RATIO_HIGH = _loss.key(
    "clip/ratio_high",
    SHARE,
    "share where rho > 1 + eps_high and A > 0 (the upper clip binds)",
)
CLIP_RATIO_REGION = _loss.key(
    "clip/ratio_region",
    SHARE,
    "share where either binds; 0 on the first on-policy pass (mu = 1)",
)
CLIP_RATIO_DUAL = _loss.key(
    "clip/ratio_dual",
    SHARE,
    "share where the dual clip binds (A < 0, rho > dual_clip)",
)
RATIO_MEAN, RATIO_MAX = _loss.keys(
    (
        "ratio/mean",
        "ratio/max",
    ),
    RATIO,
    "importance ratio rho = pi_theta / pi_old over completion tokens; pi_old is the trainer's own detached forward, so "
    "the first pass over the first mini-batch has rho = 1 exactly, in any dtype (docs/theory.md §Log-probabilities)",
    source="§Log-probabilities",
)
MISMATCH_LOGPROB_ABS_DIFF_MEAN, MISMATCH_LOGPROB_ABS_DIFF_MAX = _mismatch.keys(
    (
        "mismatch/logprob_abs_diff_mean",
        "mismatch/logprob_abs_diff_max",
    ),
    NATS,
    "mean / max over completion tokens of |log pi_old − log pi_sampler| (nats): the trainer's forward against the "
    "log-probs `generate` recorded, same definition. ~1e-6 (max ~5e-6) in float32 on the CPU; ~1e-2 (max ~0.05) in "
    "bfloat16 (docs/theory.md §Sampler-trainer mismatch)",
)
MISMATCH_KL_K3 = _mismatch.key(
    "mismatch/kl_k3",
    NATS_PER_TOKEN,
    "token mean of the k3 estimate e^d − d − 1, d = log pi_old − log pi_sampler: KL(pi_sampler ‖ pi_old) in nats per "
    "token, ≥ 0",
)
MISMATCH_TIS_WEIGHT_MEAN = _mismatch.key(
    "mismatch/tis_weight_mean",
    RATIO,
    "with `tis_cap`: mean truncated importance weight min(pi_old / pi_sampler, tis_cap) on the policy loss",
)
MISMATCH_TIS_CAPPED_FRAC = _mismatch.key(
    "mismatch/tis_capped_frac",
    SHARE,
    "with `tis_cap`: share of completion tokens whose weight hit the cap",
)
POLICY_ENTROPY = _policy.key(
    "policy/entropy",
    NATS_PER_TOKEN,
    "token mean, over the completion tokens of the step's first update pass (all processes), of the entropy "
    "−Σ_v π(v) log π(v) in nats of the temperature-scaled policy (docs/theory.md §Log-probabilities; the sampler's "
    "top-k / top-p truncation is not applied), from the logits that pass computes anyway (no extra forward; "
    "docs/theory.md §Policy entropy). With num_mini_batches > 1 mini-batch k is read after k optimizer steps. A fall "
    "towards 0 is entropy collapse",
)

# ---------------------------------------------------------------------------------------------------------------------
# dynamic/
# ---------------------------------------------------------------------------------------------------------------------
DYNAMIC_MIXED_GROUPS = _dynamic.key(
    "dynamic/mixed_groups",
    COUNT,
    "mixed groups (rewards not all equal) the step trained on: prompts_per_step unless the cap was hit. The step's "
    "`reward/mean`, `reward/std`, `reward/frac_zero_std_groups` (S1), `reward/invalid_frac` and `reward/accuracy` "
    "describe ALL sampled groups (every round: the policy's actual behaviour); its other keys (adv/, completions/, "
    "loss/, the lens) describe the kept groups only",
)
DYNAMIC_ROUNDS = _dynamic.key(
    "dynamic/rounds",
    COUNT,
    "sampling rounds of prompts_per_step prompts this step took (1 = the ordinary batch sufficed)",
)
DYNAMIC_SAMPLED_GROUPS = _dynamic.key(
    "dynamic/sampled_groups",
    COUNT,
    "groups sampled over all rounds (rounds × prompts_per_step)",
)
DYNAMIC_ZERO_VAR_FRAC_SAMPLED = _dynamic.key(
    "dynamic/zero_var_frac_sampled",
    SHARE,
    "share of all sampled groups whose rewards were all equal: the S1 that dynamic sampling paid for with extra "
    "generation",
    concept="S1",
)
(
    DYNAMIC_KEPT_REWARD_MEAN,
    DYNAMIC_KEPT_REWARD_STD,
    DYNAMIC_KEPT_FRAC_ZERO_STD_GROUPS,
    DYNAMIC_KEPT_INVALID_FRAC,
    DYNAMIC_KEPT_ACCURACY,
) = _dynamic.keys(
    (
        "dynamic/kept_reward_mean",
        "dynamic/kept_reward_std",
        "dynamic/kept_frac_zero_std_groups",
        "dynamic/kept_invalid_frac",
        "dynamic/kept_accuracy",
    ),
    (REWARD_UNITS, REWARD_UNITS, SHARE, SHARE, SHARE),
    "the same statistics as `reward/mean`, `reward/std`, `reward/frac_zero_std_groups`, `reward/invalid_frac`, "
    "`reward/accuracy`, over the kept (trained-on) groups only: selected for reward contrast, so they are not the "
    "policy's reward or S1 (kept S1 is 0 unless the cap was hit)",
    concepts=("", "", "S1", "", ""),
)
DYNAMIC_HIT_CAP = _dynamic.key(
    "dynamic/hit_cap",
    FLAG,
    "1 when the step ended at `dynamic_sampling_max_rounds` with fewer than prompts_per_step mixed groups (it then "
    "trains on those; with none, on the first round's batch, whose policy gradient is zero)",
)

#: With dynamic sampling these keys describe all sampled groups; the kept groups' values of them go to these keys.
KEPT_KEYS = {
    REWARD_MEAN: DYNAMIC_KEPT_REWARD_MEAN,
    REWARD_STD: DYNAMIC_KEPT_REWARD_STD,
    REWARD_FRAC_ZERO_STD_GROUPS: DYNAMIC_KEPT_FRAC_ZERO_STD_GROUPS,
    REWARD_INVALID_FRAC: DYNAMIC_KEPT_INVALID_FRAC,
    REWARD_ACCURACY: DYNAMIC_KEPT_ACCURACY,
}

# ---------------------------------------------------------------------------------------------------------------------
# grad/, guard/
# ---------------------------------------------------------------------------------------------------------------------
GRAD_NORM = _grad.key(
    "grad/norm",
    GRAD_NORM_UNITS,
    "global L2 norm of the step's first optimizer step's gradient, before clipping: the on-policy GRPO gradient of "
    "the whole batch when num_mini_batches = 1, of the first mini-batch otherwise",
)
GRAD_NORM_LAST = _grad.key(
    "grad/norm_last",
    GRAD_NORM_UNITS,
    "the same for the step's last optimizer step (differs when mu > 1 or num_mini_batches > 1)",
)
GRAD_OPTIMIZER_STEPS = _grad.key(
    "grad/optimizer_steps",
    COUNT,
    "optimizer steps taken this sampling round (mu × num_mini_batches, less any skipped)",
)
GRAD_IDENTITY_RESIDUAL = _grad.key(
    "grad/identity_residual",
    RELATIVE_ERROR,
    "lens steps: max over mixed 0/1 groups of the relative residual of Σ A_i g_i = c (ḡ_C − ḡ_W) with the configured "
    "estimator's own constant c (theory §4); absent when the identity does not apply (reinforce, optimal, "
    "`mask_truncated` groups with a truncated rollout, non-0/1 rewards)",
    source="§4",
    where=LENS,
)
GRAD_IDENTITY_CONSTANT = _grad.key(
    "grad/identity_constant",
    ADVANTAGE_UNITS,
    "lens steps: mean over those groups of c (= k A_C, the estimator's constant for the group's k and R)",
    source="§4",
    where=LENS,
)
# the exact Gram's coverage (gradients/gram.py)
GRAD_GRAM_COVERAGE = _grad.key(
    "grad/gram_coverage",
    SHARE,
    "lens steps with the exact Gram (`gram_source: exact`): the share of the trainable parameters (by count) whose "
    "per-rollout gradients the Gram covers, so the share of Σ‖g_i‖² it carries is 1 when this is 1 "
    "(grpo_lens.gradients.gram; a parameter it cannot attribute is listed, not guessed)",
    source="§Exact Gram",
)
GUARD_SKIPPED_OPTIMIZER_STEPS = _guard.key(
    "guard/skipped_optimizer_steps",
    COUNT,
    "optimizer steps of this round skipped because a loss or the gradient norm was non-finite (no weight or AdamW "
    "change)",
)
GUARD_STEP_SKIPPED = _guard.key(
    "guard/step_skipped",
    FLAG,
    "1 when this round skipped any optimizer step, else 0",
)
GUARD_SKIPPED_STEPS = _guard.key(
    "guard/skipped_steps",
    COUNT,
    "running total of skipped rounds in the run (kept across --resume)",
)
GUARD_CONSECUTIVE_SKIPPED = _guard.key(
    "guard/consecutive_skipped",
    COUNT,
    "skipped rounds in a row up to this one; the run stops at `max_consecutive_skips`",
)
