"""The claim that the group mean is the variance-optimal baseline when m_C = m_W (docs/theory.md §12, on the study of
§Baselines at matched expectation): the share of prompts whose permutation test rejects m_C = m_W, and the
leave-one-out b*'s MSE against RLOO's (both estimated from the same group), both read as equivalence rules with
margins fixed before any measurement. Reads a probe's
``studies["baselines"]`` (:func:`grpo_lens.probe.studies.run_baseline_study`) and returns [] when it is absent.
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
    decide,
    fmt,
    verdict_from_interval,
)
from grpo_lens.formulas.stats import MIN_INTERVAL_UNITS as MIN_UNITS
from grpo_lens.formulas.stats import binomial_upper_tail, mean_test_p, normal_upper_tail, wilson_interval

#: the calibration's name of the rule
RULE_ID = "group mean optimal (m_C = m_W)"

#: the level of each prompt's m_C = m_W permutation test: the most it rejects when m_C = m_W everywhere
EQUAL_NORMS_LEVEL = 0.05


#: equivalence margins of "the group mean is optimal" (set before any measurement, docs/theory.md §12): at most this
#: share of prompts with m_C != m_W ...
EQUAL_NORMS_MAX_SHARE = 0.25


#: ... and the leave-one-out b* at most this much below RLOO's MSE (relative)
MSE_GAIN_MARGIN = 0.10


def _interval_p(ci: dict[str, Any], control: float, side: str) -> float:
    """One-sided normal p of a mean against ``control`` from its 95% interval (SE = the half-width on ``side`` /
    1.96); 1.0 without an interval."""
    mean, lo, hi = ci.get("mean"), ci.get("lo"), ci.get("hi")
    if mean is None or lo is None or hi is None:
        return 1.0
    se = ((mean - lo) if side == "above" else (hi - mean)) / 1.959964
    if se <= 0:
        return 0.0 if (mean > control if side == "above" else mean < control) else 1.0
    z = (mean - control) / se if side == "above" else (control - mean) / se
    return normal_upper_tail(z)


@CLAIMS.register("group_mean_optimal")
def group_mean_optimal(probe: dict[str, Any]) -> list[Claim]:
    """ "The group mean is the variance-optimal baseline when m_C = m_W": does m_C = m_W hold prompt by prompt, and
    does b* measurably beat the group mean (as RLOO) where it does not?

    Rule (docs/theory.md §12): q = share of testable prompts whose permutation test rejects m_C = m_W at 0.05
    (:func:`grpo_lens.formulas.baselines.equal_norms_test`), with its Wilson interval; control
    :data:`EQUAL_NORMS_LEVEL` (the most the tests reject when m_C = m_W everywhere). An equivalence rule, so that a
    study too small to see a difference cannot make the claim hold: holds when q's interval lies below
    :data:`EQUAL_NORMS_MAX_SHARE` and the leave-one-out b*'s MSE ratio to RLOO has its interval above 1 -
    :data:`MSE_GAIN_MARGIN` (b* gains less than that); does not hold when q's interval lies above the control and
    the MSE ratio's interval lies below 1 (b* measurably helps); inconclusive otherwise, and with fewer than MIN_UNITS
    testable prompts. The mean m_C / m_W over prompts is reported, not used: prompts with m_C > m_W and m_C < m_W
    cancel in it.

    The MSE comparison is like for like: the leave-one-out b* (``optimal_loo``, what ``--estimator optimal`` trains
    with) against RLOO, both estimated from the other rollouts of the group. The 0.1 rule compared the *population*
    b* (a constant that knows p) with RLOO; knowing p alone cuts the MSE at R = 4 (0.84 of RLOO's with m_C = m_W
    planted, `grpo-lens calibrate`), so that comparison could never reach *holds*.
    """
    study = ((probe.get("studies") or {}).get("baselines") or {}).get("baselines")
    if not study:
        return []
    ratio = study.get("norm_ratio") or {}
    mse = study["summary"].get("optimal_loo", {}).get("mse_ratio_to_rloo", {})
    n = int(study.get("equal_norms_testable") or 0)
    q = study.get("equal_norms_rejected")
    k = round(q * n) if q is not None and math.isfinite(q) else 0
    q_lo, q_hi = wilson_interval(k, n)
    few_rejected = verdict_from_interval(q_lo, q_hi, EQUAL_NORMS_MAX_SHARE, "below")
    many_rejected = verdict_from_interval(q_lo, q_hi, EQUAL_NORMS_LEVEL, "above")
    small_gain = verdict_from_interval(mse.get("lo"), mse.get("hi"), 1 - MSE_GAIN_MARGIN, "above")
    b_star_helps = verdict_from_interval(mse.get("lo"), mse.get("hi"), 1.0, "below")
    # one-sided p of each branch (intersection-union: the larger of its two parts): the count k of n by exact
    # binomial tails, the MSE ratio by Hall's t over the prompts' ratios (the interval the row prints)
    est = [pp.get("estimators") or {} for pp in study.get("per_prompt") or []]
    ratios = [
        e["optimal_loo"]["mse"] / e["rloo"]["mse"]
        for e in est
        if "optimal_loo" in e and "rloo" in e and e["rloo"]["mse"] > 0
    ]
    if ratios:
        p_gain_small = mean_test_p(ratios, 1 - MSE_GAIN_MARGIN, "above")
        p_helps = mean_test_p(ratios, 1.0, "below")
    else:  # a study without its per-prompt rows: the interval's own half-width as a normal SE
        p_gain_small = _interval_p(mse, 1 - MSE_GAIN_MARGIN, "above")
        p_helps = _interval_p(mse, 1.0, "below")
    if n >= MIN_UNITS:
        p_holds = max(1.0 - binomial_upper_tail(k + 1, n, EQUAL_NORMS_MAX_SHARE), p_gain_small)
        p_dnh = max(binomial_upper_tail(k, n, EQUAL_NORMS_LEVEL), p_helps)
    else:
        p_holds = p_dnh = 1.0
    verdict = decide(p_holds, p_dnh)
    if n < MIN_UNITS or not math.isfinite(q_lo):
        verdict, why = INCONCLUSIVE, f"{n} testable prompts < {MIN_UNITS}"
    elif verdict == HOLDS:
        why = (
            f"rejection share below {EQUAL_NORMS_MAX_SHARE} and b*'s MSE gain below {MSE_GAIN_MARGIN:.0%} "
            f"(equivalence; p = {p_holds:.2g})"
        )
    elif verdict == DOES_NOT_HOLD:
        why = f"m_C != m_W in more prompts than the tests' level and b*'s MSE below RLOO's (p = {p_dnh:.2g})"
    else:
        why = (
            f"the rejection share and the MSE gain do not agree on a verdict (p holds {p_holds:.2g}, p does not "
            f"hold {p_dnh:.2g})"
        )
    del few_rejected, many_rejected, small_gain, b_star_helps
    meta = probe["studies"]["baselines"].get("meta", {})
    share = (
        f"{fmt(q, 2)} [{fmt(q_lo, 2)}, {fmt(q_hi, 2)}], Wilson interval over prompts"
        if n >= MIN_UNITS
        else "too few prompts for an interval"
    )
    return [
        Claim(
            claim="the group mean is the variance-optimal baseline (m_C = m_W)",
            scope=f"R = {meta.get('group_size')}, {study['prompts']} prompts",
            measurement=(
                f"m_C = m_W rejected (permutation test, 0.05) on {k} of {n} prompts ({share}); "
                f"mean m_C / m_W {ci_text(ratio, unit='prompts')}; "
                f"leave-one-out b* MSE / RLOO's {ci_text(mse, unit='prompts')}"
            ),
            control=(
                f"rejection share <= {EQUAL_NORMS_LEVEL} (m_C = m_W everywhere; equivalence below "
                f"{EQUAL_NORMS_MAX_SHARE}); MSE ratio 1 (equivalence above {1 - MSE_GAIN_MARGIN:g})"
            ),
            verdict=verdict,
            rule=why,
            source=f"{meta.get('gradients', 'sketch')}, d_s = {meta.get('sketch_dim')}, held-out reference",
            n=n,
            p_holds=p_holds,
            p_dnh=p_dnh,
            rule_id=RULE_ID,
            advice=(
                f"raise `--baseline-study-prompts` (grpo-lens probe; `--probe-study-prompts` in grpo-lens demo) "
                f"(now {n} testable prompts; e.g. {max(2 * n, 24)})"
                if verdict == INCONCLUSIVE
                else ""
            ),
        )
    ]
