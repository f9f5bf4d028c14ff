"""The claims that GRPO's rank-2 structure comes from its zero-sum advantages (docs/theory.md §11, on the tests of §6).

On G1 (:func:`zero_sum_rank_two`, a primary claim): the normalised effect θ_g of the span energy of the true labels
on the cosine Gram, per group, and its mean θ̄ over the groups that carry label information (:func:`label_shares`,
:func:`theta_test`; :func:`relabelling_test` the pooled control), decided as an equivalence pair at
:data:`NEGLIGIBLE_SHARE`; G1 is blind to the advantages' signs, so this reads "the labels structure G1". On G2 of
every linear layer (:func:`zero_sum_g2_weighting`, descriptive since 0.3): its stable rank under A relative to
weightings that are not zero-sum. Both read a probe.json.
"""

from __future__ import annotations

import math
from typing import Any

from grpo_lens import metrics as mk
from grpo_lens.claims.base import (
    BRANCH_LEVEL,
    CLAIMS,
    DOES_NOT_HOLD,
    HOLDS,
    INCONCLUSIVE,
    MIN_GROUPS,
    Claim,
    band_verdict,
    ci_text,
    decide,
    fmt,
    source_of,
    verdict_from_interval,
)
from grpo_lens.formulas.stats import mean_interval, mean_test_p

#: the margin of the equivalence pair: the labels capture at least / less than this share of the energy a
#: relabelling leaves outside the class span (of the cosine Gram)
NEGLIGIBLE_SHARE = 0.1

#: the calibration's name of the rule
RULE_ID = "labels structure G1 (θ on the cosine Gram, across R)"


def relabelling_test(groups: list[dict[str, Any]], level: float = 0.95, stat: str = "span_energy") -> dict[str, Any]:
    """The across-group relabelling test of a span energy and its normalised effect (docs/theory.md §11).

    Relabelling every group at once (k fixed, each labelling of a group equally likely under H0 "the labels carry no
    information about the gradients") makes T = Σ_g x_g (x_g = ``zero_sum/<stat>_excess``) a sum of independent
    mean-zero terms with the exactly enumerated variances v_g (``zero_sum/<stat>_null_var``); z = T / sqrt(Σ v_g).
    The effect θ = Σ x_g / Σ (1 − m_g), m_g = ``zero_sum/<stat>_null``: the share of the energy a relabelling leaves
    outside the class span that the true labels capture, with the linearised (ratio) interval of
    u_g = x_g − θ(1 − m_g). ``stat`` "unit_span_energy" reads the cosine Gram's keys (the mechanism claim).

    Returns {"n", "z", "p", "theta", "lo", "hi", "x", "room"} (None where undefined; x, room the per-group lists).
    """
    ex, nv, nu = mk.zero_sum_key(stat, "excess"), mk.zero_sum_key(stat, "null_var"), mk.zero_sum_key(stat, "null")
    rows = [g for g in groups if g.get(ex) is not None and g.get(nv) is not None and g.get(nu) is not None]
    out: dict[str, Any] = {
        "n": len(rows),
        "z": None,
        "p": None,
        "theta": None,
        "lo": None,
        "hi": None,
        "x": [],
        "room": [],
    }
    if not rows:
        return out
    x = [float(g[ex]) for g in rows]
    v = sum(float(g[nv]) for g in rows)
    room = [1 - float(g[nu]) for g in rows]
    out.update(x=x, room=room)
    if v > 0:
        out["z"] = sum(x) / math.sqrt(v)
        out["p"] = 0.5 * math.erfc(out["z"] / math.sqrt(2))
    if sum(room) > 0:
        theta = sum(x) / sum(room)
        u = mean_interval([xi - theta * ri for xi, ri in zip(x, room)], level=level)
        mean_room = sum(room) / len(room)
        out["theta"] = theta
        if u["lo"] is not None:
            # lo set: hi is set too
            out["lo"], out["hi"] = theta + u["lo"] / mean_room, theta + u["hi"] / mean_room  # type: ignore[operator]
    return out


