"""The report's section on a pooled probe (``grpo-lens probe --seeds``, :mod:`grpo_lens.probe.seeds`): each seed's
verdicts beside the pooled one, and for the numbers the claims decide on each seed's own interval, the between-seed
spread (SD, range, Cochran's Q) and the stratified interval beside the pooled groups' interval. Read from the pooled
probe.json and the seeds' probe.json files alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grpo_lens import metrics as mk
from grpo_lens.claims.base import Claim, evaluate_claims, holm_claims
from grpo_lens.formulas.pooling import between_seed_spread
from grpo_lens.report.format import ci, fmt, md_row, md_table
from grpo_lens.rundir import read_json_file

#: the per-group numbers the seeds section shows: the ones the rank, zero-sum and identity claims decide on
SEED_KEYS = (
    mk.RANK_G1.format(m="top2_share"),
    mk.RANK_G1.format(m="top1_share"),
    mk.RANK_G1.format(m="erank"),
    mk.RANK_G1.format(m="stable_rank"),
    mk.ZERO_SUM_SPAN_ENERGY_EXCESS,
    mk.GRAD_IDENTITY_RESIDUAL,
)


def claim_rows(claims: list[Claim]) -> list[tuple[str, int]]:
    """Each claim row's key (claim, i): its i-th row of that claim. A claim writes its rows in one order (by R) in
    every probe of one configuration, while a scope may name a count that pooling changes ("R = 4, 6 prompts")."""
    seen: dict[str, int] = {}
    keys = []
    for c in claims:
        keys.append((c.claim, seen.get(c.claim, 0)))
        seen[c.claim] = keys[-1][1] + 1
    return keys


def seed_verdicts(pooled: dict[str, Any], run_dir: Path) -> tuple[list[str], dict[tuple[str, int], dict[int, str]]]:
    """(seeds whose probe.json is missing, {claim row key (:func:`claim_rows`): {seed: verdict}}) from
    run_dir/seed_<s>/probe.json, each evaluated by :func:`grpo_lens.claims.evaluate_claims` as a probe of its own and
    decided under Holm as that seed's own report decides it (:func:`grpo_lens.claims.base.holm_claims`)."""
    verdicts: dict[tuple[str, int], dict[int, str]]
    missing, verdicts = [], {}
    for s, d in zip(pooled["seeds"]["seeds"], pooled["seeds"]["dirs"]):
        path = run_dir / d / "probe.json"
        if not path.is_file():
            missing.append(str(path))
            continue
        claims, _ = holm_claims(evaluate_claims(read_json_file(path)))
        for key, c in zip(claim_rows(claims), claims):
            verdicts.setdefault(key, {})[s] = c.verdict
    return missing, verdicts


def seed_probes(pooled: dict[str, Any], run_dir: Path) -> list[dict[str, Any]]:
    """Each seed's own probe (run_dir/seed_<s>/probe.json of a pooled probe's ``seeds`` section), those that exist,
    in the seeds' order; [] for a probe that pools nothing."""
    info = pooled.get("seeds") or {}
    paths = [run_dir / d / "probe.json" for d in info.get("dirs") or []]
    return [read_json_file(path) for path in paths if path.is_file()]


