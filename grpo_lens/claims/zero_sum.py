"""The claims that GRPO's rank-2 structure comes from its zero-sum advantages (docs/theory.md §11, on the tests of §6).

On G1 (:func:`zero_sum_rank_two`): the across-group relabelling test of the span energy of the true labels
(:func:`relabelling_test`), with its normalised effect θ below :data:`NEGLIGIBLE_SHARE` for "does not hold"; G1 is
blind to the advantages' signs, so this reads "the labels structure G1". On G2 of every linear layer
(:func:`zero_sum_g2_weighting`): its stable rank under A relative to weightings that are not zero-sum, below 0 or
within ± :data:`EQUIVALENCE_REL`. Both read a probe.json.
"""

from __future__ import annotations

import math
from typing import Any

from grpo_lens.claims.base import (
    CLAIMS,
    DOES_NOT_HOLD,
    HOLDS,
    INCONCLUSIVE,
    MIN_GROUPS,
    Claim,
    band_verdict,
    ci_text,
    fmt,
    source_of,
    verdict_from_interval,
)
from grpo_lens.formulas.stats import bootstrap_ci, mean_interval
from grpo_lens.metrics import (
    PROBE_G2_WEIGHTINGS,
    PROBE_GROUPS,
    PROBE_SUMMARY,
    RANK_G2_WEIGHTED,
    ZERO_SUM_COS_GAP_EXCESS,
    ZERO_SUM_SPAN_ENERGY,
    ZERO_SUM_SPAN_ENERGY_EXCESS,
    ZERO_SUM_SPAN_ENERGY_NULL,
    ZERO_SUM_SPAN_ENERGY_NULL_VAR,
    ZERO_SUM_SPAN_ENERGY_P,
)

#: the labels capture less than this share of the energy a relabelling leaves outside the class span = no effect
NEGLIGIBLE_SHARE = 0.1

#: one-sided level of the across-group relabelling test (matches the 2.5% per side of the 95% intervals)
TEST_LEVEL = 0.025


def relabelling_test(groups: list[dict[str, Any]], level: float = 0.95) -> dict[str, Any]:
    """The across-group relabelling test of the span energy and its normalised effect (docs/theory.md §11).

    Relabelling every group at once (k fixed, each labelling of a group equally likely under H0 "the labels carry no
    information about the gradients") makes T = Σ_g x_g (x_g = ``zero_sum/span_energy_excess``) a sum of independent
    mean-zero terms with the exactly enumerated variances v_g (``zero_sum/span_energy_null_var``); the p-value is
    the one-sided normal tail of z = T / sqrt(Σ v_g) (the permutation distribution's first two moments are exact;
    its normal shape is the approximation, whose level `grpo-lens calibrate` measures). The effect
    θ = Σ x_g / Σ (1 − m_g), m_g = ``zero_sum/span_energy_null``: the share of the energy a relabelling leaves outside
    the class span that the true labels capture, with the linearised (ratio) interval of u_g = x_g − θ(1 − m_g).

    Returns {"n", "z", "p", "theta", "lo", "hi"} (None where undefined).
    """
    rows = [g for g in groups if g.get(ZERO_SUM_SPAN_ENERGY_EXCESS) is not None
            and g.get(ZERO_SUM_SPAN_ENERGY_NULL_VAR) is not None and g.get(ZERO_SUM_SPAN_ENERGY_NULL) is not None]
    out: dict[str, Any] = {"n": len(rows), "z": None, "p": None, "theta": None, "lo": None, "hi": None}
    if not rows:
        return out
    x = [float(g[ZERO_SUM_SPAN_ENERGY_EXCESS]) for g in rows]
    v = sum(float(g[ZERO_SUM_SPAN_ENERGY_NULL_VAR]) for g in rows)
    room = [1 - float(g[ZERO_SUM_SPAN_ENERGY_NULL]) for g in rows]
    if v > 0:
        out["z"] = sum(x) / math.sqrt(v)
        out["p"] = 0.5 * math.erfc(out["z"] / math.sqrt(2))
    if sum(room) > 0:
        theta = sum(x) / sum(room)
        u = mean_interval([xi - theta * ri for xi, ri in zip(x, room)], level=level)
        mean_room = sum(room) / len(room)
        out["theta"] = theta
        if u["lo"] is not None:
            out["lo"], out["hi"] = theta + u["lo"] / mean_room, theta + u["hi"] / mean_room
    return out


