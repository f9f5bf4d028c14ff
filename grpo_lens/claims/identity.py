"""The claim that the rank-2 identity sum_i A_i g_i = c (gbar_C - gbar_W) holds on real gradients (docs/theory.md
§11, the identity of §4): every group's relative residual below :data:`IDENTITY_TOLERANCE`, beside the residual the
other std convention's constant would leave (the control that shows the check can fail). Reads a probe.json's groups.
"""

from __future__ import annotations

from typing import Any

from grpo_lens import metrics as mk
from grpo_lens.claims.base import (
    CLAIMS,
    DOES_NOT_HOLD,
    HOLDS,
    INCONCLUSIVE,
    Claim,
    fmt,
    source_of,
)
from grpo_lens.formulas.identity import rank2_constant

#: the identity holds when every group's relative residual is below this (float32 round-off is ~1e-7).
IDENTITY_TOLERANCE = 1e-4


def _value_or_range(values: list[float]) -> str:
    """'0.155' when every value prints the same at 3 digits, else 'lo–hi'."""
    lo, hi = fmt(min(values), 3), fmt(max(values), 3)
    return lo if lo == hi else f"{lo}–{hi}"


def _residual(value: float) -> str:
    """A residual in the claim's text; an exact 0 says why it can be exact (a bare 0.0e+00 reads as a bug)."""
    if value == 0.0:
        return (
            "0 (exact: both sides' coefficients agree to the last float64 bit, or their difference's energy "
            "rounds to <= 0; docs/theory.md §4)"
        )
    return f"{value:.1e}"


def _groups(n: int) -> str:
    return "one group" if n == 1 else f"{n} groups"


@CLAIMS.register("identity")
def identity_claim(probe: dict[str, Any]) -> list[Claim]:
    """ "sum_i A_i g_i = c(k, R)(gbar_C - gbar_W)": the identity's residual over every mixed 0/1 group.

    Rule: inconclusive when no group has a residual (non-0/1 rewards or an estimator without the decomposition);
    holds if the largest residual < :data:`IDENTITY_TOLERANCE`; does not hold otherwise. Control: the residual the
    other std convention's constant would leave, |1 - c_other / c| (shows the check can fail; grpo only).
    """
    meta = probe.get("meta", {})
    rows = [g for d in probe.get("per_group_size", {}).values() for g in d.get(mk.PROBE_GROUPS, [])]
    res = [g[mk.GRAD_IDENTITY_RESIDUAL] for g in rows if g.get(mk.GRAD_IDENTITY_RESIDUAL) is not None]
    control = "—"
    if meta.get("estimator", "grpo") == "grpo":
        std = meta.get("std", "sample")
        other = "population" if std == "sample" else "sample"
        std_eps = float(meta.get("eps", 1e-4))  # probe.json meta key "eps" = config std_eps
        gaps: dict[int, list[float]] = {}  # R -> the gap of each group of that size
        for g in rows:
            if g.get(mk.GRAD_IDENTITY_RESIDUAL) is not None and mk.GROUP_SIZE in g:
                k, R = int(g[mk.GROUP_CORRECT]), int(g[mk.GROUP_SIZE])
                gaps.setdefault(R, []).append(
                    abs(1 - rank2_constant(k, R, other, std_eps) / rank2_constant(k, R, std, std_eps))  # type: ignore[arg-type]  # a stored config's std: sample or population
                )
        if gaps:
            # the two stds differ by sqrt(R / (R - 1)) whatever k, so the gap is one value per R (std_eps aside)
            per_group_size = [f"{_value_or_range(gaps[R])} at R = {R} ({_groups(len(gaps[R]))})" for R in sorted(gaps)]
            control = f"with the {other}-std constant instead the residual would be {', '.join(per_group_size)}"
    if not res:
        verdict, why, meas = INCONCLUSIVE, "no group with 0/1 rewards and a decomposition", "not measured"
    else:
        worst = max(res)
        verdict = HOLDS if worst < IDENTITY_TOLERANCE else DOES_NOT_HOLD
        shown = _residual(worst)
        why = f"max residual {shown} {'<' if verdict == HOLDS else '>='} {IDENTITY_TOLERANCE:.0e}"
        meas = f"relative residual max {shown} over {len(res)} groups (estimator {meta.get('estimator', 'grpo')})"
    return [
        Claim(
            claim="the group update is c(k,R)(gbar_C − gbar_W) (the rank-2 identity)",
            scope="all R",
            measurement=meas,
            control=control,
            verdict=verdict,
            rule=why,
            source=source_of(probe),
            kind="check",
            n=len(res),
        )
    ]
