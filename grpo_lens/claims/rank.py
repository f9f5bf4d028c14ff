"""The paper's claims (arXiv 2606.29238), each tested against a probe's numbers with a verdict computed by a rule.

A claim function takes a probe.json dict and returns :class:`Claim` records; the report prints them at the top
(:func:`grpo_lens.report.claims_section`). Every verdict is one of :data:`VERDICTS` and is decided by the documented
rule of its function from the measurement, its 95% interval over groups and its null or control, never by hand.
Decision rules and their thresholds are stated in docs/theory.md §11 (rank claims, the identity) and §12 (sparsity,
credit, baselines: :mod:`grpo_lens.claims_measures`).

To add a claim: write ``fn(probe) -> list[Claim]`` and register it, e.g.::

    @CLAIMS.register("sparsity_intensifies")
    def sparsity_claim(probe: dict) -> list[Claim]:
        ...
        return [Claim(claim=..., scope=..., measurement=..., control=..., verdict=decide(...), rule=..., source=...)]

Pure functions only: no file access, no model. Functions that need a training run's records instead of a probe can
take the same dict shape and return [] when their inputs are absent.
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
)

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
        summ = d.get("summary", {})
        g1, null, ratio = summ.get("rank/g1_erank") or {}, summ.get("rank/g1_null_erank") or {}, \
            summ.get("rank/g1_erank_vs_null") or {}
        n = g1.get("n", 0) or 0
        band = band_verdict(g1.get("lo"), g1.get("hi"), 2 - ERANK_BAND, 2 + ERANK_BAND)
        below_null = ratio.get("hi") is not None and ratio["hi"] < 1
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
        sr = summ.get("rank/g1_stable_rank") or {}
        out.append(Claim(
            claim="effective rank of the per-rollout gradient matrix ≈ 2", scope=f"R = {r}",
            measurement=f"erank(G1) {ci_text(g1)}; stable rank {ci_text(sr)}",
            control=f"orthogonal null erank {ci_text(null)}; ratio G1/null {ci_text(ratio)}",
            verdict=verdict, rule=why, source=src))
    return out