@CLAIMS.register("zero_sum_rank_two")
def zero_sum_rank_two(probe: dict[str, Any]) -> list[Claim]:
    """"The reward labels structure G1" (the G1 reading of "the rank-2 structure comes from the zero-sum
    advantages"): do the labels concentrate G1's energy in span{gbar_C, gbar_W} beyond relabellings with k fixed?

    G1's spectrum and the span energy use A_i² only, and a relabelling keeps Σ w = 0, so this row tests that the
    reward labels structure the gradients, not that the advantages sum to zero; the sign-sensitive reading is the G2
    row (:func:`zero_sum_g2_weighting`).

    Rule (per R, :func:`relabelling_test`): inconclusive for R = 2 (both labellings span the same plane) or fewer
    than :data:`MIN_GROUPS` groups; holds if the across-group test's one-sided p < :data:`TEST_LEVEL`; does not hold
    if θ's interval lies below :data:`NEGLIGIBLE_SHARE`; inconclusive otherwise.
    """
    out = []
    src = source_of(probe)
    for r in sorted(probe.get("per_group_size", {}), key=int):
        d = probe["per_group_size"][r]
        summ = d.get(PROBE_SUMMARY, {})
        groups = d.get(PROBE_GROUPS, []) or []
        t = relabelling_test(groups)
        n = t["n"]
        if int(r) == 2:
            verdict, why = INCONCLUSIVE, "R = 2: both labellings span the same plane (excess 0 by construction)"
        elif n < MIN_GROUPS or t["p"] is None:
            verdict, why = INCONCLUSIVE, f"{n} groups < {MIN_GROUPS}"
        elif t["p"] < TEST_LEVEL:
            verdict, why = HOLDS, (f"across-group relabelling test z = {fmt(t['z'])}, one-sided p {t['p']:.2g} "
                                   f"< {TEST_LEVEL}")
        elif t["hi"] is not None and t["hi"] < NEGLIGIBLE_SHARE:
            verdict, why = DOES_NOT_HOLD, (f"theta interval below {NEGLIGIBLE_SHARE} (upper end {fmt(t['hi'], 3)}): "
                                           f"the labels capture a negligible share")
        else:
            verdict, why = INCONCLUSIVE, (f"relabelling test p {fmt(t['p'], 3)} >= {TEST_LEVEL} and theta's interval "
                                          f"reaches {NEGLIGIBLE_SHARE}")
        ps = [g[ZERO_SUM_SPAN_ENERGY_P] for g in groups if g.get(ZERO_SUM_SPAN_ENERGY_P) is not None]
        cg = summ.get(ZERO_SUM_COS_GAP_EXCESS) or {}
        theta_txt = ("–" if t["theta"] is None else
                     f"{fmt(t['theta'], 3)}" + ("" if t["lo"] is None else f" [{fmt(t['lo'], 3)}, {fmt(t['hi'], 3)}]"))
        out.append(Claim(
            claim="the reward labels structure G1 (G1 reading of: rank 2 comes from the zero-sum advantages)",
            scope=f"R = {r}",
            measurement=(f"span energy {ci_text(summ.get(ZERO_SUM_SPAN_ENERGY), 3)}; excess over relabelling "
                         f"{ci_text(summ.get(ZERO_SUM_SPAN_ENERGY_EXCESS), 3)}; normalised effect theta {theta_txt}; "
                         f"cos-gap excess {ci_text(cg, 3)}"),
            control=(f"relabellings with k fixed: span energy {ci_text(summ.get(ZERO_SUM_SPAN_ENERGY_NULL), 3)}; "
                     f"groups with permutation p < 0.05: {sum(p < 0.05 for p in ps)}/{len(ps)}; G1 is blind to the "
                     f"advantages' signs (this row does not test sum A = 0)"),
            verdict=verdict, rule=why, source=src))
    return out


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
    for r in sorted(probe.get("per_group_size", {}), key=int):
        rows = ((probe["per_group_size"][r].get(PROBE_G2_WEIGHTINGS) or {}).get(PROBE_GROUPS)) or []
        ds, adv_sr, other_sr = [], [], []
        for row in rows:
            parsed = [RANK_G2_WEIGHTED.parse(k) for k in row]
            types = sorted({p["kind"] for p in parsed if p is not None and p["w"] == "adv"})
            if not types:
                continue
            a = sum(row[RANK_G2_WEIGHTED.format(w="adv", kind=t)] for t in types) / len(types)
            o = sum(row[RANK_G2_WEIGHTED.format(w=w, kind=t)] for t in types for w in NOT_ZERO_SUM) / (
                len(types) * len(NOT_ZERO_SUM))
            ds.append((a - o) / o if o > 0 else float("nan"))
            adv_sr.append(a)
            other_sr.append(o)
        if not ds:
            continue
        ci = bootstrap_ci(ds)
        n = ci["n"]
        below_zero = verdict_from_interval(ci["lo"], ci["hi"], 0.0, "below")
        no_difference = band_verdict(ci["lo"], ci["hi"], -EQUIVALENCE_REL, EQUIVALENCE_REL)
        if n < MIN_GROUPS or ci["lo"] is None:
            verdict, why = INCONCLUSIVE, f"{n} group(s) with G2 of every layer < {MIN_GROUPS} (raise --g2-groups)"
        elif below_zero == HOLDS:
            verdict, why = HOLDS, f"difference interval below 0 (upper end {fmt(ci['hi'])})"
        elif no_difference == HOLDS:
            verdict, why = DOES_NOT_HOLD, (f"relative difference interval inside ±{fmt(EQUIVALENCE_REL)}: A makes no "
                                           f"difference")
        elif below_zero == DOES_NOT_HOLD:
            verdict, why = DOES_NOT_HOLD, "difference interval above 0: A gives a higher rank"
        else:
            verdict, why = INCONCLUSIVE, "difference interval includes 0 and differences beyond the equivalence margin"
        out.append(Claim(
            claim="rank-2 structure comes from the zero-sum advantages (G2, every layer)", scope=f"R = {r}",
            measurement=(f"G2 stable rank under A, mean over layer types: {fmt(sum(adv_sr) / len(adv_sr))}; "
                         f"(A − not-zero-sum) / not-zero-sum {ci_text(ci, 3)}"),
            control=f"weightings |A|, A + mean|A|, r, 1: {fmt(sum(other_sr) / len(other_sr))}",
            verdict=verdict, rule=why, source=src))
    return out
