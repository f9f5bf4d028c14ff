"""The report's opening (its first screen): one entry per primary claim, then the checks, then the rank claim's
readings side by side (:func:`grpo_lens.report.readings.readings_lines`).

Each primary claim gets its verdict, the claim and where, the primary number with its 95% interval
(:func:`grpo_lens.claims.base.primary_text`), n, and the calibrated power of the branch its verdict took at that n
(``grpo_lens/data/calibration_levels.json``, :func:`grpo_lens.report.level_at`); an inconclusive row gets both
branches' power and, where inconclusive was (almost) certain at its n (both powers below
:data:`CERTAIN_POWER`), that fact and the smallest calibrated n at which the *holds* branch reaches
:data:`DECIDING_POWER`, beside the flag that raises n (the row's advice). p-values and bounds stay in the appendix's
claims table. Every line is at most :data:`LINE_WIDTH` characters (longer ones wrap, indented).

The lines are the claims' own records (:func:`grpo_lens.claims.base.evaluate_claims`, decided under Holm), so nothing
here re-derives a verdict.
"""

from __future__ import annotations

import textwrap
from typing import Any

from grpo_lens.claims.base import DOES_NOT_HOLD, HOLDS, INCONCLUSIVE, Claim, evaluate_claims, holm_claims, primary_text
from grpo_lens.claims.sparsity import TRAINING_CLAIMS
from grpo_lens.report.format import mark_few, md_row, md_table
from grpo_lens.report.levels import _p2, branch_power, level_at, load_levels, lowest_at
from grpo_lens.report.readings import readings_lines

#: the longest line of the first screen
LINE_WIDTH = 160

#: both branches' calibrated power below this at the row's n: inconclusive was (almost) certain there
CERTAIN_POWER = 0.05

#: the power a budget is named for ("the smallest calibrated n whose *holds* power reaches this")
DECIDING_POWER = 0.8

Levels = dict[str, dict[str, dict[str, Any]]]


def training_data(
    records: list[dict[str, Any]], lora_rank: int = 0, seed_runs: list[list[dict[str, Any]]] | None = None
) -> dict[str, Any]:
    """What the claims over training read: the run's records, and with ``train --seeds`` every seed's records
    (``seeds``: the trends and "rank stays" are then decided over the seeds)."""
    return {"records": records, "lora_rank": lora_rank, **({"seed_runs": seed_runs} if seed_runs else {})}


def claim_sources(
    probes: dict[str, dict[str, Any]],
    records: list[dict[str, Any]] | None,
    lora_rank: int = 0,
    seed_runs: list[list[dict[str, Any]]] | None = None,
) -> dict[str, list[Claim]]:
    """{source label: its claims}: each probe first (the rank claims, the question a reader opens the report with),
    then ``training`` (the run's records: sparsity over training; ``seed_runs``: every seed's, from `train --seeds`)."""
    sources: dict[str, list[Claim]] = {label: evaluate_claims(probe) for label, probe in probes.items()}
    if records:
        sources["training"] = evaluate_claims(training_data(records, lora_rank, seed_runs), list(TRAINING_CLAIMS))
    # the verdicts of the claims table: the primary claims of every source under one Holm
    flat, _ = holm_claims([c for claims in sources.values() for c in claims])
    out, i = {}, 0
    for label, claims in sources.items():
        out[label], i = flat[i : i + len(claims)], i + len(claims)
    return out


def _wrap(line: str, indent: str = "  ") -> list[str]:
    return textwrap.wrap(line, LINE_WIDTH, subsequent_indent=indent, break_on_hyphens=False) or [line]


def deciding_n(levels: Levels, rule: str) -> str | None:
    """'16 groups per R': the smallest calibrated n of ``rule`` whose *holds* power reaches :data:`DECIDING_POWER`
    (None when no calibrated n does or the rule is not calibrated)."""
    cells = levels.get(rule) or {}
    for n in sorted(cells, key=float):
        if (cells[n].get("power") or 0.0) >= DECIDING_POWER:
            return f"{n} {cells[n].get('unit', '')}".strip()
    return None


