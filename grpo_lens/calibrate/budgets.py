"""The budgets of `grpo-lens calibrate`: per primary rule the smallest calibrated n where each branch's power reaches
0.8 (:func:`rule_budgets`), and the primaries decided together under Holm at a family-wise 0.05 on the planted
trials (:func:`holm_summary`; docs/theory.md §11)."""

from __future__ import annotations

from typing import Any

from grpo_lens.calibrate.families import at_margin
from grpo_lens.claims.base import DOES_NOT_HOLD, FAMILY_LEVEL, HOLDS, INCONCLUSIVE
from grpo_lens.claims.baselines import RULE_ID as BASELINE_RULE_ID
from grpo_lens.claims.credit import MC_RULE_ID
from grpo_lens.claims.rank import RULE_ID as RANK_RULE_ID
from grpo_lens.claims.rank import STAYS_RULE_ID, STAYS_SEEDS_RULE_ID
from grpo_lens.claims.sparsity import (
    S1_RULE_ID,
    S1_SEEDS_RULE_ID,
    S4_RULE_ID,
    SPARSITY_RULE_ID,
    SPARSITY_SEEDS_RULE_ID,
)
from grpo_lens.claims.zero_sum import RULE_ID as ZERO_SUM_RULE_ID
from grpo_lens.formulas.stats import holm

#: the power a documented budget must reach (docs/calibration.md, Budgets)
TARGET_POWER = 0.8

#: the primary claims (one row each in the report's table) and the rules that decide them, one run before seeds
PRIMARY_RULES = {
    "rank ≈ 2": (RANK_RULE_ID,),
    "labels structure G1": (ZERO_SUM_RULE_ID,),
    "rank stays ≈ 2": (STAYS_RULE_ID, STAYS_SEEDS_RULE_ID),
    "gradient sparsity intensifies": (SPARSITY_RULE_ID, SPARSITY_SEEDS_RULE_ID),
    "S1 rises over training": (S1_RULE_ID, S1_SEEDS_RULE_ID),
    "most parameters unchanged (S4)": (S4_RULE_ID,),
    "uniform credit disagrees with Monte Carlo credit": (MC_RULE_ID,),
    "group mean optimal": (BASELINE_RULE_ID,),
}


def _ns(cells: dict[str, dict[str, Any]]) -> list[str]:
    return sorted(cells, key=float)


def budget(cells: dict[str, dict[str, Any]], key: str, target: float = TARGET_POWER) -> str | None:
    """The smallest n of one rule's levels.json cells (:func:`grpo_lens.calibrate.rule_levels`) whose ``key``
    ("power" or "power_dnh") is at least ``target``; None when no calibrated n reaches it."""
    return next((n for n in _ns(cells) if (cells[n].get(key) or 0.0) >= target), None)


