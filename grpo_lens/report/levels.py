"""The shipped calibration's levels and powers, as the report prints them beside each verdict: the cell of a rule at
a row's n (:func:`level_at`), the power of each verdict's branch (:func:`branch_power`) and the family where the
*does not hold* branch is weakest (:func:`lowest_at`). Used by the claims table (:mod:`grpo_lens.report`) and the
answers (:mod:`grpo_lens.report.answers`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grpo_lens.claims.base import DOES_NOT_HOLD, HOLDS

#: the calibration levels shipped with the package: a copy of a full `grpo-lens calibrate` run's levels.json
LEVELS_FILE = Path(__file__).resolve().parent.parent / "data" / "calibration_levels.json"


def load_levels(path: Path = LEVELS_FILE) -> dict[str, dict[str, dict[str, Any]]]:
    """{rule id: {n: {"level", "power", "unit", "families"}}} of the shipped calibration; {} when it is missing."""
    try:
        return json.loads(Path(path).read_text(encoding="utf8"))
    except (OSError, ValueError):
        return {}


def level_at(levels: dict[str, dict[str, dict[str, Any]]], rule: str, n: int | None) -> dict[str, Any] | None:
    """The calibrated cell of ``rule`` at the largest calibrated n <= ``n`` (the smallest cell, with ``"below":
    True``, when n is below every cell); None for a rule the calibration does not cover."""
    cells = levels.get(rule)
    if not cells:
        return None
    ns = sorted(cells, key=float)
    fit = [k for k in ns if n is not None and float(k) <= n]
    key = fit[-1] if fit else ns[0]
    return {**cells[key], "n": key, "below": not fit}


def branch_power(cell: dict[str, Any] | None, branch: str) -> float | None:
    """The calibrated power of one branch of a rule at a cell (:func:`level_at`): *holds* the lowest share of holds
    over the true families, *does not hold* the lowest share of does not hold over the false ones (``power_dnh``);
    None without a cell or where the calibration has no such family (or predates per-branch power)."""
    if cell is None:
        return None
    return cell.get("power") if branch == HOLDS else cell.get("power_dnh")


def lowest_at(cell: dict[str, Any], branch: str) -> str:
    """' (lowest at a0.25)': the false family where the *does not hold* branch's power is lowest, when the
    calibration names it; '' otherwise (and for *holds*)."""
    fam = cell.get("power_dnh_family") if branch == DOES_NOT_HOLD else None
    return f" (lowest at {fam})" if fam else ""


def _p2(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"
