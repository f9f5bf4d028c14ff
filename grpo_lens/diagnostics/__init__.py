"""Diagnostics of GRPO's gradient: per-rollout gradients (exact and sketched), spectra and effective ranks, the rank-2
identity, sparsity, baselines and token credit (formulas: docs/theory.md).

The one per-group analysis path is :func:`analyse_group` (:mod:`grpo_lens.diagnostics.group`): the trainer's lens and
``grpo-lens probe`` both call it and only aggregate its rows (:mod:`grpo_lens.diagnostics.stats`).

Everything is a pure function of rollouts, rewards and gradients, plus one capture mechanism
(:class:`GradientCapture`, hooks on ``nn.Linear``) that the trainer can wrap around its own backward.
"""

from grpo_lens.diagnostics.baselines import (
    BASELINES,
    baseline_metrics,
    correct_wrong_sq_norms,
    estimator_variances,
    loo_optimal_baselines,
    optimal_baseline,
    optimal_baseline_binary,
    variance_relative_to_optimal,
)
from grpo_lens.diagnostics.credit import (
    answer_mask_from_char_span,
    answer_mask_from_tokenizer,
    answer_share,
    completion_positions,
    credit_metrics,
    decode_offsets,
    last_number_span,
    position_profile,
    token_advantages,
    within_rollout_advantage_variance,
)
from grpo_lens.diagnostics.gradients import (
    GradientCapture,
    GradientSketch,
    exact_nll_grad,
    exact_policy_grad,
    exact_rollout_grads,
    exact_weighted_grad,
    group_row_sums,
    kronecker_sketch_variance,
    kronecker_sketch_variance_factor,
    layer_weight_grads,
    linear_layer_names,
    nll_weights,
    param_slices,
    rollout_scores,
    select_parameters,
    sketch_gram_error_bound,
    sketch_nll_grad,
    sketch_policy_grad,
    sketch_rollout_grads,
    token_grad_sq_norms,
    weighted_row_sum,
)
from grpo_lens.diagnostics.group import (
    WEIGHTINGS,
    G2WeightingCapture,
    analyse_group,
    cosine_gap,
    g1_rank_keys,
    g1_singular_values,
    g2_by_type_keys,
    g2_keys,
    layer_type,
    mean_over_groups,
    orthogonal_null_singular_values,
    parameter_category,
    sketch_check_keys,
    span_energy,
    top_singular_value,
    weighted_gram_measures,
    weightings,
    zero_sum_tests,
)
from grpo_lens.diagnostics.identity import (
    IDENTITY_ESTIMATORS,
    binary_group_std,
    identity_constant,
    grpo_binary_advantages,
    rank2_constant,
    rank2_residual,
    rank2_residuals,
)
from grpo_lens.diagnostics.sparsity import (
    Bf16UpdateTracker,
    bf16_unchanged_fraction,
    hoyer_sparsity,
    predicted_zero_variance_fraction,
    predicted_zero_variance_fraction_from_rewards,
    s1_metrics,
    small_entry_share,
    unbiased_zero_variance_probability,
    zero_variance_fraction,
    zero_variance_groups,
)
from grpo_lens.diagnostics.stats import bootstrap_ci, stratify_rows, student_t_quantile, summarise_rows
from grpo_lens.diagnostics.spectrum import (
    RANK_MEASURES,
    count_distinct_prefixes,
    distinct_completions,
    distinct_completions_per_group,
    effective_rank,
    energy_rank,
    flatten_metrics,
    g1_matrix,
    g1_spectra,
    g2_rank_bound,
    g3_matrix,
    gram_singular_values,
    matrix_rank_measures,
    numerical_rank,
    participation_ratio,
    rank_measures,
    random_zero_sum_weights,
    singular_values,
    stable_rank,
)

__all__ = [
    # gradients
    "GradientCapture", "GradientSketch", "exact_nll_grad", "exact_policy_grad", "exact_rollout_grads",
    "exact_weighted_grad", "group_row_sums", "kronecker_sketch_variance", "kronecker_sketch_variance_factor", "layer_weight_grads",
    "linear_layer_names", "nll_weights", "param_slices", "rollout_scores", "select_parameters",
    "sketch_gram_error_bound", "sketch_nll_grad", "sketch_policy_grad", "sketch_rollout_grads",
    "token_grad_sq_norms", "weighted_row_sum",
    # spectrum
    "RANK_MEASURES", "count_distinct_prefixes", "distinct_completions", "distinct_completions_per_group",
    "effective_rank", "energy_rank", "flatten_metrics", "g1_matrix", "g1_spectra", "g2_rank_bound", "g3_matrix",
    "gram_singular_values", "matrix_rank_measures", "numerical_rank", "participation_ratio", "rank_measures",
    "random_zero_sum_weights", "singular_values", "stable_rank",
    # the per-group analysis path and its aggregation
    "WEIGHTINGS", "G2WeightingCapture", "analyse_group", "cosine_gap", "g2_by_type_keys", "layer_type", "weightings", "g1_rank_keys", "g1_singular_values", "g2_keys", "mean_over_groups",
    "orthogonal_null_singular_values", "parameter_category", "sketch_check_keys", "span_energy",
    "top_singular_value", "weighted_gram_measures", "zero_sum_tests",
    "bootstrap_ci", "stratify_rows", "student_t_quantile", "summarise_rows",
    # identity
    "IDENTITY_ESTIMATORS", "identity_constant", "binary_group_std", "grpo_binary_advantages", "rank2_constant", "rank2_residual", "rank2_residuals",
    # sparsity
    "Bf16UpdateTracker", "bf16_unchanged_fraction", "hoyer_sparsity", "predicted_zero_variance_fraction",
    "predicted_zero_variance_fraction_from_rewards", "s1_metrics", "small_entry_share", "zero_variance_fraction",
    "unbiased_zero_variance_probability",
    "zero_variance_groups",
    # baselines
    "BASELINES", "baseline_metrics", "correct_wrong_sq_norms", "estimator_variances", "loo_optimal_baselines",
    "optimal_baseline", "optimal_baseline_binary", "variance_relative_to_optimal",
    # credit
    "answer_mask_from_char_span", "answer_mask_from_tokenizer", "answer_share", "completion_positions",
    "credit_metrics", "decode_offsets", "last_number_span", "position_profile", "token_advantages",
    "within_rollout_advantage_variance",
]
