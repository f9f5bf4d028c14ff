"""The claims on token credit under an output-only reward (docs/theory.md §12, on the measures of §Token credit).

:func:`uniform_token_credit`: every token class (answer, format, reasoning) gets the group update in proportion to its
share of the tokens, within 1 ± :data:`CREDIT_EQUIVALENCE` (an equivalence rule). :func:`monte_carlo_credit`: the
count of rollouts with a Monte Carlo segment opposing GRPO's A_i (an exact per-rollout count test on the K_mc
continuations' successes), against its exact binomial null (disagreement supports the paper, which predicts it).
:func:`identical_token_advantage`: the literal claim, algebra that holds by construction. All read a probe's
``studies["credit"]``
(:func:`grpo_lens.probe.studies.run_credit_study`) and return [] when it is absent.
"""

from __future__ import annotations

import math
from typing import Any

from grpo_lens.claims.base import (
    BRANCH_LEVEL,
    CLAIMS,
    DOES_NOT_HOLD,
    HOLDS,
    INCONCLUSIVE,
    Claim,
    band_verdict,
    ci_text,
    decide,
    fmt,
)
from grpo_lens.formulas.credit import (
    opposing_differences,
    opposition_threshold,
    prefix_success_counts,
)
from grpo_lens.formulas.stats import MIN_INTERVAL_UNITS as MIN_UNITS
from grpo_lens.formulas.stats import binomial_upper_tail, wilson_interval

#: the level of the Monte Carlo credit rule's tests: the most a rollout with no opposing segment is flagged, and the
#: p-value at which the count of flagged rollouts makes the paper's prediction hold
MC_LEVEL = 0.05


#: the calibration's name of the Monte Carlo rule
MC_RULE_ID = "uniform credit disagrees with Monte Carlo credit"

#: "every token the same credit" read as: the answer tokens' update share / token share within 1 ± this (the paper
#: gives no tolerance; an interval that merely contains 1 is no evidence when it is wide)
CREDIT_EQUIVALENCE = 0.25