def rule_budgets(levels: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """{rule: {"holds", "does_not_hold": the budget n of each branch (None: not reached), "level": the worst level at
    the *holds* budget (else at the largest n), "largest": the largest calibrated n, "power_largest",
    "power_dnh_largest": each branch's power there, "unit": the largest n's unit}}."""
    out = {}
    for rule, cells in levels.items():
        top = _ns(cells)[-1]
        h, d = budget(cells, "power"), budget(cells, "power_dnh")
        out[rule] = {
            "holds": h,
            "does_not_hold": d,
            "level": cells[h or top]["level"],
            "largest": top,
            "power_largest": cells[top].get("power"),
            "power_dnh_largest": cells[top].get("power_dnh"),
            "unit": cells[top].get("unit", ""),
        }
    return out


def holm_verdicts(pairs: list[tuple[float, float]], alpha: float = FAMILY_LEVEL) -> list[str]:
    """The verdicts of m rules decided together under Holm at family-wise ``alpha`` from their [m] (p_holds,
    p_does_not_hold) pairs, as :func:`grpo_lens.claims.base.holm_claims` decides the report's table: Holm over the
    2m one-sided hypotheses; a rule takes the branch Holm rejects (the smaller p if both), else inconclusive."""
    flat = [p for pair in pairs for p in pair]
    rejected = holm(flat, alpha)
    out = []
    for i, (ph, pd) in enumerate(pairs):
        rh, rd = rejected[2 * i], rejected[2 * i + 1]
        out.append(HOLDS if rh and (not rd or ph <= pd) else DOES_NOT_HOLD if rd else INCONCLUSIVE)
    return out


def _route(levels: dict[str, dict[str, dict[str, Any]]], rules: tuple[str, ...]) -> tuple[str, str] | None:
    """(rule, n) a primary claim is decided at: the first route whose *holds* power reaches 0.8, at that budget;
    else the first calibrated route at its largest n."""
    have = [r for r in rules if r in levels]
    for r in have:
        n = budget(levels[r], "power")
        if n is not None:
            return r, n
    return (have[0], _ns(levels[have[0]])[-1]) if have else None


def _pick(rows: list[dict[str, Any]], truth: str, by: str) -> dict[str, Any] | None:
    """The row of one truth that is hardest for the simulation: ``by`` "level" the highest wrong-verdict share,
    "power" the lowest right-verdict share (families on the rule's margin skipped for power)."""
    rows = [r for r in rows if r["truth"] == truth and r.get("p") and not (by == "power" and at_margin(r["family"]))]
    if not rows:
        return None
    wrong, right = ("holds", "does_not_hold") if truth == "false" else ("does_not_hold", "holds")
    return max(rows, key=lambda r: r[wrong]) if by == "level" else min(rows, key=lambda r: r[right])


def holm_summary(result: dict[str, Any], rows: list[dict[str, Any]], alpha: float = FAMILY_LEVEL) -> dict[str, Any]:
    """The primaries (:data:`PRIMARY_RULES`) decided together under Holm at ``alpha`` on the planted trials: each
    primary at its route and budget (:func:`_route`); trial t of every rule forms one joint table (the rules' planted
    data are independent). "level": the share of joint tables with any wrong verdict when every rule sits on its worst
    false family (the highest *holds* share alone); "level_any": the same with each rule on its worst family of either
    truth; per primary "power" (each on its lowest-power true family) and "power_dnh" (lowest-power false family off
    the margin): the share its right verdict survives Holm, with the other primaries on their own such families."""
    levels = result["levels"]
    chosen = {}
    for claim, rules in PRIMARY_RULES.items():
        route = _route(levels, rules)
        if route is not None:
            chosen[claim] = (route, [r for r in rows if r["rule"] == route[0] and str(r["n"]) == route[1]])

    def joint(picks: dict[str, dict[str, Any] | None]) -> tuple[list[list[str]], list[str]]:
        given = {c: row for c, row in picks.items() if row is not None}
        names = list(given)
        trials = min((len(given[c]["p"]) for c in names), default=0)
        tables = [holm_verdicts([tuple(given[c]["p"][t]) for c in names], alpha) for t in range(trials)]
        return tables, names

    def wrong_share(picks: dict[str, dict[str, Any] | None]) -> float:
        tables, names = joint(picks)
        bad = {c: HOLDS if (picks[c] or {}).get("truth") == "false" else DOES_NOT_HOLD for c in names}
        return sum(any(v == bad[c] for c, v in zip(names, tab)) for tab in tables) / max(len(tables), 1)

    def right_share(picks: dict[str, dict[str, Any] | None], branch: str) -> dict[str, float | None]:
        tables, names = joint(picks)
        out: dict[str, float | None] = {c: None for c in picks}
        for i, c in enumerate(names):
            out[c] = sum(tab[i] == branch for tab in tables) / max(len(tables), 1)
        return out

    false_worst = {c: _pick(rs, "false", "level") for c, (_, rs) in chosen.items()}
    any_worst = {}
    for c, (_, rs) in chosen.items():
        cands = [x for x in (_pick(rs, "false", "level"), _pick(rs, "true", "level")) if x is not None]
        key = lambda r: r["holds"] if r["truth"] == "false" else r["does_not_hold"]  # noqa: E731
        any_worst[c] = max(cands, key=key) if cands else None
    power = right_share({c: _pick(rs, "true", "power") for c, (_, rs) in chosen.items()}, HOLDS)
    power_dnh = right_share({c: _pick(rs, "false", "power") for c, (_, rs) in chosen.items()}, DOES_NOT_HOLD)
    return {
        "alpha": alpha,
        "level": wrong_share(false_worst),
        "level_any": wrong_share(any_worst),
        "primaries": {
            c: {
                "rule": route[0],
                "n": route[1],
                "worst_false": (false_worst[c] or {}).get("family"),
                "power": power[c],
                "power_dnh": power_dnh[c],
            }
            for c, (route, _) in chosen.items()
        },
    }
