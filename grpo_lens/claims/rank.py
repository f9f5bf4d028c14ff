"""The claim "effective rank ≈ 2 for R in {2, 4, 8}" (docs/theory.md §11), one verdict per rank measure.

Three measures, each with a band fixed before any data (docs/theory.md §11) and the same structure test:

- ``top2_share`` (the headline, "k90 = 2"): the top two directions hold >= :data:`TOP_SHARE` of G1's energy and the
  top one alone less: the mean top-2 share's interval above 0.9 and the mean top-1 share's interval below 0.9.
- ``erank`` (entropy effective rank) and ``stable_rank``: the mean's interval inside [1.5, 2.5] (the values that round
  to 2; :data:`RANK_BAND`).

Structure (all three): the per-group reduction d = null − G1 (erank, stable rank) or G1 − null (top-2 share), null =
the simulated null of G1's row norms with random directions in R^P when the rows carry it
(``rank/g1_simnull_<m>``, :func:`grpo_lens.formulas.spectrum.simulated_null_measures`), else the orthogonal null
(its P → ∞ limit). "Structure" = the interval of mean d above 0; "no structure" = it lies inside ± the measure's
:data:`NO_STRUCTURE_MARGIN`. Today's ratio G1/null < 1 is reported as a number only: it is below 1 for every
matrix whose rows are not exactly orthogonal (Schur majorisation, docs/theory.md §11), so it cannot fail.
"""

from __future__ import annotations

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
from grpo_lens.formulas.stats import mean_interval
from grpo_lens.metrics import (
    PROBE_GROUPS,
    RANK_G1,
    RANK_G1_NULL,
    RANK_G1_SIMNULL,
    RANK_G1_VS_NULL,
)

#: "≈ 2" for erank and stable rank: the values that round to 2 (the paper gives no tolerance; docs/theory.md §11).
RANK_BAND = (1.5, 2.5)

#: 0.1 name: the band's half-width.
ERANK_BAND = 0.5

#: "k90 = 2": the top two directions hold at least this share of the energy and the top one alone less.
TOP_SHARE = 0.9

#: the measures with a verdict, headline first
RANK_CLAIM_MEASURES = ("top2_share", "erank", "stable_rank")

#: |mean reduction| below this (the band's half-width; 1 − TOP_SHARE for the top-2 share) = no structure.
NO_STRUCTURE_MARGIN = {"top2_share": 1 - TOP_SHARE, "erank": ERANK_BAND, "stable_rank": ERANK_BAND}

_NAMES = {"top2_share": "top-2 energy share (k90 = 2)", "erank": "entropy effective rank",
          "stable_rank": "stable rank"}


def _values(groups: list[dict[str, Any]], key: str) -> list[float]:
    return [float(g[key]) for g in groups if g.get(key) is not None]


def reductions(groups: list[dict[str, Any]], measure: str) -> tuple[list[float], str]:
    """Per-group structure reduction of ``measure`` (positive = more shared direction than the null) and the null
    it was taken against ("simulated" or "orthogonal")."""
    sim = all(g.get(RANK_G1_SIMNULL.format(m=measure)) is not None for g in groups) and groups
    null_key = (RANK_G1_SIMNULL if sim else RANK_G1_NULL).format(m=measure)
    sign = 1.0 if measure == "top2_share" else -1.0
    out = [sign * (float(g[RANK_G1.format(m=measure)]) - float(g[null_key])) for g in groups
           if g.get(RANK_G1.format(m=measure)) is not None and g.get(null_key) is not None]
    return out, "simulated" if sim else "orthogonal"


def rank_verdict(groups: list[dict[str, Any]], measure: str, level: float = 0.95) -> tuple[str, str, dict]:
    """(verdict, the rule's reason, the numbers) of "rank ≈ 2" under ``measure`` on one R's per-group rows.

    Rule (docs/theory.md §11): does not hold if the band interval lies outside the band or the structure reduction's
    interval lies inside ± :data:`NO_STRUCTURE_MARGIN`; holds if the band interval lies inside and the reduction's
    interval above 0; inconclusive otherwise or with fewer than :data:`MIN_GROUPS` groups. Intervals: Hall's t at
    ``level`` over groups (:func:`grpo_lens.formulas.stats.mean_interval`).
    """
    red, null_name = reductions(groups, measure)
    d = mean_interval(red, level=level)
    h = NO_STRUCTURE_MARGIN[measure]
    nums: dict[str, Any] = {"reduction": d, "null": null_name}
    if measure == "top2_share":
        top2 = mean_interval(_values(groups, RANK_G1.format(m="top2_share")), level=level, bounds=(0.0, 1.0))
        top1 = mean_interval(_values(groups, RANK_G1.format(m="top1_share")), level=level, bounds=(0.0, 1.0))
        nums.update(value=top2, top1=top1)
        if top2["lo"] is None or top1["lo"] is None:
            band = INCONCLUSIVE
        elif top2["lo"] > TOP_SHARE and top1["hi"] < TOP_SHARE:
            band = HOLDS
        elif top2["hi"] < TOP_SHARE or top1["lo"] > TOP_SHARE:
            band = DOES_NOT_HOLD
        else:
            band = INCONCLUSIVE
        band_text = f"top-2 share > {TOP_SHARE} > top-1 share"
    else:
        value = mean_interval(_values(groups, RANK_G1.format(m=measure)), level=level)
        nums.update(value=value)
        band = band_verdict(value["lo"], value["hi"], *RANK_BAND)
        band_text = f"inside [{RANK_BAND[0]}, {RANK_BAND[1]}]"
    structure = verdict_from_interval(d["lo"], d["hi"], 0.0, "above")
    none_ = band_verdict(d["lo"], d["hi"], -h, h)
    n = d["n"]
    if n < MIN_GROUPS:
        return INCONCLUSIVE, f"{n} groups < {MIN_GROUPS}", nums
    if band == DOES_NOT_HOLD:
        return DOES_NOT_HOLD, f"interval not {band_text}", nums
    if none_ == HOLDS:
        return DOES_NOT_HOLD, (f"no structure: the reduction against the {null_name} null lies inside ±{fmt(h)} "
                               f"(the row norms alone give this rank)"), nums
    if band == HOLDS and structure == HOLDS:
        return HOLDS, f"interval {band_text} and the reduction against the {null_name} null above 0", nums
    if band == HOLDS:
        return INCONCLUSIVE, f"interval {band_text} but the reduction against the null is not above 0", nums
    return INCONCLUSIVE, f"interval overlaps the edge of '{band_text}'", nums


