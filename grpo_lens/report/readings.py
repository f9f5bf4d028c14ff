"""The rank claim's readings side by side on the report's first screen: every matrix the paper's "the
gradient matrix has effective rank ≈ 2" can mean (G1, G2 of the probe's layer, G2 of every linear layer by type,
G3), each with E₂, erank and stable rank at every R (mean [95% interval] over groups), whether it is ≈ 2 at every R
(:func:`grpo_lens.claims.rank.near_two`), and the same matrix under weightings that are not zero-sum: if a reading's
≈ 2 came from the zero-sum advantages, its A column would stand apart from |A|, A + mean|A|, r, 1 and one rollout.
The primary row (the claims table's verdict) is marked; the others carry no verdict (docs/theory.md §11).
"""

from __future__ import annotations

from typing import Any

from grpo_lens.claims.rank import CONTROL_WEIGHTINGS, rank_readings
from grpo_lens.report.format import fmt, md_row, md_table
from grpo_lens.report.probe import WEIGHTING_LABELS

MEASURE_LABELS = {"top2_share": "E₂", "erank": "erank", "stable_rank": "stable rank"}


def _cell(s: dict[str, Any]) -> str:
    if s.get("mean") is None:
        return "–"
    if s.get("lo") is None:
        return f"{fmt(s['mean'], 2)} (n {s.get('n') or '–'})"
    return f"{fmt(s['mean'], 2)} [{fmt(s['lo'], 2)}, {fmt(s['hi'], 2)}] (n {s['n']})"


def seed_g3_rows(seed_probes: list[dict[str, Any]], rs: list[str]) -> list[str]:
    """Table rows of G3 for a pooled probe, whose pooled groups hold no G3 (one matrix per R and seed, not groups):
    per measure and R the range of the seeds' values (each seed's :func:`rank_readings` G3 row), no interval."""
    per_seed = [[r for r in rank_readings(p) if r["matrix"].startswith("G3")] for p in seed_probes]
    if len(per_seed) < 2 or not all(per_seed):
        return []
    lines = []
    for measure, label in MEASURE_LABELS.items():
        found = [next((r for r in rows if r["measure"] == measure), None) for rows in per_seed]
        rows = [r for r in found if r is not None]
        if len(rows) < len(found):
            continue
        cells = []
        for R in rs:
            values = [r["by_size"].get(R, {}).get("mean") for r in rows]
            values = [v for v in values if v is not None]
            cells.append(f"{fmt(min(values), 2)}–{fmt(max(values), 2)} ({len(values)} seeds)" if values else "–")
        name = f"{rows[0]['matrix']}, {label}, range over seeds"
        lines.append(md_row(name, *cells, "one matrix per seed: no interval"))
    return lines


def readings_lines(
    probe: dict[str, Any], label: str = "", seed_probes: list[dict[str, Any]] | None = None
) -> list[str]:
    """Markdown: the readings table and, under it, the non-zero-sum control table; [] without an R > 2. A pooled
    probe (``probe --seeds``) has no G3 of its own: with ``seed_probes`` (its seeds' probes) G3 is the range over the
    seeds (:func:`seed_g3_rows`)."""
    rows = rank_readings(probe)
    if not rows:
        return []
    rs = list(rows[0]["by_size"])
    where = f" ({label})" if label else ""
    lines = [
        f"### Rank ≈ 2: every reading side by side{where}",
        "",
        "Mean [95% interval] (n groups) per R. '≈ 2 at every R': E₂ above 0.9, erank and stable rank within [1.5, "
        "2.5], at every R (margins fixed before measuring; descriptive beside the primary verdict, docs/theory.md "
        "§11).",
        "",
        *md_table(["reading", *(f"R = {R}" for R in rs), "≈ 2 at every R?"]),
    ]
    for r in rows:
        name = f"{r['matrix']}, {MEASURE_LABELS[r['measure']]}" + (" (primary)" if r["primary"] else "")
        lines.append(md_row(name, *(_cell(r["by_size"][R]) for R in rs), r["near_two"]))
    if seed_probes and not any(r["matrix"].startswith("G3") for r in rows):
        lines += seed_g3_rows(seed_probes, rs)
    ctrl = [r for r in rows if r["controls"] and r["measure"] == "stable_rank"]
    if ctrl:
        lines += [
            "",
            "The same matrices' stable rank under weightings that are not zero-sum (means): if the zero-sum "
            "advantages caused a reading's ≈ 2, A would stand apart.",
            "",
            *md_table(["R", "matrix", "A", *(WEIGHTING_LABELS[w] for w in CONTROL_WEIGHTINGS)]),
        ]
        for R in rs:
            for r in ctrl:
                c = r["controls"].get(R) or {}
                if all(v is None for v in c.values()):
                    continue
                lines.append(
                    md_row(
                        R,
                        r["matrix"],
                        fmt(r["by_size"][R].get("mean"), 2),
                        *(fmt(c.get(w), 2) for w in CONTROL_WEIGHTINGS),
                    )
                )
    return lines + [""]
