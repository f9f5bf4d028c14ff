"""Number formatting shared by the report modules: one place for how a value and its interval are printed."""

from __future__ import annotations

import math
from typing import Any


def fmt(x: Any, nd: int = 3) -> str:
    """``x`` with ``nd`` decimals; ints as they are; '–' for None, NaN or inf."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    if isinstance(x, int):
        return str(x)
    return f"{x:.{nd}f}"


def ci(stats: dict[str, Any] | None, nd: int = 3) -> str:
    """'mean [lo, hi]' of a summary entry ({mean, lo, hi, n}); '–' when missing; the count when too few for an
    interval (docs/theory.md §7)."""
    if not stats or stats.get("mean") is None:
        return "–"
    if stats.get("lo") is None:
        return f"{fmt(stats['mean'], nd)} (n = {stats.get('n')}, too few for an interval)"
    return f"{fmt(stats['mean'], nd)} [{fmt(stats['lo'], nd)}, {fmt(stats['hi'], nd)}]"
