"""probe.json keys: the fields of one group size, the sketch check's and the studies'."""

from __future__ import annotations

from grpo_lens.metrics.entry import (
    COUNT,
    INTERVAL,
    OBJECT,
    PARAMETER_CATEGORIES,
    PROBE,
    RANK_UNITS,
    RELATIVE_ERROR,
    ROWS,
    SECONDS,
    SHARE,
    SKETCH_CHECK,
    STUDIES,
    Section,
    family,
)

# The docs/metrics.md tables this module's rows sit in, with the source and scopes each run of rows shares
_probe = Section("probe", where=(PROBE,))
_probe_s1 = Section("probe", source="§S1", where=(PROBE,))
_sketch_check = Section("sketch_check", source="§8", where=(SKETCH_CHECK,))
_studies = Section("studies", where=(STUDIES,))
_study_baselines = Section("studies", source="§Baselines at matched expectation", where=(STUDIES,))
_study_credit = Section("studies", source="§Token credit", where=(STUDIES,))

# ---------------------------------------------------------------------------------------------------------------------
# probe.json per_group_size["R"]
# ---------------------------------------------------------------------------------------------------------------------
ROLLOUTS_PER_PROMPT = _probe.key(
    "rollouts_per_prompt",
    COUNT,
    "M = max(2R, 8) completions drawn per prompt; the first R form the group",
)
PROMPTS_SAMPLED = _probe.key(
    "prompts_sampled",
    COUNT,
    "prompts drawn for this R (`--prompts`, a fixed number: the probe never stops at the N-th mixed group)",
)
(
    GROUPS_ALL_EQUAL,
    GROUPS_MIXED,
    GROUPS_INVALID,
) = _probe.keys(
    (
        "groups_all_equal",
        "groups_mixed",
        "groups_invalid",
    ),
    COUNT,
    "of those: groups with all rewards equal (no gradient), mixed (all analysed), with an invalid reward",
)
S1_MEASURED = _probe_s1.key(
    "s1_measured",
    SHARE,
    "all-equal groups / groups with all rewards valid",
    concept="S1",
)
S1_MEASURED_CI = _probe_s1.key(
    "s1_measured_ci",
    INTERVAL,
    "`{mean, lo, hi, n}`: S1 measured with its 95% interval over the prompts (Hall's transformed t, §7) "
    '(per-prompt indicator "all rewards equal")',
    concept="S1",
)
S1_PREDICTED = _probe_s1.key(
    "s1_predicted",
    SHARE,
    "mean over prompts (all M rewards valid) of [C(k′,R) + C(M′−k′,R)] / C(M′,R), k′ correct among the M′ = M − R "
    "rollouts outside the group: unbiased for p^R + (1−p)^R and not computed from the measured group (docs/theory.md "
    "§S1)",
    concept="S1 predicted",
)
S1_PREDICTED_CI = _probe_s1.key(
    "s1_predicted_ci",
    INTERVAL,
    "`{mean, lo, hi, n}`: its 95% interval over prompts (Hall's transformed t, §7)",
    concept="S1 predicted",
)
PROBE_GROUPS = _probe.key(
    "groups",
    ROWS,
    "one row per analysed group: the keys of the per-group analysis path above",
)
PROBE_SUMMARY = _probe.key(
    "summary",
    INTERVAL,
    "`{mean, lo, hi, n}`: mean over the groups that have the key, with its 95% Hall's transformed-t interval "
    "over groups (theory §7, `grpo_lens.formulas.stats.mean_interval`; lo = hi = null for n < 8)",
    source="§7",
    shown=("summary[key]",),
)
PROBE_STRATA = _probe.key(
    "strata",
    INTERVAL,
    "the same summaries within the groups with k correct rollouts / d distinct completions, for the rank, null, "
    "identity and zero-sum keys",
    source="§7",
    shown=(
        'strata.correct["k"][key]',
        'strata.distinct["d"][key]',
    ),
    fields=(
        "correct",
        "distinct",
    ),
)
PROBE_G3 = _probe.key(
    "g3",
    OBJECT,
    "`rank/g3_<m>`, `rank/g3_null_<m>`, `rank/g3_<w>_<m>` and `groups` (one matrix: no interval)",
    source="§5",
)
PROBE_G2_WEIGHTINGS = _probe.key(
    "g2_weightings",
    OBJECT,
    "`groups` (rows of `rank/g2_<w>_<kind>_stable_rank`, one per group with G2 of every layer) and their `summary`",
    source="§6",
    fields=(
        "groups",
        "summary",
    ),
)
PROBE_SPECTRA = _probe.key(
    "spectra",
    OBJECT,
    "singular values per group: `G1`, `G1_no_adv`, `G1_null`, `G2` (first 64)",
    source="§5",
    shown=("spectra[matrix]",),
    fields=(
        "G1",
        "G1_no_adv",
        "G1_null",
        "G2",
    ),
)
PROBE_BASELINES = _probe.key(
    "baselines",
    OBJECT,
    "`variance[name]` trace variance of (1/R)Σ(r_i − b_i)g_i for baselines none / mean / rloo / optimal, by "
    "resampling groups of R from M rollouts; `relative_variance` = variance / optimal's; `prompts` used",
    source="§2",
    fields=(
        "variance",
        "relative_variance",
        "prompts",
    ),
)
PROBE_CREDIT = _probe.key(
    "credit",
    OBJECT,
    "`position_profile` (mean per-token gradient norm by completion position)",
    source="§10",
    fields=("position_profile",),
)
PROBE_SKETCH_CHECK = _probe.key(
    "sketch_check",
    OBJECT,
    "unless --dense-oracle: `groups` (rows of the keys below, one per checked group: the first `--coverage-groups` "
    "mixed groups of this R) and their `summary`",
    source="§8",
    fields=(
        "groups",
        "summary",
    ),
)
# the exact Gram's coverage in the probe
PROBE_GRAM_COVERAGE = _probe.key(
    "gram_coverage",
    SHARE,
    "with the exact Gram (`gram_source: exact`): the smallest share, over the analysed groups, of the trainable "
    "parameters whose per-rollout gradients the Gram covers (1: every parameter, so all of Σ‖g_i‖²); null in the "
    "sketch and dense modes",
    source="§Exact Gram",
)
PROBE_TIMING = _probe.key(
    "timing",
    SECONDS,
    "seconds for this R: `generation_seconds`, `gradient_seconds` (every analysed group, including "
    "`g2_weightings_seconds` and `sketch_check_seconds`), `seconds` (the whole R); `meta.seconds` and "
    "`meta.studies_seconds` give the probe's and its studies'. After `--resume` (`meta.resumed` true) the R's "
    "times include the prompts a killed probe measured, `meta.seconds` and `meta.studies_seconds` count from the "
    "resume",
    fields=(
        "generation_seconds",
        "gradient_seconds",
        "g2_weightings_seconds",
        "sketch_check_seconds",
        "seconds",
    ),
)

