"""The claim that the group mean is the variance-optimal baseline when m_C = m_W (docs/theory.md §12, on the study of
§Baselines at matched expectation): one pooled equivalence test of m_C = m_W in effect units, the root mean square
over prompts of log(m_C / m_W) against a margin of log 1.25 fixed before any measurement. Reads a probe's
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
)
from grpo_lens.formulas.baselines import LOG_RATIO_MARGIN, log_ratios, rms_log_ratio
from grpo_lens.formulas.stats import MIN_INTERVAL_UNITS as MIN_UNITS
from grpo_lens.formulas.stats import mean_test_p

#: the calibration's name of the rule
RULE_ID = "group mean optimal (RMS log m_C / m_W)"

#: the level of each prompt's m_C = m_W permutation test (printed beside the rule, not used by it)
EQUAL_NORMS_LEVEL = 0.05


@CLAIMS.register("group_mean_optimal")
def group_mean_optimal(probe: dict[str, Any]) -> list[Claim]:
    """ "The group mean is the variance-optimal baseline when m_C = m_W": is m_C = m_W, in effect units, over the
    prompts the probe studied?

    Rule (docs/theory.md §12): one pooled equivalence test on the root mean square over prompts of
    δ_j = log(m_C / m_W) (:func:`grpo_lens.formulas.baselines.rms_log_ratio`): y_j = d_j² − v_j per prompt (its
    jackknifed log ratio squared less its jackknife variance), the mean of y weighted by w_j = (k(M − k)/M)² (the
    class counts alone: :func:`grpo_lens.formulas.baselines.log_ratio_weight`) against :data:`LOG_RATIO_MARGIN`²,
    as Hall's t on u_j = w_j (y_j − margin²) (:func:`grpo_lens.formulas.stats.mean_test_p`). Holds when the mean
    lies below the margin² (RMS of the log ratio below log 1.25: b* within about ±0.056 of the group mean's p at
    p = 0.5), does not hold when it lies above; inconclusive otherwise and with fewer than MIN_UNITS prompts with
    both sides. Only the class means enter, so
    unequal spreads are no effect, and a class whose rollouts are one string is a mean known exactly, not a
    rejection.

    Replaces the count of per-prompt m_C = m_W permutation tests (it rejected 0.12-0.21 of prompts when
    every correct rollout was one string and m_C = m_W exactly, 0.10-0.13 when only the spreads differed; its margin
    was a share of prompts, not an effect, and *holds* needed 0 rejections of 16). Its share and the leave-one-out
    b*'s MSE against RLOO's are printed, not used.
    """
    study = ((probe.get("studies") or {}).get("baselines") or {}).get("baselines")
    if not study:
        return []
    ratio = study.get("norm_ratio") or {}
    mse = study["summary"].get("optimal_loo", {}).get("mse_ratio_to_rloo", {})
    n_tested = int(study.get("equal_norms_testable") or 0)
    q = study.get("equal_norms_rejected")
    k = round(q * n_tested) if q is not None and math.isfinite(q) else 0
    d, v, w = log_ratios(study.get("per_prompt") or [])
    rms = rms_log_ratio(d, v, w)
    n = int(rms["n"] or 0)
    margin2 = LOG_RATIO_MARGIN**2
    if n >= MIN_UNITS:
        u = [wi * (yi - margin2) for wi, yi in zip(w, rms["y"])]  # Σ w (y − margin²) < 0 ⟺ weighted mean below
        p_holds = mean_test_p(u, 0.0, "below")
        p_dnh = mean_test_p(u, 0.0, "above")
    else:
        p_holds = p_dnh = 1.0
    verdict = decide(p_holds, p_dnh)
    if n < MIN_UNITS:
        why = f"{n} prompts with both classes' log ratio < {MIN_UNITS}" + (
            "" if d or not study.get("per_prompt") else " (a probe.json from an older grpo-lens: run the probe again)"
        )
    elif verdict == HOLDS:
        why = f"RMS of log(m_C / m_W) below log 1.25 (mean δ² below {margin2:.3f}, p = {p_holds:.2g})"
    elif verdict == DOES_NOT_HOLD:
        why = f"RMS of log(m_C / m_W) above log 1.25 (mean δ² above {margin2:.3f}, p = {p_dnh:.2g})"
    else:
        why = f"the RMS interval reaches log 1.25 (p holds {p_holds:.2g}, p does not hold {p_dnh:.2g})"
    meta = probe["studies"]["baselines"].get("meta", {})
    rms_txt = (
        "not measured"
        if rms["rms"] is None
        else f"{fmt(rms['rms'], 3)}"
        + (
            f" (n = {n} prompts, too few for an interval)"
            if rms["rms_lo"] is None
            else f" [{fmt(rms['rms_lo'], 3)}, {fmt(rms['rms_hi'], 3)}] (n = {n} prompts)"
        )
    )
    return [
        Claim(
            claim="the group mean is the variance-optimal baseline (m_C = m_W)",
            scope=f"R = {meta.get('group_size')}, {study['prompts']} prompts",
            measurement=(
                f"weighted RMS over prompts of log(m_C / m_W), less each prompt's noise: {rms_txt}; mean m_C / m_W "
                f"{ci_text(ratio, unit='prompts')}; per-prompt permutation tests rejecting m_C = m_W: {k} of "
                f"{n_tested} (not used); leave-one-out b* MSE / RLOO's {ci_text(mse, unit='prompts')} (not used)"
            ),
            control=f"equivalence margin: RMS of log(m_C / m_W) = log 1.25 = {LOG_RATIO_MARGIN:.3f}",
            verdict=verdict,
            rule=why,
            source=f"{meta.get('gradients', 'sketch')}, d_s = {meta.get('sketch_dim')}",
            n=n,
            p_holds=p_holds,
            p_dnh=p_dnh,
            rule_id=RULE_ID,
            advice=(
                f"raise `--baseline-study-prompts` (grpo-lens probe; `--probe-study-prompts` in grpo-lens demo) "
                f"(now {n} prompts; e.g. {max(2 * n, 16)})"
                if verdict == INCONCLUSIVE
                else ""
            ),
            primary=f"weighted RMS of log(m_C / m_W) less noise: {rms_txt}",
        )
    ]
