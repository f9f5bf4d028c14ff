"""What every claim shares: the :class:`Claim` record, the registry :data:`CLAIMS`, the verdicts and the rules.

A claim function takes one dict (a probe.json, or ``{"records": [metrics.jsonl records]}`` of a training run) and
returns :class:`Claim` records; :func:`evaluate_claims` runs the registered ones and the report prints them at the top
(:func:`grpo_lens.report.claims_section`). Every verdict is one of :data:`VERDICTS`, decided by the documented rule of
its function from the measurement, its 95% interval and its null or control, never by hand. The rules come in two
shapes, each decided by one helper: an interval inside or outside a band (an equivalence rule, :func:`band_verdict`)
and an interval above or below one control value (:func:`verdict_from_interval`). :func:`fmt` and :func:`ci_text`
write the numbers into a claim's text. Decision rules and thresholds: docs/theory.md §11 (rank claims, the identity:
:mod:`grpo_lens.claims.rank`, :mod:`grpo_lens.claims.zero_sum`, :mod:`grpo_lens.claims.identity`) and §12 (sparsity,
credit, baselines: :mod:`grpo_lens.claims.sparsity`, :mod:`grpo_lens.claims.credit`, :mod:`grpo_lens.claims.baselines`).

To add a claim: write ``fn(probe) -> list[Claim]`` in the module of its family and register it, e.g.::

    @CLAIMS.register("sparsity_intensifies")
    def sparsity_claim(probe: dict) -> list[Claim]:
        ...
        return [Claim(claim=..., scope=..., measurement=..., control=..., verdict=decide(...), rule=..., source=...)]

Pure functions only: no file access, no model. Functions that need a training run's records instead of a probe take
the same dict shape and return [] when their inputs are absent.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from grpo_lens.formulas.stats import MIN_INTERVAL_UNITS, holm
from grpo_lens.registry import Registry

HOLDS, DOES_NOT_HOLD, INCONCLUSIVE = "holds", "does not hold", "inconclusive"


VERDICTS = (HOLDS, DOES_NOT_HOLD, INCONCLUSIVE)

#: what a row is: a primary claim (tested, under Holm), a check (algebra, with its control) or a descriptive number
KINDS = ("claim", "check", "descriptive")


#: fewest analysed groups for a verdict other than inconclusive.
MIN_GROUPS = MIN_INTERVAL_UNITS


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
        kind: one of :data:`KINDS`: "claim" (a primary claim with a calibrated rule: in the table, under Holm),
            "check" (algebra or an identity with its control: listed under the table, no sampling error) or
            "descriptive" (a number without a calibrated rule: listed, no verdict counted).
        n: the units the rule decided on (groups, lens steps, steps, prompts, rollouts); None when not counted.
        p_holds, p_dnh: one-sided p-values of the two branches (the smallest per-branch level at which the rule
            says *holds* / *does not hold*; 1.0 = not reachable); None for checks and descriptive rows.
        rule_id: the rule's name in the calibration (``grpo_lens/data/calibration_levels.json``).
        advice: for an inconclusive row, what would decide it (a flag of the command and a count it can reach).
        primary: the primary number with its 95% interval, short (the report's first screen); "" = the first clause
            of ``measurement`` (:func:`primary_text`).
    """

    claim: str
    scope: str
    measurement: str
    control: str
    verdict: str
    rule: str
    source: str
    kind: str = "claim"
    n: int | None = None
    p_holds: float | None = None
    p_dnh: float | None = None
    rule_id: str = ""
    advice: str = ""
    primary: str = ""

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"unknown verdict {self.verdict!r}; valid: {', '.join(VERDICTS)}")
        if self.kind not in KINDS:
            raise ValueError(f"unknown kind {self.kind!r}; valid: {', '.join(KINDS)}")

    def to_dict(self) -> dict[str, Any]:
        """The record as a plain dict (for JSON)."""
        return asdict(self)


def primary_text(claim: Claim, width: int = 110) -> str:
    """A claim's primary number with its interval for the first screen: ``claim.primary``, else the first clause of
    its measurement (up to the first "; "), cut at ``width`` characters with "…"."""
    text = claim.primary or claim.measurement.split("; ")[0]
    return text if len(text) <= width else text[: width - 1].rstrip() + "…"


ClaimFn = Callable[[dict[str, Any]], list[Claim]]


CLAIMS: Registry[ClaimFn] = Registry("claim")


