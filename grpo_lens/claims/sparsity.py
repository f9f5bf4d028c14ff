"""The claims on sparsity over training (docs/theory.md §12, on the measures of §Sparsity over training).

:func:`sparsity_intensifies`: Spearman's trend of the policy gradient's Hoyer sparsity over the lens steps (first
excluded), with its permutation p-value; :func:`zero_variance_share_rises`: the same trend test of S1 over every
step. :func:`most_parameters_unchanged`: the float32-unchanged share since the start above 0.5, with the bf16-unchanged
share (S4) against its within-tensor permutation control. All read a training run's records, passed as
``{"records": [metrics.jsonl records], "lora_rank": r}`` (the report evaluates :data:`TRAINING_CLAIMS` on that), and
return [] when their inputs are absent.
"""

from __future__ import annotations

import math
from typing import Any

from grpo_lens.claims.base import (
    CLAIMS,
    DOES_NOT_HOLD,
    HOLDS,
    INCONCLUSIVE,
    Claim,
    ci_text,
    fmt,
    verdict_from_interval,
)
from grpo_lens.formulas.stats import mean_interval, spearman_trend, trend_windows
from grpo_lens.metrics import (
    PERF_LENS_SECONDS,
    RANK_MIXED_GROUPS,
    REWARD_FRAC_ZERO_STD_GROUPS,
    SPARSITY_GRAD_HOYER,
    SPARSITY_GRAD_ZERO,
    SPARSITY_SAMPLE_ENTRIES,
    SPARSITY_UPDATE_STEP_HOYER,
    SPARSITY_UPDATE_TOTAL_BF16_DENSE,
    SPARSITY_UPDATE_TOTAL_BF16_EXCESS_SE,
    SPARSITY_UPDATE_TOTAL_BF16_PERMUTED,
    SPARSITY_UPDATE_TOTAL_BF16_UNCHANGED,
    SPARSITY_UPDATE_TOTAL_BF16_UNCHANGED_SE,
    SPARSITY_UPDATE_TOTAL_F32_UNCHANGED,
    SPARSITY_UPDATE_TOTAL_F32_UNCHANGED_SE,
    STEP,
)

#: bf16-unchanged share above its within-tensor permutation control by more than this: placement matters
BF16_MARGIN = 0.05


#: fewest lens steps a trend is tested on: with n points the smallest two-sided exact p is 2/n!, which is 0.083 at
#: n = 4 and 0.017 at n = 5 (the 0.1 value 4 could never decide)
MIN_LENS_STEPS = 5


#: the claims evaluated on a training run's records
TRAINING_CLAIMS = ("sparsity_intensifies", "zero_variance_share_rises", "most_parameters_unchanged",
                   "rank_stays_near_two")


