"""Lens keys: the noise scale and dead groups, landing shares, the per-group analysis path (lens steps and probe.json
groups), g3, g2_weightings, and sparsity/ over training.
"""

from __future__ import annotations

from grpo_lens.metrics.entry import (
    COSINE_GAP,
    COUNT,
    FLAG,
    G2_WEIGHTINGS,
    G3,
    GRAD_NORM_UNITS,
    GROUPS,
    JSONL,
    LENS,
    P_VALUE,
    RANK_UNITS,
    RATIO,
    REWARD_UNITS,
    SECONDS,
    SHARE,
    SHARE_DIFFERENCE,
    SPARSITY_MEASURES,
    SPARSITY_UNITS,
    SQ_GRAD_NORM_UNITS,
    TOKENS,
    WEIGHTING_NAMES,
    Section,
    family,
    with_interval,
)

GROUPS_UNITS = "groups (prompts)"
SIGNED_SHARE = "signed share (the shares sum to 1)"
_NOISE = "§Noise scale and dead groups"
_LANDING = "§Landing shares and the dead groups' KL gradient"
_TOKEN_CLASSES = ("answer", "format", "reasoning")  # grpo_lens.formulas.credit.TOKEN_CLASSES

# The docs/metrics.md tables this module's rows sit in, with the source and scopes each run of rows shares
_noise = Section("noise", source=_NOISE)
_dead = Section("dead", source=_NOISE)
_landing = Section("landing", source=_LANDING)
_dead_kl = Section("dead", source=_LANDING)
_perf = Section("perf")
_group = Section("group", where=LENS)
_rank = Section("group", source="§5", where=LENS)
_baseline = Section("group", source="§2", where=LENS)
_zero_sum = Section("group", source="§6", where=LENS)
_probe_rank = Section("probe_group", source="§5", where=(GROUPS,))
_probe_credit = Section("probe_group", source="§10", where=(GROUPS,))
_g3 = Section("g3", source="§5", where=(G3,))
_g2_weightings = Section("g2_weightings", source="§6", where=(G2_WEIGHTINGS,))
_sparsity = Section("sparsity", source="§Sparsity over training")

