"""``grpo-lens report RUN_DIR``: report.md and PNG plots, read from the run directory alone.

A run directory may hold a training run (metrics.jsonl, config.yaml, in the folder or in ``train/``), probes
(probe.json in the folder itself or in ``probe_before/`` and ``probe_after/``), or both (the demo). Every sentence
under "Findings" is computed from those numbers; nothing is hard-coded. This module assembles the report
(:func:`write_report`): the claims table (:func:`claims_section`, verdicts from :mod:`grpo_lens.claims`), the training
section (:func:`training_section`) and one section per probe (:func:`probe_section`). Beside it:

answers            the report's opening: one line per decided claim, the undecided ones grouped by what decides them
training_measures  entropy, sparsity over training, the lens's cost and dynamic sampling, from metrics.jsonl
studies            a probe's studies: S1 predicted, baselines at matched expectation, token credit
plots              the PNGs
format             how numbers and intervals are printed
compare            ``grpo-lens compare``: several training runs in one report
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from grpo_lens.claims.base import INCONCLUSIVE, evaluate_claims, holm_claims
from grpo_lens.claims.sparsity import MIN_S1_STEPS, TRAINING_CLAIMS
from grpo_lens.formulas.stats import mean_interval, trend_windows
from grpo_lens.formulas.zero_sum import WEIGHTINGS
from grpo_lens.metrics import (
    BASELINE_B_STAR,
    BASELINE_GROUP_MEAN,
    BASELINE_M_CORRECT,
    BASELINE_M_WRONG,
    CREDIT_ADV_VAR_WITHIN_MAX,
    CREDIT_ANSWER_SHARE_MEAN,
    CREDIT_ANSWER_TOKEN_FRAC,
    G3_GROUPS,
    GRAD_GRAM_COVERAGE,
    GRAD_IDENTITY_RESIDUAL,
    GROUP_DISTINCT_COMPLETIONS,
    GROUPS_ALL_EQUAL,
    GROUPS_MIXED,
    LR,
    PERF_LENS_SECONDS,
    PERF_STEP_SECONDS,
    PROBE_BASELINES,
    PROBE_G2_WEIGHTINGS,
    PROBE_G3,
    PROBE_GROUPS,
    PROBE_STRATA,
    PROBE_SUMMARY,
    PROMPTS_SAMPLED,
    RANK_G1_VS_NULL,
    RANK_G2_NUMERICAL_RANK,
    RANK_G2_RANK_BOUND,
    RANK_G2_WEIGHTED,
    REWARD_ACCURACY,
    REWARD_FRAC_ZERO_STD_GROUPS,
    REWARD_MEAN,
    ROLLOUTS_PER_PROMPT,
    S1_MEASURED,
    S1_MEASURED_CI,
    S1_PREDICTED,
    S1_PREDICTED_CI,
    SKETCH_COVERAGE,
    SKETCH_EXACT_SHARE_EMBEDDING,
    SKETCH_EXACT_SHARE_LINEAR,
    SKETCH_EXACT_SHARE_NORM,
    SKETCH_G1_ERANK_ERROR,
    SKETCH_GRAM_ERROR,
    SKETCH_GRAM_ERROR_BOUND,
    SPARSITY_UPDATE_STEP,
    SPARSITY_UPDATE_TOTAL,
    STEP,
    ZERO_SUM_COS_GAP,
    ZERO_SUM_SPAN_ENERGY,
    ZERO_SUM_SPAN_ENERGY_NULL,
    ZERO_SUM_STATS,
    rank_key,
    zero_sum_key,
)
from grpo_lens.report import plots
from grpo_lens.report.answers import answers_section
from grpo_lens.report.format import (
    FEW_MARK,
    FEW_NOTE,
    ci,
    few_footnotes,
    fmt,
    mark_few,
    md_row,
    md_table,
)
from grpo_lens.report.seeds import seeds_section
from grpo_lens.report.studies import studies_section
from grpo_lens.report.training_measures import (
    MIN_TREND_STEPS,
    completions_section,
    dynamic_sampling_summary,
    eval_section,
    lens_rows,
    training_measures_section,
)
from grpo_lens.rundir import read_records


class ReportError(ValueError):
    """The directory holds nothing a report can be written from."""


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Records of a run-directory JSONL file (:func:`grpo_lens.rundir.read_records`: names file and line of a bad
    one)."""
    return read_records(path)


def find_probes(run_dir: Path) -> dict[str, dict[str, Any]]:
    """label -> probe.json content for every probe in the run directory (before/after training, or standalone)."""
    probes = {}
    for label, sub in (("before", "probe_before"), ("after", "probe_after"), ("probe", ".")):
        path = run_dir / sub / "probe.json"
        if path.exists():
            probes[label] = json.loads(path.read_text())
    return probes


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


#: what each advantage estimator subtracts from a rollout's reward (docs/theory.md §2)
ESTIMATOR_BASELINES = {
    "grpo": "group mean, divided by the group std",
    "dr_grpo": "group mean, no std division",
    "rloo": "leave-one-out mean of the other R − 1 rewards",
    "reinforce": "none (the raw reward)",
    "optimal": "leave-one-out variance-optimal b*_{-i}, weighted by sketched squared score-gradient norms",
}