def power_line(c: Claim, levels: Levels) -> str:
    """The power of the branch the row's verdict took at its n (both branches for inconclusive), and for an
    inconclusive row whose powers are both below :data:`CERTAIN_POWER`, that inconclusive was certain and the budget
    that would decide it."""
    cell = level_at(levels, c.rule_id, c.n)
    if cell is None:
        return "power: not calibrated (no planted cases for this rule)"
    at = f"at n = {cell['n']} {cell.get('unit', '')}".strip() + (" (this row has fewer)" if cell["below"] else "")
    if c.verdict != INCONCLUSIVE:
        power = _p2(branch_power(cell, c.verdict))
        fam = lowest_at(cell, c.verdict).strip(" ()").replace("lowest at ", "")
        return f"power of *{c.verdict}* {at}: {power} (planted cases" + (
            f"; lowest false family: {fam})" if fam else ")"
        )
    ph, pd = branch_power(cell, HOLDS), branch_power(cell, DOES_NOT_HOLD)
    line = f"power {at}: holds {_p2(ph)}, does not hold {_p2(pd)}"
    if max(ph or 0.0, pd or 0.0) < CERTAIN_POWER:
        budget = deciding_n(levels, c.rule_id)
        line += "; inconclusive was certain at this n; " + (
            f"holds reaches power {DECIDING_POWER} at n = {budget}" if budget else "no calibrated n decides it"
        )
    return line + (f"; to decide: {c.advice}" if c.advice else "")


#: the columns of the answers as one table (``answer_lines(table=True)``: ``demo --preset``, the README's claims block)
ANSWER_COLUMNS = ("claim (where)", "verdict", "primary number (95% interval)", "n", "power of this verdict's branch")


def answer_lines(sources: dict[str, list[Claim]], levels: Levels | None = None, table: bool = False) -> list[str]:
    """The Markdown lines of the answers: one entry per primary claim (verdict, claim and where; the primary number,
    n; the power of its verdict's branch), with ``table`` one row per primary claim of a table
    (:data:`ANSWER_COLUMNS`); then the checks one line each."""
    if levels is None:
        levels = load_levels()
    multi = len(sources) > 1
    primary, checks = [], []
    for label, claims in sources.items():
        for c in claims:
            where = f"{label}, {c.scope}" if multi and not c.scope.startswith(label) else c.scope
            if c.kind == "check":
                checks += _wrap(f"- **{c.verdict}** (check, not a test): {c.claim} ({where})")
            elif c.kind == "claim" and table:
                n = "–" if c.n is None else str(c.n)
                verdict = c.verdict if c.verdict == INCONCLUSIVE else f"**{c.verdict}**"
                primary.append(md_row(f"{c.claim} ({where})", verdict, primary_text(c), n, power_line(c, levels)))
            elif c.kind == "claim":
                n = "–" if c.n is None else str(c.n)
                primary += _wrap(f"- **{c.verdict}**: {c.claim} ({where})")
                primary += _wrap(f"  {primary_text(c)}; n = {n}", "    ")
                primary += _wrap(f"  {power_line(c, levels)}", "    ")
    lines = ["## Answers", ""]
    if primary:
        lines += [
            "One entry per primary claim: verdict (under Holm, family-wise 0.05), the primary number with its 95% "
            "interval, n,",
            "and the power of that verdict's branch at this n on planted cases (docs/calibration.md).",
            "",
            *(md_table(list(ANSWER_COLUMNS)) if table else []),
            *primary,
            "",
        ]
    if checks:
        lines += ["Checks (algebra with a control, not tests):", "", *checks, ""]
    if not primary and not checks:
        lines += ["No claim could be evaluated on this run.", ""]
    lines += ["p-values, bounds, controls and rules: the claims table in the appendix.", ""]
    return lines


def answers_section(
    probes: dict[str, dict[str, Any]],
    records: list[dict[str, Any]] | None,
    lora_rank: int = 0,
    seed_runs: list[list[dict[str, Any]]] | None = None,
    table: bool = False,
    seed_probes: list[dict[str, Any]] | None = None,
) -> list[str]:
    """The report's first section (:func:`answer_lines` of :func:`claim_sources`, with ``table`` the primary claims as
    one table; then the rank readings of each probe, ``seed_probes`` those of a pooled probe's seeds (its G3));
    empty when the run has neither a probe nor lens records."""
    sources = claim_sources(probes, records, lora_rank, seed_runs)
    if not any(sources.values()):
        return []
    lines = answer_lines(sources, table=table)
    for label, probe in probes.items():
        lines += readings_lines(probe, label if len(probes) > 1 else "", seed_probes if label == "probe" else None)
    out = []
    for line in (mark_few(x) for x in lines):  # "(n = 4 groups)†", as the tables print it
        if line.startswith("|") or len(line) <= LINE_WIDTH:
            out.append(line)
        else:  # a paragraph; list entries were wrapped with their indent by answer_lines
            out += textwrap.wrap(line, LINE_WIDTH, subsequent_indent="    " if line.startswith("  ") else "")
    return out