# ---------------------------------------------------------------------------------------------------------------------
# the exact gradient noise scale (lens steps) and dead-group accounting (every step)
# (grpo_lens/formulas/noise.py, docs/theory.md §Noise scale and dead groups)
# ---------------------------------------------------------------------------------------------------------------------
NOISE_GROUPS = _noise.key(
    "noise/groups",
    COUNT,
    "lens steps: B, the groups (prompts) the noise scale counts: every group of the step, those without a policy "
    "gradient (all A_i = 0) with G_b = 0",
)
(
    NOISE_GRAD_SQ,
    NOISE_GRAD_SQ_LO,
    NOISE_GRAD_SQ_HI,
) = _noise.keys(
    with_interval("noise/grad_sq"),
    SQ_GRAD_NORM_UNITS,
    "lens steps: the unbiased |G|^2 = (S - D) / (B (B - 1)) of the mean group gradient G = E[G_b], G_b = sum_{i in b} "
    "(-A_i / N) g_i (the update's policy-gradient rows, KL excluded), D = sum_b |G_b|^2, S = |sum_b G_b|^2, from the "
    "exact Gram; lo/hi: delete-one-group jackknife 95% interval (full Gram, >= 8 groups). Can be negative: no signal",
)
(
    NOISE_TRACE_SIGMA,
    NOISE_TRACE_SIGMA_LO,
    NOISE_TRACE_SIGMA_HI,
) = _noise.keys(
    with_interval("noise/trace_sigma"),
    SQ_GRAD_NORM_UNITS,
    "lens steps: the unbiased tr(Sigma) = (D - S / B) / (B - 1), the per-group gradient covariance's trace; lo/hi "
    "as `noise/grad_sq`",
)
(
    NOISE_B_SIMPLE,
    NOISE_B_SIMPLE_LO,
    NOISE_B_SIMPLE_HI,
) = _noise.keys(
    with_interval("noise/b_simple"),
    GROUPS_UNITS,
    "lens steps: the gradient noise scale B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018, arXiv 1812.06162, "
    "§2.2), in groups: the batch at which noise and signal energy are equal; NaN when |G|^2 <= 0; lo/hi as "
    "`noise/grad_sq`",
)
NOISE_SNR = _noise.key(
    "noise/snr",
    RATIO,
    "lens steps: the step's signal-to-noise |G|^2 / (tr(Sigma) / B) = B / B_simple (> 1: the step's mean gradient "
    "holds more signal than noise energy)",
)
NOISE_GRAD_SQ_P = _noise.key(
    "noise/grad_sq_p",
    P_VALUE,
    "lens steps, full Gram: the null control, a one-sided sign-flip p-value of |G|^2 > 0 (2000 flips of each "
    "group's sign; large: the step's signal is not told apart from noise)",
)
NOISE_FROM_UPDATE = _noise.key(
    "noise/from_update",
    FLAG,
    "1 when S = |sum_b G_b|^2 is the update's own first gradient norm squared (the Gram read off the update's "
    "backward holds each group's block only: no interval, no null), 0 when it is the sum of the full Gram",
)
NOISE_PROXY_TOTAL_POWER, NOISE_EXACT_TOTAL_POWER = _noise.keys(
    (
        "noise/proxy_total_power",
        "noise/exact_total_power",
    ),
    ("logit-space squared norm", SQ_GRAD_NORM_UNITS),
    "lens steps with `--lens-noise-proxy`: verl's proxy mean_i A_i^2 W_i, W_i = sum_t |e_{o_t} - pi_t|^2 (verl PR "
    "#4678, `variance_proxy/proxy2_total_power`), and the exact mean_i A_i^2 |sum_t grad log pi(o_it)|^2 from the "
    "Gram's diagonal, both over the step's N rollouts in the loss (A_i = 0 outside the mixed groups): two scales, "
    "compare their orderings (`noise/proxy_rank_corr`)",
)
NOISE_PROXY_RANK_CORR = _noise.key(
    "noise/proxy_rank_corr",
    RATIO,
    "lens steps with `--lens-noise-proxy`: Spearman's rho over the mixed groups' rollouts between verl's A_i^2 W_i and "
    "the exact A_i^2 |sum_t grad log pi(o_it)|^2 (1: the proxy orders rollouts by gradient power as the Gram does)",
)
(
    DEAD_ALL_CORRECT_GROUPS,
    DEAD_ALL_WRONG_GROUPS,
    DEAD_ALL_EQUAL_OTHER_GROUPS,
) = _dead.keys(
    family("dead/all_{}_groups", ("correct", "wrong", "equal_other")),
    COUNT,
    "every step: groups without reward contrast whose valid rewards all equal 1 (all correct under the 0/1 "
    "correctness reward), all equal 0 (all wrong), or all equal another value; with `reward/frac_zero_std_groups` "
    "they split S1",
)
DEAD_MIXED_GROUPS = _dead.key(
    "dead/mixed_groups",
    COUNT,
    "every step: groups with reward contrast (every process's); 0 counts toward `--stop-after-dead-steps`",
)
DEAD_NORMALIZER_SHARE = _dead.key(
    "dead/normalizer_share",
    SHARE,
    "every step: share of the loss normaliser (completion tokens for token-mean, rollouts otherwise) held by "
    "rollouts of groups whose advantages are all 0: every other rollout's gradient is divided by it too, so the step "
    "is (1 - share) of what a loss over the other groups alone would take",
)
DEAD_STEPS_WITHOUT_MIXED = _dead.key(
    "dead/steps_without_mixed",
    COUNT,
    "every step: consecutive steps up to this one without a mixed group (kept across --resume); "
    "`--stop-after-dead-steps N` stops the run when it reaches N",
)

