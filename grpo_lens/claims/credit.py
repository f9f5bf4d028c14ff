"""The claims on token credit under an output-only reward (docs/theory.md §12, on the measures of §Token credit).

:func:`uniform_token_credit`: every token class (answer, format, reasoning) gets the group update in proportion to its
share of the tokens, within 1 ± :data:`CREDIT_EQUIVALENCE` (an equivalence rule). :func:`monte_carlo_credit`: the
mean shift of the success probability against GRPO's A_i at each segment position, from the K_mc continuations'
successes, against the margin :data:`MC_MARGIN` (disagreement supports the paper, which predicts it).
:func:`identical_token_advantage`: the literal claim, algebra that holds by construction. All read a probe's
``studies["credit"]``
(:func:`grpo_lens.probe.studies.run_credit_study`) and return [] when it is absent.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from grpo_lens.claims import base
from grpo_lens.claims.base import BRANCH_LEVEL, DOES_NOT_HOLD, HOLDS, INCONCLUSIVE, Claim, ci_text, decide, fmt
from grpo_lens.formulas.credit import (
    opposing_differences,
    opposing_shifts,
    opposition_threshold,
    prefix_success_counts,
)
from grpo_lens.formulas.stats import MIN_INTERVAL_UNITS as MIN_UNITS
from grpo_lens.formulas.stats import binomial_upper_tail, mean_interval, mean_test_p

#: the level of the Monte Carlo credit rule's tests: the most a rollout with no opposing segment is flagged, and the
#: p-value at which the count of flagged rollouts makes the paper's prediction hold
MC_LEVEL = 0.05


#: the calibration's name of the Monte Carlo rule
MC_RULE_ID = "uniform credit disagrees with Monte Carlo credit (opposing shift)"

#: the margin of the Monte Carlo credit rule (fixed before any measurement): a segment position opposes A_i
#: when its mean shift of the success probability against A_i exceeds this
MC_MARGIN = 0.1

#: "every token the same credit" read as: the answer tokens' update share / token share within 1 ± this (the paper
#: gives no tolerance; an interval that merely contains 1 is no evidence when it is wide)
CREDIT_EQUIVALENCE = 0.25


@base.CLAIMS.register("uniform_token_credit")
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
            c: base.band_verdict(d.get("lo"), d.get("hi"), -scale[c], scale[c])
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
            c: base.band_verdict(r.get("lo"), r.get("hi"), lo_b, hi_b)
            for c, r in ratios.items()
            if r.get("lo") is not None
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
    # descriptive since 0.3: its NLL control is not zero-sum (a component shared by every token adds up under
    # NLL weights and cancels under A) and the paper does not make this update-share claim; the reading is kept
    scope = f"R = {credit['meta']['group_size']}, {contributions['groups']} groups"
    what = f"each class's share of the update / share of tokens: {measured}"
    reading = (
        f"descriptive, no verdict (its NLL control is not zero-sum, and the paper does not make this "
        f"update-share claim); the 0.2 rule reads: {verdict}, {rule}"
    )
    source = "exact update direction over every parameter, finite differences"
    n = int(contributions.get("groups") or 0)
    return [
        Claim(
            claim=claim,
            scope=scope,
            measurement=what,
            control=control,
            verdict=INCONCLUSIVE,
            rule=reading,
            source=source,
            kind="descriptive",
            n=n,
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
    # no None: checked above
    diffs = [opposing_differences(c, r["grpo_advantage"]) for c, r in zip(counts, rows)]  # type: ignore[arg-type]
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


@base.CLAIMS.register("monte_carlo_credit")
def monte_carlo_credit(probe: dict[str, Any]) -> list[Claim]:
    """ "GRPO's uniform A_i is not the credit each token earns": the paper predicts that Monte Carlo token advantages
    (VinePPO) disagree with the uniform A_i, so a segment that moves the success probability against A_i supports it.

    Rule (docs/theory.md §12), one boundary: the effect at interior segment position j is the mean over
    rollouts of δ_ij = sign(A_i)(p_ij − p_i,j+1), estimated without bias by e_ij = (opposing count difference) / K_mc
    (:func:`grpo_lens.formulas.credit.opposing_shifts`), pooled over the rollouts that reach position j. Holds when
    some position's mean opposing shift lies above :data:`MC_MARGIN` (Hall's one-sided t over rollouts,
    :func:`grpo_lens.formulas.stats.mean_test_p`, Bonferroni over the positions: p = positions × the smallest p);
    does not hold when every position's lies below it (intersection-union: the largest p); inconclusive otherwise,
    with fewer than MIN_UNITS rollouts at a position, or when the prefix values are not means of 0/1 rewards. So *does
    not hold* reads "no segment position opposes A_i by :data:`MC_MARGIN` or more", the stated margin, where the 0.2
    rule's read "fewer flagged rollouts than noise gives" (wrong 0.065-0.070 at 500+ rollouts with a real, weak
    opposition) and reduced each rollout to flagged or not (power 0.05 at 8 rollouts). The flagged count
    (:func:`opposition_count`) is printed, not used.
    """
    credit = (probe.get("studies") or {}).get("credit")
    if not credit:
        return []
    claim = "GRPO's uniform credit disagrees with Monte Carlo token credit (the paper's prediction)"
    control = (
        f"margin: a segment position whose mean shift of the success probability against A_i is {MC_MARGIN} "
        f"(above: holds; below at every position: does not hold)"
    )
    source = "Monte Carlo continuations from prefixes"
    # the row when there is nothing to decide on: inconclusive, its rule saying why
    undecided = partial(Claim, claim=claim, control=control, verdict=INCONCLUSIVE, source=source)

    if not credit["monte_carlo"]["rollouts"]:  # the credit study ran without its Monte Carlo part: say so
        why = f"not run: --mc-groups 4 gives the {MIN_UNITS} rollouts a verdict needs "
        why += "(grpo-lens demo: --probe-study-prompts 4 or more)"
        what = "no Monte Carlo rollouts (--mc-groups 0)"
        return [undecided(scope="not measured", measurement=what, rule=why)]
    mc = credit["monte_carlo"]
    mc_samples = int(mc["samples_per_prefix"])
    rows = mc["rollouts"]
    counts = [prefix_success_counts(r["values"], r["errors"], mc_samples) for r in rows]
    scope = f"{len(rows)} rollouts, K_mc = {mc_samples}"
    if any(c is None for c in counts):
        what = "prefix values are not means of 0/1 rewards"
        return [undecided(scope=scope, measurement=what, rule="the opposing shifts need 0/1 rewards")]
    # no None: checked above
    shifts = opposing_shifts(counts, [r["grpo_advantage"] for r in rows], mc_samples)  # type: ignore[arg-type]
    if not shifts:
        what = "no interior segment (fewer than 2 prefixes)"
        return [undecided(scope=scope, measurement=what, rule="nothing to test")]
    m = len(shifts)
    n = min(len(e) for e in shifts)
    p_above = [mean_test_p(e, MC_MARGIN, "above") for e in shifts]
    p_below = [mean_test_p(e, MC_MARGIN, "below") for e in shifts]
    p_holds, p_dnh = min(1.0, m * min(p_above)), max(p_below)
    verdict = decide(p_holds, p_dnh)
    j_top = min(range(m), key=lambda j: p_above[j])
    # a position with fewer than MIN_UNITS rollouts has p = 1 on both sides (mean_test_p): it can neither make the
    # row hold nor let every position read below the margin
    if verdict == HOLDS:
        why = f"segment position {j_top + 1} opposes A_i by more than {MC_MARGIN} (p = {p_holds:.2g} <= {BRANCH_LEVEL})"
    elif verdict == DOES_NOT_HOLD:
        why = f"every segment position opposes A_i by less than {MC_MARGIN} (p = {p_dnh:.2g} <= {BRANCH_LEVEL})"
    elif n < MIN_UNITS:
        why = f"{n} rollouts < {MIN_UNITS} at some segment position"
    else:
        why = f"p holds {p_holds:.2g}, p does not hold {p_dnh:.2g}; neither <= {BRANCH_LEVEL}"
    per_pos = "; ".join(f"segment {j + 1}: {ci_text(mean_interval(e), 3, 'rollouts')}" for j, e in enumerate(shifts))
    t = opposition_count(mc)
    flagged = "" if not t or not t.get("tests") else f"; rollouts flagged: {t['flagged']} of {t['rollouts']} (not used)"
    what = f"mean shift of the success probability against A_i by position: {per_pos}{flagged}"
    # the first screen shows the position the verdict turned on: the one nearest the margin for *does not hold*
    j_shown = max(range(m), key=lambda j: p_below[j]) if verdict == DOES_NOT_HOLD else j_top
    advice = (
        f"raise `--mc-groups` (grpo-lens probe; grpo-lens demo runs at most 4 groups) (now {len(rows)} "
        f"rollouts; each group adds R; 32 rollouts decide an opposition of 0.3, docs/calibration.md)"
        if verdict == INCONCLUSIVE
        else ""
    )
    return [
        Claim(
            claim=claim,
            scope=f"{scope}, {m} interior segment positions",
            measurement=what,
            control=control,
            verdict=verdict,
            rule=why,
            source=source,
            n=n,
            p_holds=p_holds,
            p_dnh=p_dnh,
            rule_id=MC_RULE_ID,
            advice=advice,
            primary=f"shift against A_i, segment {j_shown + 1} of {m}: "
            + ci_text(mean_interval(shifts[j_shown]), 3, "rollouts"),
        )
    ]


@base.CLAIMS.register("identical_token_advantage")
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