# ---------------------------------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------------------------------
def lens_gradient_source(records: list[dict[str, Any]], lora_rank: int = 0, lens_space: str = "trainable") -> str:
    """The source of the training lens's per-rollout gradients, a key of :data:`plots.GRADIENT_SOURCES`:
    ``exact_gram`` when a lens step recorded the exact Gram's coverage (only the exact Gram writes it, see
    :meth:`grpo_lens.train.lens.Lens.rollout_gram`); else ``exact_adapter`` for a LoRA run in the trainable space
    (the adapter's gradients, exact); else ``sketch``."""
    if any(r.get(GRAD_GRAM_COVERAGE) is not None for r in records):
        return "exact_gram"
    return "exact_adapter" if lora_rank and lens_space == "trainable" else "sketch"


def s1_trend_finding(records: list[dict[str, Any]]) -> str | None:
    """The Findings sentence on S1 over training: the means of S1 (and accuracy) over the first and last thirds of
    the steps, the windows of :func:`grpo_lens.formulas.stats.trend_windows` that the claims table's S1 measurement
    (claim ``zero_variance_share_rises``) prints, on the same steps (those that logged S1); None below
    :data:`grpo_lens.claims.sparsity.MIN_S1_STEPS` steps, the fewest the S1 trend is tested on."""
    rows = [r for r in records if r.get(REWARD_FRAC_ZERO_STD_GROUPS) is not None and r.get(STEP) is not None]
    if len(rows) < MIN_S1_STEPS:
        return None
    first, last = (rows[s] for s in trend_windows(len(rows)))
    s1 = [mean_interval([float(r[REWARD_FRAC_ZERO_STD_GROUPS]) for r in w], bounds=(0.0, 1.0)) for w in (first, last)]
    acc = [_mean([r.get(REWARD_ACCURACY) for r in w]) for w in (first, last)]
    verb = "rose" if s1[1]["mean"] > s1[0]["mean"] else ("fell" if s1[1]["mean"] < s1[0]["mean"] else "stayed flat")
    return (f"S1 (zero-variance group share) {verb}: {ci(s1[0], 2)} over the first third of the steps "
            f"({first[0][STEP]}–{first[-1][STEP]}) -> {ci(s1[1], 2)} over the last third ({last[0][STEP]}–"
            f"{last[-1][STEP]}), while accuracy went {fmt(acc[0])} -> {fmt(acc[1])} over the same steps (the "
            "claims table tests the trend over every step).")


def schedule_text(cfg: dict[str, Any]) -> str | None:
    """The learning-rate schedule of a saved config in words ("cosine, 2 warm-up steps"); None when the config does
    not name one (a run from before schedules existed)."""
    name = cfg.get("lr_scheduler")
    if not name:
        return None
    warm = cfg.get("warmup_steps") or 0
    warm_text = ("" if not warm else f", warm-up {float(warm):g} of max_steps" if 0 < float(warm) < 1
                 else f", {int(float(warm))} warm-up steps")
    return f"{name}{warm_text}"


