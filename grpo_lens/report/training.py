"""The report's training section (:func:`training_section`), read from a training run's metrics.jsonl records.

One function per subsection, called in order by :func:`training_section`:

summary_lines       steps, mean reward and accuracy over the first and last windows, seconds per step
curves_lines        dynamic sampling, the learning curves and the learning rate
sparsity_lines      "Sparsity of the gradient over training": S1, S4 and the lens steps' table
(training_measures) evaluation, entropy, sparsity measures and the lens's cost (:mod:`.training_measures`)
rank_lines          "Rank of G1 over training"
baselines_lines     "Baselines": b* against the group mean per lens step

Each appends its sentences to ``findings`` in the order the report lists them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grpo_lens import metrics as mk
from grpo_lens.claims.sparsity import MIN_S1_STEPS, run_slopes
from grpo_lens.formulas.stats import mean_interval, trend_windows
from grpo_lens.report import plots
from grpo_lens.report.format import ci, fmt, md_row, md_table
from grpo_lens.report.training_measures import (
    MIN_TREND_STEPS,
    dynamic_sampling_summary,
    eval_section,
    lens_rows,
    training_measures_section,
)


def _mean(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None  # type: ignore[arg-type]  # None dropped above


def lens_gradient_source(records: list[dict[str, Any]], lora_rank: int = 0, lens_space: str = "trainable") -> str:
    """The source of the training lens's per-rollout gradients, a key of :data:`plots.GRADIENT_SOURCES`:
    ``exact_gram`` when a lens step recorded the exact Gram's coverage (only the exact Gram writes it, see
    :meth:`grpo_lens.lens.trainer_lens.TrainerLens.rollout_gram`); else ``exact_adapter`` for a LoRA run in the
    trainable space (the adapter's gradients, exact); else ``sketch``."""
    if any(r.get(mk.GRAD_GRAM_COVERAGE) is not None for r in records):
        return "exact_gram"
    return "exact_adapter" if lora_rank and lens_space == "trainable" else "sketch"


def s1_trend_finding(records: list[dict[str, Any]]) -> str | None:
    """The Findings sentence on S1 over training: the means of S1 (and accuracy) over the first and last thirds of
    the steps, the windows of :func:`grpo_lens.formulas.stats.trend_windows` that the claims table's S1 measurement
    (claim ``zero_variance_share_rises``) prints, on the same steps (those that logged S1); None below
    :data:`grpo_lens.claims.sparsity.MIN_S1_STEPS` steps, the fewest the S1 trend is tested on."""
    rows = [r for r in records if r.get(mk.REWARD_FRAC_ZERO_STD_GROUPS) is not None and r.get(mk.STEP) is not None]
    if len(rows) < MIN_S1_STEPS:
        return None
    first, last = (rows[s] for s in trend_windows(len(rows)))
    s1 = [
        mean_interval([float(r[mk.REWARD_FRAC_ZERO_STD_GROUPS]) for r in w], bounds=(0.0, 1.0)) for w in (first, last)
    ]
    acc = [_mean([r.get(mk.REWARD_ACCURACY) for r in w]) for w in (first, last)]
    # at least MIN_S1_STEPS rows: both means are set
    verb = "rose" if s1[1]["mean"] > s1[0]["mean"] else ("fell" if s1[1]["mean"] < s1[0]["mean"] else "stayed flat")  # type: ignore[operator]
    return (
        f"S1 (zero-variance group share) {verb}: {ci(s1[0], 2)} over the first third of the steps "
        f"({first[0][mk.STEP]}–{first[-1][mk.STEP]}) -> {ci(s1[1], 2)} over the last third ({last[0][mk.STEP]}–"
        f"{last[-1][mk.STEP]}), while accuracy went {fmt(acc[0])} -> {fmt(acc[1])} over the same steps (the "
        "claims table tests the trend over every step)."
    )


def schedule_text(cfg: dict[str, Any]) -> str | None:
    """The learning-rate schedule of a saved config in words ("cosine, 2 warm-up steps"); None when the config does
    not name one (a run from before schedules existed)."""
    name = cfg.get("lr_scheduler")
    if not name:
        return None
    warm = cfg.get("warmup_steps") or 0
    warm_text = (
        ""
        if not warm
        else f", warm-up {float(warm):g} of max_steps"
        if 0 < float(warm) < 1
        else f", {int(float(warm))} warm-up steps"
    )
    return f"{name}{warm_text}"


def summary_lines(records: list[dict[str, Any]], findings: list[str]) -> list[str]:
    """The section's opening sentence: steps, mean reward and accuracy over the first and last (up to 5) steps
    (fewer than :data:`MIN_TREND_STEPS` steps: over all steps, no trend) and seconds per step; findings on the
    reward's trend and on a run whose every group had no reward contrast (S1 = 1)."""
    lines = []
    n = len(records)
    w = min(5, n // 2)  # non-overlapping first / last windows; fewer than MIN_TREND_STEPS steps: no trend
    trend = n >= MIN_TREND_STEPS
    head, tail = (records[:w], records[n - w :]) if trend else (records, records)
    r0, r1 = _mean([r.get(mk.REWARD_MEAN) for r in head]), _mean([r.get(mk.REWARD_MEAN) for r in tail])
    a0, a1 = _mean([r.get(mk.REWARD_ACCURACY) for r in head]), _mean([r.get(mk.REWARD_ACCURACY) for r in tail])
    sec = _mean([r.get(mk.PERF_STEP_SECONDS) for r in records])
    if trend:
        lines += [
            f"{n} steps. Mean reward over the first {len(head)} steps {fmt(r0)}, over the last {len(tail)} "
            f"steps {fmt(r1)}; accuracy {fmt(a0)} -> {fmt(a1)}. {fmt(sec, 1)} s per step on average.",
            "",
        ]
    else:
        too_few = (
            f"{n} step(s): too few steps for a trend (the first and last windows need at least 2 steps each "
            f"without overlap, so at least {MIN_TREND_STEPS} steps)"
        )
        lines += [
            f"{too_few}. Mean reward over all steps {fmt(r0)}, accuracy {fmt(a0)}. {fmt(sec, 1)} s per "
            "step on average.",
            "",
        ]
        findings.append(f"{too_few}; mean reward {fmt(r0)} over the run.")
    s1_all = [r.get(mk.REWARD_FRAC_ZERO_STD_GROUPS) for r in records]
    if records and all(isinstance(x, (int, float)) and x >= 1.0 for x in s1_all):
        findings.append(
            f"S1 = 1.000 on every one of the {n} steps: no group had reward contrast, so every advantage "
            "was zero and nothing was trained by the policy gradient (only a KL term with beta > 0 could "
            "have moved the weights)."
        )
    if trend and r0 is not None and r1 is not None:
        verb = "rose" if r1 > r0 else ("fell" if r1 < r0 else "stayed flat")
        findings.append(
            f"Mean reward {verb} over training: {fmt(r0)} (first {len(head)} steps) -> {fmt(r1)} "
            f"(last {len(tail)} steps)."
        )
    return lines


def curves_lines(
    records: list[dict[str, Any]], run_dir: Path, findings: list[str], schedule: str | None = None
) -> list[str]:
    """Dynamic sampling's sentence (also a finding), the learning curves (learning_curves.png) and, when the
    records logged it, the learning rate (learning_rate.png, titled with ``schedule``)."""
    lines = []
    dynamic = dynamic_sampling_summary(records)
    if dynamic:
        lines += [dynamic, ""]
        findings.append(dynamic)
    plots.plot_learning_curves(records, run_dir / "learning_curves.png")
    lines += ["![learning curves](learning_curves.png)", ""]
    if any(r.get(mk.LR) is not None for r in records):
        plots.plot_learning_rate(records, run_dir / "learning_rate.png", schedule)
        lines += ["![learning rate](learning_rate.png)", ""]
    return lines


def sparsity_lines(
    records: list[dict[str, Any]], run_dir: Path, findings: list[str], lora_rank: int = 0, estimator: str | None = None
) -> list[str]:
    """ "Sparsity of the gradient over training": S1 and S4 (sparsity.png; ``lora_rank`` > 0: over the adapter's
    weights), the lens steps' table (accuracy, S1, S4, G1's erank and stable rank, the identity residual, with why a
    residual is missing under ``estimator``) and the S1 trend's finding (:func:`s1_trend_finding`)."""
    lines = [
        "### Sparsity of the gradient over training",
        "",
        "S1 is the share of groups whose rewards are all equal: they carry exactly zero policy gradient "
        "(training prints no prediction of it: see the probe's S1 section). S4 is the share of parameters "
        "whose bf16 value did not change; its controls (legend) are the share the same update entries leave "
        "unchanged when permuted within each tensor and what a dense update of the same size would leave "
        "unchanged.",
        "",
    ]
    if lora_rank:
        lines += [
            f"Parameter space: this is a LoRA run (rank {lora_rank}); every S4 and update-sparsity number "
            "below is over the adapter's A and B weights, not the full model (the frozen base weights never "
            "change). B starts at zero, so on step 1 A gets no gradient and about half the adapter weights are "
            "unchanged by construction. The merged weights are not measured.",
            "",
        ]
    plots.plot_sparsity(records, run_dir / "sparsity.png")
    lines += ["![sparsity](sparsity.png)", ""]
    lens_steps = lens_rows(records)
    if lens_steps:
        lines += md_table(
            [
                "step",
                "accuracy",
                "S1 measured",
                "S4 step",
                "S4 since start",
                "G1 erank",
                "G1 stable rank",
                "identity residual",
            ]
        )
        for r in lens_steps:
            res = r.get(mk.GRAD_IDENTITY_RESIDUAL)
            lines.append(
                md_row(
                    r[mk.STEP],
                    fmt(r.get(mk.REWARD_ACCURACY)),
                    fmt(r.get(mk.REWARD_FRAC_ZERO_STD_GROUPS)),
                    fmt(r.get(mk.SPARSITY_UPDATE_STEP)),
                    fmt(r.get(mk.SPARSITY_UPDATE_TOTAL)),
                    fmt(r.get(mk.rank_key("g1", "erank"))),
                    fmt(r.get(mk.rank_key("g1", "stable_rank"))),
                    "–" if res is None else f"{res:.1e}",
                )
            )
        lines.append("")
        if any(r.get(mk.GRAD_IDENTITY_RESIDUAL) is None for r in lens_steps):
            lines += [
                "Identity residual –: the identity Σ A_i g_i = c (ḡ_C − ḡ_W) (docs/theory.md §4) is checked "
                "only where it applies: mixed groups of 0/1 rewards under an estimator with a per-group "
                "constant c (grpo, dr_grpo, rloo)"
                + (
                    f"; this run's estimator `{estimator}` has no such constant, so it is not computed"
                    if estimator not in ("grpo", "dr_grpo", "rloo")
                    else "; on these steps no group qualified (no mixed group, non-0/1 rewards, or a truncated "
                    "rollout under overlong masking)"
                )
                + ".",
                "",
            ]
    s1_finding = s1_trend_finding(records)
    if s1_finding:
        findings.append(s1_finding)
    return lines


def s4_finding(records: list[dict[str, Any]], lora_rank: int = 0) -> str | None:
    """The Findings sentence on update sparsity since the start (S4) at the last lens step; None without one."""
    lens_steps = lens_rows(records)
    s4 = [r.get(mk.SPARSITY_UPDATE_TOTAL) for r in lens_steps if r.get(mk.SPARSITY_UPDATE_TOTAL) is not None]
    if not s4:
        return None
    return (
        f"Update sparsity since the start (S4): {fmt(s4[-1])} of "
        + ("the LoRA adapter's weights (not the full model's)" if lora_rank else "parameters")
        + f" kept their bf16 value after {lens_steps[-1][mk.STEP]} steps."
    )


def rank_lines(records: list[dict[str, Any]], run_dir: Path) -> list[str]:
    """ "Rank of G1 over training" (rank_over_training.png): G1's top-2 and top-1 energy shares, erank and stable
    rank per lens step; empty when no lens step logged them."""
    lens_steps = lens_rows(records)
    if not any(r.get(mk.rank_key("g1", m)) is not None for r in lens_steps for m in ("top2_share", "erank")):
        return []
    plots.plot_rank_over_training(records, run_dir / "rank_over_training.png")
    return [
        "### Rank of G1 over training",
        "",
        "Per lens step, the mean over the step's mixed groups (error bars: the 95% interval over groups, "
        'from 8 groups): the top-2 and top-1 energy shares against 0.9 ("k90 = 2") and erank and '
        "stable rank against [1.5, 2.5] (docs/theory.md §11).",
        "",
        "![rank over training](rank_over_training.png)",
        "",
    ]


def baselines_lines(
    records: list[dict[str, Any]], run_dir: Path, findings: list[str], lora_rank: int = 0, lens_space: str = "trainable"
) -> list[str]:
    """ "Baselines": b* against the group mean and m_C / m_W per lens step (baselines.png, its gradient source from
    :func:`lens_gradient_source`), and the finding on which outcome had the larger score-gradient norms; empty when
    no step logged b*."""
    base_rows = [r for r in records if r.get(mk.BASELINE_B_STAR) is not None]
    if not base_rows:
        return []
    lines = [
        "### Baselines",
        "",
        "b* = sum ||g_i||^2 r_i / sum ||g_i||^2 is the variance-optimal constant baseline; it equals the "
        "group mean exactly when ||g||^2 does not depend on the reward (m_C = m_W). Both are means over "
        "the step's mixed groups only (groups whose rewards are all equal have no gradient), so the group "
        "mean here is not the step's accuracy or mean reward.",
        "",
    ]
    plots.plot_baselines(records, run_dir / "baselines.png", lens_gradient_source(records, lora_rank, lens_space))
    lines += ["![baselines](baselines.png)", "", *md_table(["step", "b*", "group mean", "m_C", "m_W", "m_C / m_W"])]
    for r in base_rows:
        mc, mw = r.get(mk.BASELINE_M_CORRECT), r.get(mk.BASELINE_M_WRONG)
        ratio = mc / mw if mc is not None and mw else None
        lines.append(
            md_row(
                r[mk.STEP],
                fmt(r[mk.BASELINE_B_STAR]),
                fmt(r.get(mk.BASELINE_GROUP_MEAN)),
                fmt(mc, 4),
                fmt(mw, 4),
                fmt(ratio),
            )
        )
    lines.append("")
    ratios = [
        r[mk.BASELINE_M_CORRECT] / r[mk.BASELINE_M_WRONG]
        for r in base_rows
        if r.get(mk.BASELINE_M_CORRECT) is not None and r.get(mk.BASELINE_M_WRONG)
    ]
    if ratios:
        span = fmt(min(ratios)) if min(ratios) == max(ratios) else f"{fmt(min(ratios))}–{fmt(max(ratios))}"
        findings.append(
            f"m_C / m_W over {len(ratios)} lens step(s): {span}: "
            + (
                "correct rollouts had smaller score-gradient norms, so b* sits below the group mean."
                if max(ratios) < 1
                else "correct rollouts had larger score-gradient norms, so b* sits above the group mean."
                if min(ratios) > 1
                else "neither outcome had consistently larger gradient norms."
            )
        )
    return lines


def training_section(
    records: list[dict[str, Any]],
    run_dir: Path,
    findings: list[str],
    lora_rank: int = 0,
    estimator: str | None = None,
    lens_space: str = "trainable",
    schedule: str | None = None,
) -> list[str]:
    """Learning curves, the learning rate, sparsity and baselines over training (``lora_rank`` > 0: a LoRA run, whose
    sparsity numbers are over the adapter's weights; ``lens_space``: the run's config option, naming the baselines'
    gradient source with :func:`lens_gradient_source`; ``schedule``: the learning-rate schedule in words,
    :func:`schedule_text`, titling the learning-rate plot). The subsections in order, each appending its findings."""
    lines = ["## Training", ""]
    lines += summary_lines(records, findings)
    lines += curves_lines(records, run_dir, findings, schedule)
    lines += sparsity_lines(records, run_dir, findings, lora_rank, estimator)
    lines += eval_section(records, findings)
    lines += training_measures_section(records, run_dir, findings, lora_rank=lora_rank)
    s4 = s4_finding(records, lora_rank)
    if s4:
        findings.append(s4)
    lines += rank_lines(records, run_dir)
    lines += baselines_lines(records, run_dir, findings, lora_rank, lens_space)
    return lines


def train_seeds_lines(seed_dirs: list[Path], seed_runs: list[list[dict[str, Any]]]) -> list[str]:
    """The seeds of a pooled training directory (`train --seeds`): per seed its directory, steps, the OLS slopes the
    pooled trends take as units (:func:`grpo_lens.claims.sparsity.run_slopes`) and its lowest E₂ over the lens
    steps (the unit of the pooled "rank stays"). The training section above shows the first seed."""
    e2 = mk.RANK_G1.format(m="top2_share")
    rows = []
    for d, recs in zip(seed_dirs, seed_runs):
        slopes = run_slopes(recs)
        lows = [float(r[e2]) for r in recs if r.get(e2) is not None]
        steps = [r[mk.STEP] for r in recs if r.get(mk.STEP) is not None]
        rows.append(
            (
                f"`{d.name}`",
                str(max(steps)) if steps else "–",
                fmt(slopes["s1"], 4),
                fmt(slopes["hoyer"], 4),
                fmt(min(lows), 3) if lows else "–",
            )
        )
    return [
        "## Seeds (`train --seeds`)",
        "",
        f"{len(seed_dirs)} runs that differ only in their seed; the claims over training above are decided over them "
        "(each seed's slope one unit, a t over seeds: docs/theory.md §12). The training section shows the first seed; "
        "`grpo-lens report DIR/seed_<s>` reports one seed alone.",
        "",
        *md_table(
            ["seed run", "last step", "S1 slope per step", "gradient Hoyer slope per step", "lowest E₂ (lens steps)"],
            rows,
        ),
        "",
    ]
