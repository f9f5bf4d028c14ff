"""The claim "effective rank ≈ 2 for R in {2, 4, 8}" (docs/theory.md §11): one primary measure, one verdict across R.

Primary measure (pre-registered): the top-2 energy share E₂ = (λ₁ + λ₂)/Σλ of G1 (rows A_i g_i), beside
the top-1 share E₁ = λ₁/Σλ. By Eckart–Young, 1 − E₂ is the share of ‖G1‖_F² outside the best rank-2 approximation,
so "rank ≈ 2" reads E₂ > :data:`TOP_SHARE` > E₁ (two directions hold 90% of the energy and one alone does not).

Per R > 2 (:func:`rank_two_test`, n >= :data:`MIN_RANK_GROUPS` groups: E₂ depends on the correct count k, 0.94 /
0.82 / 0.94 for k = 1 / 2 / 3 at R = 4, and a sample of 8 groups can miss a k stratum):

- *holds* branch (intersection-union, p = the largest of three): the mean E₂ above 0.9, the mean E₁ below 0.9, and
  the structure reduction d = E₂(G1) − E₂(simulated null) above 0 (the null: G1's row norms with random directions
  in R^P, :func:`grpo_lens.formulas.spectrum.simulated_null_measures`; the probe and the lens pass P);
- *does not hold* branch (a union of three routes, Bonferroni: p = 3 × the smallest): the mean E₂ below 0.9, the
  mean E₁ above 0.9, or no structure (the mean d below :data:`STRUCTURE_BOUNDARY` = 0).

The two branches share each boundary: 0.9 for E₂, 0.9 for E₁, :data:`STRUCTURE_BOUNDARY` for d. The 0.3
rule's *does not hold* accepted |d| < 0.1 while *holds* needed d > 0, so a rank-2 matrix with 0 < d < 0.1 could read
*does not hold*; with one boundary a branch's wrong verdict needs its one-sided test to fail on the other side.

Each one-sided p is Hall's transformed t (:func:`grpo_lens.formulas.stats.mean_test_p`), the test of the interval
the row prints. Across R (:func:`rank_two_top2_share`): holds only if it holds at every R > 2 measured (p = the
largest), does not hold if it fails at any (p = the number of R × the smallest). Erank, stable rank, participation
ratio, k90 and k99 are printed beside it without a verdict (descriptive): erank follows the noise floor (rank 2 + 1%
noise has erank ≈ 2.9 at R = 8) and stable rank follows the class sizes (an exact rank-2 G1 has stable rank
1 + λ₂/λ₁, which depends on k and on the class means' angle).
"""

from __future__ import annotations

import math
from typing import Any

from grpo_lens import metrics as mk
from grpo_lens.claims import base
from grpo_lens.claims.base import BRANCH_LEVEL, DOES_NOT_HOLD, HOLDS, INCONCLUSIVE, Claim, ci_text, decide, fmt
from grpo_lens.claims.sparsity import seed_records
from grpo_lens.formulas.pooling import seed_mean_test
from grpo_lens.formulas.stats import (
    MIN_INTERVAL_UNITS,
    mean_interval,
    mean_test_p,
    student_t_cdf,
    student_t_quantile,
)

#: "≈ 2" for erank and stable rank in the 0.2 rules (the values that round to 2); descriptive since 0.3.
RANK_BAND = (1.5, 2.5)

#: "k90 = 2": the top two directions hold more than this share of the energy and the top one alone less.
TOP_SHARE = 0.9

#: fewest groups per R for a rank verdict (every boundary miss at n = 8 was a sample missing a k stratum)
MIN_RANK_GROUPS = 16

#: the measures printed beside the primary one, without a verdict
DESCRIPTIVE_MEASURES = ("erank", "stable_rank", "participation_ratio", "k90", "k99")

#: the one structure boundary of both branches: holds needs the mean d above it, "no structure" the mean d below it
STRUCTURE_BOUNDARY = 0.0

#: the calibration's name of the rule (grpo_lens/data/calibration_levels.json)
RULE_ID = "rank ≈ 2 (E2, across R)"