@CLAIMS.register("erank_near_two")
def erank_near_two(probe: dict[str, Any]) -> list[Claim]:
    """"Effective rank ≈ 2 for R in {2, 4, 8}": one row per R and measure of :data:`RANK_CLAIM_MEASURES`, decided by
    :func:`rank_verdict`; inconclusive for R = 2 (G1 has two rows: every measure is "≈ 2" by construction)."""
    out = []
    src = source_of(probe)
    for r in sorted(probe.get("per_group_size", {}), key=int):
        d = probe["per_group_size"][r]
        groups = d.get(PROBE_GROUPS) or []
        summ = d.get("summary", {})
        for m in RANK_CLAIM_MEASURES:
            verdict, why, nums = rank_verdict(groups, m)
            if int(r) == 2:
                verdict, why = INCONCLUSIVE, "R = 2: G1 has two rows, so it has rank <= 2 whatever the gradients"
            ratio = summ.get(RANK_G1_VS_NULL.format(m=m)) or {}
            meas = f"{_NAMES[m]} {ci_text(nums['value'], 3 if m == 'top2_share' else 2)}"
            if m == "top2_share":
                meas += f"; top-1 share {ci_text(nums['top1'], 3)}"
            out.append(Claim(
                claim=f"effective rank of the per-rollout gradient matrix ≈ 2 ({_NAMES[m]})", scope=f"R = {r}",
                measurement=meas,
                control=(f"structure reduction against the {nums['null']} null {ci_text(nums['reduction'], 3)} "
                         f"(no structure within ±{fmt(NO_STRUCTURE_MARGIN[m])}); ratio G1/orthogonal null "
                         f"{fmt(ratio.get('mean'))} ({'above' if m == 'top2_share' else 'below'} 1 for any "
                         f"non-orthogonal rows: not a test)"),
                verdict=verdict, rule=why, source=src))
    return out


@CLAIMS.register("rank_stays_near_two")
def rank_stays_near_two(data: dict[str, Any]) -> list[Claim]:
    """"The effective rank stays near 2 as training goes on", on a training run's lens records (``{"records":
    [...]}``; [] without lens rank numbers).

    Rule (the top-2 reading of :func:`rank_verdict` over lens steps instead of groups): the lens step's mean top-2 and
    top-1 energy shares are the units; holds if the interval over lens steps of the mean top-2 share lies above
    :data:`TOP_SHARE` and that of the top-1 share below it; does not hold if the top-2 interval lies below it or the
    top-1 interval above it; inconclusive otherwise or with fewer than :data:`MIN_GROUPS` lens steps. Consecutive
    lens steps share a slowly changing policy, so the interval describes the spread over this run's steps, not a
    rerun with another seed.
    """
    rows = [r for r in data.get("records") or [] if r.get(RANK_G1.format(m="top2_share")) is not None
            and r.get(RANK_G1.format(m="top1_share")) is not None]
    if not rows:
        return []
    top2 = mean_interval(_values(rows, RANK_G1.format(m="top2_share")), bounds=(0.0, 1.0))
    top1 = mean_interval(_values(rows, RANK_G1.format(m="top1_share")), bounds=(0.0, 1.0))
    erank = mean_interval(_values(rows, RANK_G1.format(m="erank")))
    if top2["lo"] is None:
        verdict, why = INCONCLUSIVE, f"{len(rows)} lens steps < {MIN_GROUPS}"
    elif top2["lo"] > TOP_SHARE and top1["hi"] < TOP_SHARE:
        verdict, why = HOLDS, f"over lens steps: top-2 share > {TOP_SHARE} > top-1 share"
    elif top2["hi"] < TOP_SHARE or top1["lo"] > TOP_SHARE:
        verdict, why = DOES_NOT_HOLD, f"over lens steps: not top-2 share > {TOP_SHARE} > top-1 share"
    else:
        verdict, why = INCONCLUSIVE, f"an interval over lens steps overlaps {TOP_SHARE}"
    return [Claim(claim="the effective rank of G1 stays ≈ 2 over training (top-2 energy share, k90 = 2)",
                  scope=f"training, {len(rows)} lens steps (steps {rows[0].get('step')}–{rows[-1].get('step')})",
                  measurement=(f"top-2 share {ci_text(top2, 3, 'lens steps')}; top-1 share "
                               f"{ci_text(top1, 3, 'lens steps')}; erank {ci_text(erank, 2, 'lens steps')}"),
                  control=f"the band: top-2 share > {TOP_SHARE} > top-1 share",
                  verdict=verdict, rule=why, source="lens (mean over each lens step's mixed groups)")]