# ---------------------------------------------------------------------------------------------------------------------
# Landing shares during training and the dead groups' KL-only gradient (lens steps, opt-in)
# ---------------------------------------------------------------------------------------------------------------------
(
    LANDING_ANSWER_SHARE,
    LANDING_FORMAT_SHARE,
    LANDING_REASONING_SHARE,
) = _landing.keys(
    family("landing/{}_share", _TOKEN_CLASSES),
    SIGNED_SHARE,
    "lens steps with `--lens-landing` and a tokenizer: the token class's share of the update's landing, sum over its "
    "tokens of s_it = w_it <grad log pi(o_it), u> / |u|^2 (u the update's own first gradient, negated; w_it = A_i "
    "omega_i / N) over the sum of s_it over every measured token; classes as the credit study's (answer: the last "
    "number's tokens, format: no letter or digit, reasoning: the rest); signed, so one may exceed 1 or fall below 0",
)
(
    LANDING_ANSWER_TOKEN_SHARE,
    LANDING_FORMAT_TOKEN_SHARE,
    LANDING_REASONING_TOKEN_SHARE,
) = _landing.keys(
    family("landing/{}_token_share", _TOKEN_CLASSES),
    SHARE,
    "lens steps with `--lens-landing` and a tokenizer: the class's share of the measured tokens, the control its "
    "landing share is read against (equal: the class carries the update in proportion to its size)",
)
LANDING_POSITIVE_SHARE = _landing.key(
    "landing/positive_share",
    SIGNED_SHARE,
    "lens steps with `--lens-landing`: the share of the update's landing on tokens of rollouts with A_i > 0 (the rest "
    "lands on A_i < 0 rollouts' tokens)",
)
LANDING_CLOSURE = _landing.key(
    "landing/closure",
    RATIO,
    "lens steps with `--lens-landing`: sum of s_it over the measured tokens; 1 (to the finite differences' O(e^4) "
    "error) when they make the whole update (one process, no KL term in the loss, no importance weights), the "
    "share of |u|^2 they account for otherwise",
)
LANDING_TOKENS = _landing.key(
    "landing/tokens",
    TOKENS,
    "lens steps with `--lens-landing`: the tokens measured (every token the loss sums of this process's rollouts "
    "with A_i != 0 in the update's first mini-batch, whose gradient the first optimizer step takes)",
)
DEAD_KL_GRAD_NORM = _dead_kl.key(
    "dead/kl_grad_norm",
    GRAD_NORM_UNITS,
    "lens steps with `--lens-dead-kl`, beta > 0 and the KL in the loss: |grad of the loss over the rollouts of groups "
    "whose advantages are all 0| = |beta grad KL| of those rows (their policy term has no gradient), aggregated and "
    "normalised as in the update, at the step's starting weights, every trainable parameter (one process)",
)
DEAD_KL_GRAD_RATIO = _dead_kl.key(
    "dead/kl_grad_ratio",
    RATIO,
    "lens steps with `--lens-dead-kl`: `dead/kl_grad_norm` over the update's first gradient norm (before clipping): "
    "how large the push groups without reward contrast give through the KL term is next to the whole step's",
)
PERF_LENS_LANDING_SECONDS = _perf.key(
    "perf/lens_landing_seconds",
    SECONDS,
    "lens steps with `--lens-landing` or `--lens-dead-kl`: wall time of their extra forwards and backward (not in "
    "`perf/lens_seconds`)",
)

