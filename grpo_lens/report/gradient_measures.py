"""Report sections for sparsity over training, policy entropy, S1, baselines at matched expectation and token credit
(docs/theory.md §Sparsity over training, §S1, §Baselines at matched expectation, §Token credit).

Everything is computed from metrics.jsonl records and probe.json's ``studies``. The claims these sections support are
in :mod:`grpo_lens.claims_measures` and appear in the report's claims section.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import matplotlib.pyplot as plt

from grpo_lens.report import plots
from grpo_lens.report.format import ci, fmt
from grpo_lens.rundir import lens_overhead

_fmt, _ci = fmt, ci


# ---------------------------------------------------------------------------------------------------------------------
# Training: entropy, sparsity over training, lens cost
# ---------------------------------------------------------------------------------------------------------------------
def lens_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of lens steps (those with a lens timing)."""
    return [r for r in records if r.get("perf/lens_seconds") is not None]


def plot_sparsity_measures(records: list[dict[str, Any]], path: Path) -> Path:
    """bf16-unchanged since start beside its dense control and float32-unchanged; Hoyer and top-1% energy of the
    step's update and gradient; Hoyer of the update since start per layer type."""
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(plots.SIZE[0] * 1.5, plots.SIZE[1]))
    for key, label, style in [("sparsity/update_total_bf16_unchanged", "bf16 unchanged", "-"),
                              ("sparsity/update_total_bf16_dense", "dense control", "--"),
                              ("sparsity/update_total_f32_unchanged", "f32 unchanged", ":")]:
        xs, ys = plots._series(records, key)
        if xs:
            a1.plot(xs, ys, marker=".", linestyle=style, label=label)
    a1.set_title("since start: unchanged shares", fontsize=9)
    a1.set_ylim(-0.02, 1.02)
    for key, label in [("sparsity/update_step_hoyer", "update Hoyer"),
                       ("sparsity/update_step_top1_energy", "update top-1% energy"),
                       ("sparsity/grad_hoyer", "gradient Hoyer"), ("sparsity/grad_top1_energy", "gradient top-1%")]:
        xs, ys = plots._series(records, key)
        if xs:
            a2.plot(xs, ys, marker=".", label=label)
    a2.axhline(0.20, color="gray", lw=0.8, ls=":")  # Hoyer of a Gaussian vector
    a2.set_title("this step (Gaussian: Hoyer 0.20, top-1% 0.105)", fontsize=8)
    for kind in ("embedding", "attention", "mlp", "norm"):
        xs, ys = plots._series(records, f"sparsity/{kind}/update_total_hoyer")
        if xs:
            a3.plot(xs, ys, marker=".", label=kind)
    a3.set_title("update since start: Hoyer by layer type", fontsize=9)
    for ax in (a1, a2, a3):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        plots._legend(ax, fontsize=6)
    return plots._save(fig, path)


