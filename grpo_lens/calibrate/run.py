"""The run of `grpo-lens calibrate`: levels.json (:func:`rule_levels`), the markdown (:func:`render`), the run
itself (:func:`run_calibration`) and its confined writes."""

from __future__ import annotations

import json
import os
import platform
import resource
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from grpo_lens.calibrate import cells
from grpo_lens.calibrate.budgets import PRIMARY_RULES, TARGET_POWER, holm_summary, rule_budgets
from grpo_lens.calibrate.families import FAMILIES, PLANTED_DIM, CalibrationConfig, at_margin
from grpo_lens.rundir import write_file, writes_confined_to

# ---------------------------------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------------------------------


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


# ---------------------------------------------------------------------------------------------------------------------
# levels, the table, the run
# ---------------------------------------------------------------------------------------------------------------------
def _level_power(row: dict[str, Any]) -> tuple[float, float]:
    """(level, power) of one row under its truth: the wrong verdict's share and the right one's."""
    if row["truth"] == "true":
        return row["does_not_hold"], row["holds"]
    return row["holds"], row["does_not_hold"]


def _rule_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        row
        for key in ("group_rules", "training_rules", "stays_rules", "update_rules", "credit_rules", "baseline_rules")
        for row in result.get(key, [])
    ]


def rule_levels(result: dict[str, Any]) -> dict[str, dict[str, dict[str, float | None]]]:
    """{rule id: {n: {"level": the worst level over its families at n, "power": the lowest power of the *holds*
    branch over its true families at n (None without one), "power_dnh": the lowest power of the *does not hold*
    branch over its false families at n but those on the rule's boundary (:func:`at_margin`: ``boundary``, a
    family planted at the margin; no branch has power there by construction; None without one) and
    "power_dnh_family" where it is lowest, "unit", "families"}}}: what the report prints beside each row, each
    verdict with its own branch's power (a *does not hold* row must not print the *holds* branch's power)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for row in _rule_rows(result):
        level, power = _level_power(row)
        cell = out.setdefault(row["rule"], {}).setdefault(
            str(row["n"]),
            {"level": 0.0, "power": None, "power_dnh": None, "unit": row.get("unit", ""), "families": 0},
        )
        cell["level"] = max(cell["level"], level)
        cell["families"] += 1
        if row["truth"] == "true":
            cell["power"] = power if cell["power"] is None else min(cell["power"], power)
        elif not at_margin(row["family"]) and (cell["power_dnh"] is None or power < cell["power_dnh"]):
            cell["power_dnh"], cell["power_dnh_family"] = power, row["family"]
    return out


def _worst(result: dict[str, Any]) -> dict[str, Any]:
    """The summary: the worst level over every rule and family (and where), the power of each rule at the probe's
    default n (its largest calibrated n for the training and study rules), the lowest interval coverage."""
    rows = _rule_rows(result)
    worst = max(rows, key=lambda r: _level_power(r)[0], default=None)
    levels = rule_levels(result)
    power = {}
    for rule, by_n in levels.items():
        n = "22" if "22" in by_n else max(by_n, key=lambda k: float(k))
        power[rule] = (
            n,
            by_n[n]["power"],
            by_n[n]["unit"],
            by_n[n].get("power_dnh"),
            by_n[n].get("power_dnh_family"),
        )
    return {
        "level": _level_power(worst)[0] if worst else 0.0,
        "where": f"{worst['rule']}, {worst['family']}, n = {worst['n']}" if worst else "",
        "power": power,
        "coverage": min([r["coverage"] for r in result.get("coverage", [])], default=1.0),
    }


def _cells(row: dict[str, Any]) -> tuple[str, str]:
    level, power = _level_power(row)
    wrong, right = ("does not hold", "holds") if row["truth"] == "true" else ("holds", "does not hold")
    return f"{wrong} {level:.3f}", f"{right} {power:.3f}"


def _render_head(result: dict[str, Any]) -> list[str]:
    """The markdown's header and summary (the first part of :func:`render`)."""
    meta = result["meta"]
    worst = _worst(result)
    lines = [
        "# Calibration of the verdict rules",
        "",
        f"Written by `grpo-lens calibrate` ({meta['mode']}) on {meta['date']}, machine {meta['machine']}, "
        f"{meta['cpus']} CPUs ({meta.get('workers', 1)} worker processes of one thread each), load average "
        f"{meta['load_before']} before and {meta['load_after']} after (a shared machine); "
        f"{meta['seconds']:.0f} s wall, "
        f"{meta.get('cpu_seconds', float('nan')):.0f} s CPU over all processes. {meta['trials']} trials per cell; "
        f"each trial draws n "
        f"groups per R from a pool of {meta['pool']} planted groups per (family, R) analysed by `analyse_group` "
        f"(P = {PLANTED_DIM}), then the registered claim decides once across R. One truth per family and claim, "
        f"from what was planted (module docstring of `grpo_lens.calibrate`): level = the wrong verdict's share "
        f"under it (target <= 0.05, <= 0.08 allowing binomial noise at 200 trials), power = the right one's "
        f"(target >= 0.80). Each rule decides at 0.025 per branch on its own; the report's table is decided under "
        f"Holm at a family-wise 0.05 on top (docs/theory.md §11).",
        "",
        "Regenerate: `grpo-lens calibrate --out runs/calibration` writes this file as runs/calibration/calibration.md "
        "(copy it to docs/calibration.md) and levels.json (copy it to grpo_lens/data/calibration_levels.json, which "
        "the report reads); `--quick` is a seconds-long smoke run; `--planted FILE.npz` runs your own cases.",
        "",
        "## Summary",
        "",
        f"Worst level over every rule and family: {worst['level']:.3f} ({worst['where']}); lowest interval coverage "
        f"{worst['coverage']:.3f}.",
        "",
        "| rule | n | power of *holds* (lowest over its true families) | power of *does not hold* (lowest over its "
        "false families, where) |",
        "|---|---|---|---|",
    ]
    for rule, (n, p, unit, pd, fam) in worst["power"].items():
        dnh = "–" if pd is None else f"{pd:.3f} ({fam})"
        lines.append(f"| {rule} | {n} {unit} | {'–' if p is None else f'{p:.3f}'} | {dnh} |")
    return lines


