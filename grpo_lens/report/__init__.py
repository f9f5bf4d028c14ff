"""``grpo-lens report RUN_DIR``: report.md and PNG plots, read from the run directory alone.

A run directory may hold a training run (metrics.jsonl, config.yaml, in the folder or in ``train/``), probes
(probe.json in the folder itself or in ``probe_before/`` and ``probe_after/``), or both (the demo). Every sentence under "Findings" is computed from those
numbers; nothing is hard-coded.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from grpo_lens.report import plots

RANK_MEASURES_SHOWN = ("erank", "stable_rank", "participation_ratio", "k90", "k99")
NEAR_TWO = 0.5  # "near 2" in the findings means |erank - 2| <= this


class ReportError(ValueError):
    """The directory holds nothing a report can be written from."""


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def find_probes(run_dir: Path) -> dict[str, dict[str, Any]]:
    """label -> probe.json content for every probe in the run directory (before/after training, or standalone)."""
    probes = {}
    for label, sub in (("before", "probe_before"), ("after", "probe_after"), ("probe", ".")):
        path = run_dir / sub / "probe.json"
        if path.exists():
            probes[label] = json.loads(path.read_text())
    return probes


def _fmt(x: Any, nd: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    if isinstance(x, int):
        return str(x)
    return f"{x:.{nd}f}"


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


# ---------------------------------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------------------------------
def training_section(records: list[dict[str, Any]], run_dir: Path, findings: list[str]) -> list[str]:
    """Learning curves, sparsity and baselines over training."""
    lines = ["## Training", ""]
    n = len(records)
    head, tail = records[: min(5, n)], records[max(0, n - 5):]
    r0, r1 = _mean([r.get("reward/mean") for r in head]), _mean([r.get("reward/mean") for r in tail])
    a0, a1 = _mean([r.get("reward/accuracy") for r in head]), _mean([r.get("reward/accuracy") for r in tail])
    sec = _mean([r.get("perf/step_seconds") for r in records])
    lines += [f"{n} steps. Mean reward over the first {len(head)} steps {_fmt(r0)}, over the last {len(tail)} steps "
              f"{_fmt(r1)}; accuracy {_fmt(a0)} -> {_fmt(a1)}. {_fmt(sec, 1)} s per step on average.", ""]
    if r0 is not None and r1 is not None:
        verb = "rose" if r1 > r0 else ("fell" if r1 < r0 else "stayed flat")
        findings.append(f"Mean reward {verb} over training: {_fmt(r0)} (first {len(head)} steps) -> {_fmt(r1)} "
                        f"(last {len(tail)} steps).")
    plots.plot_learning_curves(records, run_dir / "learning_curves.png")
    lines += ["![learning curves](learning_curves.png)", ""]

    lines += ["### Sparsity of the gradient over training", "",
              "S1 is the share of groups whose rewards are all equal: they carry exactly zero policy gradient. Its "
              "prediction from each prompt's success rate p is mean(p^R + (1-p)^R). S4 is the share of parameters "
              "whose bf16 value did not change.", ""]
    plots.plot_sparsity(records, run_dir / "sparsity.png")
    lines += ["![sparsity](sparsity.png)", ""]
    lens_rows = [r for r in records if r.get("sparsity/zero_var_groups_predicted") is not None]
    if lens_rows:
        lines += ["| step | accuracy | S1 measured | S1 predicted | S4 step | S4 since start | G1 erank | "
                  "G1 stable rank | identity residual |", "|---|---|---|---|---|---|---|---|---|"]
        for r in lens_rows:
            res = r.get("grad/identity_residual")
            lines.append(f"| {r['step']} | {_fmt(r.get('reward/accuracy'))} | "
                         f"{_fmt(r.get('reward/frac_zero_std_groups'))} | "
                         f"{_fmt(r.get('sparsity/zero_var_groups_predicted'))} | "
                         f"{_fmt(r.get('sparsity/update_step'))} | {_fmt(r.get('sparsity/update_total'))} | "
                         f"{_fmt(r.get('rank/g1_erank'))} | {_fmt(r.get('rank/g1_stable_rank'))} | "
                         f"{'–' if res is None else f'{res:.1e}'} |")
        lines.append("")
    s1 = [r.get("reward/frac_zero_std_groups") for r in records]
    s1_head, s1_tail = _mean(s1[:5]), _mean(s1[-5:])
    if s1_head is not None and s1_tail is not None:
        direction = "rose" if s1_tail > s1_head else ("fell" if s1_tail < s1_head else "stayed flat")
        findings.append(f"S1 (zero-variance group share) {direction}: {_fmt(s1_head)} (first steps) -> "
                        f"{_fmt(s1_tail)} (last steps), while accuracy went {_fmt(a0)} -> {_fmt(a1)}.")
    if lens_rows:
        gap = _mean([abs(r["reward/frac_zero_std_groups"] - r["sparsity/zero_var_groups_predicted"])
                     for r in lens_rows if r.get("reward/frac_zero_std_groups") is not None])
        findings.append(f"S1 measured vs predicted differ by {_fmt(gap)} on average over the {len(lens_rows)} lens "
                        f"steps (a prediction from one group's own success rate; it is biased for small R).")
        s4 = [r.get("sparsity/update_total") for r in lens_rows if r.get("sparsity/update_total") is not None]
        if s4:
            findings.append(f"Update sparsity since the start (S4): {_fmt(s4[-1])} of parameters kept their bf16 "
                            f"value after {lens_rows[-1]['step']} steps.")

    base_rows = [r for r in records if r.get("baseline/b_star") is not None]
    if base_rows:
        lines += ["### Baselines", "",
                  "b* = sum ||g_i||^2 r_i / sum ||g_i||^2 is the variance-optimal constant baseline; it equals the "
                  "group mean exactly when ||g||^2 does not depend on the reward (m_C = m_W).", ""]
        plots.plot_baselines(records, run_dir / "baselines.png")
        lines += ["![baselines](baselines.png)", "",
                  "| step | b* | group mean | m_C | m_W | m_C / m_W |", "|---|---|---|---|---|---|"]
        for r in base_rows:
            mc, mw = r.get("baseline/m_correct"), r.get("baseline/m_wrong")
            ratio = mc / mw if mc is not None and mw else None
            lines.append(f"| {r['step']} | {_fmt(r['baseline/b_star'])} | {_fmt(r.get('baseline/group_mean'))} | "
                         f"{_fmt(mc, 4)} | {_fmt(mw, 4)} | {_fmt(ratio)} |")
        lines.append("")
        ratios = [r["baseline/m_correct"] / r["baseline/m_wrong"] for r in base_rows
                  if r.get("baseline/m_correct") is not None and r.get("baseline/m_wrong")]
        if ratios:
            span = _fmt(min(ratios)) if min(ratios) == max(ratios) else f"{_fmt(min(ratios))}–{_fmt(max(ratios))}"
            findings.append(f"m_C / m_W over {len(ratios)} lens step(s): {span}: "
                            + ("correct rollouts had smaller score-gradient norms, so b* sits below the group mean."
                               if max(ratios) < 1 else "correct rollouts had larger score-gradient norms, so b* sits "
                               "above the group mean." if min(ratios) > 1 else
                               "neither outcome had consistently larger gradient norms."))
    return lines


def rank_table(probe: dict[str, Any], measures: tuple[str, ...] = RANK_MEASURES_SHOWN) -> list[str]:
    """Markdown table: rows = (R, matrix), columns = rank measures as mean ± std over groups."""
    per_r = probe["per_group_size"]
    lines = ["| R | matrix | groups | " + " | ".join(measures) + " |", "|---|---|---|" + "---|" * len(measures)]
    for r in sorted(per_r, key=int):
        for matrix, stats in per_r[r]["rank"].items():
            cells = []
            for m in measures:
                s = stats.get(m) or {}
                cells.append(f"{_fmt(s.get('mean'), 2)} ± {_fmt(s.get('std'), 2)}" if s else "–")
            n = stats.get("groups", per_r[r].get("groups_mixed"))
            lines.append(f"| {r} | {matrix} | {n} | " + " | ".join(cells) + " |")
    return lines


def _g2_cell(g2: dict[str, Any]) -> str:
    """'rank / bound' per group, e.g. '61/75, 64/80' (the bound is prompt tokens + distinct completion prefixes)."""
    ranks, bounds = g2.get("numerical_rank") or [], g2.get("rank_bound") or []
    return ", ".join(f"{r}/{b}" for r, b in zip(ranks, bounds)) or "–"


def probe_section(label: str, probe: dict[str, Any], run_dir: Path, findings: list[str]) -> list[str]:
    """Effective-rank table, identity residuals, S1, baselines and credit of one probe."""
    per_r = probe["per_group_size"]
    meta = probe.get("meta", {})
    lines = [f"## Gradient probe: {label}", "",
             f"Model {meta.get('model')}, task {meta.get('task')}, gradients {meta.get('gradients')}"
             f"{' (sketch ' + str(meta.get('sketch_dim')) + ' per side per layer)' if meta.get('gradients') == 'sketch' else ''}"
             f", std convention {meta.get('std')}, eps {meta.get('eps')}.", ""]
    lines += ["| R | groups sampled | all-equal (skipped) | mixed | S1 measured | S1 predicted | identity residual "
              "(max) | distinct completions (mean) | G2 numerical rank / bound |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(per_r, key=int):
        d = per_r[r]
        res = d.get("identity_residual", {}).get("max")
        lines.append(f"| {r} | {d.get('groups_sampled')} | {d.get('groups_all_equal')} | {d.get('groups_mixed')} | "
                     f"{_fmt(d.get('s1_measured'))} | {_fmt(d.get('s1_predicted'))} | "
                     f"{'–' if res is None else f'{res:.1e}'} | {_fmt(d.get('distinct_completions_mean'), 2)} | "
                     f"{_g2_cell(d.get('g2', {}))} |")
        if d.get("groups_mixed", 0) == 0:
            findings.append(f"[{label}] R={r}: no mixed group among {d.get('groups_sampled')} sampled (S1 = "
                            f"{_fmt(d.get('s1_measured'))}): GRPO's policy gradient was exactly zero on every "
                            f"sampled group, so no rank could be measured.")
    lines += ["", "### Effective rank vs group size", "",
              "G1: rows A_i g_i of a group (the per-rollout policy-gradient terms). Controls on the same tokens: "
              "G1_no_adv (rows g_i), G1_random_zero_sum (rows w_i g_i, w random zero-sum with ||w|| = ||A||, "
              "averaged over draws), G1_nll (rows of the supervised NLL gradient). G2: the layer weight gradient "
              "of the group loss. G3: rows = per-group policy gradients of the batch.", ""]
    lines += rank_table(probe) + [""]
    # Findings on rank: computed, never assumed.
    for r in sorted(per_r, key=int):
        g1 = per_r[r]["rank"].get("G1", {}).get("erank", {})
        ctrl = per_r[r]["rank"].get("G1_random_zero_sum", {}).get("erank", {})
        sr = per_r[r]["rank"].get("G1", {}).get("stable_rank", {})
        if g1.get("mean") is None:
            continue
        near = abs(g1["mean"] - 2.0) <= NEAR_TWO
        note = " (R = 2 caps every rank measure at 2)" if int(r) == 2 else ""
        findings.append(f"[{label}] R={r}: G1 erank {_fmt(g1['mean'], 2)} ± {_fmt(g1.get('std'), 2)}, stable rank "
                        f"{_fmt(sr.get('mean'), 2)}, random zero-sum control {_fmt(ctrl.get('mean'), 2)}: "
                        f"{'within' if near else 'outside'} ±{NEAR_TWO} of 2{note}.")
    res_all = [per_r[r].get("identity_residual", {}).get("max") for r in per_r]
    res_all = [x for x in res_all if x is not None]
    if res_all:
        findings.append(f"[{label}] The rank-2 identity sum_i A_i g_i = c(k,R)(gbar_C - gbar_W) held to a relative "
                        f"residual of at most {max(res_all):.1e} over all mixed groups.")
    plots.plot_erank_vs_group_size({label: probe}, run_dir / f"erank_vs_R_{label}.png")
    plots.plot_spectra(probe, run_dir / f"spectra_{label}.png")
    lines += [f"![erank vs R]({f'erank_vs_R_{label}.png'})", f"![spectra]({f'spectra_{label}.png'})", ""]

    lines += ["### Baselines", "",
              "Variance of the gradient estimate (1/R) sum_i (r_i - b_i) g_i under each baseline, relative to the "
              "leave-one-out optimal baseline b*, from groups of R resampled out of M rollouts of one prompt. The "
              "group mean is not leave-one-out: it equals rloo scaled by (R-1)/R, so its variance is ((R-1)/R)^2 "
              "times rloo's (a shorter step, not a better direction).", "",
              "| R | b* (mean) | group mean | m_C | m_W | Var/Var* none | mean | rloo | optimal |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(per_r, key=int):
        b = per_r[r].get("baselines", {})
        rel = b.get("relative_variance", {})
        lines.append(f"| {r} | {_fmt(b.get('b_star'))} | {_fmt(b.get('group_mean'))} | {_fmt(b.get('m_correct'), 4)}"
                     f" | {_fmt(b.get('m_wrong'), 4)} | {_fmt(rel.get('none'), 2)} | {_fmt(rel.get('mean'), 2)} | "
                     f"{_fmt(rel.get('rloo'), 2)} | {_fmt(rel.get('optimal'), 2)} |")
        if rel.get("rloo") is not None:
            findings.append(f"[{label}] R={r}: the rloo baseline's gradient variance is {_fmt(rel['rloo'], 2)}x the "
                            f"leave-one-out optimal b*'s; no baseline at all gives {_fmt(rel.get('none'), 2)}x "
                            f"(one resampling estimate over {b.get('prompts')} prompt(s) of "
                            f"{per_r[r].get('rollouts_per_prompt')} rollouts; g_i is length-normalised, so its mean "
                            f"is not exactly 0 and a constant baseline's optimum need not minimise this variance).")
    plots.plot_baseline_variance(probe, run_dir / f"baseline_variance_{label}.png")
    lines += ["", f"![baseline variance](baseline_variance_{label}.png)", ""]

    lines += ["### Credit", "",
              "Under an output-only reward every token of a rollout gets the same advantage: the per-token "
              "advantage variance within a rollout is measured, not assumed.", "",
              "| R | within-rollout advantage variance (max) | answer-token share of ||g||^2 | answer tokens share "
              "of tokens |", "|---|---|---|---|"]
    for r in sorted(per_r, key=int):
        c = per_r[r].get("credit", {})
        lines.append(f"| {r} | {_fmt(c.get('within_rollout_adv_var_max'), 6)} | {_fmt(c.get('answer_grad_share'))} | "
                     f"{_fmt(c.get('answer_token_share'))} |")
    plots.plot_credit_profile(probe, run_dir / f"credit_profile_{label}.png")
    lines += ["", f"![credit profile](credit_profile_{label}.png)", ""]
    return lines


def write_report(run_dir: Path) -> Path:
    """Write run_dir/report.md and its PNGs from the run directory's files; return the report's path.

    Raises:
        ReportError: the directory has neither metrics.jsonl nor any probe.json.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a directory; pass a run directory written by train, probe or demo")
    train_dir = run_dir / "train" if (run_dir / "train" / "metrics.jsonl").exists() else run_dir  # demo layout
    records = [r for r in _read_jsonl(train_dir / "metrics.jsonl") if "step" in r]
    probes = find_probes(run_dir)
    if not records and not probes:
        raise ReportError(f"{run_dir} holds neither metrics.jsonl nor probe.json; nothing to report")
    findings: list[str] = []
    body: list[str] = []
    if records:
        body += training_section(records, run_dir, findings)
    for label, probe in probes.items():
        body += probe_section(label, probe, run_dir, findings)
    if len(probes) > 1:
        plots.plot_erank_vs_group_size(probes, run_dir / "erank_vs_R.png")
        body += ["## Before vs after training", "", "![erank vs R, before and after](erank_vs_R.png)", ""]

    header = ["# grpo-lens report", "", f"Run directory: `{run_dir}`.", ""]
    config = train_dir / "config.yaml"
    if config.exists():
        header += ["<details><summary>config</summary>", "", "```yaml", config.read_text().strip(), "```", "",
                   "</details>", ""]
    header += ["## Findings", "", *[f"- {f}" for f in findings], ""]
    path = run_dir / "report.md"
    path.write_text("\n".join(header + body) + "\n")
    return path