def training_measures_section(records: list[dict[str, Any]], run_dir: Path, findings: list[str],
                              beta: float | None = None, lora_rank: int = 0) -> list[str]:
    """Policy entropy, sparsity over training (with the dense control) and the lens's cost (``lora_rank`` > 0: the
    sparsity numbers are over the LoRA adapter's weights)."""
    lines: list[str] = []
    ent = [r.get("policy/entropy") for r in records if r.get("policy/entropy") is not None]
    if ent:
        head, tail = ent[: min(5, len(ent))], ent[max(0, len(ent) - 5):]
        e0, e1 = sum(head) / len(head), sum(tail) / len(tail)
        lines += ["### Policy entropy", "",
                  f"Token-mean entropy of the policy (temperature-scaled, from the update's own logits): "
                  f"{_fmt(e0)} nats over the first {len(head)} steps -> {_fmt(e1)} over the last {len(tail)} "
                  f"(plotted with the reward in the learning curves; the KL panel is shown only when beta > 0).", ""]
        findings.append(f"Policy entropy went {_fmt(e0)} -> {_fmt(e1)} nats/token (first vs last steps).")
    rows = [r for r in lens_rows(records) if r.get("sparsity/update_total_bf16_dense") is not None]
    if rows:
        plot_sparsity_measures(records, run_dir / "sparsity_measures.png")
        n = rows[-1].get("sparsity/sample_entries")
        lines += ["### Sparsity over training: the update and the gradient, separated from bf16 rounding", "",
                  "bf16 unchanged: share of weights whose bf16 value did not change; dense control: the share a "
                  "dense Gaussian update with the same per-tensor RMS would leave unchanged (rounding alone). "
                  "f32 unchanged: exactly unchanged in float32. Hoyer: 0 equal magnitudes, 0.20 Gaussian, 1 one "
                  "entry; top-1%: share of the squared norm in the largest 1% of entries (0.105 Gaussian). "
                  f"Computed on a fixed sample of {_fmt(int(n) if n else None)} weights (standard error of a share "
                  f"<= {_fmt(0.5 / math.sqrt(n), 4) if n else '–'}).", "",
                  "![sparsity measures](sparsity_measures.png)", "",
                  "| step | S1 measured | bf16 unchanged since start | dense control | f32 unchanged since start | "
                  "update Hoyer (step) | update top-1% (step) | gradient zero | gradient Hoyer | gradient top-1% |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(" | ".join([f"| {r['step']}", _fmt(r.get("reward/frac_zero_std_groups")),
                                     _fmt(r.get("sparsity/update_total_bf16_unchanged")),
                                     _fmt(r.get("sparsity/update_total_bf16_dense")),
                                     _fmt(r.get("sparsity/update_total_f32_unchanged"), 4),
                                     _fmt(r.get("sparsity/update_step_hoyer")),
                                     _fmt(r.get("sparsity/update_step_top1_energy")),
                                     _fmt(r.get("sparsity/grad_zero"), 4), _fmt(r.get("sparsity/grad_hoyer")),
                                     _fmt(r.get("sparsity/grad_top1_energy"))]) + " |")
        last = rows[-1]
        kinds = [k for k in ("embedding", "attention", "mlp", "norm", "other")
                 if last.get(f"sparsity/{k}/update_total_hoyer") is not None]
        if kinds:
            lines += ["", f"By layer type at step {last['step']} (update since the start; gradient of the step):", "",
                      "| layer type | bf16 unchanged | dense control | f32 unchanged | update Hoyer | update top-1% | "
                      "gradient zero | gradient Hoyer |", "|---|---|---|---|---|---|---|---|"]
            for k in kinds:
                p = f"sparsity/{k}/"
                lines.append(" | ".join([f"| {k}", _fmt(last.get(p + "update_total_bf16_unchanged")),
                                         _fmt(last.get(p + "update_total_bf16_dense")),
                                         _fmt(last.get(p + "update_total_f32_unchanged"), 4),
                                         _fmt(last.get(p + "update_total_hoyer")),
                                         _fmt(last.get(p + "update_total_top1_energy")),
                                         _fmt(last.get(p + "grad_zero"), 4), _fmt(last.get(p + "grad_hoyer"))]) + " |")
        gap = last["sparsity/update_total_bf16_unchanged"] - last["sparsity/update_total_bf16_dense"]
        weights = "the LoRA adapter's weights (not the full model's)" if lora_rank else "weights"
        findings.append(f"After {last['step']} steps {_fmt(last['sparsity/update_total_bf16_unchanged'])} of {weights} "
                        f"kept their bf16 value, against {_fmt(last['sparsity/update_total_bf16_dense'])} for a dense "
                        f"update of the same size (difference {_fmt(gap)}); "
                        f"{_fmt(last.get('sparsity/update_total_f32_unchanged'), 4)} were unchanged in float32.")
        lines.append("")
    cost = lens_overhead(records)
    if cost and cost["lens_steps"]:
        lines += [f"The lens measured {cost['lens_steps']} of {cost['steps']} steps and took "
                  f"{_fmt(cost['lens_seconds'], 1)} s: {_fmt(100 * cost['overhead'], 1)}% of the "
                  f"{_fmt(cost['train_seconds'], 1)} s the steps took without it.", ""]
    return lines