# sketch check keys (per checked group)
SKETCH_COVERAGE = _sketch_check.key(
    "sketch/coverage",
    SHARE,
    "Σ‖S g_i‖² / Σ‖g_i‖²: the share of the exact squared gradient norm that the sketch carries",
)
(
    SKETCH_EXACT_SHARE_LINEAR,
    SKETCH_EXACT_SHARE_EMBEDDING,
    SKETCH_EXACT_SHARE_NORM,
    SKETCH_EXACT_SHARE_OTHER,
) = _sketch_check.keys(
    family("sketch/exact_share_{}", PARAMETER_CATEGORIES),
    SHARE,
    "each parameter category's share of the exact Σ‖g_i‖²; a tied embedding counts under embedding, both uses",
)
SKETCH_GRAM_ERROR = _sketch_check.key(
    "sketch/gram_error",
    RELATIVE_ERROR,
    "‖Ĝ − G‖_F / ‖G‖_F for G1's Gram, sketched vs exact over every parameter",
)
SKETCH_GRAM_ERROR_BOUND = _sketch_check.key(
    "sketch/gram_error_bound",
    RELATIVE_ERROR,
    "the projection-error bound for the sketched layers alone",
)
SKETCH_G1_ERANK_ERROR = _sketch_check.key(
    "sketch/g1_erank_error",
    RANK_UNITS,
    "erank(G1) sketched minus exact",
)

