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

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable

from grpo_lens.diagnostics.stats import MIN_INTERVAL_UNITS
from grpo_lens.registry import Registry

HOLDS, DOES_NOT_HOLD, INCONCLUSIVE = "holds", "does not hold", "inconclusive"
VERDICTS = (HOLDS, DOES_NOT_HOLD, INCONCLUSIVE)

#: "effective rank ≈ 2" means erank within 2 ± this (the paper gives no tolerance; docs/theory.md §11).
ERANK_BAND = 0.5
#: fewest analysed groups for a verdict other than inconclusive.
MIN_GROUPS = MIN_INTERVAL_UNITS
#: the identity holds when every group's relative residual is below this (float32 round-off is ~1e-7).
IDENTITY_TOLERANCE = 1e-4
#: an excess span energy below this share of G1's energy counts as no effect.
NEGLIGIBLE_SHARE = 0.02


@dataclass(frozen=True)
class Claim:
    """One claim tested on one scope (e.g. one group size R).

    Attributes:
        claim: the paper's statement, short.
        scope: where it was tested ("R = 4", "all R").
        measurement: the number(s) with their 95% interval, as text.
        control: the null or control the measurement is compared with, with its number(s).
        verdict: one of :data:`VERDICTS`.
        rule: the decision rule that produced the verdict, with the inputs that decided it.
        source: where the gradients came from ("exact gradients" or the sketch and what it covers).
    """

    claim: str
    scope: str
    measurement: str
    control: str
    verdict: str
    rule: str
    source: str

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"unknown verdict {self.verdict!r}; valid: {', '.join(VERDICTS)}")

    def to_dict(self) -> dict[str, str]:
        """The record as a plain dict (for JSON)."""
        return asdict(self)


ClaimFn = Callable[[dict[str, Any]], list[Claim]]
CLAIMS: Registry[ClaimFn] = Registry("claim")


def _fmt(x: float | None, nd: int = 2) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{x:.{nd}f}"


def _ci_text(s: dict[str, Any] | None, nd: int = 2) -> str:
    if not s or s.get("mean") is None:
        return "not measured"
    if s.get("lo") is None:
        return f"{_fmt(s['mean'], nd)} (n = {s.get('n')} groups, too few for an interval)"
    return f"{_fmt(s['mean'], nd)} [{_fmt(s['lo'], nd)}, {_fmt(s['hi'], nd)}] (n = {s['n']} groups)"


def source_of(probe: dict[str, Any]) -> str:
    """'exact gradients of every parameter' or the sketch's description (what it covers), from probe.json meta."""
    meta = probe.get("meta", {})
    if meta.get("gradients") == "exact":
        return "exact gradients of every parameter"
    cov = meta.get("sketch_coverage")
    cov_txt = f", covering {_fmt(cov, 2)} of ||g||^2" if isinstance(cov, (int, float)) else ""
    return f"sketch ({meta.get('sketch_dim')} per side per nn.Linear weight{cov_txt}), not exact"