# ---------------------------------------------------------------------------------------------------------------------
# The per-group analysis path (lens steps and probe.json)
# ---------------------------------------------------------------------------------------------------------------------
RANK_MIXED_GROUPS = _group.key(
    "rank/mixed_groups",
    COUNT,
    "lens: groups analysed this step (mixed, all rewards valid), over every process",
    where=(JSONL,),
)
GROUP_SIZE = _group.key(
    "group/size",
    COUNT,
    "R (probe only; the lens omits it)",
    where=(GROUPS,),
)
GROUP_REWARD_MEAN = _group.key(
    "group/reward_mean",
    REWARD_UNITS,
    "the group's mean reward",
)
GROUP_CORRECT = _group.key(
    "group/correct",
    COUNT,
    "k, the number of rollouts with reward 1 (0/1 rewards only)",
)
GROUP_DISTINCT_COMPLETIONS = _group.key(
    "group/distinct_completions",
    COUNT,
    "distinct completions among the R (identical completions have identical g_i and cap G1's rank)",
)
RANK_G1 = _rank.template(
    "rank/g1_{m}",
    RANK_UNITS,
    "G1, rows A_i g_i (theory §5)",
)
RANK_G1_NULL = _rank.template(
    "rank/g1_null_{m}",
    RANK_UNITS,
    "the orthogonal null: singular values |A_i|·‖g_i‖, what G1 would have if its rows shared no direction (theory §5)",
)
RANK_G1_SIMNULL = _rank.template(
    "rank/g1_simnull_{m}",
    RANK_UNITS,
    "the simulated null: G1's row norms with iid uniform random directions in R^P (mean over draws; only when "
    "the dimension P is given, e.g. by `grpo-lens calibrate`); tends to the orthogonal null as P grows (theory §5)",
)
RANK_G1_LO, RANK_G1_HI = (
    _rank.template(
        f"rank/g1_{{m}}_{end}",
        RANK_UNITS,
        f"lens: the {side} end of the 95% interval over the step's mixed groups of rank/g1_<m> (Hall's t, theory §7; "
        f"absent with fewer than 8 groups)",
        source="§7",
        where=(JSONL,),
    )
    for end, side in (("lo", "lower"), ("hi", "upper"))
)
RANK_G1_VS_NULL = _rank.template(
    "rank/g1_{m}_vs_null",
    RATIO,
    "rank/g1_<m> / rank/g1_null_<m>: below 1 = shared directions beyond the row norms",
)
RANK_G1_NO_ADV = _rank.template(
    "rank/g1_no_adv_{m}",
    RANK_UNITS,
    "control: rows g_i (no advantages)",
)
RANK_G1_RANDOM = _rank.template(
    "rank/g1_random_{m}",
    RANK_UNITS,
    "control: rows w_i g_i, w random zero-sum with ‖w‖ = ‖A‖ (mean over draws)",
)
RANK_G1_NLL = _rank.template(
    "rank/g1_nll_{m}",
    RANK_UNITS,
    "control: rows of the supervised token-mean NLL gradient of the same completions",
)
BASELINE_M_CORRECT, BASELINE_M_WRONG = _baseline.keys(
    (
        "baseline/m_correct",
        "baseline/m_wrong",
    ),
    SQ_GRAD_NORM_UNITS,
    "m_C, m_W: mean ‖g_i‖² of correct / wrong rollouts",
)
BASELINE_B_STAR = _baseline.key(
    "baseline/b_star",
    REWARD_UNITS,
    "b* = Σ‖g_i‖² r_i / Σ‖g_i‖², the variance-optimal constant baseline (plug-in, theory §2)",
)
BASELINE_GROUP_MEAN = _baseline.key(
    "baseline/group_mean",
    REWARD_UNITS,
    "the group mean reward, GRPO's baseline; equals b* iff m_C = m_W",
)
BASELINE_B_STAR_MINUS_MEAN = _baseline.key(
    "baseline/b_star_minus_mean",
    REWARD_UNITS,
    "b* − group mean",
)
#: The statistics of the zero-sum test (:func:`grpo_lens.formulas.zero_sum.zero_sum_tests`) and the parts of each.
ZERO_SUM_STATS = ("span_energy", "cos_gap")

#: the span energy of the cosine Gram (the mechanism claim's θ; not in the report's zero-sum table)
ZERO_SUM_UNIT_STATS = ("unit_span_energy",)
ZERO_SUM_PARTS = ("", "null", "excess", "null_var", "p")

