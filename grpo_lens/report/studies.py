"""The report section of a probe's studies (probe.json ``studies``): S1 predicted from rollouts outside the group
(docs/theory.md §S1), baselines at matched expectation (§Baselines at matched expectation) and token credit, signed
shares and Monte Carlo advantages (§Token credit).

Everything comes from probe.json; the claims these numbers decide are in :mod:`grpo_lens.claims.credit` and
:mod:`grpo_lens.claims.baselines`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from grpo_lens.claims.base import ci_text
from grpo_lens.claims.credit import MC_LEVEL, MC_MARGIN, opposition_count
from grpo_lens.formulas.credit import opposing_shifts, prefix_success_counts
from grpo_lens.formulas.stats import MIN_INTERVAL_UNITS, mean_interval
from grpo_lens.report import plots
from grpo_lens.report.format import ci, fmt, interval, md_row, md_table


def studies_section(label: str, studies: dict[str, Any], run_dir: Path, findings: list[str]) -> list[str]:
    """S1 predicted without bias, baselines at matched expectation and token credit of one probe."""
    lines: list[str] = []
    base = studies.get("baselines") or {}
    s1 = base.get("s1")
    meta = base.get("meta", {})
    if s1:
        lines += _s1_lines(label, s1, meta)
    study = base.get("baselines")
    if study:
        lines += _baseline_lines(label, study, meta, findings)
    credit = studies.get("credit")
    if credit:
        lines += _credit_lines(label, credit, run_dir)
    return lines


def _s1_lines(label: str, s1: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    """S1 measured on the first R rollouts of each prompt beside its unbiased prediction from the other M - R."""
    lines: list[str] = []
    lines += [
        f"### S1 predicted from rollouts outside the group ({label})",
        "",
        f"{s1['prompts']} prompts, M = {s1['rollouts_per_prompt']} rollouts each, R = "
        f"{meta.get('group_size')}: S1 measured on the first R, predicted by [C(k',R) + C(M'-k',R)] / "
        "C(M',R) from the other M' = M - R (unbiased, docs/theory.md §S1).",
        "",
        *md_table(
            ["S1 measured", "S1 predicted", "measured - predicted"],
            [[ci(s1["measured"]), ci(s1["predicted"]), ci(s1["difference"])]],
        ),
        "",
    ]
    return lines


def _baseline_lines(label: str, study: dict[str, Any], meta: dict[str, Any], findings: list[str]) -> list[str]:
    """The baselines' MSE, cosine and bias table, m_C / m_W per prompt, and the finding on population b*."""
    lines: list[str] = []
    s = study["summary"]
    lines += [
        f"### Baselines at matched expectation ({label})",
        "",
        f"{study['prompts']} prompts with reward contrast ({study['prompts_constant']} without were "
        f"skipped), M = {meta.get('rollouts_per_prompt')} rollouts each, groups of R = "
        f"{meta.get('group_size')} drawn from one half of each prompt's rollouts and compared with the "
        "centred gradient Cov(r, h) estimated on the other half; h_i = c_i g_i, "
        f"{meta.get('gradients')}, d_s = {meta.get('sketch_dim')} per side. MSE is the per-prompt ratio to "
        "RLOO's; the group mean is rescaled by R/(R-1) (it then equals RLOO sample by sample). 95% "
        "intervals over prompts (Hall's transformed t, docs/theory.md §7).",
        "",
        *md_table(["estimator", "MSE / RLOO's", "cosine to reference", "bias² share of MSE"]),
    ]
    for name in ("none", "mean_rescaled", "rloo", "optimal_loo", "optimal_pop"):
        e = s.get(name, {})
        lines.append(md_row(name, ci(e.get("mse_ratio_to_rloo")), ci(e.get("cosine")), ci(e.get("bias2_share"))))
    lines += [
        "",
        f"RMS over prompts of log(m_C / m_W), less each prompt's noise (what the claim decides on, margin "
        f"log 1.25 = 0.223): {_rms_text(study.get('log_ratio_rms'))}. "
        f"m_C / m_W over prompts: {ci(study.get('norm_ratio'))}; m_C = m_W rejected (permutation "
        f"test at 0.05 over each prompt's rollouts, k fixed) on "
        f"{fmt(study.get('equal_norms_rejected'), 2)} of "
        f"{study.get('equal_norms_testable')} testable prompts. b* - p (how far the optimal constant "
        f"baseline is from the group mean's expectation): {ci(study.get('b_star_minus_p'))}.",
        "",
        _mean_score_sentence(study),
        "",
        *md_table(
            [
                "prompt",
                "p",
                "m_C",
                "m_W",
                "m_C / m_W [95%]",
                "permutation p",
                "verdict",
                "b* (population)",
                "b*_exact",
            ]
        ),
    ]
    for j, p in enumerate(study["per_prompt"]):
        eq = p["equal_norms"]
        interval = f"[{fmt(eq['lo'], 2)}, {fmt(eq['hi'], 2)}]" if eq.get("lo") is not None else "(< 8 a side)"
        lines.append(
            md_row(
                j,
                fmt(p["p"], 2),
                fmt(p["m_correct"], 4),
                fmt(p["m_wrong"], 4),
                f"{fmt(eq['ratio'], 2)} {interval}",
                fmt(eq.get("p"), 3),
                eq["verdict"],
                fmt(p["b_star_pop"]),
                fmt(p["b_star_exact"]),
            )
        )
    lines.append("")
    opt = s.get("optimal_pop", {}).get("mse_ratio_to_rloo", {})
    findings.append(
        f"[{label}] Population b* has {ci(opt, 2)} times RLOO's MSE to the reference gradient over "
        f"{study['prompts']} prompts; m_C / m_W = {ci(study.get('norm_ratio'), 2)}."
    )
    return lines