# ---------------------------------------------------------------------------------------------------------------------
# Probe studies: S1, baselines, credit
# ---------------------------------------------------------------------------------------------------------------------
def studies_section(label: str, studies: dict[str, Any], run_dir: Path, findings: list[str]) -> list[str]:
    """S1 predicted without bias, baselines at matched expectation and token credit of one probe."""
    lines: list[str] = []
    base = studies.get("baselines") or {}
    s1 = base.get("s1")
    meta = base.get("meta", {})
    if s1:
        lines += [f"### S1 predicted from rollouts outside the group ({label})", "",
                  f"{s1['prompts']} prompts, M = {s1['rollouts_per_prompt']} rollouts each, R = "
                  f"{meta.get('group_size')}: S1 measured on the first R, predicted by [C(k',R) + C(M'-k',R)] / "
                  "C(M',R) from the other M' = M - R (unbiased, docs/theory.md §S1).", "",
                  "| S1 measured | S1 predicted | measured - predicted |", "|---|---|---|",
                  f"| {_ci(s1['measured'])} | {_ci(s1['predicted'])} | {_ci(s1['difference'])} |", ""]
    study = base.get("baselines")
    if study:
        s = study["summary"]
        lines += [f"### Baselines at matched expectation ({label})", "",
                  f"{study['prompts']} prompts with reward contrast ({study['prompts_constant']} without were "
                  f"skipped), M = {meta.get('rollouts_per_prompt')} rollouts each, groups of R = "
                  f"{meta.get('group_size')} drawn from one half of each prompt's rollouts and compared with the "
                  "centred gradient Cov(r, h) estimated on the other half; h_i = c_i g_i, "
                  f"{meta.get('gradients')}, k = {meta.get('sketch_dim')} per side. MSE is the per-prompt ratio to "
                  "RLOO's; the group mean is rescaled by R/(R-1) (it then equals RLOO sample by sample). 95% "
                  "bootstrap intervals over prompts.", "",
                  "| estimator | MSE / RLOO's | cosine to reference | bias² share of MSE |", "|---|---|---|---|"]
        for name in ("none", "mean_rescaled", "rloo", "optimal_loo", "optimal_pop"):
            e = s.get(name, {})
            lines.append(f"| {name} | {_ci(e.get('mse_ratio_to_rloo'))} | {_ci(e.get('cosine'))} | "
                         f"{_ci(e.get('bias2_share'))} |")
        lines += ["", f"m_C / m_W over prompts: {_ci(study.get('norm_ratio'))}; m_C = m_W rejected (permutation "
                  f"test at 0.05 over each prompt's rollouts, k fixed) on "
                  f"{_fmt(study.get('equal_norms_rejected'), 2)} of "
                  f"{study.get('equal_norms_testable')} testable prompts. b* - p (how far the optimal constant "
                  f"baseline is from the group mean's expectation): {_ci(study.get('b_star_minus_p'))}.", "",
                  _mean_score_sentence(study), "",
                  "| prompt | p | m_C | m_W | m_C / m_W [95%] | permutation p | verdict | b* (population) | b*_exact |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for j, p in enumerate(study["per_prompt"]):
            eq = p["equal_norms"]
            interval = f"[{_fmt(eq['lo'], 2)}, {_fmt(eq['hi'], 2)}]" if eq.get("lo") is not None else "(< 8 a side)"
            lines.append(f"| {j} | {_fmt(p['p'], 2)} | {_fmt(p['m_correct'], 4)} | {_fmt(p['m_wrong'], 4)} | "
                         f"{_fmt(eq['ratio'], 2)} {interval} | {_fmt(eq.get('p'), 3)} | {eq['verdict']} | "
                         f"{_fmt(p['b_star_pop'])} | {_fmt(p['b_star_exact'])} |")
        lines.append("")
        opt = s.get("optimal_pop", {}).get("mse_ratio_to_rloo", {})
        findings.append(f"[{label}] Population b* has {_ci(opt, 2)} times RLOO's MSE to the reference gradient over "
                        f"{study['prompts']} prompts; m_C / m_W = {_ci(study.get('norm_ratio'), 2)}.")
    credit = studies.get("credit")
    if credit:
        c = credit["contributions"]
        mc = credit["monte_carlo"]
        lines += [f"### Token credit ({label})", "",
                  f"Signed share of each token in its group's update, s = w <grad log pi_t, u> / ||u||^2 (sums to 1 "
                  f"per group; largest closure error {_fmt(c.get('closure'), 4)}), over {c['groups']} groups of R = "
                  f"{credit['meta']['group_size']}; u is the exact update over every parameter.", ""]
        prof = c.get("position_profile") or []
        if prof:
            plot_credit_position(prof, run_dir / f"credit_position_{label}.png")
            lines += [f"![credit by relative position](credit_position_{label}.png)", "",
                      "| relative position | " + " | ".join(f"{b / len(prof):.1f}-{(b + 1) / len(prof):.1f}"
                                                          for b in range(len(prof))) + " |",
                      "|---|" + "---|" * len(prof),
                      "| share of update | " + " | ".join(_ci(x, 2) for x in prof) + " |", ""]
        lines += ["| token class | share of the update | share of the tokens (control) | ratio |", "|---|---|---|---|"]
        for name, v in c["classes"].items():
            lines.append(f"| {name} | {_ci(v['update_share'])} | {_ci(v['token_share'])} | {_ci(v['ratio'], 2)} |")
        lines += ["", f"Monte Carlo token advantages (VinePPO): {len(mc['rollouts'])} rollouts, K = "
                  f"{mc['samples_per_prefix']} continuations per prefix. Share of tokens in segments whose Monte "
                  f"Carlo advantage has the opposite sign of GRPO's A_i beyond 2 SE: {_ci(mc.get('disagree'))}; the "
                  f"same sign: {_ci(mc.get('agree'))}; within noise of 0: {_ci(mc.get('neutral'))}. Largest "
                  f"segment's share of sum |A|: {_ci(mc.get('top_segment_share'))}.", "",
                  "| rollout | r | GRPO A_i | prefix lengths | V(prefix) ± SE | segment advantages ± SE |",
                  "|---|---|---|---|---|---|"]
        for j, row in enumerate(mc["rollouts"]):
            vals = ", ".join(f"{v:.2f}±{e:.2f}" for v, e in zip(row["values"], row["errors"]))
            advs = ", ".join(f"{a:+.2f}±{e:.2f}" for a, e in zip(row["advantages"], row["adv_errors"]))
            lines.append(f"| {j} | {_fmt(row['reward'], 1)} | {_fmt(row['grpo_advantage'], 2)} | "
                         f"{row['boundaries']} | {vals} | {advs} |")
        lines.append("")
    return lines


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
    return (f"{head}: ||mean h||^2 is {_ci(ratio, 1)} times the floor a mean-zero score would give (1 = mean zero); "
            f"correcting b* for E[h] != 0 moves it by {_ci(study.get('b_star_shift'), 4)} (b*_exact - b*).")


def plot_credit_position(profile: Sequence[dict[str, Any]], path: Path) -> Path:
    """Mean share of the group update per relative-position bin, with 95% intervals."""
    fig, ax = plt.subplots(figsize=plots.SIZE)
    n = len(profile)
    xs = [(b + 0.5) / n for b in range(n)]
    ys = [p.get("mean") if p.get("mean") is not None else math.nan for p in profile]
    lo = [(y - p["lo"]) if p.get("lo") is not None else 0.0 for y, p in zip(ys, profile)]
    hi = [(p["hi"] - y) if p.get("hi") is not None else 0.0 for y, p in zip(ys, profile)]
    ax.bar(xs, ys, width=0.8 / n, yerr=[lo, hi], capsize=2)
    ax.axhline(1.0 / n, color="gray", ls=":", lw=0.8, label="uniform over positions")
    ax.set_xlabel("relative position in the completion")
    ax.set_ylabel("share of the group update")
    ax.set_title("signed token contributions by position", fontsize=9)
    ax.grid(alpha=0.3)
    plots._legend(ax, fontsize=7)
    return plots._save(fig, path)