def _fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


def _render_budgets(result: dict[str, Any]) -> list[str]:
    """The summary's budget table (each primary rule's n where each branch reaches power 0.8, its level there) and
    the Holm section (:func:`grpo_lens.calibrate.budgets.holm_summary`)."""
    levels = result.get("levels") or rule_levels(result)
    budgets = rule_budgets(levels)
    hs = result.get("holm") or holm_summary({**result, "levels": levels}, _rule_rows(result))
    lines = [
        "",
        f"### Budgets: the smallest calibrated n where each branch's power reaches {TARGET_POWER}",
        "",
        "Power is the lowest over the rule's families of that truth (*does not hold*: families on the rule's margin "
        "skipped); level is the worst wrong-verdict share over every family at the *holds* budget (at the largest n "
        "where it is not reached).",
        "",
        "| primary claim | rule | *holds*: power 0.8 at | level there | *does not hold*: power 0.8 at | largest n: "
        "power holds / does not hold |",
        "|---|---|---|---|---|---|",
    ]
    for claim, rules in PRIMARY_RULES.items():
        for rule in rules:
            b = budgets.get(rule)
            if b is None:
                continue
            top = f"{b['largest']} {b['unit']}"
            h = f"{b['holds']}" if b["holds"] else f"not reached by {top}"
            d = f"{b['does_not_hold']}" if b["does_not_hold"] else f"not reached by {top}"
            lines.append(
                f"| {claim} | {rule} | {h} | {b['level']:.3f} | {d} | {_fmt(b['power_largest'])} / "
                f"{_fmt(b['power_dnh_largest'])} |"
            )
    lines += [
        "",
        f"### Holm over the primaries (family-wise {hs['alpha']})",
        "",
        f"The {len(hs['primaries'])} primaries decided together under Holm's step-down over their "
        f"{2 * len(hs['primaries'])} one-sided hypotheses at {hs['alpha']} (as the report's table), each at its "
        "route and budget below (the first route whose *holds* power reaches 0.8, else its largest n), trial t of "
        "every rule one joint table (the rules' planted data are independent). Family-wise level with every primary "
        f"on its worst false family: **{hs['level']:.3f}**; with each on its worst family of either truth: "
        f"{hs['level_any']:.3f}. Holm's bound is {hs['alpha']} under any dependence between rows when each rule's "
        "p-values are valid (Holm 1979); the simulation checks it on the planted trials. Power under Holm: each "
        "primary's right verdict when every primary sits on its lowest-power family of that truth.",
        "",
        "| primary claim | rule at n | worst false family | power of *holds* under Holm | power of *does not hold* "
        "under Holm |",
        "|---|---|---|---|---|",
    ]
    for claim, row in hs["primaries"].items():
        lines.append(
            f"| {claim} | {row['rule']} at {row['n']} | {row['worst_false'] or '–'} | {_fmt(row['power'])} | "
            f"{_fmt(row['power_dnh'])} |"
        )
    return lines