def fmt(x: float | None, nd: int = 2) -> str:
    """``x`` with ``nd`` decimals (integers too); '–' for None, NaN or inf.

    The report's tables use :func:`grpo_lens.report.format.fmt` (ints as they are, three decimals by default); the
    two print differently on purpose, see that module's docstring."""
    return "–" if x is None or not math.isfinite(x) else f"{x:.{nd}f}"


def ci_text(s: dict[str, Any] | None, nd: int = 2, unit: str = "groups") -> str:
    """'mean [lo, hi] (n = N unit)' of a summary entry ({mean, lo, hi, n}); 'not measured' when missing; the count
    alone when there are too few units for an interval (docs/theory.md §7). A claim's text is read on its own, so its
    interval names what it is over; the report's tables print :func:`grpo_lens.report.format.ci` instead."""
    if not s or s.get("mean") is None:
        return "not measured"
    if s.get("lo") is None:
        return f"{fmt(s['mean'], nd)} (n = {s.get('n')} {unit}, too few for an interval)"
    return f"{fmt(s['mean'], nd)} [{fmt(s['lo'], nd)}, {fmt(s['hi'], nd)}] (n = {s.get('n')} {unit})"


def source_of(probe: dict[str, Any]) -> str:
    """'exact gradients of every parameter' or the sketch's description (what it covers), from probe.json meta."""
    meta = probe.get("meta", {})
    if meta.get("gradients") == "exact":
        return "exact gradients of every parameter"
    if meta.get("gradients") == "exact_gram":  # the exact Gram from one backward (gradients/gram.py)
        cov = meta.get("gram_coverage")
        return (
            f"exact gradients of every parameter, coverage {fmt(cov, 2)} of Σ‖g‖² (exact Gram)"
            if isinstance(cov, (int, float)) and cov >= 1
            else f"exact gradients, covering {fmt(cov, 2)} of the parameters (exact Gram)"
        )
    cov = meta.get("sketch_coverage")
    # Σ‖S g‖² / Σ‖g‖²: an estimate (the sketch's Gram is one), so it can read above 1
    cov_txt = (
        (f", share of Σ‖g‖² estimated at {fmt(cov, 2)} (Σ‖Sg‖² / Σ‖g‖², which can exceed 1 by the sketch's error)")
        if isinstance(cov, (int, float))
        else ""
    )
    return f"sketch ({meta.get('sketch_dim')} per side per nn.Linear weight{cov_txt}), not exact"


def band_verdict(lo: float | None, hi: float | None, low: float, high: float) -> str:
    """The verdict of an equivalence rule (docs/theory.md §11, §12): holds if [lo, hi] lies inside [low, high]; does
    not hold if it lies wholly outside it; inconclusive otherwise or when the interval is missing or not finite (a
    wide interval that merely contains the control is no evidence for it). One of :data:`VERDICTS`."""
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return INCONCLUSIVE
    if low <= lo and hi <= high:
        return HOLDS
    if hi < low or lo > high:
        return DOES_NOT_HOLD
    return INCONCLUSIVE


def verdict_from_interval(lo: float | None, hi: float | None, control: float, holds_if: str) -> str:
    """The verdict of an interval [lo, hi] against one control value (docs/theory.md §11, §12).

    Args:
        lo: the interval's lower end; None when there is no interval.
        hi: its upper end; None when there is no interval.
        control: the value the interval is compared with.
        holds_if: "above" (holds when the interval lies above the control, fails when it lies below), "below" (the
            reverse), or "contains" (holds when the interval contains the control, fails when it excludes it).

    Returns:
        one of :data:`VERDICTS`; inconclusive without an interval, or when it straddles the control
        for above / below.

    Raises:
        ValueError: an unknown ``holds_if``.
    """
    if holds_if not in ("above", "below", "contains"):
        raise ValueError(f"unknown holds_if {holds_if!r}; valid: above, below, contains")
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return INCONCLUSIVE
    if holds_if == "contains":
        return HOLDS if lo <= control <= hi else DOES_NOT_HOLD
    above, below = lo > control, hi < control
    if holds_if == "above":
        return HOLDS if above else (DOES_NOT_HOLD if below else INCONCLUSIVE)
    return HOLDS if below else (DOES_NOT_HOLD if above else INCONCLUSIVE)