ZERO_SUM_SPAN_ENERGY = _zero_sum.key(
    "zero_sum/span_energy",
    SHARE,
    "share of G1's energy ΣA_i²‖g_i‖² that lies in span{ḡ_C, ḡ_W} (theory §6)",
)
ZERO_SUM_SPAN_ENERGY_NULL = _zero_sum.key(
    "zero_sum/span_energy_null",
    SHARE,
    "its mean over relabellings of the group with k fixed (the permutation null)",
)
ZERO_SUM_SPAN_ENERGY_P = _zero_sum.key(
    "zero_sum/span_energy_p",
    P_VALUE,
    "permutation p-value: share of relabellings with a span energy ≥ the true labels'",
)
ZERO_SUM_SPAN_ENERGY_EXCESS = _zero_sum.key(
    "zero_sum/span_energy_excess",
    SHARE_DIFFERENCE,
    "span energy minus its relabelling mean; mean zero under the null when all C(R, k) relabellings are enumerated, "
    "so its mean over groups with an interval is the across-group test (theory §6)",
)
ZERO_SUM_SPAN_ENERGY_NULL_VAR = _zero_sum.key(
    "zero_sum/span_energy_null_var",
    "squared share",
    "variance of the span energy over the relabellings with k fixed: the group's null variance in the across-group "
    "relabelling test of the claims (theory §11)",
    source="§11",
)
ZERO_SUM_COS_GAP = _zero_sum.key(
    "zero_sum/cos_gap",
    COSINE_GAP,
    "mean within-class minus mean between-class cosine of the g_i (absent for R = 2)",
)
(
    ZERO_SUM_COS_GAP_NULL,
    ZERO_SUM_COS_GAP_EXCESS,
    ZERO_SUM_COS_GAP_NULL_VAR,
    ZERO_SUM_COS_GAP_P,
) = _zero_sum.keys(
    family("zero_sum/cos_gap_{}", ZERO_SUM_PARTS[1:]),
    (COSINE_GAP, COSINE_GAP, "squared cosine gap", P_VALUE),
    "its relabelling mean, excess over it, variance over the relabellings, and permutation p-value",
)

(
    ZERO_SUM_UNIT_SPAN_ENERGY,
    ZERO_SUM_UNIT_SPAN_ENERGY_NULL,
    ZERO_SUM_UNIT_SPAN_ENERGY_EXCESS,
    ZERO_SUM_UNIT_SPAN_ENERGY_NULL_VAR,
    ZERO_SUM_UNIT_SPAN_ENERGY_P,
) = _zero_sum.keys(
    family("zero_sum/unit_span_energy{}", tuple(f"_{p}" if p else "" for p in ZERO_SUM_PARTS)),
    (SHARE, SHARE, SHARE_DIFFERENCE, "squared share", P_VALUE),
    "the span energy on the cosine Gram (every g_i scaled to norm 1, so a label effect on gradient norms alone "
    "cannot raise it): observed, relabelling mean, excess, variance over the relabellings, permutation p-value; the "
    "mechanism claim's θ (theory §11)",
    source="§11",
)

# probe only, computed with the model
RANK_G1_LAYER = _probe_rank.template(
    "rank/g1_layer_{m}",
    RANK_UNITS,
    "G1 of one layer's rows",
)
RANK_G2 = _probe_rank.template(
    "rank/g2_{m}",
    RANK_UNITS,
    "that layer's weight gradient of the group loss, [d_out, d_in]",
)
RANK_G2_NUMERICAL_RANK = _probe_rank.key(
    "rank/g2_numerical_rank",
    RANK_UNITS,
    "G2's singular values above max(d_out, d_in) × the float epsilon of the precision G2 was computed in, × s₁",
)
RANK_G2_RANK_BOUND = _probe_rank.key(
    "rank/g2_rank_bound",
    RANK_UNITS,
    "prompt tokens + distinct proper completion prefixes",
)
CREDIT_ADV_VAR_WITHIN_MAX = _probe_credit.key(
    "credit/adv_var_within_max",
    "advantage units²",
    "the largest variance of the per-token advantages within a rollout: 0 by construction under an output-only reward",
)
CREDIT_ANSWER_SHARE_MEAN = _probe_credit.key(
    "credit/answer_share_mean",
    SHARE,
    "share of a rollout's Σ_t ‖∇_t‖² on its final-answer tokens",
)
CREDIT_ANSWER_TOKEN_FRAC = _probe_credit.key(
    "credit/answer_token_frac",
    SHARE,
    "share of its tokens that are answer tokens: what a flat profile gives",
)