@CLAIMS.register("uniform_token_credit")
def uniform_token_credit(probe: dict[str, Any]) -> list[Claim]:
    """ "Output-only reward gives every token the same credit", read as: every token class (answer, format, reasoning)
    gets the group update in proportion to what the same tokens get under NLL weights (the control with the same
    gradient geometry: a high-probability token has grad log pi ≈ 0 under any weighting).

    Rule (docs/theory.md §12): per class, d = (its update share / token share under A) − (the same under NLL weights,
    every A_i = 1), paired per group, 95% interval over groups (none from fewer than MIN_UNITS groups), against the
    band ± :data:`CREDIT_EQUIVALENCE` × the class's mean NLL ratio (A's credit within 25% of the geometric reference;
    the band's scale is an estimate, its uncertainty not carried). Holds when every measured class's interval lies
    inside the band; does not hold when any class's lies wholly outside; inconclusive otherwise, or when the answer
    class has no interval. A probe written before the control (no ``classes_nll``) is read by the 0.2 rule: the ratio
    against 1 ± :data:`CREDIT_EQUIVALENCE`, a control that ignores gradient geometry, said in the row.
    """
    credit = (probe.get("studies") or {}).get("credit")
    if not credit:
        return []
    contributions = credit["contributions"]
    classes, nll = contributions["classes"], contributions.get("classes_nll")
    names = ("answer", "format", "reasoning")
    ratios = {c: (classes.get(c) or {}).get("ratio") or {} for c in names}
    measured = "; ".join(f"{c} tokens {ci_text(r)}" for c, r in ratios.items() if r.get("mean") is not None)
    if nll:
        diffs = {c: (nll.get(c) or {}).get("ratio_minus_nll") or {} for c in names}
        scale = {c: abs(((nll.get(c) or {}).get("ratio") or {}).get("mean") or 0.0) * CREDIT_EQUIVALENCE for c in names}
        # a class whose NLL ratio has no mean (or is 0) has no reference to scale the band by: not judged
        per_class = {
            c: band_verdict(d.get("lo"), d.get("hi"), -scale[c], scale[c])
            for c, d in diffs.items()
            if d.get("lo") is not None and scale[c] > 0
        }
        band = f"± {CREDIT_EQUIVALENCE:g} × the class's NLL ratio"
        measured += "; paired difference from NLL weights: " + "; ".join(
            f"{c} {ci_text(d)} (band ±{fmt(scale[c], 2)})" for c, d in diffs.items() if d.get("mean") is not None
        )
        control = (
            "the same tokens under NLL weights (every A_i = 1: the same gradient geometry): "
            + "; ".join(
                f"{c} tokens {ci_text((nll.get(c) or {}).get('ratio'))}"
                for c in names
                if ((nll.get(c) or {}).get("ratio") or {}).get("mean") is not None
            )
            + f"; equivalence band {band}"
        )
        claim = (
            "every token class gets the update in proportion to what the same tokens get under NLL weights "
            "(update-share reading of 'the same credit', gradient geometry controlled)"
        )
    else:
        lo_b, hi_b = 1.0 - CREDIT_EQUIVALENCE, 1.0 + CREDIT_EQUIVALENCE
        band = f"[{lo_b:g}, {hi_b:g}]"
        per_class = {
            c: band_verdict(r.get("lo"), r.get("hi"), lo_b, hi_b) for c, r in ratios.items() if r.get("lo") is not None
        }
        control = (
            f"1 (every class credited in proportion to its token count); equivalence band {band}; this "
            f"control ignores gradient geometry (a high-probability token has grad log pi ≈ 0, so format "
            f"tokens get a small share under any weighting; probes since 2026-12-02 carry the NLL control)"
        )
        claim = (
            "every token class gets the update in proportion to its tokens (update-share reading of 'the same credit')"
        )
    outside = [c for c, v in per_class.items() if v == DOES_NOT_HOLD]
    if outside:
        verdict, rule = DOES_NOT_HOLD, f"interval of {', '.join(outside)} tokens wholly outside {band}"
    elif "answer" not in per_class:
        verdict, rule = INCONCLUSIVE, f"no interval for answer tokens (fewer than {MIN_UNITS} groups with them)"
    elif all(v == HOLDS for v in per_class.values()):
        verdict, rule = HOLDS, f"every measured class's interval inside {band} ({', '.join(per_class)})"
    else:
        wide = [c for c, v in per_class.items() if v != HOLDS]
        verdict, rule = (
            INCONCLUSIVE,
            (f"interval of {', '.join(wide)} tokens overlaps the edge of {band}: too wide to tell"),
        )
    # descriptive since issue 29: its NLL control is not zero-sum (a component shared by every token adds up under
    # NLL weights and cancels under A) and the paper does not make this update-share claim; the reading is kept
    return [
        Claim(
            claim=claim,
            scope=f"R = {credit['meta']['group_size']}, {contributions['groups']} groups",
            measurement=f"each class's share of the update / share of tokens: {measured}",
            control=control,
            verdict=INCONCLUSIVE,
            rule=(
                f"descriptive, no verdict (its NLL control is not zero-sum, and the paper does not make this "
                f"update-share claim); the 0.2 rule reads: {verdict}, {rule}"
            ),
            source="exact update direction over every parameter, finite differences",
            kind="descriptive",
            n=int(contributions.get("groups") or 0),
        )
    ]


def opposition_count(mc: dict[str, Any], level: float = MC_LEVEL) -> dict[str, Any] | None:
    """The exact count test of :func:`monte_carlo_credit` on a credit study's ``monte_carlo`` dict (its rollouts'
    prefix values and SEs, ``samples_per_prefix`` K_mc): one place for the numbers the claim decides on and the study
    section reports (docs/theory.md §12).

    Returns:
        None when a prefix value is not a mean of K_mc 0/1 rewards, else a dict: ``mc_samples`` K_mc, ``rollouts`` n,
        ``tests`` (the most interior segments of a rollout; 0 = nothing to test, the other keys then absent), ``d`` (the
        opposing count difference, :func:`grpo_lens.formulas.credit.opposition_threshold`), ``alpha_r`` (the most a
        rollout with no opposing segment is flagged), ``flagged`` (rollouts with a segment opposing A_i by >= d),
        ``segments``, ``agreeing`` (segments agreeing by >= d) and ``p_value`` = P(Binomial(n, α_r) >= flagged).
    """
    mc_samples = int(mc["samples_per_prefix"])
    rows = mc["rollouts"]
    counts = [prefix_success_counts(r["values"], r["errors"], mc_samples) for r in rows]
    if any(c is None for c in counts):
        return None
    diffs = [opposing_differences(c, r["grpo_advantage"]) for c, r in zip(counts, rows)]
    tests = max((len(x) for x in diffs), default=0)
    out: dict[str, Any] = {"mc_samples": mc_samples, "rollouts": len(rows), "tests": tests}
    if tests == 0:
        return out
    d, size = opposition_threshold(mc_samples, tests, level)
    alpha_r = min(1.0, tests * size)
    flagged = sum(any(x >= d for x in ds) for ds in diffs)
    return {
        **out,
        "d": d,
        "alpha_r": alpha_r,
        "flagged": flagged,
        "segments": sum(len(ds) for ds in diffs),
        "agreeing": sum(x <= -d for ds in diffs for x in ds),
        "p_value": binomial_upper_tail(flagged, len(rows), alpha_r),
    }


