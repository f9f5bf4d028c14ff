"""The claim "effective rank ≈ 2 for R in {2, 4, 8}" (docs/theory.md §11): the 95% interval of G1's mean erank per R
inside 2 ± :data:`ERANK_BAND`, and G1's erank below its orthogonal null's (docs/theory.md §5), from a probe.json's
per-R summaries.
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
from grpo_lens.metrics import PROBE_SUMMARY, RANK_G1, RANK_G1_NULL, RANK_G1_VS_NULL

#: "effective rank ≈ 2" means erank within 2 ± this (the paper gives no tolerance; docs/theory.md §11).
ERANK_BAND = 0.5


@CLAIMS.register("erank_near_two")
def erank_near_two(probe: dict[str, Any]) -> list[Claim]:
    """"Effective rank ≈ 2 for R in {2, 4, 8}": G1's erank per R, beside the orthogonal null.

    Rule (per R): inconclusive for R = 2 (G1 has two rows, erank <= 2 by construction) or fewer than
    :data:`MIN_GROUPS` groups. Otherwise, with the 95% interval of mean erank(G1):
    holds if it lies inside 2 ± :data:`ERANK_BAND` AND the interval of erank(G1)/erank(null) lies below 1 (the low rank
    is more than the row norms imply); does not hold if it lies outside 2 ± band; inconclusive otherwise (including
    inside the band but not below the null).
    """
    out = []
    src = source_of(probe)
    for r in sorted(probe.get("per_group_size", {}), key=int):
        d = probe["per_group_size"][r]
        summ = d.get(PROBE_SUMMARY, {})
        g1, null, ratio = summ.get(RANK_G1.format(m="erank")) or {}, summ.get(RANK_G1_NULL.format(m="erank")) or {}, \
            summ.get(RANK_G1_VS_NULL.format(m="erank")) or {}
        n = g1.get("n", 0) or 0
        band = band_verdict(g1.get("lo"), g1.get("hi"), 2 - ERANK_BAND, 2 + ERANK_BAND)
        below_null = verdict_from_interval(ratio.get("lo"), ratio.get("hi"), 1.0, "below") == HOLDS
        if int(r) == 2:
            verdict, why = INCONCLUSIVE, "R = 2: G1 has two rows, so erank <= 2 whatever the gradients (cannot fail)"
        elif n < MIN_GROUPS:
            verdict, why = INCONCLUSIVE, f"{n} groups < {MIN_GROUPS}"
        elif band == HOLDS and below_null:
            verdict, why = HOLDS, f"interval inside 2 ± {ERANK_BAND} and G1/null interval below 1"
        elif band == HOLDS:
            verdict, why = INCONCLUSIVE, (f"interval inside 2 ± {ERANK_BAND} but the G1/null interval reaches "
                                          f"{fmt(ratio.get('hi'))} >= 1: the row norms alone give this rank")
        elif band == DOES_NOT_HOLD:
            verdict, why = DOES_NOT_HOLD, f"interval outside 2 ± {ERANK_BAND}"
        else:
            verdict, why = INCONCLUSIVE, f"interval overlaps the edge of 2 ± {ERANK_BAND}"
        sr = summ.get(RANK_G1.format(m="stable_rank")) or {}
        out.append(Claim(
            claim="effective rank of the per-rollout gradient matrix ≈ 2", scope=f"R = {r}",
            measurement=f"erank(G1) {ci_text(g1)}; stable rank {ci_text(sr)}",
            control=f"orthogonal null erank {ci_text(null)}; ratio G1/null {ci_text(ratio)}",
            verdict=verdict, rule=why, source=src))
    return out