# one matrix per R: probe.json g3
RANK_G3 = _g3.template(
    "rank/g3_{m}",
    RANK_UNITS,
    "G3, rows = the analysed groups' updates Σ_i A_i g_i",
)
RANK_G3_NULL = _g3.template(
    "rank/g3_null_{m}",
    RANK_UNITS,
    "its orthogonal null, singular values = the row norms",
)
RANK_G3_WEIGHTED = _g3.template(
    "rank/g3_{w}_{m}",
    RANK_UNITS,
    "G3 with rows Σ_i w_i g_i under the weighting `<w>`",
    source="§6",
    only=(("w", WEIGHTING_NAMES[1:]),),
)
G3_GROUPS = _g3.key(
    "groups",
    COUNT,
    "the analysed groups, G3's rows (one matrix: no interval)",
    source="",
)

# probe.json g2_weightings
RANK_G2_WEIGHTED = _g2_weightings.template(
    "rank/g2_{w}_{kind}_stable_rank",
    RANK_UNITS,
    "the mean over the layers of kind `<kind>` (q_proj, down_proj, lm_head, ...) of the stable rank ‖G2‖_F²/s₁² of "
    "every nn.Linear layer's G2 under weighting `<w>` (s₁ by subspace iteration with a residual check, the exact "
    "symmetric solver where it does not converge; `probe.json` `g2_weightings`)",
)

# ---------------------------------------------------------------------------------------------------------------------
# sparsity/ (lens steps)
# ---------------------------------------------------------------------------------------------------------------------
SPARSITY_UPDATE_STEP = _sparsity.key(
    "sparsity/update_step",
    SHARE,
    "**S4**: share of parameters whose bf16 value did not change in this step (every parameter)",
    source="§9",
    concept="S4",
)
SPARSITY_UPDATE_TOTAL = _sparsity.key(
    "sparsity/update_total",
    SHARE,
    "**S4**: share whose bf16 value is the same as before training (every parameter)",
    source="§9",
    concept="S4",
)
#: (unit, meaning, concept) of each measure of the sampled update, on one row for this step's update
#: (``sparsity/update_step_<measure>``) and the update since the start (``sparsity/update_total_<measure>``)
_UPDATE_ROWS = {
    "f32_unchanged": (
        SHARE,
        "share of weights exactly unchanged in float32 by this step's update / since the start (docs/theory.md "
        "§Sparsity over training)",
        "",
    ),
    "bf16_unchanged": (
        SHARE,
        "share whose bf16 value is unchanged, on the fixed sample (estimates S4)",
        "S4",
    ),
    "bf16_permuted": (
        SHARE,
        "**the control** for the line above: the expected bf16-unchanged share when the same update entries are "
        "permuted within each tensor (each tensor's magnitudes, zeros included, kept; where they land removed; exact "
        "mean over permutations)",
        "",
    ),
    "bf16_dense": (
        SHARE,
        "a second control: the expected bf16-unchanged share of a dense Gaussian update with the same per-tensor RMS "
        "(shown, not the claim's control: with heavy-tailed magnitudes the RMS is set by the few large entries, so "
        "this reads a dense update as sparser than rounding)",
        "",
    ),
    "f32_unchanged_se": (
        SHARE,
        "standard error of the float32-unchanged share from the fixed sample, stratified by tensor (Cochran 1977 "
        "§5.3; tensors taken whole add none)",
        "",
    ),
    "bf16_unchanged_se": (
        SHARE,
        "the same for the bf16-unchanged share",
        "",
    ),
    "bf16_excess_se": (
        SHARE,
        "the same for bf16-unchanged − the permutation control (per-entry differences treated as independent within a "
        "tensor: the control's own sampling noise is left out)",
        "",
    ),
    "hoyer": (
        SPARSITY_UNITS,
        "Hoyer sparsity (S3) of the update: 0 equal magnitudes, ≈ 0.20 Gaussian, 1 one entry; null for a zero update "
        "(0/0)",
        "",
    ),
    "top1_energy": (
        SHARE,
        "share of ‖Δθ‖² in the top 1% of entries (S2-style): ≈ 0.105 for a Gaussian vector, 1 when ≤ 1% of entries "
        "move; null for a zero update",
        "",
    ),
}