# ---------------------------------------------------------------------------------------------------------------------
# probe.json studies (R = --study-group-size; grpo_lens.probe.studies)
# ---------------------------------------------------------------------------------------------------------------------
STUDY_BASELINES_META = _studies.key(
    "baselines.meta",
    OBJECT,
    "group_size R, rollouts_per_prompt M = 4R, prompts_sampled, presampled_prompts (of those, the probe's shared "
    "draws it reused), prompts_with_contrast, the gradient source (LoGra "
    "sketch of every nn.Linear weight) and sketch_dim, aggregation, seconds",
    fields=(
        "group_size",
        "rollouts_per_prompt",
        "prompts_sampled",
        "presampled_prompts",
        "prompts_with_contrast",
        "gradients",
        "sketch_dim",
        "aggregation",
        "seconds",
    ),
)
STUDY_BASELINES_S1 = _studies.key(
    "baselines.s1",
    OBJECT,
    "`measured` (first R rollouts of each prompt all equal), `predicted` (from the other M − R rollouts, unbiased), "
    "`difference`: each `{mean, lo, hi, n}` over every sampled prompt with valid rewards",
    source="§S1",
    concept="S1",
    fields=(
        "measured",
        "predicted",
        "difference",
        "prompts",
        "rollouts_per_prompt",
    ),
)
STUDY_BASELINES_PER_PROMPT = _study_baselines.key(
    "baselines.baselines.per_prompt",
    OBJECT,
    "one prompt with contrast: `estimators[name]` = `{bias2, variance, mse, cosine}` against the held-out reference "
    "for none / mean_rescaled / rloo / optimal_loo / optimal_pop; `ref_norm2`, `ref_noise` (the reference's own trace "
    "variance, in every mse), `b_star_pop`, `b_star_exact` (corrected for E[h] ≠ 0), `p`, `m_correct`, `m_wrong`, "
    "`mean_score` (`mean_norm`, `floor_norm`, `ratio`, `excess`, `mean_sq_norm`), `equal_norms` (`ratio` m_C/m_W, `p` "
    "its permutation p-value, bootstrap `lo`, `hi` (null with < 8 rollouts a side), `verdict`), `log_ratio` "
    "log(m_C/m_W) (jackknifed) and `log_ratio_var` its jackknife variance (null with < 2 rollouts a side), "
    "`n_correct`, `n_wrong` the class counts (the baseline claim's input)",
    shown=("baselines.baselines.per_prompt[j]",),
    fields=(
        "estimators",
        "ref_norm2",
        "ref_noise",
        "b_star_pop",
        "b_star_exact",
        "p",
        "m_correct",
        "m_wrong",
        "mean_score",
        "equal_norms",
        "log_ratio",
        "log_ratio_var",
        "n_correct",
        "n_wrong",
    ),
    each=True,
)
STUDY_BASELINES_SUMMARY = _study_baselines.key(
    "baselines.baselines.summary",
    INTERVAL,
    "`mse_ratio_to_rloo`, `cosine`, `bias2_share`: `{mean, lo, hi, n}` over prompts",
    shown=("baselines.baselines.summary[name]",),
    fields=(
        "mse_ratio_to_rloo",
        "cosine",
        "bias2_share",
    ),
    each=True,
)
STUDY_BASELINES = _study_baselines.key(
    "baselines.baselines",
    OBJECT,
    "`prompts`, `prompts_constant` (pools without contrast, skipped), `b_star_shift`, `b_star_minus_p`, `norm_ratio` "
    "(m_C/m_W), `mean_score_ratio`: `{mean, lo, hi, n}` over prompts; `equal_norms_rejected` (share of testable "
    "prompts whose permutation test rejects m_C = m_W at 0.05), `equal_norms_testable`; `log_ratio_rms` (`msq` mean "
    "over prompts of log(m_C/m_W)² less its noise with `lo`, `hi`, `n`; `rms`, `rms_lo`, `rms_hi` their roots)",
    shown=("baselines.baselines.*",),
    fields=(
        "per_prompt",
        "summary",
        "prompts",
        "prompts_constant",
        "b_star_shift",
        "b_star_minus_p",
        "norm_ratio",
        "mean_score_ratio",
        "equal_norms_rejected",
        "equal_norms_testable",
        "log_ratio_rms",
    ),
)
STUDY_CREDIT_CONTRIBUTIONS = _study_credit.key(
    "credit.contributions",
    OBJECT,
    "`position_profile` (per relative-position bin, `{mean, lo, hi, n}` over groups of the summed signed share s of "
    "the group update), `classes[answer|format|reasoning]` (`update_share`, `token_share`, `ratio`, each over "
    "groups), `classes_nll[class]` (`ratio`: the same tokens' ratio under NLL weights, every A_i = 1, the control "
    "with the same gradient geometry; `ratio_minus_nll`: the paired difference, over groups), `closure` (max over "
    "groups of abs(Σ s − 1): the finite-difference error), `groups`, `shares` and `shares_nll` (each group's "
    "`classes` entry under A and under NLL weights: what `probe --seeds` pools)",
    fields=(
        "position_profile",
        "classes",
        "classes_nll",
        "closure",
        "groups",
        "shares",
        "shares_nll",
    ),
)
STUDY_CREDIT_MONTE_CARLO = _study_credit.key(
    "credit.monte_carlo",
    OBJECT,
    "`rollouts` (per rollout: reward, grpo_advantage, boundaries, values and errors of V(prefix), segment advantages "
    "and their errors, disagree / agree / neutral token shares, top_segment_share), the means over rollouts of "
    "`disagree`, `agree`, `neutral`, `top_segment_share` with intervals, `samples_per_prefix` K_mc",
    fields=(
        "rollouts",
        "samples_per_prefix",
        "disagree",
        "agree",
        "neutral",
        "top_segment_share",
        "segments",
    ),
)
STUDY_CREDIT_META = _studies.key(
    "credit.meta",
    OBJECT,
    "group_size, groups_sampled, gradient source (exact update over every parameter), finite-difference step, seconds",
    fields=(
        "group_size",
        "groups_sampled",
        "gradients",
        "step",
        "seconds",
    ),
)