@CLAIMS.register("monte_carlo_credit")
def monte_carlo_credit(probe: dict[str, Any]) -> list[Claim]:
    """ "GRPO's uniform A_i is not the credit each token earns": the paper predicts that Monte Carlo token advantages
    (VinePPO) disagree with the uniform A_i, so disagreement supports the claim.

    Rule (docs/theory.md §12), exact at any number of rollouts: per rollout, X_j = successes among the K_mc
    continuations of prefix b_j (0/1 rewards). An interior segment b_j -> b_{j+1} *opposes* A_i when its count
    difference against A_i's sign is at least d (:func:`grpo_lens.formulas.credit.opposing_differences`), d the smallest
    with sup_p P(X - Y >= d) <= :data:`MC_LEVEL` / (segments tested per rollout)
    (:func:`grpo_lens.formulas.credit.opposition_threshold`), so a rollout none of whose segments truly opposes A_i
    is flagged with probability at most α_r = tests · size <= :data:`MC_LEVEL` (Bonferroni within the rollout).
    Rollouts' continuations are independent, so under "no segment opposes A_i" the count c of flagged rollouts out of
    n is stochastically below Binomial(n, α_r). Holds when P(Binomial(n, α_r) >= c) <= :data:`MC_LEVEL` (an exact
    one-sided test of the count, :func:`grpo_lens.formulas.stats.binomial_upper_tail`); does not hold when the Wilson
    interval of the flagged share lies below α_r, fewer flags than noise alone can give (at K_mc = 8, 3 segments tested:
    α_r = 0.032, reachable from 117 rollouts); inconclusive otherwise, from fewer than MIN_UNITS rollouts, or when the
    rewards are not 0/1. With four segments a monotone value path of K_mc = 8 continuations cannot agree with A_i by
    d = 5 in more than one segment, so "agreement beyond noise" is no usable evidence here; the count of segments
    agreeing by d is shown, not used.

    Replaces the 0.1 rule (2-SE Wald counting over segments against Φ(−2) = 0.023), whose false holds `grpo-lens
    calibrate` measured at 0.06 / 0.08 / 0.16 with 8 / 32 / 100 rollouts: a prefix whose K_mc continuations all agree
    has SE 0, and its level grew with the number of segments.
    """
    credit = (probe.get("studies") or {}).get("credit")
    if not credit:
        return []
    claim = "GRPO's uniform credit disagrees with Monte Carlo token credit (the paper's prediction)"
    control = (
        f"no segment opposes A_i: each rollout flagged with probability <= α_r (exact binomial bound, level {MC_LEVEL})"
    )
    source = "Monte Carlo continuations from prefixes"
    if not credit["monte_carlo"]["rollouts"]:  # the credit study ran without its Monte Carlo part: say so
        return [
            Claim(
                claim=claim,
                scope="not measured",
                measurement="no Monte Carlo rollouts (--mc-groups 0)",
                control=control,
                verdict=INCONCLUSIVE,
                rule=(
                    f"not run: --mc-groups 4 gives the {MIN_UNITS} rollouts a verdict needs "
                    "(grpo-lens demo: --probe-study-prompts 4 or more)"
                ),
                source=source,
            )
        ]
    mc = credit["monte_carlo"]
    t = opposition_count(mc)
    scope = f"{len(mc['rollouts'])} rollouts, K_mc = {int(mc['samples_per_prefix'])}"
    if t is None:
        return [
            Claim(
                claim=claim,
                scope=scope,
                measurement="prefix values are not means of 0/1 rewards",
                control=control,
                verdict=INCONCLUSIVE,
                rule="the exact count test needs 0/1 rewards",
                source=source,
            )
        ]
    if t["tests"] == 0:
        return [
            Claim(
                claim=claim,
                scope=scope,
                measurement="no interior segment (fewer than 2 prefixes)",
                control=control,
                verdict=INCONCLUSIVE,
                rule="nothing to test",
                source=source,
            )
        ]
    mc_samples, n, d, alpha_r = t["mc_samples"], t["rollouts"], t["d"], t["alpha_r"]
    flagged, segments, agreeing, p_value = t["flagged"], t["segments"], t["agreeing"], t["p_value"]
    f_lo, f_hi = wilson_interval(flagged, n)
    a_lo, a_hi = wilson_interval(agreeing, segments)
    # exact binomial tails on both sides: holds when the count is high for Binomial(n, α_r), does not hold when it
    # is low (fewer flags than noise alone gives); each branch at BRANCH_LEVEL
    p_low = 1.0 - binomial_upper_tail(flagged + 1, n, alpha_r)
    p_holds, p_dnh = (p_value, p_low) if n >= MIN_UNITS else (1.0, 1.0)
    verdict = decide(p_holds, p_dnh)
    if n < MIN_UNITS:
        why = f"{n} rollouts < {MIN_UNITS}"
    elif verdict == HOLDS:
        why = f"P(Binomial({n}, {alpha_r:.3g}) >= {flagged}) = {p_value:.2g} <= {BRANCH_LEVEL}"
    elif verdict == DOES_NOT_HOLD:
        why = (
            f"P(Binomial({n}, {alpha_r:.3g}) <= {flagged}) = {p_low:.2g} <= {BRANCH_LEVEL}: fewer opposing "
            f"segments than noise alone gives"
        )
    else:
        why = (
            f"P(Binomial({n}, {alpha_r:.3g}) >= {flagged}) = {p_value:.2g}, <= {flagged}: {p_low:.2g}; neither "
            f"<= {BRANCH_LEVEL}"
        )
    return [
        Claim(
            claim=claim,
            scope=f"{scope}, {segments} interior segments",
            measurement=(
                f"rollouts with a segment opposing A_i by >= {d} of {mc_samples} continuations: {flagged} of "
                f"{n} ({fmt(flagged / n, 3)} [{fmt(f_lo, 3)}, {fmt(f_hi, 3)}], Wilson interval over "
                f"rollouts); segments agreeing by >= {d}: {agreeing} of {segments} "
                f"[{fmt(a_lo, 3)}, {fmt(a_hi, 3)}]"
            ),
            control=f"{control}; α_r = {alpha_r:.3g} at d = {d}",
            verdict=verdict,
            rule=why,
            source=source,
            n=n,
            p_holds=p_holds,
            p_dnh=p_dnh,
            rule_id=MC_RULE_ID,
            advice=(
                f"raise `--mc-groups` (grpo-lens probe; grpo-lens demo runs at most 4 groups) (now {n} rollouts; each "
                f"group adds R; *does not hold* needs about "
                f"{math.ceil(3.7 / max(alpha_r, 1e-9))} rollouts with no flag)"
                if verdict == INCONCLUSIVE
                else ""
            ),
        )
    ]


@CLAIMS.register("identical_token_advantage")
def identical_token_advantage(probe: dict[str, Any]) -> list[Claim]:
    """The literal claim "under an outcome reward every token of a completion receives the same advantage A_i": it
    holds by construction (the loss broadcasts A_i over the completion's tokens, docs/theory.md §3, §10), so it is
    reported as algebra, not tested. Shown beside the credit study, which measures what that uniform advantage does
    to each token's share of the update."""
    if not (probe.get("studies") or {}).get("credit"):
        return []
    return [
        Claim(
            claim="every token of a completion receives the identical advantage A_i (algebra)",
            scope="every rollout",
            measurement="A_i is broadcast over the completion's tokens by the loss",
            control=(
                "the Monte Carlo token advantages of the credit study, which differ by segment (the "
                "claim is about what the loss assigns, not what a token earns)"
            ),
            verdict=HOLDS,
            rule="by construction (docs/theory.md §3, §10); not a test",
            source="the loss",
            kind="check",
        )
    ]