def _values(groups: list[dict[str, Any]], key: str) -> list[float]:
    return [float(g[key]) for g in groups if g.get(key) is not None]


def reductions(groups: list[dict[str, Any]], measure: str = "top2_share") -> tuple[list[float], str]:
    """Per-group structure reduction of ``measure`` (positive = more shared direction than the null; G1 − null for
    the top-2 share, null − G1 for the others) and the null it was taken against ("simulated" when every group
    carries it, else "orthogonal", under which the reduction is > 0 for every matrix)."""
    sim = bool(groups) and all(g.get(mk.RANK_G1_SIMNULL.format(m=measure)) is not None for g in groups)
    null_key = (mk.RANK_G1_SIMNULL if sim else mk.RANK_G1_NULL).format(m=measure)
    sign = 1.0 if measure in ("top2_share", "top1_share") else -1.0
    out = [
        sign * (float(g[mk.RANK_G1.format(m=measure)]) - float(g[null_key]))
        for g in groups
        if g.get(mk.RANK_G1.format(m=measure)) is not None and g.get(null_key) is not None
    ]
    return out, "simulated" if sim else "orthogonal"


def rank_two_test(groups: list[dict[str, Any]], min_groups: int = MIN_RANK_GROUPS) -> dict[str, Any]:
    """The two branch p-values of "E₂ > 0.9 > E₁ with structure" on one R's per-group rows (module docstring).

    Returns:
        {"n", "p_holds", "p_dnh", "route" (the does-not-hold route with the smallest p), "top2", "top1",
        "reduction" (:func:`grpo_lens.formulas.stats.mean_interval` dicts), "null" ("simulated" / "orthogonal")};
        both p = 1 with fewer than ``min_groups`` groups.
    """
    e2 = _values(groups, mk.RANK_G1.format(m="top2_share"))
    e1 = _values(groups, mk.RANK_G1.format(m="top1_share"))
    red, null = reductions(groups)
    out: dict[str, Any] = {
        "n": len(e2),
        "null": null,
        "top2": mean_interval(e2, bounds=(0.0, 1.0)),
        "top1": mean_interval(e1, bounds=(0.0, 1.0)),
        "reduction": mean_interval(red),
    }
    if len(e2) < min_groups or len(e1) < min_groups or len(red) < min_groups:
        return {**out, "p_holds": 1.0, "p_dnh": 1.0, "route": None}
    p_holds = max(
        mean_test_p(e2, TOP_SHARE, "above"),
        mean_test_p(e1, TOP_SHARE, "below"),
        mean_test_p(red, STRUCTURE_BOUNDARY, "above"),
    )
    routes = {
        "E2 below 0.9": mean_test_p(e2, TOP_SHARE, "below"),
        "E1 above 0.9 (one direction)": mean_test_p(e1, TOP_SHARE, "above"),
        f"no structure (reduction below {fmt(STRUCTURE_BOUNDARY)})": mean_test_p(red, STRUCTURE_BOUNDARY, "below"),
    }
    # routes' keys: get never returns None
    route = min(routes, key=routes.get)  # type: ignore[arg-type]
    return {**out, "p_holds": p_holds, "p_dnh": min(1.0, len(routes) * routes[route]), "route": route}


def combine_over_r(tests: dict[str, dict[str, Any]]) -> tuple[float, float]:
    """(p_holds, p_dnh) of one verdict across R: holds only where it holds at every R (intersection-union: the
    largest p), does not hold where it fails at any (Bonferroni: the number of R × the smallest p)."""
    if not tests:
        return 1.0, 1.0
    return (max(t["p_holds"] for t in tests.values()), min(1.0, len(tests) * min(t["p_dnh"] for t in tests.values())))