#: a group whose relabellings leave at most this share of its cosine-Gram energy outside the class span carries no
#: label information (every labelling spans the same directions: two distinct directions in the group, exact up to
#: float64 rounding), so its share θ_g = x_g / (1 − m_g) is rounding over rounding and the group is left out
INFORMATIVE_ROOM = 1e-9


def label_shares(groups: list[dict[str, Any]], stat: str = "unit_span_energy") -> list[float]:
    """θ_g = x_g / (1 − m_g) per informative group (docs/theory.md §11): the share of the energy a relabelling leaves
    outside the class span that the group's true labels capture (x_g = ``zero_sum/<stat>_excess``, m_g its
    relabelling mean). Each group weighs the same, so groups that carry the labels' structure are not outweighed by
    groups with more room and none (half rank-2, half isotropic groups: θ pooled as Σ x / Σ (1 − m) is 0.11 at R = 8,
    the mean of θ_g 0.38). Under "the labels carry no information" E[x_g | the group's Gram] = 0 and 1 − m_g is a
    function of the Gram, so E θ_g = 0 per group. Groups with 1 − m_g <= :data:`INFORMATIVE_ROOM` or a zero null
    variance are left out.

    Returns:
        [n] θ_g of the informative groups, in order (each in (−∞, 1]).
    """
    ex, nv, nu = mk.zero_sum_key(stat, "excess"), mk.zero_sum_key(stat, "null_var"), mk.zero_sum_key(stat, "null")
    out = []
    for g in groups:
        if g.get(ex) is None or g.get(nv) is None or g.get(nu) is None:
            continue
        room = 1 - float(g[nu])
        if room > INFORMATIVE_ROOM and float(g[nv]) > 0:
            out.append(float(g[ex]) / room)
    return out


def theta_test(groups: list[dict[str, Any]], margin: float = NEGLIGIBLE_SHARE) -> dict[str, Any]:
    """The equivalence pair on θ̄, the mean of :func:`label_shares` over the informative groups, at ``margin``
    (docs/theory.md §11): each side is Hall's one-sided t-test of the mean of θ_g against the margin
    (:func:`grpo_lens.formulas.stats.mean_test_p`), its interval :func:`grpo_lens.formulas.stats.mean_interval`.
    Returns :func:`relabelling_test`'s dict (its "z" the pooled relabelling control, "theta_pooled" its pooled θ,
    "n_groups" the groups with the keys) with "theta", "lo", "hi", "n" (informative groups) of θ̄, plus "p_holds"
    (θ̄ above the margin) and "p_dnh" (below); both 1 with fewer than :data:`MIN_GROUPS` informative groups."""
    t = relabelling_test(groups, stat="unit_span_energy")
    shares = label_shares(groups)
    ci = mean_interval(shares)
    out = {**t, "theta_pooled": t["theta"], "n_groups": t["n"], "n": len(shares)}
    out.update(theta=ci["mean"], lo=ci["lo"], hi=ci["hi"])
    if len(shares) < MIN_GROUPS:
        return {**out, "p_holds": 1.0, "p_dnh": 1.0}
    return {**out, "p_holds": mean_test_p(shares, margin, "above"), "p_dnh": mean_test_p(shares, margin, "below")}