def _credit_lines(label: str, credit: dict[str, Any], run_dir: Path) -> list[str]:
    """Signed token shares by relative position and token class, and the Monte Carlo token advantages."""
    lines: list[str] = []
    c = credit["contributions"]
    mc = credit["monte_carlo"]
    lines += [
        f"### Token credit ({label})",
        "",
        f"Signed share of each token in its group's update, s = w <grad log pi_t, u> / ||u||^2 (sums to 1 "
        f"per group; largest closure error {fmt(c.get('closure'), 4)}), over {c['groups']} groups of R = "
        f"{credit['meta']['group_size']}; u is the exact update over every parameter.",
        "",
    ]
    prof = c.get("position_profile") or []
    if prof:
        plot_credit_position(prof, run_dir / f"credit_position_{label}.png")
        lines += [
            f"![credit by relative position](credit_position_{label}.png)",
            "",
            *md_table(
                [
                    "relative position",
                    *(f"{b / len(prof):.1f}-{(b + 1) / len(prof):.1f}" for b in range(len(prof))),
                ],
                [["share of update", *(ci(x, 2) for x in prof)]],
            ),
            "",
        ]
    nll = c.get("classes_nll") or {}
    head = ["token class", "share of the update", "share of the tokens", "ratio"]
    lines += md_table(head + (["ratio under NLL weights (same tokens)", "ratio − NLL's (paired)"] if nll else []))
    for name, v in c["classes"].items():
        extra = [ci(nll[name]["ratio"], 2), ci(nll[name]["ratio_minus_nll"], 2)] if name in nll else []
        lines.append(md_row(name, ci(v["update_share"]), ci(v["token_share"]), ci(v["ratio"], 2), *extra))
    lines += [
        "",
        f"Monte Carlo token advantages (VinePPO): {len(mc['rollouts'])} rollouts, K_mc = "
        f"{mc['samples_per_prefix']} continuations per prefix. {_opposition_sentence(mc)} Largest "
        f"segment's share of sum |A|: {ci(mc.get('top_segment_share'))}.",
        "",
        *md_table(["rollout", "r", "GRPO A_i", "prefix lengths", "V(prefix) ± SE", "segment advantages ± SE"]),
    ]
    for j, row in enumerate(mc["rollouts"]):
        vals = ", ".join(f"{v:.2f}±{e:.2f}" for v, e in zip(row["values"], row["errors"]))
        advs = ", ".join(f"{a:+.2f}±{e:.2f}" for a, e in zip(row["advantages"], row["adv_errors"]))
        lines.append(md_row(j, fmt(row["reward"], 1), fmt(row["grpo_advantage"], 2), row["boundaries"], vals, advs))
    lines.append("")
    return lines


