"""The claims on sparsity over training (docs/theory.md §12, on the measures of §Sparsity over training).

:func:`sparsity_intensifies`: the trend of the policy gradient's Hoyer sparsity over the lens steps (first and the
LR warm-up's excluded), by the first-difference slope test in one run; :func:`zero_variance_share_rises`: the trend of
S1 over every step after the warm-up, by the OLS slope's fixed-b HAC test in one run. When the data hold several
seeds (``data["seed_runs"]``, from `train --seeds`) both take each seed's OLS slope and a t over seeds
(:func:`trend_verdict`). :func:`most_parameters_unchanged`: the float32-unchanged share since the start above 0.5,
with the bf16-unchanged share (S4) against its within-tensor permutation control. All read a training run's records,
passed as ``{"records": [metrics.jsonl records], "lora_rank": r}`` (the report evaluates :data:`TRAINING_CLAIMS` on
that), and return [] when their inputs are absent.
"""

from __future__ import annotations

import math
from typing import Any

from grpo_lens import metrics as mk
from grpo_lens.claims import base
from grpo_lens.claims.base import BRANCH_LEVEL, DOES_NOT_HOLD, HOLDS, INCONCLUSIVE, Claim, ci_text, decide, fmt
from grpo_lens.formulas.pooling import seed_slope_test
from grpo_lens.formulas.stats import (
    difference_trend_test,
    hac_trend_test,
    mean_interval,
    normal_upper_tail,
    ols_trend,
    spearman_trend,
    trend_windows,
)

#: bf16-unchanged share above its within-tensor permutation control by more than this: placement matters
BF16_MARGIN = 0.05


#: fewest lens steps a trend is tested on: with n points the smallest two-sided exact p is 2/n!, which is 0.083 at
#: n = 4 and 0.017 at n = 5 (the 0.1 value 4 could never decide)
MIN_LENS_STEPS = 5


#: the claims evaluated on a training run's records
TRAINING_CLAIMS = (
    "sparsity_intensifies",
    "zero_variance_share_rises",
    "most_parameters_unchanged",
    "rank_stays_near_two",
)