def _lens_rows(records: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    return [r for r in records if r.get(PERF_LENS_SECONDS) is not None and r.get(key) is not None]


def trend_verdict(xs: list[float], ys: list[float], min_points: int) -> tuple[str, str, float]:
    """(verdict, reason, rho) of a monotone trend of ys over xs: Spearman's rho with its two-sided permutation p
    (:func:`grpo_lens.formulas.stats.spearman_trend`); holds (rises) when rho > 0 and p < 0.05, does not hold when
    rho < 0 and p < 0.05 (each side at 2.5%), inconclusive otherwise or with fewer than ``min_points`` points."""
    rho, p = spearman_trend(xs, ys)
    if len(xs) < min_points or not math.isfinite(p):
        return INCONCLUSIVE, f"{len(xs)} points < {min_points}: no order reaches p < 0.05", rho
    if p < 0.05:
        return (HOLDS if rho > 0 else DOES_NOT_HOLD), f"rho {fmt(rho, 2)}, permutation p {fmt(p, 3)} < 0.05", rho
    return INCONCLUSIVE, f"permutation p {fmt(p, 3)} >= 0.05", rho


@CLAIMS.register("sparsity_intensifies")
def sparsity_intensifies(data: dict[str, Any]) -> list[Claim]:
    """"Gradient sparsity intensifies over training": the Hoyer sparsity of each lens step's policy gradient against
    the step.

    Rule (:func:`trend_verdict`): Spearman's trend of the gradient's Hoyer over the lens steps, excluding the first
    lens step and the steps without a mixed group (their gradient carries no policy-gradient term); needs
    :data:`MIN_LENS_STEPS` steps. The AdamW update's Hoyer is shown but not tested: Adam's first steps are sign-like
    (Hoyer near 0) and its Hoyer rises with stationary gradients (issue 18: holds 10 of 10 with no change in
    sparsity), so its trend says nothing about the gradient.
    """
    records = data.get("records") or []
    rows = _lens_rows(records, SPARSITY_GRAD_HOYER)
    zero = [r for r in records if r.get(PERF_LENS_SECONDS) is not None and r.get(SPARSITY_GRAD_ZERO) is not None
            and r.get(SPARSITY_GRAD_HOYER) is None]  # a zero gradient: Hoyer is 0/0 (the run directory's null)
    if not rows and zero:
        return [Claim(claim="gradient sparsity intensifies over training", scope=f"training, {len(zero)} lens steps",
                      measurement="the sampled policy gradient was exactly zero at every lens step (no reward "
                                  "contrast): its Hoyer sparsity is undefined (0/0)",
                      control="no trend (rho = 0); a Gaussian vector has Hoyer 0.20", verdict=INCONCLUSIVE,
                      rule="no lens step with a non-zero gradient", source="lens")]
    if not rows:
        return []
    tested = [r for r in rows[1:] if r.get(RANK_MIXED_GROUPS) is None or float(r[RANK_MIXED_GROUPS]) > 0]
    xs = [float(r[STEP]) for r in tested]
    ys = [float(r[SPARSITY_GRAD_HOYER]) for r in tested]
    verdict, why, rho = trend_verdict(xs, ys, MIN_LENS_STEPS)
    upd = [r.get(SPARSITY_UPDATE_STEP_HOYER) for r in rows]
    grad = [float(r[SPARSITY_GRAD_HOYER]) for r in rows]
    space = f", LoRA adapter weights (rank {data['lora_rank']}) only" if data.get("lora_rank") else ""
    return [Claim(claim="gradient sparsity intensifies over training",
                  scope=f"training, {len(tested)} lens steps (first lens step excluded){space}",
                  measurement=(f"Hoyer of the policy gradient {fmt(grad[0], 3)} (step {rows[0][STEP]}) -> "
                               f"{fmt(grad[-1], 3)} (step {rows[-1][STEP]}), Spearman rho {fmt(rho, 2)} on the "
                               f"tested steps; AdamW update Hoyer {fmt(upd[0], 3)} -> {fmt(upd[-1], 3)} (not tested)"),
                  control="no trend (rho = 0); a Gaussian vector has Hoyer 0.20",
                  verdict=verdict, rule=why, source=f"lens, fixed sample of {_sample_size(rows)} weights")]


#: fewest steps the S1 trend is tested on
MIN_S1_STEPS = 8


@CLAIMS.register("zero_variance_share_rises")
def zero_variance_share_rises(data: dict[str, Any]) -> list[Claim]:
    """"Sparsity intensifies" read as S1: the share of groups without reward contrast (all rewards equal, no policy
    gradient) rises over training.

    Rule (:func:`trend_verdict`): Spearman's trend of S1 (``reward/frac_zero_std_groups``) over every logged step,
    needs :data:`MIN_S1_STEPS` steps; the measurement gives the mean S1 of the first and the last third of the steps,
    each with its interval over steps (:func:`grpo_lens.formulas.stats.mean_interval`).
    """
    rows = [r for r in data.get("records") or [] if r.get(REWARD_FRAC_ZERO_STD_GROUPS) is not None
            and r.get(STEP) is not None]
    if not rows:
        return []
    xs = [float(r[STEP]) for r in rows]
    ys = [float(r[REWARD_FRAC_ZERO_STD_GROUPS]) for r in rows]
    verdict, why, rho = trend_verdict(xs, ys, MIN_S1_STEPS)
    first, last = (mean_interval(ys[w], bounds=(0.0, 1.0)) for w in trend_windows(len(ys)))
    return [Claim(claim="the share of groups without reward contrast (S1) rises over training",
                  scope=f"training, {len(rows)} steps",
                  measurement=(f"S1 first third {ci_text(first, 2, 'steps')}, last third {ci_text(last, 2, 'steps')}"
                               f"; Spearman rho {fmt(rho, 2)}"),
                  control="no trend (rho = 0)", verdict=verdict, rule=why, source="every step's rewards")]


def _sample_size(rows: list[dict[str, Any]]) -> str:
    n = rows[-1].get(SPARSITY_SAMPLE_ENTRIES)
    return str(int(n)) if n else "?"


def _share_se(row: dict[str, Any], key: str, se_key: str) -> tuple[float, str]:
    """(standard error, how it was computed) of a sampled share: the logged stratified SE, or for records written
    before it was logged the simple-random-sample SE √(q(1−q)/s) (labelled as such)."""
    se = row.get(se_key)
    if se is not None:
        return float(se), "stratified by tensor"
    n, q = float(row.get(SPARSITY_SAMPLE_ENTRIES) or 0), row.get(key)
    if not n or q is None:
        return math.nan, "no standard error"
    return math.sqrt(max(q * (1 - q), 1e-12) / n), "simple-random-sample approximation (older run)"


@CLAIMS.register("most_parameters_unchanged")
def most_parameters_unchanged(data: dict[str, Any]) -> list[Claim]:
    """"RL leaves most parameters unchanged" (S4), beyond bf16 rounding.

    Measures at the last lens step, since the start, on the lens's fixed stratified sample: z = float32-unchanged
    share, q = bf16-unchanged share, c = its within-tensor permutation control (the same update entries permuted within
    each tensor: :func:`grpo_lens.formulas.sparsity.permuted_bf16_unchanged_probability`), each interval ± 1.96 SE
    with the SE stratified by tensor (the sample's design:
    :func:`grpo_lens.formulas.stats.stratified_mean_se`).

    Rule: inconclusive when z = 1 (no sampled weight moved since the start: a zero update, e.g. a warm-up step at
    learning rate 0 or every advantage 0, says nothing about what training changes); holds when z's interval lies
    above 0.5 (most weights did not move at all; then q >= z > 0.5 too); does not
    hold when z's interval lies below 0.5 (most weights moved in float32, whatever bf16 shows) or q's lies below 0.5;
    inconclusive otherwise. The excess q − c is reported with its interval and names the reason when the rule does
    not hold: within :data:`BF16_MARGIN` of 0, the update's own magnitudes placed at random explain the bf16 share
    (rounding of small changes); above it, where the changes land matters too (structure), but the weights still
    moved. The excess is not a condition for holds: permuting a sparse update keeps its zeros, so a truly sparse
    update has excess ≈ 0 (the control tells "placement matters" from "magnitudes explain it", and the float32 share
    tells "sparse" from "small"). The 0.1 rule's dense Gaussian control at the per-tensor RMS is shown, not used:
    with heavy-tailed magnitudes it is set by the few large entries and read a dense update as sparse (issue 18).
    """
    rows = _lens_rows(data.get("records") or [], SPARSITY_UPDATE_TOTAL_BF16_UNCHANGED)
    if not rows:
        return []
    last = rows[-1]
    if data.get("lora_rank"):  # the lens samples the trainable (adapter) weights; the frozen base never changes
        return [Claim(claim="RL leaves most parameters unchanged (S4), beyond bf16 rounding",
                      scope=f"training, step {last[STEP]}, LoRA rank {data['lora_rank']}",
                      measurement=(f"over the adapter's A and B only: bf16 unchanged since start "
                                   f"{fmt(last[SPARSITY_UPDATE_TOTAL_BF16_UNCHANGED], 3)}"),
                      control="none: the claim is about the model's weights, not the adapter's",
                      verdict=INCONCLUSIVE,
                      rule=("not applicable to adapter parameters: the frozen base weights never change and the "
                            "adapter is a different parameter space (B starts at 0, so A gets no gradient on step 1); "
                            "the merged weights W + (alpha/r) B A are not measured"),
                      source=f"lens, fixed sample of {_sample_size(rows)} adapter weights")]
    share = float(last[SPARSITY_UPDATE_TOTAL_BF16_UNCHANGED])
    f32 = last.get(SPARSITY_UPDATE_TOTAL_F32_UNCHANGED)
    perm = last.get(SPARSITY_UPDATE_TOTAL_BF16_PERMUTED)
    dense = last.get(SPARSITY_UPDATE_TOTAL_BF16_DENSE)
    q_se, how = _share_se(last, SPARSITY_UPDATE_TOTAL_BF16_UNCHANGED, SPARSITY_UPDATE_TOTAL_BF16_UNCHANGED_SE)
    most = verdict_from_interval(share - 1.96 * q_se, share + 1.96 * q_se, 0.5, "above")
    if f32 is None:
        f32_most, f32_lo, f32_hi = INCONCLUSIVE, math.nan, math.nan
    else:
        f32 = float(f32)
        z_se, _ = _share_se(last, SPARSITY_UPDATE_TOTAL_F32_UNCHANGED, SPARSITY_UPDATE_TOTAL_F32_UNCHANGED_SE)
        f32_lo, f32_hi = f32 - 1.96 * z_se, f32 + 1.96 * z_se
        f32_most = verdict_from_interval(f32_lo, f32_hi, 0.5, "above")
    if perm is not None:
        gap = share - float(perm)
        e_se = last.get(SPARSITY_UPDATE_TOTAL_BF16_EXCESS_SE)
        e_se = float(e_se) if e_se is not None else q_se
        lo, hi = gap - 1.96 * e_se, gap + 1.96 * e_se
        placement = verdict_from_interval(lo, hi, BF16_MARGIN, "above")
        excess = f"excess over the permutation control {fmt(gap, 3)} [{fmt(lo, 3)}, {fmt(hi, 3)}]"
    else:
        placement, excess = INCONCLUSIVE, "no permutation control (a run from before it was logged)"
    if f32 is not None and f32 >= 1.0:  # not one sampled weight moved: the update was zero (lr 0, every A_i = 0)
        verdict, why = INCONCLUSIVE, ("no sampled weight changed since the start (a zero update: learning rate 0 or "
                                      "every advantage 0); the claim is about what training changes")
    elif f32_most == DOES_NOT_HOLD or most == DOES_NOT_HOLD:
        verdict = DOES_NOT_HOLD
        if most == DOES_NOT_HOLD:
            why = f"only {fmt(share, 3)} of weights kept their bf16 value (< 0.5)"
        else:
            why = f"only {fmt(f32, 3)} of weights are unchanged in float32 (interval below 0.5): most moved"
            if placement == HOLDS:
                why += (f"; their bf16 share {fmt(share, 3)} exceeds the permutation control by more than "
                        f"{BF16_MARGIN}: where the changes land matters, but they are changes")
            elif perm is not None:
                why += (f"; the update's own magnitudes placed at random leave {fmt(float(perm), 3)} unchanged in "
                        f"bf16 (observed {fmt(share, 3)}): rounding of small changes")
    elif f32_most == HOLDS:
        verdict, why = HOLDS, f"float32-unchanged share [{fmt(f32_lo, 3)}, {fmt(f32_hi, 3)}] lies above 0.5"
    else:
        verdict, why = INCONCLUSIVE, (f"the float32-unchanged share's interval [{fmt(f32_lo, 3)}, {fmt(f32_hi, 3)}] "
                                      f"contains 0.5" if f32 is not None else "no float32-unchanged share logged")
    dense_txt = f"; a dense Gaussian update of the same per-tensor RMS {fmt(dense, 3)} (not used)" if dense else ""
    return [Claim(claim="RL leaves most parameters unchanged (S4), beyond bf16 rounding",
                  scope=f"training, step {last[STEP]}",
                  measurement=(f"float32 unchanged since start {fmt(f32, 4)} [{fmt(f32_lo, 4)}, {fmt(f32_hi, 4)}]; "
                               f"bf16 unchanged {fmt(share, 3)}; {excess} (95% intervals over "
                               f"{_sample_size(rows)} sampled weights, standard errors {how})"),
                  control=(f"the same update entries permuted within each tensor leave "
                           f"{fmt(None if perm is None else float(perm), 3)} unchanged in bf16{dense_txt}"),
                  verdict=verdict, rule=why, source=f"lens, fixed stratified sample of {_sample_size(rows)} weights")]