@CLAIMS.register("zero_sum_rank_two")
def zero_sum_rank_two(probe: dict[str, Any]) -> list[Claim]:
    """ "The reward labels structure G1" (the G1 reading of "the rank-2 structure comes from the zero-sum
    advantages"): one row across the R > 2 measured.

    G1's spectrum and the span energy use A_i² only, and a relabelling keeps Σ w = 0, so this row tests that the
    reward labels structure the gradients' directions, not that the advantages sum to zero. θ is read on the cosine
    Gram (every g_i scaled to norm 1), so a label effect on gradient norms alone cannot pass.

    Rule (:func:`theta_test`, per R > 2): θ̄ is the mean over the groups that carry label information of each
    group's θ_g (:func:`label_shares`); holds when θ̄'s interval lies above :data:`NEGLIGIBLE_SHARE`, does not hold
    when it lies below (an equivalence pair: a negligible θ = 0.01 cannot read holds); across R, holds only where it
    holds at every R (the largest p) and does not hold where it fails at any (the number of R × the smallest p).
    The rule's earlier form pooled θ as Σ x_g / Σ (1 − m_g), which lets isotropic groups with much room outweigh
    rank-2 groups with little (power 0.01 at 128 groups per R on half-and-half planted groups, θ pooled 0.110 at
    R = 8); the pooled θ stays in :func:`relabelling_test`.
    """
    per_group_size = probe.get("per_group_size", {})
    rs = [R for R in sorted(per_group_size, key=int) if int(R) > 2]
    if not rs:
        return []
    tests = {R: theta_test(per_group_size[R].get(mk.PROBE_GROUPS, []) or []) for R in rs}
    p_holds = max(t["p_holds"] for t in tests.values())
    p_dnh = min(1.0, len(tests) * min(t["p_dnh"] for t in tests.values()))
    verdict = decide(p_holds, p_dnh)
    n = min(t["n"] for t in tests.values())
    if verdict == HOLDS:
        why = f"θ above {NEGLIGIBLE_SHARE} at every R (p = {p_holds:.2g} <= {BRANCH_LEVEL})"
    elif verdict == DOES_NOT_HOLD:
        why = f"θ below {NEGLIGIBLE_SHARE} at some R (p = {p_dnh:.2g} <= {BRANCH_LEVEL}): the labels capture little"
    elif min(t["n_groups"] for t in tests.values()) == 0:
        why = "no group carries the cosine-Gram span energy (a probe.json from an older grpo-lens, or R = 2 only)"
    elif n < MIN_GROUPS:
        why = f"{n} groups that carry label information < {MIN_GROUPS} at some R"
    else:
        why = f"θ's interval reaches {NEGLIGIBLE_SHARE} (p holds {p_holds:.2g}, p does not hold {p_dnh:.2g})"
    meas, ctrl, primary = [], [], []
    for R, t in tests.items():
        summ = per_group_size[R].get(mk.PROBE_SUMMARY, {})
        th = (
            "–"
            if t["theta"] is None
            else fmt(t["theta"], 3) + ("" if t["lo"] is None else f" [{fmt(t['lo'], 3)}, {fmt(t['hi'], 3)}]")
        )
        meas.append(
            f"R = {R}: θ̄ (cosine Gram) {th} (n = {t['n']} of {t['n_groups']} groups carry label information); "
            f"pooled θ = Σ x / Σ (1 − m) {fmt(t['theta_pooled'], 3)} (not used); span energy "
            f"{ci_text(summ.get(mk.ZERO_SUM_SPAN_ENERGY), 3)}; cos-gap excess "
            f"{ci_text(summ.get(mk.ZERO_SUM_COS_GAP_EXCESS), 3)}"
        )
        ctrl.append(f"R = {R}: relabelling z {fmt(t['z'])}")
        primary.append(f"{th} (R = {R})")
    return [
        Claim(
            claim="the reward labels structure G1's directions "
            "(G1 reading of: rank 2 comes from the zero-sum advantages)",
            scope="R = " + ", ".join(rs) + " (one verdict)",
            measurement="; ".join(meas),
            control=(
                f"relabellings with k fixed ({'; '.join(ctrl)}); equivalence margin θ = {NEGLIGIBLE_SHARE}; G1 is "
                f"blind to the advantages' signs (this row does not test sum A = 0)"
            ),
            verdict=verdict,
            rule=why,
            source=source_of(probe),
            n=n,
            p_holds=p_holds,
            p_dnh=p_dnh,
            rule_id=RULE_ID,
            advice=(
                "raise `--prompts` (grpo-lens probe; `--probe-prompts` in grpo-lens demo), e.g. to twice its value: "
                "θ's interval narrows as 1/√groups"
                if verdict == INCONCLUSIVE
                else ""
            ),
            primary="θ̄ " + ", ".join(primary),
        )
    ]


#: G2 stable ranks within this relative difference of each other count as "no difference" between weightings
#: (relative: stable ranks differ in scale by layer type).
EQUIVALENCE_REL = 0.1


NOT_ZERO_SUM = ("abs", "shift", "reward", "uniform")


