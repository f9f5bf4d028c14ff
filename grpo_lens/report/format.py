"""How the report modules print a number and its interval: one place for the tables of report.md and compare.md.

The claims build their own text with :func:`grpo_lens.claims.base.fmt` and :func:`grpo_lens.claims.base.ci_text`,
which print differently on purpose: a claim's measurement is read on its own, so every interval there names its unit
count ("(n = 24 groups)"), a missing number reads "not measured" and every number, counts included, gets the same
decimals; here the table has a column for n, a missing cell is '–' and integers are counts, printed as they are. The
two are kept apart so that report.md stays byte-identical (the claims package is below the report and cannot import
it).
"""

from __future__ import annotations

import math
import re
from typing import Any

#: a ``|`` with no backslash before it (:func:`md_cell`).
_UNESCAPED_PIPE = re.compile(r"(?<!\\)\|")


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


def fmt_sig(x: float | None) -> str:
    """``x`` with 3 significant digits (4 from 1000 on), for compare.md, whose metrics range over several orders of
    magnitude; '–' for None, NaN or inf."""
    if x is None or not math.isfinite(x):
        return "–"
    return f"{x:#.3g}" if abs(x) < 1000 else f"{x:.4g}"


def md_cell(x: Any) -> str:
    """``x`` as one Markdown table cell: whitespace (newlines included) collapsed to single spaces and every ``|``
    not already escaped written ``\\|``, so that a cell such as ``|A_i| ||g_i||`` stays one cell."""
    return _UNESCAPED_PIPE.sub(r"\\|", " ".join(str(x).split()))


def md_row(*cells: Any) -> str:
    """One Markdown table row, every cell through :func:`md_cell` (the one place report.md and compare.md escape
    ``|``)."""
    return "| " + " | ".join(md_cell(c) for c in cells) + " |"


def md_table(head: list[Any] | tuple[Any, ...], rows: Any = ()) -> list[str]:
    """A Markdown table's lines: the header row, the separator and one :func:`md_row` per entry of ``rows`` (each a
    sequence of cells, as many as ``head``)."""
    return [md_row(*head), "|" + "---|" * len(head)] + [md_row(*r) for r in rows]
