"""The claims that GRPO's rank-2 structure comes from its zero-sum advantages (docs/theory.md §11, on the tests of §6).

On G1 (:func:`zero_sum_rank_two`): the excess span energy of the true labels over relabellings with k fixed, mean
over groups with its 95% interval, above 0 or below :data:`NEGLIGIBLE_SHARE`. On G2 of every linear layer
(:func:`zero_sum_g2_weighting`): its stable rank under A minus under weightings that are not zero-sum, below 0 or
within ± :data:`EQUIVALENCE_RANK`. Both read a probe.json.
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
from grpo_lens.formulas.stats import bootstrap_ci
from grpo_lens.metrics import (
    PROBE_G2_WEIGHTINGS,
    PROBE_GROUPS,
    PROBE_SUMMARY,
    RANK_G2_WEIGHTED,
    ZERO_SUM_COS_GAP_EXCESS,
    ZERO_SUM_SPAN_ENERGY,
    ZERO_SUM_SPAN_ENERGY_EXCESS,
    ZERO_SUM_SPAN_ENERGY_NULL,
    ZERO_SUM_SPAN_ENERGY_P,
)

#: an excess span energy below this share of G1's energy counts as no effect.
NEGLIGIBLE_SHARE = 0.02


@CLAIMS.register("zero_sum_rank_two")
def zero_sum_rank_two(probe: dict[str, Any]) -> list[Claim]:
    """"The rank-2 structure comes from the zero-sum advantages": do the reward labels concentrate the gradient energy
    in span{gbar_C, gbar_W} beyond what relabelling the same group (k fixed) gives?

    Rule (per R, on the excess span energy d = E(true labels) - mean E(relabellings), mean over groups with its 95%
    interval): inconclusive for R = 2 (the span is the same for both labellings: d = 0 always) or fewer than
    :data:`MIN_GROUPS` groups; holds if the interval's lower end > 0; does not hold if its upper end <
    :data:`NEGLIGIBLE_SHARE` (any effect is negligible); inconclusive otherwise.
    """
    out = []
    src = source_of(probe)
    for r in sorted(probe.get("per_group_size", {}), key=int):
        d = probe["per_group_size"][r]
        summ = d.get(PROBE_SUMMARY, {})
        ex = summ.get(ZERO_SUM_SPAN_ENERGY_EXCESS) or {}
        n = ex.get("n", 0) or 0
        above_zero = verdict_from_interval(ex.get("lo"), ex.get("hi"), 0.0, "above")
        negligible = verdict_from_interval(ex.get("lo"), ex.get("hi"), NEGLIGIBLE_SHARE, "below")
        if int(r) == 2:
            verdict, why = INCONCLUSIVE, "R = 2: both labellings span the same plane (excess 0 by construction)"
        elif n < MIN_GROUPS or ex.get("lo") is None:
            verdict, why = INCONCLUSIVE, f"{n} groups < {MIN_GROUPS}"
        elif above_zero == HOLDS:
            verdict, why = HOLDS, f"excess interval above 0 (lower end {fmt(ex['lo'], 3)})"
        elif negligible == HOLDS:
            verdict, why = DOES_NOT_HOLD, (f"excess interval below {NEGLIGIBLE_SHARE} (upper end "
                                           f"{fmt(ex['hi'], 3)}): the labels add no energy to the span")
        else:
            verdict, why = INCONCLUSIVE, "excess interval includes 0 and effects above the negligible share"
        ps = [g[ZERO_SUM_SPAN_ENERGY_P] for g in d.get(PROBE_GROUPS, []) if g.get(ZERO_SUM_SPAN_ENERGY_P) is not None]
        cg = summ.get(ZERO_SUM_COS_GAP_EXCESS) or {}
        out.append(Claim(
            claim="rank-2 structure comes from the zero-sum advantages", scope=f"R = {r}",
            measurement=(f"span energy {ci_text(summ.get(ZERO_SUM_SPAN_ENERGY), 3)}; excess over relabelling "
                         f"{ci_text(ex, 3)}; cos-gap excess {ci_text(cg, 3)}"),
            control=(f"relabellings with k fixed: span energy {ci_text(summ.get(ZERO_SUM_SPAN_ENERGY_NULL), 3)}; "
                     f"groups with permutation p < 0.05: {sum(p < 0.05 for p in ps)}/{len(ps)}"),
            verdict=verdict, rule=why, source=src))
    return out


#: G2 stable ranks within this of each other count as "no difference" between weightings.
EQUIVALENCE_RANK = 0.25


NOT_ZERO_SUM = ("abs", "shift", "reward", "uniform")


@CLAIMS.register("zero_sum_g2_weighting")
def zero_sum_g2_weighting(probe: dict[str, Any]) -> list[Claim]:
    """The same claim seen on G2 (every nn.Linear layer's weight gradient of the group loss): is G2's rank under the
    zero-sum advantages A lower than under the weightings that are not zero-sum (|A|, A + mean|A|, r, 1)?

    Per group: d = mean over layer types of [stable rank under A − mean over those four weightings of the stable
    rank]. Rule (per R, mean of d over the groups with G2 of every layer, 95% interval): inconclusive with fewer than
    :data:`MIN_GROUPS` groups (raise ``--g2-groups``); holds if the interval lies below 0; does not hold if it lies
    inside ± :data:`EQUIVALENCE_RANK` (A makes no difference) or above 0; inconclusive otherwise.
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
            ds.append(a - o)
            adv_sr.append(a)
            other_sr.append(o)
        if not ds:
            continue
        ci = bootstrap_ci(ds)
        n = ci["n"]
        below_zero = verdict_from_interval(ci["lo"], ci["hi"], 0.0, "below")
        no_difference = band_verdict(ci["lo"], ci["hi"], -EQUIVALENCE_RANK, EQUIVALENCE_RANK)
        if n < MIN_GROUPS or ci["lo"] is None:
            verdict, why = INCONCLUSIVE, f"{n} group(s) with G2 of every layer < {MIN_GROUPS} (raise --g2-groups)"
        elif below_zero == HOLDS:
            verdict, why = HOLDS, f"difference interval below 0 (upper end {fmt(ci['hi'])})"
        elif no_difference == HOLDS:
            verdict, why = DOES_NOT_HOLD, f"difference interval inside ±{EQUIVALENCE_RANK}: A makes no difference"
        elif below_zero == DOES_NOT_HOLD:
            verdict, why = DOES_NOT_HOLD, "difference interval above 0: A gives a higher rank"
        else:
            verdict, why = INCONCLUSIVE, "difference interval includes 0 and differences beyond the equivalence margin"
        out.append(Claim(
            claim="rank-2 structure comes from the zero-sum advantages (G2, every layer)", scope=f"R = {r}",
            measurement=(f"G2 stable rank under A, mean over layer types: {fmt(sum(adv_sr) / len(adv_sr))}; "
                         f"A minus not-zero-sum weightings {ci_text(ci)}"),
            control=f"weightings |A|, A + mean|A|, r, 1: {fmt(sum(other_sr) / len(other_sr))}",
            verdict=verdict, rule=why, source=src))
    return out