@CLAIMS.register("zero_sum_g2_weighting")
def zero_sum_g2_weighting(probe: dict[str, Any]) -> list[Claim]:
    """The same claim seen on G2 (every nn.Linear layer's weight gradient of the group loss): is G2's rank under the
    zero-sum advantages A lower than under the weightings that are not zero-sum (|A|, A + mean|A|, r, 1)?

    Per group: d = (a − o) / o with a = mean over layer types of the stable rank under A and o = its mean under
    those four weightings (a relative difference). Rule (per R, mean of d over the groups with G2 of every layer,
    95% interval): inconclusive with fewer than :data:`MIN_GROUPS` groups (raise ``--g2-groups``); holds if the
    interval lies below 0; does not hold if it lies inside ± :data:`EQUIVALENCE_REL` (A makes no difference) or
    above 0; inconclusive otherwise.
    """
    out = []
    src = source_of(probe) + "; G2 is exact (autograd weight gradients)"
    for R in sorted(probe.get("per_group_size", {}), key=int):
        rows = ((probe["per_group_size"][R].get(mk.PROBE_G2_WEIGHTINGS) or {}).get(mk.PROBE_GROUPS)) or []
        ds, adv_sr, other_sr = [], [], []
        for row in rows:
            parsed = [mk.RANK_G2_WEIGHTED.parse(k) for k in row]
            types = sorted({p["kind"] for p in parsed if p is not None and p["w"] == "adv"})
            if not types:
                continue
            a = sum(row[mk.RANK_G2_WEIGHTED.format(w="adv", kind=t)] for t in types) / len(types)
            o = sum(row[mk.RANK_G2_WEIGHTED.format(w=w, kind=t)] for t in types for w in NOT_ZERO_SUM) / (
                len(types) * len(NOT_ZERO_SUM)
            )
            ds.append((a - o) / o if o > 0 else float("nan"))
            adv_sr.append(a)
            other_sr.append(o)
        if not ds:
            continue
        ci = mean_interval(ds)
        n = ci["n"]
        below_zero = verdict_from_interval(ci["lo"], ci["hi"], 0.0, "below")
        no_difference = band_verdict(ci["lo"], ci["hi"], -EQUIVALENCE_REL, EQUIVALENCE_REL)
        # descriptive since 0.3: the 0.2 rule said *does not hold* whether the zero-sum constraint was
        # irrelevant (0.75-0.95) or decisive (1.0) on planted cases, so it cannot tell them apart; no verdict
        # n: a count
        if n < MIN_GROUPS or ci["lo"] is None:  # type: ignore[operator]
            reading = f"{n} group(s) with G2 of every layer (an interval needs {MIN_GROUPS}: --g2-groups)"
        elif below_zero == HOLDS:
            reading = f"difference interval below 0 (upper end {fmt(ci['hi'])})"
        elif no_difference == HOLDS:
            reading = f"relative difference interval inside ±{fmt(EQUIVALENCE_REL)}"
        elif below_zero == DOES_NOT_HOLD:
            reading = "difference interval above 0: A gives a higher rank"
        else:
            reading = "difference interval includes 0 and differences beyond ±0.1"
        verdict, why = (
            INCONCLUSIVE,
            (
                f"descriptive, no verdict: the 0.2 rule could not tell planted "
                f"zero-sum-irrelevant from zero-sum-decisive cases apart; reads: {reading}"
            ),
        )
        out.append(
            Claim(
                claim="rank-2 structure comes from the zero-sum advantages (G2, every layer)",
                scope=f"R = {R}",
                measurement=(
                    f"G2 stable rank under A, mean over layer types: {fmt(sum(adv_sr) / len(adv_sr))}; "
                    f"(A − not-zero-sum) / not-zero-sum {ci_text(ci, 3)}"
                ),
                control=f"weightings |A|, A + mean|A|, r, 1: {fmt(sum(other_sr) / len(other_sr))}",
                verdict=verdict,
                rule=why,
                source=src,
                kind="descriptive",
                n=n,  # type: ignore[arg-type]  # n: a count
            )
        )
    return out