def band_verdict(lo: float | None, hi: float | None, low: float, high: float) -> str:
    """An equivalence verdict (docs/theory.md §11, §12): holds if [lo, hi] lies inside [low, high]; does not hold if it
    lies wholly outside it; inconclusive otherwise or when the interval is missing or not finite (a wide interval
    that merely contains the control is no evidence for it)."""
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return INCONCLUSIVE
    if low <= lo and hi <= high:
        return HOLDS
    if hi < low or lo > high:
        return DOES_NOT_HOLD
    return INCONCLUSIVE


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
                                          f"{_fmt(ratio.get('hi'))} >= 1: the row norms alone give this rank")
        elif band == DOES_NOT_HOLD:
            verdict, why = DOES_NOT_HOLD, f"interval outside 2 ± {ERANK_BAND}"
        else:
            verdict, why = INCONCLUSIVE, f"interval overlaps the edge of 2 ± {ERANK_BAND}"
        sr = summ.get("rank/g1_stable_rank") or {}
        out.append(Claim(
            claim="effective rank of the per-rollout gradient matrix ≈ 2", scope=f"R = {r}",
            measurement=f"erank(G1) {_ci_text(g1)}; stable rank {_ci_text(sr)}",
            control=f"orthogonal null erank {_ci_text(null)}; ratio G1/null {_ci_text(ratio)}",
            verdict=verdict, rule=why, source=src))
    return out


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
        summ = d.get("summary", {})
        ex = summ.get("zero_sum/span_energy_excess") or {}
        n = ex.get("n", 0) or 0
        if int(r) == 2:
            verdict, why = INCONCLUSIVE, "R = 2: both labellings span the same plane (excess 0 by construction)"
        elif n < MIN_GROUPS or ex.get("lo") is None:
            verdict, why = INCONCLUSIVE, f"{n} groups < {MIN_GROUPS}"
        elif ex["lo"] > 0:
            verdict, why = HOLDS, f"excess interval above 0 (lower end {_fmt(ex['lo'], 3)})"
        elif ex["hi"] < NEGLIGIBLE_SHARE:
            verdict, why = DOES_NOT_HOLD, (f"excess interval below {NEGLIGIBLE_SHARE} (upper end "
                                           f"{_fmt(ex['hi'], 3)}): the labels add no energy to the span")
        else:
            verdict, why = INCONCLUSIVE, "excess interval includes 0 and effects above the negligible share"
        ps = [g["zero_sum/span_energy_p"] for g in d.get("groups", []) if g.get("zero_sum/span_energy_p") is not None]
        cg = summ.get("zero_sum/cos_gap_excess") or {}
        out.append(Claim(
            claim="rank-2 structure comes from the zero-sum advantages", scope=f"R = {r}",
            measurement=(f"span energy {_ci_text(summ.get('zero_sum/span_energy'), 3)}; excess over relabelling "
                         f"{_ci_text(ex, 3)}; cos-gap excess {_ci_text(cg, 3)}"),
            control=(f"relabellings with k fixed: span energy {_ci_text(summ.get('zero_sum/span_energy_null'), 3)}; "
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
    from grpo_lens.diagnostics.stats import bootstrap_ci

    out = []
    src = source_of(probe) + "; G2 is exact (autograd weight gradients)"
    for r in sorted(probe.get("per_group_size", {}), key=int):
        rows = ((probe["per_group_size"][r].get("g2_weightings") or {}).get("groups")) or []
        ds, adv_sr, other_sr = [], [], []
        for row in rows:
            types = sorted({k[len("rank/g2_adv_"):-len("_stable_rank")] for k in row
                            if k.startswith("rank/g2_adv_") and k.endswith("_stable_rank")})
            if not types:
                continue
            a = sum(row[f"rank/g2_adv_{t}_stable_rank"] for t in types) / len(types)
            o = sum(row[f"rank/g2_{w}_{t}_stable_rank"] for t in types for w in NOT_ZERO_SUM) / (len(types)
                                                                                               * len(NOT_ZERO_SUM))
            ds.append(a - o)
            adv_sr.append(a)
            other_sr.append(o)
        if not ds:
            continue
        ci = bootstrap_ci(ds)
        n = ci["n"]
        if n < MIN_GROUPS or ci["lo"] is None:
            verdict, why = INCONCLUSIVE, f"{n} group(s) with G2 of every layer < {MIN_GROUPS} (raise --g2-groups)"
        elif ci["hi"] < 0:
            verdict, why = HOLDS, f"difference interval below 0 (upper end {_fmt(ci['hi'])})"
        elif -EQUIVALENCE_RANK <= ci["lo"] and ci["hi"] <= EQUIVALENCE_RANK:
            verdict, why = DOES_NOT_HOLD, f"difference interval inside ±{EQUIVALENCE_RANK}: A makes no difference"
        elif ci["lo"] > 0:
            verdict, why = DOES_NOT_HOLD, "difference interval above 0: A gives a higher rank"
        else:
            verdict, why = INCONCLUSIVE, "difference interval includes 0 and differences beyond the equivalence margin"
        out.append(Claim(
            claim="rank-2 structure comes from the zero-sum advantages (G2, every layer)", scope=f"R = {r}",
            measurement=(f"G2 stable rank under A, mean over layer types: {_fmt(sum(adv_sr) / len(adv_sr))}; "
                         f"A minus not-zero-sum weightings {_ci_text(ci)}"),
            control=f"weightings |A|, A + mean|A|, r, 1: {_fmt(sum(other_sr) / len(other_sr))}",
            verdict=verdict, rule=why, source=src))
    return out


@CLAIMS.register("identity")
def identity_claim(probe: dict[str, Any]) -> list[Claim]:
    """"sum_i A_i g_i = c(k, R)(gbar_C - gbar_W)": the identity's residual over every mixed 0/1 group.

    Rule: inconclusive when no group has a residual (non-0/1 rewards or an estimator without the decomposition);
    holds if the largest residual < :data:`IDENTITY_TOLERANCE`; does not hold otherwise. Control: the residual the
    other std convention's constant would leave, |1 - c_other / c| (shows the check can fail; grpo only).
    """
    meta = probe.get("meta", {})
    rows = [g for d in probe.get("per_group_size", {}).values() for g in d.get("groups", [])]
    res = [g["grad/identity_residual"] for g in rows if g.get("grad/identity_residual") is not None]
    control = "—"
    if meta.get("estimator", "grpo") == "grpo":
        from grpo_lens.diagnostics.identity import rank2_constant

        std = meta.get("std", "sample")
        other = "population" if std == "sample" else "sample"
        eps = float(meta.get("eps", 1e-4))
        gaps = [abs(1 - rank2_constant(int(g["group/correct"]), int(g["group/size"]), other, eps)
                    / rank2_constant(int(g["group/correct"]), int(g["group/size"]), std, eps))
                for g in rows if g.get("grad/identity_residual") is not None and "group/size" in g]
        if gaps:
            control = (f"with the {other}-std constant instead the residual would be {_fmt(min(gaps), 3)}–"
                       f"{_fmt(max(gaps), 3)}")
    if not res:
        verdict, why, meas = INCONCLUSIVE, "no group with 0/1 rewards and a decomposition", "not measured"
    else:
        worst = max(res)
        verdict = HOLDS if worst < IDENTITY_TOLERANCE else DOES_NOT_HOLD
        why = f"max residual {worst:.1e} {'<' if verdict == HOLDS else '>='} {IDENTITY_TOLERANCE:.0e}"
        meas = f"relative residual max {worst:.1e} over {len(res)} groups (estimator {meta.get('estimator', 'grpo')})"
    return [Claim(claim="the group update is c(k,R)(gbar_C − gbar_W) (the rank-2 identity)", scope="all R",
                  measurement=meas, control=control, verdict=verdict, rule=why, source=source_of(probe))]


def evaluate_claims(probe: dict[str, Any], names: list[str] | None = None) -> list[Claim]:
    """Every registered claim (or the named ones) evaluated on one probe.json dict, in name order.

    Raises:
        ValueError: an unknown claim name (listing the valid ones).
    """
    out: list[Claim] = []
    for name in names or CLAIMS.names():
        out += CLAIMS.get(name)(probe)
    return out


# The sparsity, credit and baseline claims (issue 10) register themselves in CLAIMS on import.
from grpo_lens import claims_measures  # noqa: E402,F401