def render(result: dict[str, Any]) -> str:
    """The markdown of a calibration result (what docs/calibration.md holds)."""
    meta = result["meta"]
    lines = _render_head(result) + _render_budgets(result)
    lines += [
        "",
        "## Rules on per-group rows (probe): rank ≈ 2 and the labels structure G1",
        "",
        "Families: "
        + "; ".join(f"`{k}` {v}" for k, v in FAMILIES.items() if k in meta.get("families", FAMILIES))
        + ". Population values (E₂, E₁ over 1500 planted groups; θ̄ of the cosine Gram over the pool's informative "
        "groups) after each family's rows.",
        "",
        "| rule | family | groups (R = 4 / 8) | truth | level (wrong verdict) | power (right verdict) |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["group_rules"]:
        level, power = _cells(row)
        lines.append(f"| {row['rule']} | {row['family']} | {row['groups']} | {row['truth']} | {level} | {power} |")
    lines += [""] + [
        f"- `{fam}`: {pop}" for fam, pop in dict.fromkeys((r["family"], r["population"]) for r in result["group_rules"])
    ]
    sections = [
        (
            "training_rules",
            "Trends over training: one run (Hoyer: first differences; S1: OLS with a fixed-b HAC t) and seeds pooled "
            "(t over the seeds' OLS slopes), LR warm-up dropped",
        ),
        ("stays_rules", "Rank stays ≈ 2 at every lens step (planted lens runs, R = 8, 7 lens steps; one run or seeds)"),
        ("update_rules", "Most parameters unchanged (S4), on a planted update through the lens's sampler"),
        (
            "credit_rules",
            "Uniform credit disagrees with Monte Carlo credit (opposing shift by position, margin 0.1, K_mc = 8)",
        ),
        (
            "baseline_rules",
            "The group mean is the variance-optimal baseline (RMS of log m_C / m_W, margin log 1.25; M = 16, R = 4)",
        ),
    ]
    for key, title in sections:
        if not result.get(key):
            continue
        lines += [
            "",
            f"## {title}",
            "",
            "| rule | planted case | n | truth | level (wrong verdict) | power |",
            "|---|---|---|---|---|---|",
        ]
        for row in result[key]:
            level, power = _cells(row)
            lines.append(
                f"| {row['rule']} | {row['family']} | {row['n']} {row.get('unit', '')} | {row['truth']} | "
                f"{level} | {power} |"
            )
    lines += [
        "",
        "## Rows without a verdict (descriptive) and checks",
        "",
        "- `zero_sum_g2_weighting` (G2 stable rank under A against weightings that are not zero-sum): "
        "descriptive; its 0.2 rule said *does not hold* whether the zero-sum constraint was irrelevant or "
        "decisive, so it has no calibrated verdict.",
        "- `uniform_token_credit` (update shares against NLL weights): descriptive; its NLL control is not "
        "zero-sum and the paper does not make this claim.",
        "- Erank, stable rank, participation ratio, k90, k99: printed beside E₂, without verdicts.",
        "- `identity`, `identical_token_advantage`: checks (algebra with a control), not tests.",
        "",
        "## Interval coverage (`mean_interval`, nominal 0.95)",
        "",
        "| data | n | coverage | upper end below the mean | lower end above the mean |",
        "|---|---|---|---|---|",
    ]
    for row in result.get("coverage", []):
        lines.append(
            f"| {row['data']} | {row['n']} | {row['coverage']:.3f} | {row['miss_below']:.3f} | "
            f"{row['miss_above']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def run_calibration(
    config: CalibrationConfig, out: Path | None = None, mode: str = "full", log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Run every calibration and return {meta, group_rules, training_rules, stays_rules, update_rules,
    credit_rules, baseline_rules, coverage, levels}; with ``out``, also write OUT/calibration.json,
    OUT/calibration.md (the table) and OUT/levels.json (:func:`rule_levels`)."""
    t0, load0 = time.perf_counter(), _load()
    cpu0 = sum(
        resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # [R, R] matrices: one thread is ~3x faster than several (thread start-up per op)
    sections: list[tuple[str, Callable[[], Any]]] = [
        ("group_rules", lambda: cells.calibrate_group_rules(config, log)),
        ("baseline_rules", lambda: cells.calibrate_baseline_rules(config)),
    ]
    if config.training:
        sections += [
            ("training_rules", lambda: cells.calibrate_training_rules(config)),
            ("stays_rules", lambda: cells.calibrate_stays_rules(config)),
        ]
    sections += [
        ("update_rules", lambda: cells.calibrate_update_rules(config)),
        ("credit_rules", lambda: cells.calibrate_credit_rules(config)),
        ("coverage", lambda: cells.interval_coverage(config)),
    ]
    result: dict[str, Any] = {}
    try:
        for key, fn in sections:
            t1 = time.perf_counter()
            result[key] = fn()
            log(f"calibrate: {key}: {time.perf_counter() - t1:.0f} s (load {_load()})")
            if out is not None:  # a run stopped later keeps the sections it finished
                write_outputs(out, {"calibration.partial.json": json.dumps(result, indent=1)})
    finally:
        torch.set_num_threads(threads)
    cpu = (
        sum(
            resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
            for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        )
        - cpu0
    )
    result["meta"] = {
        "mode": mode,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu_seconds": cpu,
        "workers": config.workers,
        "machine": f"{platform.machine()} {platform.processor() or platform.system()}",
        "cpus": os.cpu_count(),
        "load_before": load0,
        "load_after": _load(),
        "seconds": time.perf_counter() - t0,
        "trials": config.trials,
        "pool": config.pool,
        "coverage_trials": config.coverage_trials,
        "seed": config.seed,
        "families": list(config.families),
    }
    result["levels"] = rule_levels(result)
    result["holm"] = holm_summary(result, _rule_rows(result))
    if out is not None:
        write_outputs(
            out,
            {
                "calibration.json": json.dumps(result, indent=1),
                "calibration.md": render(result),
                "levels.json": json.dumps(result["levels"], indent=1, sort_keys=True),
            },
        )
    return result


def write_outputs(out: Path, files: dict[str, str]) -> None:
    """Write {name: text} into ``out`` (made if missing) through :func:`grpo_lens.rundir.write_file`, confined to
    ``out`` (:func:`grpo_lens.rundir.writes_confined_to`): a file planted there as a link is replaced, the file it
    points to unchanged.

    Raises:
        UnsafeWriteError: ``out`` is not writable or a name in it is a folder (one line naming it).
    """
    out.mkdir(parents=True, exist_ok=True)
    with writes_confined_to(out):
        for name, text in files.items():
            write_file(out / name, text)