def _lens_rows(records: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    return [r for r in records if r.get(mk.PERF_LENS_SECONDS) is not None and r.get(key) is not None]


def _more_lens_steps(rows: list[dict[str, Any]], tested: int) -> str:
    """How to get more tested lens steps, from the run's own lens spacing (the median gap between its lens steps)."""
    gaps = sorted(b[mk.STEP] - a[mk.STEP] for a, b in zip(rows, rows[1:]))
    every = int(gaps[len(gaps) // 2]) if gaps else 1
    if every <= 1:
        return f"raise `--max-steps` (now {tested} tested lens steps, the lens on every step)"
    lower = max(1, every // 2)
    return (
        f"raise `--max-steps` or lower `--lens-every` (now {tested} tested lens steps, every {every} steps; "
        f"e.g. --lens-every {lower} gives about {every / lower:.1f}× as many)"
    )


#: a trend's series in one run: (steps [n], values [n], covariate [n] or None)
Series = tuple[list[float], list[float], list[float] | None]


def after_warmup(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records from the step at which the logged learning rate (``perf/lr``) first reaches its largest value on:
    the LR warm-up's steps dropped, so that a transient of the warm-up (a policy barely moving, then moving) is not
    read as a trend over training. Records without a learning rate are all kept (a constant LR drops nothing)."""
    lrs = [r.get(mk.LR) for r in records]
    if not records or any(v is None for v in lrs):
        return records
    # no None: checked above
    top = max(float(v) for v in lrs)  # type: ignore[arg-type]
    first = next(i for i, v in enumerate(lrs) if float(v) >= top * (1 - 1e-9))  # type: ignore[arg-type]
    return records[first:]


#: the tests of a trend within one run, by name (docs/theory.md §12)
WITHIN_RUN_TESTS = {"hac": hac_trend_test, "differences": difference_trend_test}


def trend_verdict(series: list[Series], min_points: int, within: str) -> tuple[str, str, dict[str, Any]]:
    """(verdict, reason, the test's numbers) of a rising trend, from one run or pooled over seeds (docs/theory.md §12).

    - One run (one series), ``within`` = "hac": the OLS slope with its fixed-b HAC t (Bartlett kernel, b = 1: Kiefer
      & Vogelsang 2005; :func:`grpo_lens.formulas.stats.hac_trend_test`), which keeps its level under stationary
      autocorrelated steps (S1: each step's share of fresh groups); "differences": the first-difference slope test
      (:func:`grpo_lens.formulas.stats.difference_trend_test`), which keeps it up to a random walk (the gradient's
      Hoyer, correlated 0.59 between lens steps 5 apart) and gains power as the lens runs more often.
    - Several seeds: each seed's OLS slope (:func:`grpo_lens.formulas.stats.ols_trend`) and the t-test over seeds
      (:func:`grpo_lens.formulas.pooling.seed_slope_test`), valid whatever the within-run dependence (a random walk
      included), since the seeds are independent runs.

    The covariate (when given) is partialled out. Holds (rises) when the one-sided p of slope > 0 is <=
    :data:`BRANCH_LEVEL`; does not hold when that of slope < 0 is; inconclusive otherwise. A series with fewer than
    ``min_points`` points gives no slope. The numbers carry "p_holds", "p_dnh", "route" ("run" / "seeds"), "k" (series
    with a slope) and Spearman's rho of the first series (descriptive)."""
    xs, ys, _ = series[0]
    rho, _ = spearman_trend(xs, ys, num_perm=200) if len(xs) >= 3 else (math.nan, math.nan)
    usable = [s for s in series if len(s[0]) >= min_points]
    if len(series) > 1:
        t = seed_slope_test([ols_trend(*s)["slope"] for s in usable])
        route, k = "seeds", t["k"]
        enough = k >= 2
        what = (
            f"mean OLS slope over {k} seeds {fmt(t['slope'], 3)} per step "
            f"(t = {fmt(t['t'], 2)}, df {t['df']}; per seed {', '.join(fmt(b, 3) for b in t['per_seed'])})"
        )
        short = f"{len(usable)} of {len(series)} seeds have >= {min_points} points (2 needed)"
    else:
        if within not in WITHIN_RUN_TESTS:
            raise ValueError(f"unknown within-run trend test {within!r}; valid: {', '.join(WITHIN_RUN_TESTS)}")
        t = WITHIN_RUN_TESTS[within](*series[0])
        route, k = "run", int(t["slope"] is not None and bool(usable))
        enough = k == 1
        what = (
            f"OLS slope {fmt(t['slope'], 3)} per step (fixed-b HAC t = {fmt(t['t'], 2)})"
            if within == "hac"
            else f"slope from first differences {fmt(t['slope'], 3)} per step (t = {fmt(t['t'], 2)}, df {t['df']})"
        )
        short = f"{len(xs)} points < {min_points} (or no variation in x)"
    nums = {**t, "rho": rho, "p_holds": t["p_up"], "p_dnh": t["p_down"], "route": route, "k": k}
    if not enough or t["slope"] is None:
        return INCONCLUSIVE, short, {**nums, "p_holds": 1.0, "p_dnh": 1.0}
    # t['slope'] set: both p-values are set
    verdict = decide(t["p_up"], t["p_down"])  # type: ignore[arg-type]
    if verdict == HOLDS:
        return HOLDS, f"{what}, one-sided p {t['p_up']:.2g} <= {BRANCH_LEVEL}", nums
    if verdict == DOES_NOT_HOLD:
        return DOES_NOT_HOLD, f"{what}: falls, one-sided p {t['p_down']:.2g} <= {BRANCH_LEVEL}", nums
    return INCONCLUSIVE, f"{what}, one-sided p {min(t['p_up'], t['p_down']):.2g} > {BRANCH_LEVEL}", nums  # type: ignore[type-var]


def seed_records(data: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """The runs a training claim reads: ``data["seed_runs"]`` (one metrics.jsonl record list per seed, from `train
    --seeds`) when it holds two or more, else the one run of ``data["records"]``."""
    seeds = [list(r) for r in data.get("seed_runs") or [] if r]
    return seeds if len(seeds) >= 2 else [list(data.get("records") or [])]


#: the calibration's names of the trend rules
SPARSITY_RULE_ID, S1_RULE_ID, S4_RULE_ID = (
    "gradient sparsity intensifies",
    "S1 rises over training",
    "most parameters unchanged (S4)",
)
#: the same trends pooled over seeds (`train --seeds`): each seed's OLS slope, t over seeds
SPARSITY_SEEDS_RULE_ID, S1_SEEDS_RULE_ID = (
    "gradient sparsity intensifies (seeds pooled)",
    "S1 rises over training (seeds pooled)",
)


@base.CLAIMS.register("sparsity_intensifies")
def sparsity_intensifies(data: dict[str, Any]) -> list[Claim]:
    """ "Gradient sparsity intensifies over training": the Hoyer sparsity of each lens step's policy gradient against
    the step.

    Rule (:func:`trend_verdict`): the trend of the gradient's Hoyer over the lens steps (the first-difference slope
    test in one run, t over the seeds' OLS slopes when pooled), excluding the LR warm-up's steps, the first lens
    step after it and the steps without
    a mixed group (their gradient carries no policy-gradient term); needs :data:`MIN_LENS_STEPS` steps per run. The
    AdamW update's Hoyer is shown but not tested: Adam's first steps are sign-like
    (Hoyer near 0) and its Hoyer rises with stationary gradients (holds 10 of 10 with no change in
    sparsity), so its trend says nothing about the gradient.
    """
    records = data.get("records") or []
    rows = _lens_rows(records, mk.SPARSITY_GRAD_HOYER)
    zero = [
        r
        for r in records
        if r.get(mk.PERF_LENS_SECONDS) is not None
        and r.get(mk.SPARSITY_GRAD_ZERO) is not None
        and r.get(mk.SPARSITY_GRAD_HOYER) is None
    ]  # a zero gradient: Hoyer is 0/0 (the run directory's null)
    if not rows and zero:
        return [
            Claim(
                claim="gradient sparsity intensifies over training",
                scope=f"training, {len(zero)} lens steps",
                measurement="the sampled policy gradient was exactly zero at every lens step (no reward "
                "contrast): its Hoyer sparsity is undefined (0/0)",
                control="no trend (rho = 0); a Gaussian vector has Hoyer 0.20",
                verdict=INCONCLUSIVE,
                rule="no lens step with a non-zero gradient",
                source="lens",
            )
        ]
    if not rows:
        return []
    runs = [_sparsity_series(after_warmup(_lens_rows(recs, mk.SPARSITY_GRAD_HOYER))) for recs in seed_records(data)]
    verdict, why, nums = trend_verdict(runs, MIN_LENS_STEPS, "differences")
    tested = len(runs[0][0])
    rho = nums["rho"]
    upd = [r.get(mk.SPARSITY_UPDATE_STEP_HOYER) for r in rows]
    grad = [float(r[mk.SPARSITY_GRAD_HOYER]) for r in rows]
    space = f", LoRA adapter weights (rank {data['lora_rank']}) only" if data.get("lora_rank") else ""
    return [
        Claim(
            claim="gradient sparsity intensifies over training",
            scope=(
                f"training, {len(runs)} seeds × {tested} lens steps (first lens step and LR warm-up excluded){space}"
                if nums["route"] == "seeds"
                else f"training, {tested} lens steps (first lens step and LR warm-up excluded){space}"
            ),
            measurement=(
                f"Hoyer of the policy gradient {fmt(grad[0], 3)} (step {rows[0][mk.STEP]}) -> "
                f"{fmt(grad[-1], 3)} (step {rows[-1][mk.STEP]}), Spearman rho {fmt(rho, 2)} on the "
                f"tested steps{' of the first seed' if nums['route'] == 'seeds' else ''}; AdamW update Hoyer "
                f"{fmt(upd[0], 3)} -> {fmt(upd[-1], 3)} (not tested)"
            ),
            control=(
                "no trend (OLS slope 0 after the log of the mixed-group count is partialled out); a "
                "Gaussian vector has Hoyer 0.20"
            ),
            verdict=verdict,
            rule=why,
            source=f"lens, fixed sample of {_sample_size(rows)} weights",
            n=nums["k"] if nums["route"] == "seeds" else tested,
            p_holds=nums["p_holds"],
            p_dnh=nums["p_dnh"],
            rule_id=SPARSITY_SEEDS_RULE_ID if nums["route"] == "seeds" else SPARSITY_RULE_ID,
            advice=(
                _trend_advice(_more_lens_steps(rows, tested), nums["route"], len(runs), nums["k"])
                if verdict == INCONCLUSIVE
                else ""
            ),
            primary=(
                f"mean OLS slope of the Hoyer over {nums['k']} seeds {fmt(nums['slope'], 4)} per step "
                f"(t = {fmt(nums['t'], 2)}, df {nums['df']})"
                if nums["route"] == "seeds" and nums.get("slope") is not None
                else ""
            ),
        )
    ]


def _sparsity_series(tested_rows: list[dict[str, Any]]) -> Series:
    """(steps, gradient Hoyer, log mixed groups or None) of one run's lens steps, the first lens step and the steps
    without a mixed group (no policy-gradient term) excluded. The step's gradient sums its mixed groups' terms:
    fewer groups alone make it sparser, so log(mixed groups) is partialled out (constant per-group
    sparsity while mixed groups fall 8 -> 1 read holds 1.00)."""
    tested = [r for r in tested_rows[1:] if r.get(mk.RANK_MIXED_GROUPS) is None or float(r[mk.RANK_MIXED_GROUPS]) > 0]
    cov = (
        [math.log(float(r[mk.RANK_MIXED_GROUPS])) for r in tested]
        if tested and all(r.get(mk.RANK_MIXED_GROUPS) is not None for r in tested)
        else None
    )
    return [float(r[mk.STEP]) for r in tested], [float(r[mk.SPARSITY_GRAD_HOYER]) for r in tested], cov


def _s1_series(records: list[dict[str, Any]]) -> Series:
    """(steps, S1, None) of one run's steps after the LR warm-up."""
    rows = [r for r in records if r.get(mk.REWARD_FRAC_ZERO_STD_GROUPS) is not None and r.get(mk.STEP) is not None]
    rows = after_warmup(rows)
    return [float(r[mk.STEP]) for r in rows], [float(r[mk.REWARD_FRAC_ZERO_STD_GROUPS]) for r in rows], None


def run_slopes(records: list[dict[str, Any]]) -> dict[str, float | None]:
    """One run's OLS slopes per step of the two trends on the steps their claims test (the units the seeds route pools,
    :func:`trend_verdict`): {"s1": S1's, "hoyer": the gradient Hoyer's (log mixed groups partialled out)}; None where
    the run has too few steps."""
    s1 = _s1_series(records)
    hoyer = _sparsity_series(after_warmup(_lens_rows(records, mk.SPARSITY_GRAD_HOYER)))
    return {
        "s1": ols_trend(*s1)["slope"] if len(s1[0]) >= MIN_S1_STEPS else None,
        "hoyer": ols_trend(*hoyer)["slope"] if len(hoyer[0]) >= MIN_LENS_STEPS else None,
    }


def _trend_advice(more: str, route: str, seeds_run: int = 1, seeds_used: int = 1) -> str:
    """What decides an undecided trend: pooling seeds first (the power route), else ``more`` steps; where 5 seeds or
    more already ran, or some had too few tested steps to enter, ``more`` steps per seed first."""
    if route == "seeds" and (seeds_run >= 5 or seeds_used < seeds_run):
        return f"{more} ({seeds_used} of {seeds_run} seeds had enough tested steps to enter the pooled test)"
    if route == "seeds":
        return (
            f"more seeds (`train --seeds 0 1 2 3 4`: 5 seeds of 30 steps reach power 1.0, docs/calibration.md), "
            f"or {more}"
        )
    return (
        f"train several seeds and pool them (`train --seeds 0 1 2 --out DIR`: 3 seeds of 30 steps reach power 0.94, "
        f"docs/calibration.md), or {more}"
    )


#: fewest steps the S1 trend is tested on
MIN_S1_STEPS = 8


@base.CLAIMS.register("zero_variance_share_rises")
def zero_variance_share_rises(data: dict[str, Any]) -> list[Claim]:
    """ "Sparsity intensifies" read as S1: the share of groups without reward contrast (all rewards equal, no policy
    gradient) rises over training.

    Rule (:func:`trend_verdict`): the OLS trend of S1 (``reward/frac_zero_std_groups``) over every logged step after
    the LR warm-up (fixed-b HAC in one run, t over seeds when pooled), needs :data:`MIN_S1_STEPS` steps per run; the
    measurement gives the mean S1 of the first and the last third of the steps,
    each with its interval over steps (:func:`grpo_lens.formulas.stats.mean_interval`).
    """
    rows = [
        r
        for r in data.get("records") or []
        if r.get(mk.REWARD_FRAC_ZERO_STD_GROUPS) is not None and r.get(mk.STEP) is not None
    ]
    if not rows:
        return []
    runs = [_s1_series(recs) for recs in seed_records(data)]
    verdict, why, nums = trend_verdict(runs, MIN_S1_STEPS, "hac")
    ys = [float(r[mk.REWARD_FRAC_ZERO_STD_GROUPS]) for r in rows]
    rho = nums["rho"]
    first, last = (mean_interval(ys[w], bounds=(0.0, 1.0)) for w in trend_windows(len(ys)))
    return [
        Claim(
            claim="the share of groups without reward contrast (S1) rises over training",
            scope=(
                f"training, {len(runs)} seeds × {len(runs[0][0])} steps (LR warm-up excluded)"
                if nums["route"] == "seeds"
                else f"training, {len(runs[0][0])} steps (LR warm-up excluded)"
            ),
            measurement=(
                f"S1{' (first seed)' if nums['route'] == 'seeds' else ''} first third "
                f"{ci_text(first, 2, 'steps')}, last third {ci_text(last, 2, 'steps')}"
                f"; Spearman rho {fmt(rho, 2)}"
            ),
            control="no trend (slope 0)",
            verdict=verdict,
            rule=why,
            source="every step's rewards",
            n=nums["k"] if nums["route"] == "seeds" else len(runs[0][0]),
            p_holds=nums["p_holds"],
            p_dnh=nums["p_dnh"],
            rule_id=S1_SEEDS_RULE_ID if nums["route"] == "seeds" else S1_RULE_ID,
            advice=(
                _trend_advice(
                    f"raise `--max-steps` (now {len(rows)} steps) or `--prompts-per-step` (S1 per step is a "
                    f"share of that many groups: more groups, less noise per step)",
                    nums["route"],
                    len(runs),
                    nums["k"],
                )
                if verdict == INCONCLUSIVE
                else ""
            ),
        )
    ]


def _sample_size(rows: list[dict[str, Any]]) -> str:
    n = rows[-1].get(mk.SPARSITY_SAMPLE_ENTRIES)
    return str(int(n)) if n else "?"


def _share_se(row: dict[str, Any], key: str, se_key: str) -> tuple[float, str]:
    """(standard error, how it was computed) of a sampled share: the logged stratified SE, or for records written
    before it was logged the simple-random-sample SE √(q(1−q)/s) (labelled as such)."""
    se = row.get(se_key)
    if se is not None:
        return float(se), "stratified by tensor"
    n, q = float(row.get(mk.SPARSITY_SAMPLE_ENTRIES) or 0), row.get(key)
    if not n or q is None:
        return math.nan, "no standard error"
    return math.sqrt(max(q * (1 - q), 1e-12) / n), "simple-random-sample approximation (older run)"


def _s4_lora_claim(last: dict[str, Any], lora_rank: int, rows: list[dict[str, Any]]) -> Claim:
    """S4 with LoRA: inconclusive, not applicable to the adapter's parameters (the base weights never change)."""
    return Claim(
        claim="RL leaves most parameters unchanged (S4), beyond bf16 rounding",
        scope=f"training, step {last[mk.STEP]}, LoRA rank {lora_rank}",
        measurement=(
            f"over the adapter's A and B only: bf16 unchanged since start "
            f"{fmt(last[mk.SPARSITY_UPDATE_TOTAL_BF16_UNCHANGED], 3)}"
        ),
        control="none: the claim is about the model's weights, not the adapter's",
        verdict=INCONCLUSIVE,
        rule=(
            "not applicable to adapter parameters: the frozen base weights never change and the "
            "adapter is a different parameter space (B starts at 0, so A gets no gradient on step 1); "
            "the merged weights W + (alpha/r) B A are not measured"
        ),
        source=f"lens, fixed sample of {_sample_size(rows)} adapter weights",
    )


def _s4_verdict(
    share: float,
    f32: float | None,
    f32_lo: float,
    f32_hi: float,
    f32_most: str,
    most: str,
    perm: Any,
    placement: str,
) -> tuple[str, str]:
    """(verdict, why) of :func:`most_parameters_unchanged`'s rule from the bf16-unchanged share ``share``, the
    float32-unchanged share ``f32`` (None: not logged) with its interval, their verdicts against 0.5, the permutation
    control ``perm`` (None: not logged) and the excess's verdict ``placement`` against :data:`BF16_MARGIN`."""
    if f32 is not None and f32 >= 1.0:  # not one sampled weight moved: the update was zero (lr 0, every A_i = 0)
        verdict, why = (
            INCONCLUSIVE,
            (
                "no sampled weight changed since the start (a zero update: learning rate 0 or "
                "every advantage 0); the claim is about what training changes"
            ),
        )
    elif f32_most == DOES_NOT_HOLD or most == DOES_NOT_HOLD:
        verdict = DOES_NOT_HOLD
        if most == DOES_NOT_HOLD:
            why = f"only {fmt(share, 3)} of weights kept their bf16 value (< 0.5)"
        else:
            why = f"only {fmt(f32, 3)} of weights are unchanged in float32 (interval below 0.5): most moved"
            if placement == HOLDS:
                why += (
                    f"; their bf16 share {fmt(share, 3)} exceeds the permutation control by more than "
                    f"{BF16_MARGIN}: where the changes land matters, but they are changes"
                )
            elif perm is not None:
                why += (
                    f"; the update's own magnitudes placed at random leave {fmt(float(perm), 3)} unchanged in "
                    f"bf16 (observed {fmt(share, 3)}): rounding of small changes"
                )
    elif f32_most == HOLDS:
        verdict, why = HOLDS, f"float32-unchanged share [{fmt(f32_lo, 3)}, {fmt(f32_hi, 3)}] lies above 0.5"
    else:
        verdict, why = (
            INCONCLUSIVE,
            (
                f"the float32-unchanged share's interval [{fmt(f32_lo, 3)}, {fmt(f32_hi, 3)}] contains 0.5"
                if f32 is not None
                else "no float32-unchanged share logged"
            ),
        )
    return verdict, why


def _s4_p_values(share: float, q_se: float, f32: float | None, f32_lo: float, f32_hi: float) -> tuple[float, float]:
    """(p holds, p does not hold) of :func:`most_parameters_unchanged`'s rule: z / q against 0.5 with their
    stratified SEs, normal, one-sided (the same decisions as the 1.96-SE intervals at 0.025); 1, 1 when z is not
    logged or no weight moved."""
    if f32 is None or f32 >= 1.0 or not math.isfinite(f32_lo):
        p_holds = p_dnh = 1.0
    else:
        z_se = (f32_hi - f32) / 1.96
        p_holds = normal_upper_tail((f32 - 0.5) / z_se) if z_se > 0 else float(f32 <= 0.5)
        p_z = normal_upper_tail((0.5 - f32) / z_se) if z_se > 0 else float(f32 >= 0.5)
        p_q = normal_upper_tail((0.5 - share) / q_se) if q_se > 0 else float(share >= 0.5)
        p_dnh = min(p_z, p_q)
    return p_holds, p_dnh


@base.CLAIMS.register("most_parameters_unchanged")
def most_parameters_unchanged(data: dict[str, Any]) -> list[Claim]:
    """ "RL leaves most parameters unchanged" (S4), beyond bf16 rounding.

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
    with heavy-tailed magnitudes it is set by the few large entries and read a dense update as sparse.
    """
    rows = _lens_rows(data.get("records") or [], mk.SPARSITY_UPDATE_TOTAL_BF16_UNCHANGED)
    if not rows:
        return []
    last = rows[-1]
    if data.get("lora_rank"):  # the lens samples the trainable (adapter) weights; the frozen base never changes
        return [_s4_lora_claim(last, data["lora_rank"], rows)]
    share = float(last[mk.SPARSITY_UPDATE_TOTAL_BF16_UNCHANGED])
    f32 = last.get(mk.SPARSITY_UPDATE_TOTAL_F32_UNCHANGED)
    perm = last.get(mk.SPARSITY_UPDATE_TOTAL_BF16_PERMUTED)
    dense = last.get(mk.SPARSITY_UPDATE_TOTAL_BF16_DENSE)
    q_se, how = _share_se(last, mk.SPARSITY_UPDATE_TOTAL_BF16_UNCHANGED, mk.SPARSITY_UPDATE_TOTAL_BF16_UNCHANGED_SE)
    most = base.verdict_from_interval(share - 1.96 * q_se, share + 1.96 * q_se, 0.5, "above")
    if f32 is None:
        f32_most, f32_lo, f32_hi = INCONCLUSIVE, math.nan, math.nan
    else:
        f32 = float(f32)
        z_se, _ = _share_se(last, mk.SPARSITY_UPDATE_TOTAL_F32_UNCHANGED, mk.SPARSITY_UPDATE_TOTAL_F32_UNCHANGED_SE)
        f32_lo, f32_hi = f32 - 1.96 * z_se, f32 + 1.96 * z_se
        f32_most = base.verdict_from_interval(f32_lo, f32_hi, 0.5, "above")
    if perm is not None:
        gap = share - float(perm)
        e_se = last.get(mk.SPARSITY_UPDATE_TOTAL_BF16_EXCESS_SE)
        e_se = float(e_se) if e_se is not None else q_se
        lo, hi = gap - 1.96 * e_se, gap + 1.96 * e_se
        placement = base.verdict_from_interval(lo, hi, BF16_MARGIN, "above")
        excess = f"excess over the permutation control {fmt(gap, 3)} [{fmt(lo, 3)}, {fmt(hi, 3)}]"
    else:
        placement, excess = INCONCLUSIVE, "no permutation control (a run from before it was logged)"
    verdict, why = _s4_verdict(share, f32, f32_lo, f32_hi, f32_most, most, perm, placement)
    # the rule's branches as one-sided p-values (z / q against 0.5 with their stratified SEs, normal): the same
    # decisions as the 1.96-SE intervals above at 0.025
    p_holds, p_dnh = _s4_p_values(share, q_se, f32, f32_lo, f32_hi)
    dense_txt = f"; a dense Gaussian update of the same per-tensor RMS {fmt(dense, 3)} (not used)" if dense else ""
    return [
        Claim(
            claim="RL leaves most parameters unchanged (S4), beyond bf16 rounding",
            scope=f"training, step {last[mk.STEP]}",
            measurement=(
                f"float32 unchanged since start {fmt(f32, 4)} [{fmt(f32_lo, 4)}, {fmt(f32_hi, 4)}]; "
                f"bf16 unchanged {fmt(share, 3)}; {excess} (95% intervals over "
                f"{_sample_size(rows)} sampled weights, standard errors {how})"
            ),
            control=(
                f"the same update entries permuted within each tensor leave "
                f"{fmt(None if perm is None else float(perm), 3)} unchanged in bf16{dense_txt}"
            ),
            verdict=verdict,
            rule=why,
            source=f"lens, fixed stratified sample of {_sample_size(rows)} weights",
            n=int(float(last.get(mk.SPARSITY_SAMPLE_ENTRIES) or 0)) or None,
            p_holds=p_holds,
            p_dnh=p_dnh,
            rule_id=S4_RULE_ID,
            advice=(
                "no flag narrows it: the lens's weight sample has a fixed size; the share's interval contains 0.5"
                if verdict == INCONCLUSIVE and f32 is not None and f32 < 1.0
                else (
                    "train at a learning rate above 0 with reward contrast (`--learning-rate`, `--prompts-per-step`)"
                    if verdict == INCONCLUSIVE
                    else ""
                )
            ),
        )
    ]