def _update_keys(measure: str) -> tuple[str, ...]:
    """Register the row of ``measure`` (:data:`_UPDATE_ROWS`); return its step and total keys."""
    unit, meaning, concept = _UPDATE_ROWS[measure]
    return _sparsity.keys(family(f"sparsity/update_{{}}_{measure}", ("step", "total")), unit, meaning, concepts=concept)


SPARSITY_UPDATE_STEP_F32_UNCHANGED, SPARSITY_UPDATE_TOTAL_F32_UNCHANGED = _update_keys("f32_unchanged")
SPARSITY_UPDATE_STEP_BF16_UNCHANGED, SPARSITY_UPDATE_TOTAL_BF16_UNCHANGED = _update_keys("bf16_unchanged")
SPARSITY_UPDATE_STEP_BF16_PERMUTED, SPARSITY_UPDATE_TOTAL_BF16_PERMUTED = _update_keys("bf16_permuted")
SPARSITY_UPDATE_STEP_BF16_DENSE, SPARSITY_UPDATE_TOTAL_BF16_DENSE = _update_keys("bf16_dense")
SPARSITY_UPDATE_STEP_F32_UNCHANGED_SE, SPARSITY_UPDATE_TOTAL_F32_UNCHANGED_SE = _update_keys("f32_unchanged_se")
SPARSITY_UPDATE_STEP_BF16_UNCHANGED_SE, SPARSITY_UPDATE_TOTAL_BF16_UNCHANGED_SE = _update_keys("bf16_unchanged_se")
SPARSITY_UPDATE_STEP_BF16_EXCESS_SE, SPARSITY_UPDATE_TOTAL_BF16_EXCESS_SE = _update_keys("bf16_excess_se")
SPARSITY_UPDATE_STEP_HOYER, SPARSITY_UPDATE_TOTAL_HOYER = _update_keys("hoyer")
SPARSITY_UPDATE_STEP_TOP1_ENERGY, SPARSITY_UPDATE_TOTAL_TOP1_ENERGY = _update_keys("top1_energy")


def _gradient_keys(quantity: str, meaning: str) -> tuple[str, ...]:
    """Register the row of a sampled gradient's measures (zero share, Hoyer, top-1% energy): ``sparsity/<quantity>_*``
    for ``quantity`` "grad" (the step's) or "grad_total" (summed since the start); return its keys."""
    keys = family(f"sparsity/{quantity}_{{}}", SPARSITY_MEASURES[quantity])
    return _sparsity.keys(keys, (SHARE, SPARSITY_UNITS, SHARE), meaning)


(
    SPARSITY_GRAD_ZERO,
    SPARSITY_GRAD_HOYER,
    SPARSITY_GRAD_TOP1_ENERGY,
) = _gradient_keys(
    "grad",
    "the same measures of the step's policy gradient (the first optimizer step's gradient, before clipping)",
)
(
    SPARSITY_GRAD_TOTAL_ZERO,
    SPARSITY_GRAD_TOTAL_HOYER,
    SPARSITY_GRAD_TOTAL_TOP1_ENERGY,
) = _gradient_keys(
    "grad_total",
    "the same measures of the policy gradients summed over every step since the start (the sampled entries, "
    "accumulated in float64 on every step; kept in checkpoints)",
)
SPARSITY_BY_TYPE = _sparsity.template(
    "sparsity/{type}/{key}",
    "as `<key>`",
    "each of the keys above for one layer type: `norm`, `embedding`, `attention`, `mlp` (`other` if any)",
)
SPARSITY_SAMPLE_ENTRIES = _sparsity.key(
    "sparsity/sample_entries",
    COUNT,
    "how many weight entries the sampled keys come from (a fixed stratified uniform sample, weights n_t/s_t; standard "
    "error of a share ≤ 0.5/√this)",
)