def _probe_advice(probe: dict[str, Any], tests: dict[str, dict[str, Any]], need: int) -> str:
    """What would decide a probe's per-group row: the probe's --prompts (the demo's --probe-prompts) and a count."""
    cfg = (probe.get("meta") or {}).get("config") or {}
    parts = []
    for r, t in tests.items():
        prompts = cfg.get("prompts") or max(24, 128 // int(r))
        rate = t["n"] / prompts if prompts else 0.0
        target = math.ceil(need / rate) if rate > 0 else 2 * need
        if t["n"] < need:
            groups = f"{t['n']} mixed group" + ("" if t["n"] == 1 else "s")
            parts.append(f"R = {r}: {groups} < {need}, about {target} prompts reach {need}")
    more = "; ".join(parts) if parts else "the intervals overlap 0.9: more groups narrow them (e.g. twice the prompts)"
    return f"raise `--prompts` (grpo-lens probe; `--probe-prompts` in grpo-lens demo): {more}"


@base.CLAIMS.register("rank_two_top2_share")
def rank_two_top2_share(probe: dict[str, Any]) -> list[Claim]:
    """ "Effective rank ≈ 2 for R in {2, 4, 8}": one row, decided by E₂ over the R > 2 measured (module docstring);
    R = 2 is left out (G1 has two rows: rank <= 2 whatever the gradients). Descriptive measures in the text."""
    per_group_size = probe.get("per_group_size", {})
    rs = [R for R in sorted(per_group_size, key=int) if int(R) > 2]
    if not rs:
        return []
    tests = {R: rank_two_test(per_group_size[R].get(mk.PROBE_GROUPS) or []) for R in rs}
    p_holds, p_dnh = combine_over_r(tests)
    verdict = decide(p_holds, p_dnh)
    meas, ctrl, primary = [], [], []
    for R, t in tests.items():
        primary.append(f"{ci_text(t['top2'], 3).split(' (n = ')[0]} (R = {R})")
        groups = per_group_size[R].get(mk.PROBE_GROUPS) or []
        desc = ", ".join(
            f"{m} {fmt(mean_interval(_values(groups, mk.RANK_G1.format(m=m)))['mean'])}" for m in DESCRIPTIVE_MEASURES
        )
        g2 = mean_interval(_values(groups, mk.RANK_G2.format(m="top2_share")))
        g2_txt = f"; G2 (one layer) top-2 share {fmt(g2['mean'], 3)}" if g2["mean"] is not None else ""
        meas.append(f"R = {R}: E₂ {ci_text(t['top2'], 3)}, E₁ {ci_text(t['top1'], 3)} (descriptive: {desc}{g2_txt})")
        ctrl.append(f"R = {R}: E₂ − {t['null']} null {ci_text(t['reduction'], 3)}")
    n = min(t["n"] for t in tests.values())
    if verdict == HOLDS:
        why = f"at every R: E₂ > {TOP_SHARE} > E₁ and E₂ above its null (p = {p_holds:.2g} <= {BRANCH_LEVEL})"
    elif verdict == DOES_NOT_HOLD:
        worst = min(tests, key=lambda R: tests[R]["p_dnh"])
        why = f"fails at R = {worst}: {tests[worst]['route']} (p = {p_dnh:.2g} <= {BRANCH_LEVEL}, over routes and R)"
    elif n < MIN_RANK_GROUPS:
        why = f"{n} groups < {MIN_RANK_GROUPS} at some R (E₂ depends on k: a small sample misses k strata)"
    else:
        why = f"neither branch reaches {BRANCH_LEVEL} (p holds {p_holds:.2g}, p does not hold {p_dnh:.2g})"
    return [
        Claim(
            claim=f"the per-rollout gradient matrix G1 has effective rank ≈ 2 "
            f"(top-2 energy share E₂ > {TOP_SHARE} > E₁)",
            scope="R = " + ", ".join(rs) + " (one verdict)",
            measurement="; ".join(meas),
            control=f"structure: {'; '.join(ctrl)} (structure above {fmt(STRUCTURE_BOUNDARY)}, none below)",
            verdict=verdict,
            rule=why,
            source=base.source_of(probe),
            n=n,
            p_holds=p_holds,
            p_dnh=p_dnh,
            rule_id=RULE_ID,
            advice=_probe_advice(probe, tests, MIN_RANK_GROUPS) if verdict == INCONCLUSIVE else "",
            primary="E₂ " + ", ".join(primary),
        )
    ]


def _step_p(row: dict[str, Any], m: str, side: str) -> float:
    """One lens step's one-sided p of its mean ``m`` against 0.9, from the step's logged 95% interval over its n mixed
    groups (``rank/mixed_groups``; :data:`grpo_lens.formulas.stats.MIN_INTERVAL_UNITS` where it is missing, the
    fewest an interval has): the interval is a t interval, so se = half-width on ``side`` / t_{0.975, n−1} and p is
    Student's t tail with n − 1 degrees of freedom (the 0.3 rule took the normal's, p 0.0009 where the t
    test gives 0.0025 at n = 12); 1.0 without an interval."""
    lo, hi, mean = (
        row.get(mk.RANK_G1_LO.format(m=m)),
        row.get(mk.RANK_G1_HI.format(m=m)),
        row.get(mk.RANK_G1.format(m=m)),
    )
    if lo is None or hi is None or mean is None:
        return 1.0
    mean, lo, hi = float(mean), float(lo), float(hi)
    n = int(row.get(mk.RANK_MIXED_GROUPS) or MIN_INTERVAL_UNITS)
    df = max(n, MIN_INTERVAL_UNITS) - 1
    se = ((mean - lo) if side == "above" else (hi - mean)) / student_t_quantile(0.975, df)
    if se <= 0:
        return 0.0 if (mean > TOP_SHARE if side == "above" else mean < TOP_SHARE) else 1.0
    t = (mean - TOP_SHARE) / se
    return 1.0 - student_t_cdf(t, df) if side == "above" else student_t_cdf(t, df)


#: the calibration's name of the training rule
STAYS_RULE_ID = "rank stays ≈ 2 (every lens step)"
#: the statement of the training claim (one run or seeds pooled) and its control, the band each lens step is held to
STAYS_CLAIM = f"the effective rank of G1 stays ≈ 2 over training (E₂ > {TOP_SHARE} > E₁ at every lens step)"
STAYS_BAND = f"the band: E₂ > {TOP_SHARE} > E₁ at each step"


@base.CLAIMS.register("rank_stays_near_two")
def rank_stays_near_two(data: dict[str, Any]) -> list[Claim]:
    """ "The effective rank stays near 2 as training goes on", on a training run's lens records (``{"records":
    [...]}``; [] without lens rank numbers): E₂ > 0.9 > E₁ at every lens step.

    Rule (an intersection-union over lens steps, docs/theory.md §11): each lens step's one-sided tests come from its
    logged 95% interval over that step's mixed groups (``rank/g1_<m>_lo``/``_hi``, logged from 8 mixed groups;
    Student's t with the step's groups − 1 degrees of freedom). Holds when every lens step has E₂ above 0.9 and E₁
    below it (p = the largest step p: no multiplicity penalty for "every"); does not hold when some step has E₂
    below 0.9 or E₁ above it (p = 2 × the number of steps × the smallest step p, Bonferroni over steps and the two
    routes); inconclusive otherwise, and
    whenever a lens step has no interval (fewer than 8 mixed groups), since "stays" is about every step. The row's
    n is the fewest mixed groups of a lens step (the unit its calibration is indexed by).
    """
    if len(seed_records(data)) > 1:  # `train --seeds`: the pooled route
        return rank_stays_pooled(seed_records(data))
    rows = [
        r
        for r in data.get("records") or []
        if r.get(mk.RANK_G1.format(m="top2_share")) is not None and r.get(mk.RANK_G1.format(m="top1_share")) is not None
    ]
    if not rows:
        return []
    p_holds = max(max(_step_p(r, "top2_share", "above"), _step_p(r, "top1_share", "below")) for r in rows)
    p_dnh = min(
        1.0,
        2 * len(rows) * min(min(_step_p(r, "top2_share", "below"), _step_p(r, "top1_share", "above")) for r in rows),
    )
    verdict = decide(p_holds, p_dnh)
    lows = [r for r in rows if r.get(mk.RANK_G1_LO.format(m="top2_share")) is None]
    groups = [int(r.get(mk.RANK_MIXED_GROUPS) or 0) for r in rows]
    if verdict == HOLDS:
        why = f"every lens step: E₂ > {TOP_SHARE} > E₁ (largest step p {p_holds:.2g})"
    elif verdict == DOES_NOT_HOLD:
        why = f"a lens step with E₂ below {TOP_SHARE} or E₁ above it (p = {p_dnh:.2g}, Bonferroni over steps)"
    elif lows:
        why = f"{len(lows)} of {len(rows)} lens steps have fewer than 8 mixed groups (no interval)"
    else:
        why = f"neither branch reaches {BRANCH_LEVEL} (p holds {p_holds:.2g}, p does not hold {p_dnh:.2g})"
    advice = ""
    if verdict == INCONCLUSIVE:
        most = max(groups, default=0)
        advice = (
            f"raise `--prompts-per-step` (now at most {most} mixed group{'' if most == 1 else 's'} per lens step; a "
            f"step interval needs 8, e.g. --prompts-per-step 12 with R = 8)"
        )
    e2 = [float(r[mk.RANK_G1.format(m="top2_share")]) for r in rows]
    return [
        Claim(
            claim=STAYS_CLAIM,
            scope=f"training, {len(rows)} lens steps (steps {rows[0].get('step')}–{rows[-1].get('step')})",
            measurement=(
                f"E₂ per lens step {', '.join(fmt(x, 3) for x in e2)} (lowest {fmt(min(e2), 3)}); "
                f"mixed groups per step {', '.join(map(str, groups))}"
            ),
            control=STAYS_BAND,
            verdict=verdict,
            rule=why,
            source="lens (each step's mixed groups)",
            n=min(groups),
            p_holds=p_holds,
            p_dnh=p_dnh,
            rule_id=STAYS_RULE_ID,
            advice=advice,
        )
    ]


#: the calibration's name of the pooled training rule (`train --seeds`)
STAYS_SEEDS_RULE_ID = "rank stays ≈ 2 (seeds pooled, every lens step)"


def rank_stays_pooled(runs: list[list[dict[str, Any]]]) -> list[Claim]:
    """ "The effective rank stays near 2" pooled over seeds (`train --seeds`): at every lens step, the seeds' step
    means of E₂ and E₁ are independent units (one run each), tested against 0.9 by the t over seeds
    (:func:`grpo_lens.formulas.pooling.seed_mean_test`, k − 1 degrees of freedom).

    Rule (over the lens steps every seed logged, docs/theory.md §11): holds when the mean over seeds of each seed's
    lowest E₂ over those steps lies above 0.9 and that of its highest E₁ below it (t over seeds; since E[min_s X_s]
    <= min_s E[X_s], this implies E₂ > 0.9 > E₁ at every step, with no penalty for the number of steps); does not
    hold when at some step the seeds' mean E₂ lies below 0.9 or E₁ above it (p = 2 × steps × the smallest step p,
    Bonferroni); inconclusive otherwise. A seed's numbers are one unit whatever its steps' group counts, so a step
    needs no interval of its own (4 mixed groups per lens step suffice), and the within-run dependence between steps
    does not matter (every t is over seeds). The row's n is the number of seeds.
    """
    e2k, e1k = mk.RANK_G1.format(m="top2_share"), mk.RANK_G1.format(m="top1_share")
    by_step: dict[float, list[tuple[float, float]]] = {}
    for recs in runs:
        for r in recs:
            if r.get(e2k) is not None and r.get(e1k) is not None and r.get("step") is not None:
                by_step.setdefault(float(r["step"]), []).append((float(r[e2k]), float(r[e1k])))
    steps = sorted(s for s, v in by_step.items() if len(v) == len(runs))  # the lens steps every seed logged
    if not steps:
        return []
    # holds: E[min_s X_s] <= min_s E[X_s], so "the mean over seeds of each seed's lowest E₂ lies above 0.9" implies
    # every step's E₂ does (and each seed's highest E₁ below it): one t over seeds, no penalty for the steps
    p_holds = max(
        seed_mean_test([min(by_step[s][j][0] for s in steps) for j in range(len(runs))], TOP_SHARE, "above"),
        seed_mean_test([max(by_step[s][j][1] for s in steps) for j in range(len(runs))], TOP_SHARE, "below"),
    )
    dnh_p = [
        min(
            seed_mean_test([a for a, _ in by_step[s]], TOP_SHARE, "below"),
            seed_mean_test([b for _, b in by_step[s]], TOP_SHARE, "above"),
        )
        for s in steps
    ]
    p_dnh = min(1.0, 2 * len(steps) * min(dnh_p))
    verdict = decide(p_holds, p_dnh)
    means = [sum(a for a, _ in by_step[s]) / len(runs) for s in steps]
    if verdict == HOLDS:
        why = (
            f"each seed's lowest E₂ over the lens steps lies above {TOP_SHARE} on average, its highest E₁ below "
            f"(p {p_holds:.2g})"
        )
    elif verdict == DOES_NOT_HOLD:
        why = f"a lens step whose seeds' mean E₂ lies below {TOP_SHARE} or E₁ above it (p = {p_dnh:.2g}, Bonferroni)"
    else:
        why = f"neither branch reaches {BRANCH_LEVEL} (p holds {p_holds:.2g}, p does not hold {p_dnh:.2g})"
    scope = f"training, {len(runs)} seeds × {len(steps)} lens steps (steps {int(steps[0])}–{int(steps[-1])})"
    measurement = (
        f"E₂ per lens step, mean over seeds {', '.join(fmt(x, 3) for x in means)} (lowest {fmt(min(means), 3)})"
    )
    source = "lens (each step's mixed groups, each seed one unit)"
    advice = (
        f"more seeds (now {len(runs)}; `train --seeds 0 1 2 3 4`: 5 seeds reach power 1.0 at 4 mixed groups per lens "
        "step, docs/calibration.md)"
        if verdict == INCONCLUSIVE
        else ""
    )
    control = f"{STAYS_BAND}, t over seeds"
    return [
        Claim(
            STAYS_CLAIM,
            scope,
            measurement,
            control,
            verdict,
            why,
            source,
            n=len(runs),
            p_holds=p_holds,
            p_dnh=p_dnh,
            rule_id=STAYS_SEEDS_RULE_ID,
            advice=advice,
        )
    ]


# ---------------------------------------------------------------------------------------------------------------------
# the readings of "the gradient matrix has effective rank ≈ 2" side by side (descriptive)
# ---------------------------------------------------------------------------------------------------------------------
#: the measures every reading prints, and the band "≈ 2" of each: erank and stable rank within RANK_BAND (the values
#: that round to 2, fixed in 0.2 before any measurement), E₂ above TOP_SHARE (the primary rule's boundary)
READING_MEASURES = ("top2_share", "erank", "stable_rank")

#: the weightings that are not zero-sum (the control of "does the zero-sum A cause it"), in the report's order
CONTROL_WEIGHTINGS = ("abs", "shift", "reward", "uniform", "single")


def near_two(stats_by_size: dict[str, dict[str, Any]], loose_by_size: dict[str, dict[str, Any]], measure: str) -> str:
    """Equivalence test of "≈ 2 at every R" for one reading: "yes" when the 95% interval lies inside the band at
    every R (intersection-union: 0.025 per side, no multiplicity penalty), "no at R = r" when at some R the interval
    at level 1 − 0.05/|R| (Bonferroni over R, ``loose_by_size``) lies wholly outside it, "undecided" otherwise and
    "no interval" when some R has fewer than 8 units. The band: E₂ > :data:`TOP_SHARE`; erank and stable rank in
    :data:`RANK_BAND`. Pre-registered margins, not calibrated on planted cases for G2 (docs/theory.md §11)."""
    lo_b, hi_b = (TOP_SHARE, 1.0) if measure == "top2_share" else RANK_BAND
    if not stats_by_size or any(s.get("lo") is None for s in stats_by_size.values()):
        return "no interval"
    if all(lo_b < s["lo"] and s["hi"] <= hi_b for s in stats_by_size.values()):
        return "yes"
    out = [R for R, s in loose_by_size.items() if s.get("lo") is not None and (s["hi"] < lo_b or s["lo"] > hi_b)]
    return f"no at R = {', '.join(out)}" if out else "undecided"


def _reading(values_by_size: dict[str, list[float]], measure: str) -> dict[str, Any]:
    k = max(len(values_by_size), 1)
    bounds = (0.0, 1.0) if measure == "top2_share" else None
    stats = {R: mean_interval(v, bounds=bounds) for R, v in values_by_size.items()}
    loose = {R: mean_interval(v, level=1 - 0.05 / k, bounds=bounds) for R, v in values_by_size.items()}
    return {"by_size": stats, "near_two": near_two(stats, loose, measure)}


def rank_readings(probe: dict[str, Any]) -> list[dict[str, Any]]:
    """Every reading of "the gradient matrix has effective rank ≈ 2" in a probe.json, side by side:
    G1 (rows A_i g_i: the primary row's matrix), G2 of the probe's one layer, G2 of every linear layer by layer type
    (stable rank: what `g2_weightings` holds) and G3 (one matrix per R: no interval), each with E₂, erank and stable
    rank where measured, the mean [95% interval] over groups at every R > 2, :func:`near_two`, and the same matrix's
    stable rank under the weightings that are not zero-sum (:data:`CONTROL_WEIGHTINGS`: mean over groups; G1 under
    "uniform" is G1_no_adv, rows g_i).

    Returns:
        [{"matrix", "measure", "primary" (bool), "by_size": {R: {mean, lo, hi, n}}, "near_two": str,
        "controls": {R: {weighting: mean}}}], G1 first; [] without an R > 2.
    """
    per = probe.get("per_group_size", {})
    rs = [R for R in sorted(per, key=int) if int(R) > 2]
    if not rs:
        return []
    groups = {R: per[R].get(mk.PROBE_GROUPS) or [] for R in rs}
    out: list[dict[str, Any]] = []
    for m in READING_MEASURES:
        row = _reading({R: _values(groups[R], mk.RANK_G1.format(m=m)) for R in rs}, m)
        ctrl = {R: {"uniform": mean_interval(_values(groups[R], mk.RANK_G1_NO_ADV.format(m=m)))["mean"]} for R in rs}
        out.append({"matrix": "G1 (rows A_i g_i)", "measure": m, "primary": m == "top2_share", **row, "controls": ctrl})
    for m in READING_MEASURES:
        vals = {R: _values(groups[R], mk.RANK_G2.format(m=m)) for R in rs}
        if any(vals.values()):
            row = _reading(vals, m)
            out.append({"matrix": "G2 (the probe's layer)", "measure": m, "primary": False, **row, "controls": {}})
    g2w = {R: (per[R].get(mk.PROBE_G2_WEIGHTINGS) or {}).get(mk.PROBE_GROUPS) or [] for R in rs}
    kinds = sorted(
        {
            p["kind"]
            for rows in g2w.values()
            for g in rows
            for p in (mk.RANK_G2_WEIGHTED.parse(k) for k in g)
            if p is not None and p["w"] == "adv"
        }
    )
    for kind in kinds:
        row = _reading({R: _values(g2w[R], mk.RANK_G2_WEIGHTED.format(w="adv", kind=kind)) for R in rs}, "stable_rank")
        ctrl = {
            R: {
                w: mean_interval(_values(g2w[R], mk.RANK_G2_WEIGHTED.format(w=w, kind=kind)))["mean"]
                for w in CONTROL_WEIGHTINGS
            }
            for R in rs
        }
        out.append(
            {"matrix": f"G2 {kind} (every layer)", "measure": "stable_rank", "primary": False, **row, "controls": ctrl}
        )
    g3 = {R: per[R].get(mk.PROBE_G3) or {} for R in rs}
    for m in READING_MEASURES:
        if all(g3[R].get(mk.rank_key("g3", m)) is None for R in rs):
            continue
        by_size = {
            R: {"mean": g3[R].get(mk.rank_key("g3", m)), "lo": None, "hi": None, "n": g3[R].get(mk.G3_GROUPS)}
            for R in rs
        }
        ctrl = {R: {w: g3[R].get(mk.rank_key(f"g3_{w}", m)) for w in CONTROL_WEIGHTINGS} for R in rs}
        out.append(
            {
                "matrix": "G3 (rows = groups' updates)",
                "measure": m,
                "primary": False,
                "by_size": by_size,
                "near_two": "one matrix: no interval",
                "controls": ctrl,
            }
        )
    return out