def training_section(records: list[dict[str, Any]], run_dir: Path, findings: list[str],
                     lora_rank: int = 0, estimator: str | None = None, lens_space: str = "trainable",
                     schedule: str | None = None) -> list[str]:
    """Learning curves, the learning rate, sparsity and baselines over training (``lora_rank`` > 0: a LoRA run, whose
    sparsity numbers are over the adapter's weights; ``lens_space``: the run's config option, naming the baselines'
    gradient source with :func:`lens_gradient_source`; ``schedule``: the learning-rate schedule in words,
    :func:`schedule_text`, titling the learning-rate plot)."""
    lines = ["## Training", ""]
    n = len(records)
    w = min(5, n // 2)  # non-overlapping first / last windows; fewer than MIN_TREND_STEPS steps: no trend
    trend = n >= MIN_TREND_STEPS
    head, tail = (records[:w], records[n - w:]) if trend else (records, records)
    r0, r1 = _mean([r.get(REWARD_MEAN) for r in head]), _mean([r.get(REWARD_MEAN) for r in tail])
    a0, a1 = _mean([r.get(REWARD_ACCURACY) for r in head]), _mean([r.get(REWARD_ACCURACY) for r in tail])
    sec = _mean([r.get(PERF_STEP_SECONDS) for r in records])
    if trend:
        lines += [f"{n} steps. Mean reward over the first {len(head)} steps {fmt(r0)}, over the last {len(tail)} "
                  f"steps {fmt(r1)}; accuracy {fmt(a0)} -> {fmt(a1)}. {fmt(sec, 1)} s per step on average.", ""]
    else:
        too_few = (f"{n} step(s): too few steps for a trend (the first and last windows need at least 2 steps each "
                   f"without overlap, so at least {MIN_TREND_STEPS} steps)")
        lines += [f"{too_few}. Mean reward over all steps {fmt(r0)}, accuracy {fmt(a0)}. {fmt(sec, 1)} s per "
                  "step on average.", ""]
        findings.append(f"{too_few}; mean reward {fmt(r0)} over the run.")
    s1_all = [r.get(REWARD_FRAC_ZERO_STD_GROUPS) for r in records]
    if records and all(isinstance(x, (int, float)) and x >= 1.0 for x in s1_all):
        findings.append(f"S1 = 1.000 on every one of the {n} steps: no group had reward contrast, so every advantage "
                        "was zero and nothing was trained by the policy gradient (only a KL term with beta > 0 could "
                        "have moved the weights).")
    if trend and r0 is not None and r1 is not None:
        verb = "rose" if r1 > r0 else ("fell" if r1 < r0 else "stayed flat")
        findings.append(f"Mean reward {verb} over training: {fmt(r0)} (first {len(head)} steps) -> {fmt(r1)} "
                        f"(last {len(tail)} steps).")

    dynamic = dynamic_sampling_summary(records)
    if dynamic:
        lines += [dynamic, ""]
        findings.append(dynamic)
    plots.plot_learning_curves(records, run_dir / "learning_curves.png")
    lines += ["![learning curves](learning_curves.png)", ""]
    if any(r.get(LR) is not None for r in records):
        plots.plot_learning_rate(records, run_dir / "learning_rate.png", schedule)
        lines += ["![learning rate](learning_rate.png)", ""]

    lines += ["### Sparsity of the gradient over training", "",
              "S1 is the share of groups whose rewards are all equal: they carry exactly zero policy gradient "
              "(training prints no prediction of it: see the probe's S1 section). S4 is the share of parameters "
              "whose bf16 value did not change; its controls (legend) are the share the same update entries leave "
              "unchanged when permuted within each tensor and what a dense update of the same size would leave "
              "unchanged.", ""]
    if lora_rank:
        lines += [f"Parameter space: this is a LoRA run (rank {lora_rank}); every S4 and update-sparsity number "
                  "below is over the adapter's A and B weights, not the full model (the frozen base weights never "
                  "change). B starts at zero, so on step 1 A gets no gradient and about half the adapter weights are "
                  "unchanged by construction. The merged weights are not measured.", ""]
    plots.plot_sparsity(records, run_dir / "sparsity.png")
    lines += ["![sparsity](sparsity.png)", ""]
    lens_steps = lens_rows(records)
    if lens_steps:
        lines += md_table(["step", "accuracy", "S1 measured", "S4 step", "S4 since start", "G1 erank",
                           "G1 stable rank", "identity residual"])
        for r in lens_steps:
            res = r.get(GRAD_IDENTITY_RESIDUAL)
            lines.append(md_row(r[STEP], fmt(r.get(REWARD_ACCURACY)), fmt(r.get(REWARD_FRAC_ZERO_STD_GROUPS)),
                                fmt(r.get(SPARSITY_UPDATE_STEP)), fmt(r.get(SPARSITY_UPDATE_TOTAL)),
                                fmt(r.get(rank_key('g1', 'erank'))), fmt(r.get(rank_key('g1', 'stable_rank'))),
                                '–' if res is None else f'{res:.1e}'))
        lines.append("")
        if any(r.get(GRAD_IDENTITY_RESIDUAL) is None for r in lens_steps):
            lines += ["Identity residual –: the identity Σ A_i g_i = c (ḡ_C − ḡ_W) (docs/theory.md §4) is checked "
                      "only where it applies: mixed groups of 0/1 rewards under an estimator with a per-group "
                      "constant c (grpo, dr_grpo, rloo)"
                      + (f"; this run's estimator `{estimator}` has no such constant, so it is not computed"
                         if estimator in ("optimal", "reinforce") else
                         "; on these steps no group qualified (no mixed group, non-0/1 rewards, or a truncated "
                         "rollout under overlong masking)") + ".", ""]
    s1_finding = s1_trend_finding(records)
    if s1_finding:
        findings.append(s1_finding)
    lines += eval_section(records, findings)
    lines += training_measures_section(records, run_dir, findings, lora_rank=lora_rank)
    if lens_steps:
        s4 = [r.get(SPARSITY_UPDATE_TOTAL) for r in lens_steps if r.get(SPARSITY_UPDATE_TOTAL) is not None]
        if s4:
            findings.append(f"Update sparsity since the start (S4): {fmt(s4[-1])} of "
                            + ("the LoRA adapter's weights (not the full model's)" if lora_rank else "parameters")
                            + f" kept their bf16 value after {lens_steps[-1][STEP]} steps.")
    if any(r.get(rank_key("g1", m)) is not None for r in lens_steps for m in ("top2_share", "erank")):
        plots.plot_rank_over_training(records, run_dir / "rank_over_training.png")
        lines += ["### Rank of G1 over training", "",
                  "Per lens step, the mean over the step's mixed groups (error bars: the 95% interval over groups, "
                  "from 8 groups): the top-2 and top-1 energy shares against 0.9 (\"k90 = 2\") and erank and "
                  "stable rank against [1.5, 2.5] (docs/theory.md §11).",
                  "", "![rank over training](rank_over_training.png)", ""]

    base_rows = [r for r in records if r.get(BASELINE_B_STAR) is not None]
    if base_rows:
        lines += ["### Baselines", "",
                  "b* = sum ||g_i||^2 r_i / sum ||g_i||^2 is the variance-optimal constant baseline; it equals the "
                  "group mean exactly when ||g||^2 does not depend on the reward (m_C = m_W). Both are means over "
                  "the step's mixed groups only (groups whose rewards are all equal have no gradient), so the group "
                  "mean here is not the step's accuracy or mean reward.", ""]
        plots.plot_baselines(records, run_dir / "baselines.png", lens_gradient_source(records, lora_rank, lens_space))
        lines += ["![baselines](baselines.png)", "",
                  *md_table(["step", "b*", "group mean", "m_C", "m_W", "m_C / m_W"])]
        for r in base_rows:
            mc, mw = r.get(BASELINE_M_CORRECT), r.get(BASELINE_M_WRONG)
            ratio = mc / mw if mc is not None and mw else None
            lines.append(md_row(r[STEP], fmt(r[BASELINE_B_STAR]), fmt(r.get(BASELINE_GROUP_MEAN)), fmt(mc, 4),
                                fmt(mw, 4), fmt(ratio)))
        lines.append("")
        ratios = [r[BASELINE_M_CORRECT] / r[BASELINE_M_WRONG] for r in base_rows
                  if r.get(BASELINE_M_CORRECT) is not None and r.get(BASELINE_M_WRONG)]
        if ratios:
            span = fmt(min(ratios)) if min(ratios) == max(ratios) else f"{fmt(min(ratios))}–{fmt(max(ratios))}"
            findings.append(f"m_C / m_W over {len(ratios)} lens step(s): {span}: "
                            + ("correct rollouts had smaller score-gradient norms, so b* sits below the group mean."
                               if max(ratios) < 1 else "correct rollouts had larger score-gradient norms, so b* sits "
                               "above the group mean." if min(ratios) > 1 else
                               "neither outcome had consistently larger gradient norms."))
    return lines


def _ci(stats: dict[str, Any] | None, nd: int = 2) -> str:
    """:func:`grpo_lens.report.format.ci` with two decimals by default (this module's tables; the training measures
    and the studies print three)."""
    return ci(stats, nd)


#: (row label, key stem) of the rank table: G1, its null and controls, one layer's G1, G2.
RANK_ROWS = (("G1 (rows A_i g_i)", "g1"), ("orthogonal null (|A_i| ||g_i||)", "g1_null"),
             ("G1_no_adv (rows g_i)", "g1_no_adv"), ("G1_random_zero_sum", "g1_random"), ("G1_nll", "g1_nll"),
             ("G1_layer", "g1_layer"), ("G2 (layer weight gradient)", "g2"))


def rank_table(probe: dict[str, Any], measures: tuple[str, ...] = ("erank", "stable_rank", "participation_ratio",
                                                                  "k90")) -> list[str]:
    """Markdown table: rows = (R, matrix), columns = rank measures as mean [95% interval] over groups,
    plus G1's ratio to the orthogonal null and G3 (one matrix over the analysed groups, no interval)."""
    per_r = probe["per_group_size"]
    lines = md_table(["R", "matrix", "groups", *measures])
    for r in sorted(per_r, key=int):
        summ = per_r[r].get(PROBE_SUMMARY, {})
        for label, stem in RANK_ROWS:
            cells = [_ci(summ.get(rank_key(stem, m))) for m in measures]
            n = (summ.get(rank_key(stem, measures[0])) or {}).get("n", 0)
            if n:
                lines.append(md_row(r, label, n, *cells))
        cells = [_ci(summ.get(RANK_G1_VS_NULL.format(m=m))) for m in measures]
        n = (summ.get(RANK_G1_VS_NULL.format(m=measures[0])) or {}).get("n", 0)
        if n:
            lines.append(md_row(r, "G1 / null (ratio)", n, *cells))
        g3 = per_r[r].get(PROBE_G3, {})
        if g3.get(rank_key("g3", measures[0])) is not None:
            lines.append(md_row(r, "G3 (rows = groups' updates)", g3.get(G3_GROUPS),
                                *(f"{fmt(g3.get(rank_key('g3', m)), 2)} (null {fmt(g3.get(rank_key('g3_null', m)), 2)})"
                                  for m in measures)))
    return lines


WEIGHTING_LABELS = {"adv": "A", "abs": "|A|", "shift": "A + mean|A|", "reward": "r", "uniform": "1",
                    "single": "one rollout"}


def weighting_tables(probe: dict[str, Any]) -> list[str]:
    """G3 and G2 (every layer, by layer type) under the weightings A, |A|, A + mean|A|, r, 1 and a single rollout:
    if a rank ≈ 2 came from the zero-sum advantages, A would stand apart from the weightings that are not zero-sum."""
    per_r = probe["per_group_size"]
    layers = (probe["meta"].get("config") or {}).get("layers")  # probe --layers PATTERN
    kept = f" (the layers --layers {layers!r} keeps)" if layers else ""
    lines = ["### Zero-sum or not: G3 and G2 under other weightings", "",
             "Rows weighted by A (GRPO), |A|, A + mean|A| and r (not zero-sum), 1 (no advantages) and a single "
             "rollout. "
             "G3: one matrix per R over the analysed groups, its stable rank (no interval: resampling its rows would "
             f"repeat rows and lower the rank). G2: every linear layer's weight gradient of the group loss{kept}, "
             "mean stable rank over the layers "
             "of each type, on the first --g2-groups group(s) of each R (mean over those groups).", "",
             *md_table(["R", "matrix", *(WEIGHTING_LABELS[w] for w in WEIGHTINGS)])]
    for r in sorted(per_r, key=int):
        g3 = per_r[r].get(PROBE_G3) or {}
        if g3.get(rank_key("g3", "stable_rank")) is not None:
            cells = []
            for w in WEIGHTINGS:
                key = rank_key("g3" if w == "adv" else f"g3_{w}", "stable_rank")
                cells.append(fmt(g3.get(key), 2))
            lines.append(md_row(r, f"G3 stable rank ({g3.get(G3_GROUPS)} groups)", *cells))
        g2 = (per_r[r].get(PROBE_G2_WEIGHTINGS) or {}).get(PROBE_SUMMARY) or {}
        parsed = [RANK_G2_WEIGHTED.parse(k) for k in g2]
        types = sorted({p["kind"] for p in parsed if p is not None and p["w"] == "adv"})
        for t in types:
            cells = [fmt((g2.get(RANK_G2_WEIGHTED.format(w=w, kind=t)) or {}).get("mean"), 2) for w in WEIGHTINGS]
            n = (g2.get(RANK_G2_WEIGHTED.format(w="adv", kind=t)) or {}).get("n")
            lines.append(md_row(r, f"G2 {t} stable rank ({n} group(s))", *cells))
    return lines + [""]


def strata_table(probe: dict[str, Any], by: str) -> list[str]:
    """Markdown table of G1 vs its null and the zero-sum statistics per stratum (``by`` = "correct" or "distinct")."""
    per_r = probe["per_group_size"]
    head = "k (correct)" if by == "correct" else "distinct completions"
    lines = md_table(["R", head, "groups", "G1 erank", "null erank", "G1 / null erank", "G1 stable rank",
                      "null stable rank", "span energy", "span energy, relabelled", "cos gap"])
    for r in sorted(per_r, key=int):
        for stratum, summ in per_r[r].get(PROBE_STRATA, {}).get(by, {}).items():
            n = (summ.get(rank_key("g1", "erank")) or {}).get("n", 0)
            lines.append(md_row(r, stratum, n, _ci(summ.get(rank_key('g1', 'erank'))),
                                _ci(summ.get(rank_key('g1_null', 'erank'))),
                                _ci(summ.get(RANK_G1_VS_NULL.format(m='erank'))),
                                _ci(summ.get(rank_key('g1', 'stable_rank'))),
                                _ci(summ.get(rank_key('g1_null', 'stable_rank'))),
                                _ci(summ.get(ZERO_SUM_SPAN_ENERGY)), _ci(summ.get(ZERO_SUM_SPAN_ENERGY_NULL)),
                                _ci(summ.get(ZERO_SUM_COS_GAP), 3)))
    return lines


def _g2_cell(summ: dict[str, Any]) -> str:
    """'rank / bound' means over groups (the bound is prompt tokens + distinct completion prefixes)."""
    rk, bd = summ.get(RANK_G2_NUMERICAL_RANK) or {}, summ.get(RANK_G2_RANK_BOUND) or {}
    if rk.get("mean") is None:
        return "–"
    return f"{fmt(rk['mean'], 1)} / {fmt(bd.get('mean'), 1)}"


def probe_section(label: str, probe: dict[str, Any], run_dir: Path, findings: list[str]) -> list[str]:
    """Rank tables beside the orthogonal null (with intervals and strata), the zero-sum test, the identity, S1,
    baselines and credit of one probe."""
    per_r = probe["per_group_size"]
    meta = probe.get("meta", {})
    source = ("exact per-rollout gradients of every parameter" if meta.get("gradients") == "exact" else
              f"the exact Gram of the per-rollout gradients (coverage {fmt(meta.get('gram_coverage'), 2)} of "
              f"Σ||g_i||², every parameter; G3 from the sketch)" if meta.get("gradients") == "exact_gram" else
              f"sketched per-rollout gradients ({meta.get('sketch_dim')} per side per nn.Linear weight)")
    lines = [f"## Gradient probe: {label}", "",
             f"Model {meta.get('model')}, task {meta.get('task')}, {source}, std convention {meta.get('std')}, "
             f"eps {meta.get('eps')}. Every mean is over the analysed (mixed) groups, with its 95% "
             "interval over groups in brackets (Hall's transformed t, docs/theory.md §7).", ""]
    check = meta.get("sketch_check") or {}
    if meta.get("gradients") != "exact":
        cov = check.get(SKETCH_COVERAGE)
        if cov:
            lines += [f"Sketch checked against exact gradients of every parameter on {cov.get('n')} group(s): it "
                      f"carries {_ci(cov)} of Σ||g_i||² (Σ||S g_i||² / Σ||g_i||², the sketch's estimate of the "
                      f"linear weights' share, which can exceed 1 by its error; exact shares: linear weights "
                      f"{_ci(check.get(SKETCH_EXACT_SHARE_LINEAR))}, embedding "
                      f"{_ci(check.get(SKETCH_EXACT_SHARE_EMBEDDING))}, norms "
                      f"{_ci(check.get(SKETCH_EXACT_SHARE_NORM))}); G1's Gram error, measured "
                      f"{_ci(check.get(SKETCH_GRAM_ERROR))} (missing parameters and projection noise), bound for the "
                      f"sketched layers {_ci(check.get(SKETCH_GRAM_ERROR_BOUND))}; erank(G1) sketched − exact "
                      f"{_ci(check.get(SKETCH_G1_ERANK_ERROR), 3)}.", ""]
        else:
            lines += ["The sketch was not checked against exact gradients (coverage_groups = 0): the share of "
                      "||g||² it covers is unknown; it sees nn.Linear weights only.", ""]
    lines += md_table(["R", "prompts", "all-equal", "mixed (analysed)", "S1 measured", "S1 predicted",
                       "identity residual (max)", "distinct completions", "G2 numerical rank / bound"])
    for r in sorted(per_r, key=int):
        d = per_r[r]
        summ = d.get(PROBE_SUMMARY, {})
        res = [g.get(GRAD_IDENTITY_RESIDUAL) for g in d.get(PROBE_GROUPS, [])
               if g.get(GRAD_IDENTITY_RESIDUAL) is not None]
        lines.append(md_row(r, d.get(PROMPTS_SAMPLED), d.get(GROUPS_ALL_EQUAL), d.get(GROUPS_MIXED),
                            _ci(d[S1_MEASURED_CI], 3) if d.get(S1_MEASURED_CI) else fmt(d.get(S1_MEASURED)),
                            _ci(d[S1_PREDICTED_CI], 3) if d.get(S1_PREDICTED_CI) else fmt(d.get(S1_PREDICTED)),
                            f'{max(res):.1e}' if res else '–', _ci(summ.get(GROUP_DISTINCT_COMPLETIONS)),
                            _g2_cell(summ)))
        if d.get(GROUPS_MIXED, 0) == 0:
            findings.append(f"[{label}] R={r}: no mixed group among {d.get(PROMPTS_SAMPLED)} prompts (S1 = "
                            f"{fmt(d.get(S1_MEASURED))}): GRPO's policy gradient was exactly zero on every "
                            f"sampled group, so no rank could be measured.")
    lines += ["", "### Effective rank vs group size, beside the orthogonal null", "",
              "G1: rows A_i g_i of a group. The orthogonal null has singular values |A_i| ||g_i||: what G1 would be "
              "if its rows shared no direction; a ratio G1 / null well below 1 is structure beyond the row norms. "
              "Controls on the same tokens: G1_no_adv (rows g_i), G1_random_zero_sum (rows w_i g_i, w random "
              "zero-sum, ||w|| = ||A||), G1_nll (rows of the supervised NLL gradient). G1_layer: G1 of "
              f"`{meta.get('layer')}` only; G2: that layer's weight gradient of the group loss. G3: rows = the "
              "analysed groups' updates (one matrix; its null has singular values = the row norms).", ""]
    lines += rank_table(probe) + [""]
    lines += weighting_tables(probe)
    lines += ["### Stratified by k (correct rollouts in the group)", "", *strata_table(probe, "correct"), "",
              "### Stratified by distinct completions", "", *strata_table(probe, "distinct"), ""]
    lines += ["### Zero-sum structure: label-permutation test with k fixed", "",
              "span energy: share of G1's energy in span{gbar_C, gbar_W}; relabelled: its mean over every relabelling "
              "with the same k (the permutation null). cos gap: mean within-class minus between-class cosine of the "
              "g_i. p: share of groups whose own permutation p-value is below 0.05.", "",
              *md_table(["R", "groups", "span energy", "relabelled", "groups p < 0.05", "cos gap", "relabelled",
                         "groups p < 0.05"])]
    for r in sorted(per_r, key=int):
        d = per_r[r]
        summ = d.get(PROBE_SUMMARY, {})
        cells = []
        for stat in ZERO_SUM_STATS:
            p_key = zero_sum_key(stat, "p")
            ps = [g[p_key] for g in d.get(PROBE_GROUPS, []) if g.get(p_key) is not None]
            cells += [_ci(summ.get(zero_sum_key(stat)), 3), _ci(summ.get(zero_sum_key(stat, "null")), 3),
                      f"{sum(p < 0.05 for p in ps)}/{len(ps)}" if ps else "–"]
        n = (summ.get(ZERO_SUM_SPAN_ENERGY) or {}).get("n", 0)
        lines.append(md_row(r, n, *cells))
    lines.append("")
    for r in sorted(per_r, key=int):
        summ = per_r[r].get(PROBE_SUMMARY, {})
        g1 = summ.get(rank_key("g1", "erank")) or {}
        null = summ.get(rank_key("g1_null", "erank")) or {}
        if g1.get("mean") is None:
            continue
        note = " (R = 2 caps every rank measure at 2)" if int(r) == 2 else ""
        findings.append(f"[{label}] R={r}: G1 erank {_ci(g1)} vs orthogonal null {_ci(null)} over {g1.get('n')} "
                        f"groups{note}.")
    res_all = [g.get(GRAD_IDENTITY_RESIDUAL) for d in per_r.values() for g in d.get(PROBE_GROUPS, [])
               if g.get(GRAD_IDENTITY_RESIDUAL) is not None]
    if res_all:
        findings.append(f"[{label}] The rank-2 identity sum_i A_i g_i = c(k,R)(gbar_C - gbar_W) held to a relative "
                        f"residual of at most {max(res_all):.1e} over {len(res_all)} mixed 0/1 groups.")
    plots.plot_erank_vs_group_size({label: probe}, run_dir / f"erank_vs_R_{label}.png")
    plots.plot_spectra(probe, run_dir / f"spectra_{label}.png")
    lines += [f"![erank vs R]({f'erank_vs_R_{label}.png'})", f"![spectra]({f'spectra_{label}.png'})", ""]

    lines += ["### Baselines", "",
              "Variance of the gradient estimate (1/R) sum_i (r_i - b_i) g_i under each baseline, relative to the "
              "leave-one-out optimal baseline b*, from groups of R resampled out of M rollouts of one prompt. The "
              "group mean is not leave-one-out: it equals rloo scaled by (R-1)/R, so its variance is ((R-1)/R)^2 "
              "times rloo's (a shorter step, not a better direction).", "",
              *md_table(["R", "b*", "group mean", "m_C", "m_W", "Var/Var* none", "mean", "rloo", "optimal"])]
    for r in sorted(per_r, key=int):
        b = per_r[r].get(PROBE_BASELINES, {})
        summ = per_r[r].get(PROBE_SUMMARY, {})
        rel = b.get("relative_variance", {})
        lines.append(md_row(r, _ci(summ.get(BASELINE_B_STAR), 3), _ci(summ.get(BASELINE_GROUP_MEAN), 3),
                            _ci(summ.get(BASELINE_M_CORRECT), 4), _ci(summ.get(BASELINE_M_WRONG), 4),
                            fmt(rel.get('none'), 2), fmt(rel.get('mean'), 2), fmt(rel.get('rloo'), 2),
                            fmt(rel.get('optimal'), 2)))
        if rel.get("rloo") is not None:
            none = rel.get("none")
            lower = (f"; with no baseline at all it is {fmt(none, 2)}x, lower: b* minimises the second moment "
                     f"E||(r - b) g||^2, which is the variance only when E[g] = 0, and the length-normalised g_i's "
                     f"mean is not 0" if none is not None and none < 1
                     else f"; no baseline at all gives {fmt(none, 2)}x")
            findings.append(f"[{label}] R={r}: the rloo baseline's gradient variance is {fmt(rel['rloo'], 2)}x the "
                            f"leave-one-out optimal b*'s{lower} (one resampling estimate over {b.get('prompts')} "
                            f"prompt(s) of {per_r[r].get(ROLLOUTS_PER_PROMPT)} rollouts; no interval).")
    plots.plot_baseline_variance(probe, run_dir / f"baseline_variance_{label}.png")
    lines += ["", f"![baseline variance](baseline_variance_{label}.png)", ""]

    lines += ["### Credit", "",
              "Under an output-only reward every token of a rollout gets the same advantage: the per-token "
              "advantage variance within a rollout is measured, not assumed.", "",
              *md_table(["R", "within-rollout advantage variance (max)", "answer-token share of ||g||^2",
                         "answer tokens share of tokens"])]
    for r in sorted(per_r, key=int):
        d = per_r[r]
        summ = d.get(PROBE_SUMMARY, {})
        vmax = [g.get(CREDIT_ADV_VAR_WITHIN_MAX) for g in d.get(PROBE_GROUPS, [])
                if g.get(CREDIT_ADV_VAR_WITHIN_MAX) is not None]
        lines.append(md_row(r, fmt(max(vmax), 6) if vmax else '–', _ci(summ.get(CREDIT_ANSWER_SHARE_MEAN), 3),
                            _ci(summ.get(CREDIT_ANSWER_TOKEN_FRAC), 3)))
    plots.plot_credit_profile(probe, run_dir / f"credit_profile_{label}.png")
    lines += ["", f"![credit profile](credit_profile_{label}.png)", ""]
    if probe.get("studies"):
        lines += studies_section(label, probe["studies"], run_dir, findings)
    return lines


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


def _calibrated(c: Any, levels: dict[str, dict[str, dict[str, Any]]]) -> str:
    cell = level_at(levels, c.rule_id, c.n)
    if cell is None:
        return "not calibrated"
    power = "–" if cell["power"] is None else f"{cell['power']:.2f}"
    where = f"n = {cell['n']} {cell.get('unit', '')}".strip() + (" (the smallest calibrated; this row has fewer)"
                                                                 if cell["below"] else "")
    return f"level {cell['level']:.3f}, power {power} ({where})"


def claims_section(probes: dict[str, dict[str, Any]], records: list[dict[str, Any]] | None = None,
                   lora_rank: int = 0) -> list[str]:
    """The paper's claims, per probe and on the training run's records (:func:`grpo_lens.claims.base.evaluate_claims`;
    rules in docs/theory.md §11 and §12): the primary claims in one table decided under Holm at a family-wise 0.05
    (:func:`grpo_lens.claims.base.holm_claims`), each with its n, the p-value it was decided at and its rule's
    calibrated level and power at that n (read from grpo_lens/data/calibration_levels.json, written by `grpo-lens
    calibrate`); then the checks (algebra with a control) and the descriptive rows, apart. ``lora_rank`` > 0: the
    training sparsity numbers are over the LoRA adapter's weights."""
    rule_text = ("One primary measure and one verdict per claim, computed from the numbers by the rule shown "
                 "(docs/theory.md §11 for the rank claims and the identity, §12 for sparsity, credit and baselines): "
                 "holds / does not "
                 "hold / inconclusive, decided under Holm at a family-wise 0.05. Intervals are 95%, none from fewer "
                 "than 8 units. 'calibrated' is the rule's level (wrong-verdict share) and power on planted cases at "
                 "the row's n (docs/calibration.md).")
    if probes and records:
        lines = ["## Claims: effective rank, zero-sum structure, the identity, sparsity, credit, baselines", "",
                 rule_text, ""]
    elif probes:
        lines = ["## Claims: effective rank, zero-sum structure, the identity, credit, baselines", "", rule_text +
                 " The claims on sparsity over training come from a training run (`grpo-lens train`, or "
                 "`grpo-lens demo`); this report has a probe only.", ""]
    else:
        lines = ["## Claims: sparsity over training", "", rule_text + " The claims on effective rank, zero-sum "
                 "structure, the identity, credit and baselines come from `grpo-lens probe` (or `grpo-lens demo`, "
                 "which probes before and after training); this run has no probe.json.", ""]
    sources = dict(probes)
    if records:
        sources = {"training": {"records": records, "lora_rank": lora_rank}, **sources}
    multi = len(sources) > 1
    evaluated = [(label, c) for label, probe in sources.items()
                 for c in evaluate_claims(probe, list(TRAINING_CLAIMS) if label == "training" else None)]
    decided, note = holm_claims([c for _, c in evaluated])
    labelled = [(label, d) for (label, _), d in zip(evaluated, decided)]
    levels = load_levels()
    lines += md_table((["probe"] if multi else []) + ["claim", "scope", "measurement", "null / control", "verdict",
                                                      "decided by", "n", "calibrated (level, power)", "gradients"])
    for label, c in labelled:
        if c.kind != "claim":
            continue
        rule = c.rule + (f". To decide: {c.advice}" if c.verdict == INCONCLUSIVE and c.advice else "")
        cells = [mark_few(x) for x in (c.claim, c.scope, c.measurement, c.control, f"**{c.verdict}**", rule,
                                         "–" if c.n is None else str(c.n), _calibrated(c, levels), c.source)]
        lines.append(md_row(*([label] if multi else []), *cells))
    lines += ([""] + [note] if note else [])
    for kind, title in (("check", "Checks (algebra and identities, each with its control; not tests, not counted)"),
                        ("descriptive", "Descriptive rows (no calibrated rule, no verdict)")):
        rows = [(label, c) for label, c in labelled if c.kind == kind]
        if rows:
            lines += ["", f"{title}:", ""]
            lines += [f"- {c.claim} ({label + ', ' if multi else ''}{c.scope}): **{c.verdict}** — {c.measurement}; "
                      f"control: {c.control}; {c.rule}" if kind == "check" else
                      f"- {c.claim} ({label + ', ' if multi else ''}{c.scope}): {c.measurement}; {c.rule}"
                      for label, c in rows]
    return lines + [""]


def write_report(run_dir: Path) -> Path:
    """Write run_dir/report.md and its PNGs from the run directory's files; return the report's path.

    Raises:
        ReportError: the directory has neither metrics.jsonl nor any probe.json.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a directory; pass a run directory written by train, probe or demo")
    train_dir = run_dir / "train" if (run_dir / "train" / "metrics.jsonl").exists() else run_dir  # demo layout
    records = [r for r in _read_jsonl(train_dir / "metrics.jsonl") if STEP in r]
    probes = find_probes(run_dir)
    if not records and not probes:
        raise ReportError(f"{run_dir} holds neither metrics.jsonl nor probe.json; nothing to report")
    findings: list[str] = []
    body: list[str] = []
    config = train_dir / "config.yaml"
    try:
        cfg = (yaml.safe_load(config.read_text()) or {}) if config.exists() else {}
        lora_rank = int(cfg.get("lora_rank") or 0)
    except (yaml.YAMLError, TypeError, ValueError, AttributeError):
        cfg, lora_rank = {}, 0
    estimator = cfg.get("estimator") if isinstance(cfg, dict) else None
    if records:
        body += training_section(records, run_dir, findings, lora_rank, estimator=estimator,
                                 lens_space=str(cfg.get("lens_space") or "trainable") if isinstance(cfg, dict)
                                 else "trainable", schedule=schedule_text(cfg) if isinstance(cfg, dict) else None)
        body += completions_section(_read_jsonl(train_dir / "completions.jsonl"))
    for label, probe in probes.items():
        body += probe_section(label, probe, run_dir, findings)
    if len(probes) > 1:
        plots.plot_erank_vs_group_size(probes, run_dir / "erank_vs_R.png")
        body += ["## Before vs after training", "", "![erank vs R, before and after](erank_vs_R.png)", ""]

    header = ["# grpo-lens report", "", f"Run directory: `{run_dir}`.", ""]
    if probes or any(r.get(PERF_LENS_SECONDS) is not None for r in records):
        header += answers_section(probes, records, lora_rank)  # the answers first, the full table below
    if records and estimator:
        header += [f"Advantage estimator: `{estimator}` (baseline: {ESTIMATOR_BASELINES.get(estimator, 'see docs')}"
                   + (f"; std convention `{cfg.get('std')}`" if estimator == "grpo" and cfg.get("std") else "")
                   + ").", ""]
    config = train_dir / "config.yaml"
    if config.exists():
        header += ["<details><summary>config</summary>", "", "```yaml", config.read_text().strip(), "```", "",
                   "</details>", ""]
    if probes or any(r.get(PERF_LENS_SECONDS) is not None for r in records):
        header += claims_section(probes, records, lora_rank)
    if (probes.get("probe") or {}).get("seeds"):  # a pooled probe (probe --seeds): each seed beside the pool
        header += seeds_section(probes["probe"], run_dir)
    header += ["## Findings", "", *[f"- {f}" for f in findings], ""]
    lines = few_footnotes(header + body)
    if any(FEW_MARK in line for line in lines):  # the mark's meaning, once, under the title
        lines[4:4] = [FEW_NOTE, ""]
    path = run_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
