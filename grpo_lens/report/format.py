"""How the report modules print a number and its interval: one place for the tables of report.md and compare.md.

The claims build their own text with :func:`grpo_lens.claims.base.fmt` and :func:`grpo_lens.claims.base.ci_text`,
which print differently on purpose: a claim's measurement is read on its own, so every interval there names its unit
count ("(n = 24 groups)"), a missing number reads "not measured" and every number, counts included, gets the same
decimals; here the table has a column for n, a missing cell is '–' and integers are counts, printed as they are. The
two are kept apart so that report.md stays byte-identical (the claims package is below the report and cannot import
it).

A mean from fewer than :data:`grpo_lens.formulas.stats.MIN_INTERVAL_UNITS` units has no interval; its cell reads
"mean (n = N)" with the short mark :data:`FEW_MARK`, said in words once per report (:data:`FEW_NOTE`) and counted once
per table (:func:`few_footnotes`), where it used to be spelled out in every cell.
"""

from __future__ import annotations

import math
import re
from typing import Any

from grpo_lens.formulas.stats import MIN_INTERVAL_UNITS

#: a ``|`` with no backslash before it (:func:`md_cell`).
_UNESCAPED_PIPE = re.compile(r"(?<!\\)\|")


def fmt(x: Any, nd: int = 3) -> str:
    """``x`` with ``nd`` decimals; ints as they are; '–' for None, NaN or inf."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    if isinstance(x, int):
        return str(x)
    return f"{x:.{nd}f}"


#: the mark after a mean that has too few units for an interval (a cell reads "1.98 (n = 4)†")
FEW_MARK = "†"

#: the one sentence that says what :data:`FEW_MARK` means (the report prints it once, above the claims)
FEW_NOTE = (
    f"{FEW_MARK} after a number: it is a mean over fewer than {MIN_INTERVAL_UNITS} units (groups, prompts, "
    "steps or segments, as its n says), too few for a 95% interval (docs/theory.md §7)."
)


def interval(stats: dict[str, Any] | None) -> tuple[float, float] | None:
    """(lo, hi) of a summary entry ({mean, lo, hi, n}) when it has an interval, else None (missing, or fewer than
    :data:`grpo_lens.formulas.stats.MIN_INTERVAL_UNITS` units: the summaries then store lo = hi = None). The one
    test of "has an interval" that the tables (:func:`ci`) and the error bars of the plots share."""
    if not stats or stats.get("mean") is None or stats.get("lo") is None or stats.get("hi") is None:
        return None
    return float(stats["lo"]), float(stats["hi"])


def ci(stats: dict[str, Any] | None, nd: int = 3) -> str:
    """'mean [lo, hi]' of a summary entry ({mean, lo, hi, n}); '–' when missing; 'mean (n = N)†' when too few for
    an interval (:func:`interval`, docs/theory.md §7; the mark :data:`FEW_MARK` is explained by :data:`FEW_NOTE`)."""
    if not stats or stats.get("mean") is None:
        return "–"
    bounds = interval(stats)
    if bounds is None:
        return f"{fmt(stats['mean'], nd)} (n = {stats.get('n')}){FEW_MARK}"
    return f"{fmt(stats['mean'], nd)} [{fmt(bounds[0], nd)}, {fmt(bounds[1], nd)}]"


#: the claims' own words for a mean without an interval (:func:`grpo_lens.claims.base.ci_text`)
_CLAIM_TOO_FEW = re.compile(r"\(n = (\d+)((?: [^,()]+)?), too few for an interval\)")


def mark_few(text: str) -> str:
    """A claim's text with each "(n = N unit, too few for an interval)" shortened to "(n = N unit)†", as the
    tables print it (presentation only: the claim's record keeps its words)."""
    return _CLAIM_TOO_FEW.sub(lambda m: f"(n = {m.group(1)}{m.group(2)}){FEW_MARK}", text)


def few_footnotes(lines: list[str]) -> list[str]:
    """``lines`` (a report's Markdown lines) with one short line after every table that has cells marked
    :data:`FEW_MARK`, counting them: the mark's meaning is said once per report (:data:`FEW_NOTE`), not per cell."""
    out: list[str] = []
    marked = 0
    for i, line in enumerate(lines):
        out.append(line)
        if line.startswith("|"):
            marked += sum(FEW_MARK in cell for cell in _UNESCAPED_PIPE.split(line.strip().strip("|")))
            if (i + 1 == len(lines) or not lines[i + 1].startswith("|")) and marked:
                out += ["", f"{FEW_MARK} {marked} cell(s) of this table: n < {MIN_INTERVAL_UNITS}, no interval."]
                marked = 0
    return out


def fmt_sig(x: float | None) -> str:
    """``x`` with 3 significant digits (4 from 1000 on), for compare.md, whose metrics range over several orders of
    magnitude: 0.250, 13.3, 202 (no trailing point), 0 for zero; '–' for None, NaN or inf."""
    if x is None or not math.isfinite(x):
        return "–"
    if x == 0:
        return "0"
    return f"{x:#.3g}".rstrip(".") if abs(x) < 1000 else f"{x:.4g}"


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