#: the wrong-verdict probability each rule allows per branch on its own (one-sided 2.5%: the end of a 95% interval);
#: measured per rule by `grpo-lens calibrate` (docs/calibration.md). In the report the table is decided under Holm.
BRANCH_LEVEL = 0.025

#: the family-wise error of the claims table: the chance that at least one primary verdict is wrong
FAMILY_LEVEL = 0.05


def decide(p_holds: float, p_dnh: float, level: float = BRANCH_LEVEL) -> str:
    """The verdict of a rule from its two one-sided p-values at a per-branch ``level``: holds when p_holds <= level,
    does not hold when p_dnh <= level (the smaller p wins if both are), inconclusive otherwise."""
    ok_h, ok_d = p_holds <= level, p_dnh <= level
    if ok_h and (not ok_d or p_holds <= p_dnh):
        return HOLDS
    return DOES_NOT_HOLD if ok_d else INCONCLUSIVE


def tested(claim: Claim) -> bool:
    """Whether a row is a primary claim with a test (kind "claim" and both branch p-values)."""
    return claim.kind == "claim" and claim.p_holds is not None and claim.p_dnh is not None


def holm_claims(claims: list[Claim], alpha: float = FAMILY_LEVEL) -> tuple[list[Claim], str]:
    """The primary claims decided under Holm at family-wise ``alpha`` (docs/theory.md §11, multiplicity), and the
    line that says so.

    Every tested row has two one-sided hypotheses (*holds* is wrong; *does not hold* is wrong), at most one of them
    true; Holm's step-down over all 2m of them (Holm 1979) keeps the chance of any wrong verdict in the table at most
    ``alpha`` under any dependence between rows. A row keeps the verdict of the branch Holm rejects; rows that are not
    tested pass through unchanged. Each row's ``rule`` gains the level it was decided at.
    """
    rows = [c for c in claims if tested(c)]
    hyps = [(i, b, p) for i, c in enumerate(rows) for b, p in ((HOLDS, c.p_holds), (DOES_NOT_HOLD, c.p_dnh))]
    # tested(): both p-values are set
    rejected = holm([p for _, _, p in hyps], alpha)  # type: ignore[misc]
    m2 = len(hyps)
    order = sorted(range(m2), key=lambda j: hyps[j][2])  # type: ignore[arg-type, return-value]
    threshold = {j: alpha / (m2 - rank) for rank, j in enumerate(order)}
    new: list[Claim] = []
    for i, c in enumerate(rows):
        won = [(hyps[j][2], hyps[j][1], threshold[j]) for j in range(m2) if hyps[j][0] == i and rejected[j]]
        if won:
            p, branch, thr = min(won)
            new.append(
                Claim(
                    **{**c.to_dict(), "verdict": branch, "rule": f"{c.rule}; Holm: p = {p:.2g} <= {thr:.3g}, decided"}
                )
            )
        else:
            held = "" if c.verdict == INCONCLUSIVE else f" (alone, at {BRANCH_LEVEL} per branch: {c.verdict})"
            new.append(
                Claim(
                    **{
                        **c.to_dict(),
                        "verdict": INCONCLUSIVE,
                        "rule": (
                            f"{c.rule}; Holm: not decided at family-wise {alpha} (p holds "
                            f"{c.p_holds:.2g}, p does not hold {c.p_dnh:.2g}){held}"
                        ),
                    }
                )
            )
    out, k = [], 0
    for c in claims:
        if tested(c):
            out.append(new[k])
            k += 1
        else:
            out.append(c)
    decided = sum(c.verdict != INCONCLUSIVE for c in out if tested(c))
    note = (
        f"Family-wise: {len(rows)} primary claims, {m2} one-sided hypotheses (each row: *holds* wrong, *does not "
        f"hold* wrong), decided under Holm's step-down at {alpha} (Holm 1979): the chance that any verdict in this "
        f"table is wrong is at most {alpha}, whatever the dependence between rows; {decided} decided. Checks and "
        f"descriptive rows are listed below the table and are not counted."
        if rows
        else ""
    )
    return out, note


def evaluate_claims(probe: dict[str, Any], names: list[str] | None = None) -> list[Claim]:
    """Every registered claim (or the named ones) evaluated on one probe.json dict, in name order.

    Raises:
        ValueError: an unknown claim name (listing the valid ones).
    """
    out: list[Claim] = []
    for name in names or CLAIMS.names():
        out += CLAIMS.get(name)(probe)
    return out