def _opposition_sentence(mc: dict[str, Any]) -> str:
    """What the Monte Carlo credit claim decides on (the mean opposing shift at each segment position,
    :func:`grpo_lens.formulas.credit.opposing_shifts`, against the margin MC_MARGIN), then the count of rollouts
    with an opposing segment against its exact binomial bound at level MC_LEVEL
    (:func:`grpo_lens.claims.credit.opposition_count`), printed, not used."""
    t = opposition_count(mc)
    if t is None:
        return "The opposing shifts need 0/1 rewards; these prefix values are not means of K_mc 0/1 rewards."
    if t["tests"] == 0:
        return "No interior segment (fewer than 2 prefixes per rollout): nothing to test."
    k = int(mc["samples_per_prefix"])
    rows = mc["rollouts"]
    counts = [prefix_success_counts(r["values"], r["errors"], k) for r in rows]
    # no None: checked by the caller
    shifts = opposing_shifts(counts, [r["grpo_advantage"] for r in rows], k)  # type: ignore[arg-type]
    per_pos = "; ".join(f"segment {j + 1}: {ci(mean_interval(e))}" for j, e in enumerate(shifts))
    n, a = t["rollouts"], t["alpha_r"]
    return (
        f"Mean shift of the success probability against A_i by segment position (what the claim decides on, margin "
        f"{MC_MARGIN}): {per_pos}. Not used by the claim: r"
        f"ollouts with a segment whose success count differs against A_i's sign by >= {t['d']} of {t['mc_samples']} "
        f"continuations (opposing): {t['flagged']} of {n}; with no opposing segment a rollout is flagged with "
        f"probability <= {a:.3g} ({t['tests']} segments tested per rollout, level {MC_LEVEL}), and "
        f"P(Binomial({n}, {a:.3g}) >= {t['flagged']}) = {t['p_value']:.2g}. Segments agreeing with A_i by >= "
        f"{t['d']}: {t['agreeing']} of {t['segments']}."
    )


def _rms_text(rms: dict[str, Any] | None) -> str:
    """'rms [lo, hi] (n = N prompts)' of :func:`grpo_lens.formulas.baselines.rms_log_ratio` (without "y")."""
    if not rms or rms.get("rms") is None:
        return "not measured (a probe.json from an older grpo-lens)"
    root = {"mean": rms["rms"], "lo": rms.get("rms_lo"), "hi": rms.get("rms_hi"), "n": rms.get("n")}
    return ci_text(root, 3, "prompts")


def _mean_score_sentence(study: dict[str, Any]) -> str:
    """What ||E h|| was measured to be, and what it does to b*, in words chosen by the numbers."""
    ratio = study.get("mean_score_ratio") or {}
    lo = ratio.get("lo")
    if lo is not None and lo > 1:
        head = "The length-normalised score is not mean-zero here"
    elif ratio.get("hi") is not None:
        head = "The length-normalised score is consistent with mean zero here"
    else:
        head = "Too few prompts to tell whether the length-normalised score is mean-zero"
    return (
        f"{head}: ||mean h||^2 is {ci(ratio, 1)} times the floor a mean-zero score would give (1 = mean zero); "
        f"correcting b* for E[h] != 0 moves it by {ci(study.get('b_star_shift'), 4)} (b*_exact - b*)."
    )


def plot_credit_position(profile: Sequence[dict[str, Any]], path: Path) -> Path:
    """Mean share of the group update per relative-position bin, with its 95% interval as an error bar only where the
    bin has one (:func:`grpo_lens.report.format.interval`, the rule the table's cells follow: no bar where a cell
    reads "(n = N)†"); the legend says so when some bins have none."""
    fig, ax = plt.subplots(figsize=plots.SIZE)
    n = len(profile)
    xs = [(b + 0.5) / n for b in range(n)]
    ys = [p.get("mean") if p.get("mean") is not None else math.nan for p in profile]
    # None means are NaN here
    bars = ax.bar(xs, ys, width=0.8 / n, label="mean share over groups")  # type: ignore[arg-type]
    bounds = [(x, y, interval(p)) for x, y, p in zip(xs, ys, profile)]
    with_ci = [(x, y, b) for x, y, b in bounds if b is not None]
    if with_ci:
        ax.errorbar(
            [x for x, _, _ in with_ci],
            # None means are NaN here
            [y for _, y, _ in with_ci],  # type: ignore[arg-type]
            yerr=[[y - b[0] for _, y, b in with_ci], [b[1] - y for _, y, b in with_ci]],  # type: ignore[operator]
            fmt="none",
            ecolor="k",
            capsize=2,
            label="95% interval over groups",
        )
    if len(with_ci) < n:
        few = n - len(with_ci)
        bars.set_label(f"mean share over groups ({few} of {n} bins: n < {MIN_INTERVAL_UNITS}, no interval)")
    ax.axhline(1.0 / n, color="gray", ls=":", lw=0.8, label="uniform over positions")
    ax.set_xlabel("relative position in the completion")
    ax.set_ylabel("share of the group update")
    ax.set_title("signed token contributions by position", fontsize=9)
    ax.grid(alpha=0.3)
    plots.legend_below(ax, ncol=1, fontsize=7)
    return plots._save(fig, path)