def seeds_section(pooled: dict[str, Any], run_dir: Path) -> list[str]:
    """The "Seeds pooled" section of a pooled probe's report (a probe.json with a ``seeds`` section)."""
    info = pooled["seeds"]
    seeds = info["seeds"]
    dirs = ", ".join(f"`{d}/`" for d in info["dirs"])
    lines = [
        "## Seeds pooled",
        "",
        (
            f"This probe pools {len(seeds)} runs that differ only in their seed ({dirs}, each a probe run directory "
            f"with its own report). The claims table above is decided on the pooled groups. Below: each seed's "
            f"verdicts from its own groups; then, per R, each seed's mean with its 95% interval over its groups "
            f"(within-run), the SD and range of the seeds' means, Cochran's Q p-value (small: the seeds differ by "
            f"more than their within-run intervals allow, so a rerun's uncertainty is larger than the pooled "
            f"interval says), and the 95% interval with the seed as a stratum (Cochran eq. 5.6, Satterthwaite df; "
            f"between-seed differences of the mean do not enter it) beside the interval over the pooled groups "
            f"(docs/seeds.md)."
        ),
        "",
    ]
    pooled_claims, _ = holm_claims(evaluate_claims(pooled))  # the verdicts of the claims table above, under Holm
    missing, per_seed = seed_verdicts(pooled, run_dir)
    if missing:
        lines += [f"Per-seed verdicts not shown: {', '.join(missing)} missing.", ""]
    else:
        lines += md_table(["claim", "scope", "pooled", *[f"seed {s}" for s in seeds], "seeds agreeing"])
        for key, c in zip(claim_rows(pooled_claims), pooled_claims):
            v = per_seed.get(key, {})
            agree = sum(v.get(s) == c.verdict for s in seeds)
            lines.append(
                md_row(c.claim, c.scope, f"**{c.verdict}**", *[v.get(s, "–") for s in seeds], f"{agree}/{len(seeds)}")
            )
        lines.append("")
    lines += md_table(
        [
            "R",
            "key",
            *[f"seed {s}" for s in seeds],
            "SD of seeds [range]",
            "Cochran Q p",
            "pooled groups",
            "seed as stratum",
        ]
    )
    for R, d in sorted(info["per_group_size"].items(), key=lambda kv: int(kv[0])):
        for key in SEED_KEYS:
            k = d["keys"].get(key)
            if not k:
                continue
            sp = k["spread"]
            spread = f"{fmt(sp['sd'])} [{fmt(sp['min'])}, {fmt(sp['max'])}]" if sp["sd"] is not None else "–"
            lines.append(
                md_row(
                    R,
                    f"`{key}`",
                    *[ci(w) for w in k["within"]],
                    spread,
                    fmt(sp["p"]),
                    ci(k["pooled"]),
                    ci(k["stratified"]),
                )
            )
    lines.append("")
    g3 = [
        f"R = {R}: "
        + ", ".join(f"seed {s} {fmt(d['g3'].get(str(s), {}).get(mk.rank_key('g3', 'stable_rank')), 2)}" for s in seeds)
        for R, d in sorted(info["per_group_size"].items(), key=lambda kv: int(kv[0]))
    ]
    lines += [
        "G3 (one matrix per run over its own groups, from a sketch seeded by the run's seed) is not pooled; "
        "its stable rank per seed: " + "; ".join(g3) + ".",
        "",
    ]
    return lines


def pooled_finals(table: dict[str, dict[str, Any]], keys: list[str], labels: list[str]) -> dict[str, Any]:
    """Per metric key, the runs' final numbers pooled over seeds (``grpo-lens compare`` of runs that differ only in
    their seed): {key: {"per_run": [final mean], "mean": mean over runs, "sd", "min", "max", "runs"}}. A run is the
    unit here (each seed trains its own policy): the SD over runs is the rerun-to-rerun spread the within-run
    intervals do not show."""
    out = {}
    for key in keys:
        finals = [(table[lab].get(key) or {}).get("mean") for lab in labels]
        have = [f for f in finals if f is not None]
        if not have:
            continue
        spread = between_seed_spread([[f] if f is not None else [] for f in finals])
        out[key] = {
            "per_run": finals,
            "mean": sum(have) / len(have),
            "sd": spread["sd"],
            "min": spread["min"],
            "max": spread["max"],
            "runs": len(have),
        }
    return out


def compare_seeds_section(pooled: dict[str, Any], metrics: list[tuple[str, str]], seeds: dict[str, Any]) -> list[str]:
    """compare.md's section on runs that differ only in their seed (``seeds``: run label -> seed)."""
    if not pooled:
        return []
    lines = [
        "## Seeds pooled",
        "",
        (
            f"The runs differ only in their seed ({', '.join(f'`{lab}`: {s}' for lab, s in seeds.items())}), so "
            f"they are reruns of one configuration: per metric, the mean of the runs' final numbers, their SD over "
            f"runs (the rerun-to-rerun spread, which the intervals above do not show) and their range. No interval "
            f"over runs from fewer than 8 (docs/seeds.md)."
        ),
        "",
        *md_table(["metric", "mean over runs", "SD over runs", "range", "runs"]),
    ]
    for key, label in metrics:
        if key in pooled:
            p = pooled[key]
            lines.append(
                md_row(
                    f"{label} (`{key}`)", fmt(p["mean"]), fmt(p["sd"]), f"[{fmt(p['min'])}, {fmt(p['max'])}]", p["runs"]
                )
            )
    return lines + [""]
