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
from dataclasses import asdict, dataclass
from typing import Any, Callable

from grpo_lens.formulas.stats import MIN_INTERVAL_UNITS
from grpo_lens.registry import Registry

HOLDS, DOES_NOT_HOLD, INCONCLUSIVE = "holds", "does not hold", "inconclusive"


VERDICTS = (HOLDS, DOES_NOT_HOLD, INCONCLUSIVE)


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
    if meta.get("gradients") == "exact_gram":  # issue 20: the exact Gram from one backward (gradients/gram.py)
        cov = meta.get("gram_coverage")
        return f"exact gradients of every parameter, coverage {fmt(cov, 2)} of Σ‖g‖² (exact Gram)" \
            if isinstance(cov, (int, float)) and cov >= 1 else \
            f"exact gradients, covering {fmt(cov, 2)} of the parameters (exact Gram)"
    cov = meta.get("sketch_coverage")
    # Σ‖S g‖² / Σ‖g‖²: an estimate (the sketch's Gram is one), so it can read above 1
    cov_txt = (f", share of Σ‖g‖² estimated at {fmt(cov, 2)} (Σ‖Sg‖² / Σ‖g‖², which can exceed 1 by the sketch's "
               f"error)") if isinstance(cov, (int, float)) else ""
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
        lo, hi: the interval's ends; None when there is no interval.
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


#: the wrong-verdict probability each rule allows per branch (one-sided 2.5%: the end of a 95% interval, or a test at
#: 0.025 / two-sided 0.05); measured per rule by `grpo-lens calibrate` (docs/calibration.md)
BRANCH_LEVEL = 0.025


def tested(claim: Claim) -> bool:
    """Whether a row carries a statistical test: not the identity or another algebraic statement (no sampling error),
    and not
    a scope where the verdict is inconclusive by construction (R = 2 rank and zero-sum rows)."""
    return not claim.claim.endswith(("(the rank-2 identity)", "(algebra)")) and not (claim.scope == "R = 2"
                                                                      and claim.verdict == INCONCLUSIVE)


def family_wise_note(claims: list[Claim], alpha: float = 0.05) -> str:
    """The family-wise statement under a claims table (docs/theory.md §11, multiplicity): with m rows that carry a
    test, each wrong at most :data:`BRANCH_LEVEL` (only one of a row's two nulls can be true), the chance of at least
    one wrong verdict in the table is at most m × BRANCH_LEVEL by the union bound, whatever the dependence between
    rows (Bonferroni); a verdict meant to hold family-wise at ``alpha`` needs each branch at alpha / m."""
    m = sum(tested(c) for c in claims)
    decided = sum(tested(c) and c.verdict != INCONCLUSIVE for c in claims)
    if m == 0:
        return ""
    return (f"Family-wise: {m} rows carry a test ({decided} decided), each wrong with probability at most "
            f"{BRANCH_LEVEL} under its rule (levels measured in docs/calibration.md), so the chance that at least one "
            f"verdict here is wrong is at most {m} × {BRANCH_LEVEL} = {min(m * BRANCH_LEVEL, 1.0):.2f} (Bonferroni, "
            f"any dependence between rows). For a table wrong with probability at most {alpha}, read a verdict only "
            f"if it also holds at {alpha}/{m} = {alpha / m:.4f} per branch.")


def evaluate_claims(probe: dict[str, Any], names: list[str] | None = None) -> list[Claim]:
    """Every registered claim (or the named ones) evaluated on one probe.json dict, in name order.

    Raises:
        ValueError: an unknown claim name (listing the valid ones).
    """
    out: list[Claim] = []
    for name in names or CLAIMS.names():
        out += CLAIMS.get(name)(probe)
    return out
