"""``grpo-lens report RUN_DIR``: report.md and PNG plots, read from the run directory alone.

A run directory may hold a training run (metrics.jsonl, config.yaml, in the folder or in ``train/``), probes
(probe.json in the folder itself or in ``probe_before/`` and ``probe_after/``), or both (the demo); ``demo --preset``
writes a pooled probe in ``probe/`` and ``train --seeds`` runs in ``train/`` (:func:`preset_layout`). Every sentence
under "Findings" is computed from those numbers; nothing is hard-coded. This module assembles the report
(:func:`write_report`) and holds the claims table (:func:`claims_section`, verdicts from :mod:`grpo_lens.claims`).
report.md opens with one screen, the answers and three figures (:func:`first_figures`); everything else follows
under "## Appendix" (:func:`appendix`): the settings, the claims table, the findings, the training section and one
section per probe. Beside it:

answers            the report's opening: one line per decided claim, the undecided ones grouped by what decides them
training           the training section (:func:`training_section`), one function per subsection
training_measures  entropy, sparsity over training, the lens's cost and dynamic sampling, from metrics.jsonl
probe              one section per probe (:func:`probe_section`), one function per subsection
studies            a probe's studies: S1 predicted, baselines at matched expectation, token credit
seeds              a pooled probe's seeds side by side
plots              the PNGs
format             how numbers and intervals are printed
compare            ``grpo-lens compare``: several training runs in one report
"""

from __future__ import annotations

import re
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import yaml

from grpo_lens import metrics as mk
from grpo_lens.claims.base import DOES_NOT_HOLD, HOLDS, INCONCLUSIVE, evaluate_claims, holm_claims
from grpo_lens.claims.sparsity import TRAINING_CLAIMS
from grpo_lens.config.base import safe_load_yaml
from grpo_lens.report import plots
from grpo_lens.report.answers import answers_section, training_data
from grpo_lens.report.format import (
    FEW_MARK,
    FEW_NOTE,
    few_footnotes,
    mark_few,
    md_row,
    md_table,
)
from grpo_lens.report.levels import (  # noqa: F401 (re-exported: `from grpo_lens.report import level_at` works)
    LEVELS_FILE,
    _p2,
    branch_power,
    level_at,
    load_levels,
    lowest_at,
)
from grpo_lens.report.probe import (  # noqa: F401 (re-exported: `from grpo_lens.report import rank_table` works)
    RANK_ROWS,
    WEIGHTING_LABELS,
    _ci,
    probe_section,
    rank_table,
    strata_table,
    weighting_tables,
)
from grpo_lens.report.seeds import seed_probes, seeds_section
from grpo_lens.report.training import (  # noqa: F401 (re-exported)
    lens_gradient_source,
    s1_trend_finding,
    schedule_text,
    train_seeds_lines,
    training_section,
)
from grpo_lens.report.training_measures import completions_section
from grpo_lens.rundir import read_json_file, read_records, read_train_seeds, write_file, writes_confined_to


class ReportError(ValueError):
    """The directory holds nothing a report can be written from."""


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Records of a run-directory JSONL file (:func:`grpo_lens.rundir.read_records`: names file and line of a bad
    one)."""
    return read_records(path)


def find_probes(run_dir: Path) -> dict[str, dict[str, Any]]:
    """label -> probe.json content for every probe in the run directory (before/after training, or standalone)."""
    probes = {}
    for label, sub in (("before", "probe_before"), ("after", "probe_after"), ("probe", "."), ("probe", "probe")):
        path = run_dir / sub / "probe.json"
        if path.exists() and label not in probes:  # probe/: the pooled probe of ``demo --preset``
            probes[label] = read_probe(path)
    return probes


def preset_layout(run_dir: Path) -> bool:
    """Whether ``run_dir`` is a ``demo --preset`` run (:mod:`grpo_lens.demo`): a pooled probe in probe/ and/or a
    finished ``train --seeds`` directory in train/ (its train_seeds.json, written when every seed finished), reported
    together under one Holm family, the primary claims as one table. One finished stage is enough: the report then
    says which stage is missing (:func:`preset_missing_lines`)."""
    return (run_dir / "probe" / "probe.json").is_file() or read_train_seeds(run_dir / "train") is not None


def preset_missing_lines(run_dir: Path) -> list[str]:
    """The lines a ``demo --preset`` report prints under its answers' heading for each stage that is not finished
    (no probe/probe.json; no train/train_seeds.json): its claims are not in the table, and how to add them. Empty
    when both stages are finished."""
    missing = []
    if not (run_dir / "probe" / "probe.json").is_file():
        missing.append(("probe", "the probe's claims (rank, labels, credit, baseline)"))
    if read_train_seeds(run_dir / "train") is None:
        missing.append(("train", "the claims over training"))
    return [
        f"**Stage not finished: {stage}/**: {what} are not in this table nor in its Holm family; "
        f"the same `demo --preset` command adds them."
        for stage, what in missing
    ] + ([""] if missing else [])


def read_probe(path: Path) -> dict[str, Any]:
    """The probe in ``path`` (a probe.json), read the bounded way (:func:`grpo_lens.rundir.read_json_file`) and
    checked for what a report reads: an object with ``meta`` and ``per_group_size`` objects (``studies``, when
    present, an object too).

    Raises:
        ReportError: one line naming the file: unreadable, cut, nested too deep, or not a probe (``{}``, ``[]``).
    """
    fix = "run the probe again (grpo-lens probe --out ... --overwrite), or move the file away"
    probe = read_json_file(path, ReportError, fix)
    wrong = [
        k
        for k in ("meta", "per_group_size", "studies")
        if not isinstance(probe, dict) or not isinstance(probe.get(k, {} if k == "studies" else None), dict)
    ]
    if wrong:
        held = f"a JSON {type(probe).__name__}" if not isinstance(probe, dict) else f"no {', '.join(wrong)} object"
        raise ReportError(f"{path} is not a probe: it holds {held}; {fix}")
    return probe


#: what each advantage estimator subtracts from a rollout's reward (docs/theory.md §2)
ESTIMATOR_BASELINES = {
    "grpo": "group mean, divided by the group std",
    "dr_grpo": "group mean, no std division",
    "rloo": "leave-one-out mean of the other R − 1 rewards",
    "reinforce": "none (the raw reward)",
    "optimal": "leave-one-out variance-optimal b*_{-i}, weighted by sketched squared score-gradient norms",
    "grpo_batch": "group mean, divided by the batch's reward std (TRL's scale_rewards=batch)",
    "reinforce_pp": "batch mean, divided by the batch std (REINFORCE++), no group baseline",
    "reinforce_pp_baseline": "group mean, then divided by the batch std of the centred rewards (REINFORCE++-baseline)",
}


def _calibrated(c: Any, levels: dict[str, dict[str, dict[str, Any]]]) -> str:
    """'level L, power of *verdict* P (n = N unit)': the rule's level and the power of the branch the row's verdict
    took (both branches' for an inconclusive row) at the largest calibrated n <= the row's n."""
    cell = level_at(levels, c.rule_id, c.n)
    if cell is None:
        return "not calibrated"
    if c.verdict == INCONCLUSIVE:
        power = f"power holds {_p2(branch_power(cell, HOLDS))}, does not hold {_p2(branch_power(cell, DOES_NOT_HOLD))}"
    else:
        power = f"power of *{c.verdict}* {_p2(branch_power(cell, c.verdict))}{lowest_at(cell, c.verdict)}"
    where = f"n = {cell['n']} {cell.get('unit', '')}".strip() + (
        " (the smallest calibrated; this row has fewer)" if cell["below"] else ""
    )
    return f"level {cell['level']:.3f}, {power} ({where})"


def _claims_header(probes: bool, records: bool) -> list[str]:
    """The claims section's title and rule text for a report with a probe, training records or both."""
    rule_text = (
        "One primary measure and one verdict per claim, computed from the numbers by the rule shown "
        "(docs/theory.md §11 for the rank claims and the identity, §12 for sparsity, credit and baselines): "
        "holds / does not "
        "hold / inconclusive, decided under Holm at a family-wise 0.05. Intervals are 95%, none from fewer "
        "than 8 units. 'calibrated' is the rule's level (wrong-verdict share) and power on planted cases at "
        "the row's n: the power of the branch the row's verdict took, both for inconclusive (docs/calibration.md)."
    )
    if probes and records:
        lines = [
            "## Claims: effective rank, zero-sum structure, the identity, sparsity, credit, baselines",
            "",
            rule_text,
            "",
        ]
    elif probes:
        lines = [
            "## Claims: effective rank, zero-sum structure, the identity, credit, baselines",
            "",
            rule_text + " The claims on sparsity over training come from a training run (`grpo-lens train`, or "
            "`grpo-lens demo`); this report has a probe only.",
            "",
        ]
    else:
        lines = [
            "## Claims: sparsity over training",
            "",
            rule_text + " The claims on effective rank, zero-sum "
            "structure, the identity, credit and baselines come from `grpo-lens probe` (or `grpo-lens demo`, "
            "which probes before and after training); this run has no probe.json.",
            "",
        ]
    return lines


def claims_section(
    probes: dict[str, dict[str, Any]],
    records: list[dict[str, Any]] | None = None,
    lora_rank: int = 0,
    seed_runs: list[list[dict[str, Any]]] | None = None,
) -> list[str]:
    """The paper's claims, per probe and on the training run's records (:func:`grpo_lens.claims.base.evaluate_claims`;
    rules in docs/theory.md §11 and §12): the primary claims in one table decided under Holm at a family-wise 0.05
    (:func:`grpo_lens.claims.base.holm_claims`), each with its n, the p-value it was decided at and its rule's
    calibrated level and power at that n (read from grpo_lens/data/calibration_levels.json, written by `grpo-lens
    calibrate`); then the checks (algebra with a control) and the descriptive rows, apart. ``lora_rank`` > 0: the
    training sparsity numbers are over the LoRA adapter's weights."""
    lines = _claims_header(bool(probes), bool(records))
    sources = dict(probes)
    if records:
        sources = {"training": training_data(records, lora_rank, seed_runs), **sources}
    multi = len(sources) > 1
    evaluated = [
        (label, c)
        for label, probe in sources.items()
        for c in evaluate_claims(probe, list(TRAINING_CLAIMS) if label == "training" else None)
    ]
    decided, note = holm_claims([c for _, c in evaluated])
    labelled = [(label, d) for (label, _), d in zip(evaluated, decided)]
    levels = load_levels()
    lines += md_table(
        (["probe"] if multi else [])
        + [
            "claim",
            "scope",
            "measurement",
            "null / control",
            "verdict",
            "decided by",
            "n",
            "calibrated (level, power)",
            "gradients",
        ]
    )
    for label, c in labelled:
        if c.kind != "claim":
            continue
        rule = c.rule + (f". To decide: {c.advice}" if c.verdict == INCONCLUSIVE and c.advice else "")
        cells = [
            mark_few(x)
            for x in (
                c.claim,
                c.scope,
                c.measurement,
                c.control,
                f"**{c.verdict}**",
                rule,
                "–" if c.n is None else str(c.n),
                _calibrated(c, levels),
                c.source,
            )
        ]
        lines.append(md_row(*([label] if multi else []), *cells))
    lines += [""] + [note] if note else []
    for kind, title in (
        ("check", "Checks (algebra and identities, each with its control; not tests, not counted)"),
        ("descriptive", "Descriptive rows (no calibrated rule, no verdict)"),
    ):
        rows = [(label, c) for label, c in labelled if c.kind == kind]
        if rows:
            lines += ["", f"{title}:", ""]
            lines += [
                f"- {c.claim} ({label + ', ' if multi else ''}{c.scope}): **{c.verdict}** — {c.measurement}; "
                f"control: {c.control}; {c.rule}"
                if kind == "check"
                else f"- {c.claim} ({label + ', ' if multi else ''}{c.scope}): {c.measurement}; {c.rule}"
                for label, c in rows
            ]
    return lines + [""]


#: the report's first-screen figures, most informative first: one figure per entry, the first file (in report
#: order) that matches its first pattern, else its second; the first three entries the run has are shown
FIRST_FIGURES = (
    ("erank_vs_R.png", "erank_vs_R_*.png"),  # the rank claim: G1's erank vs R beside its null
    ("sparsity.png",),  # S1 and S4 over training
    ("rank_over_training.png",),  # G1's rank at every lens step
    ("spectra_*.png",),
    ("baseline_variance_*.png",),
    ("learning_curves.png",),
    ("baselines.png",),
)
N_FIRST_FIGURES = 3

_IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)]+)\)")
_HEADING = re.compile(r"(#{2,5}) (.*)")


def report_figures(lines: list[str]) -> list[tuple[str, str, str]]:
    """(alt text, file name, where) of every image line of ``lines`` (a report's Markdown), in order; ``where`` is
    the section heading above it and, when there is one, the subsection heading ("Training, Sparsity of ...")."""
    section = subsection = ""
    out = []
    for line in lines:
        heading = _HEADING.fullmatch(line)
        if heading:
            section, subsection = (heading[2], "") if len(heading[1]) == 2 else (section, heading[2])
        image = _IMAGE.fullmatch(line)
        if image:
            out.append((image[1], image[2], f"{section}, {subsection}" if subsection else section))
    return out


def first_figures(body: list[str], n: int = N_FIRST_FIGURES) -> list[str]:
    """The report's first-screen figures: the first ``n`` entries of :data:`FIRST_FIGURES` that ``body`` (the
    report's sections) shows, each image once more here, and a line naming the appendix section of each; [] when the
    body has no image."""
    figures = report_figures(body)
    chosen: list[tuple[str, str, str]] = []
    for patterns in FIRST_FIGURES:
        match = next((f for p in patterns for f in figures if fnmatch(f[1], p)), None)
        if match and len(chosen) < n:
            chosen.append(match)
    if not chosen:
        return []
    return [
        "## Figures",
        "",
        *(f"![{alt}]({name})" for alt, name, _ in chosen),
        "",
        "In order: " + "; ".join(f"{alt} (appendix: {where})" for alt, _, where in chosen) + ".",
        "",
    ]


def appendix(lines: list[str]) -> list[str]:
    """``lines`` under an "## Appendix" heading, every Markdown heading in them one level deeper (``## Training`` ->
    ``### Training``); code blocks (the config's YAML, whose comments start with #) are left as they are."""
    out, fenced = ["## Appendix", ""], False
    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
        out.append("#" + line if not fenced and _HEADING.fullmatch(line) else line)
    return out


def write_report(run_dir: Path) -> Path:
    """Write run_dir/report.md and its PNGs from the run directory's files; return the report's path.

    Every file is written through :func:`grpo_lens.rundir.write_file` inside the run directory
    (:func:`grpo_lens.rundir.writes_confined_to`): a report.md or PNG planted as a link out of it is replaced, and a
    folder that leads out of it is refused, so no file outside the run directory changes.

    Raises:
        ReportError: the directory has neither metrics.jsonl nor any probe.json.
        UnsafeWriteError: a folder written leads outside the run directory, or the directory is not writable.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a directory; pass a run directory written by train, probe or demo")
    with writes_confined_to(run_dir):
        return _write_report(run_dir)


def _write_report(run_dir: Path) -> Path:
    train_dir = run_dir / "train" if (run_dir / "train" / "metrics.jsonl").exists() else run_dir  # demo layout
    preset = preset_layout(run_dir)
    # `train --seeds` (in train/ for `demo --preset`): the first seed's run, the claims over every seed
    seed_dirs = read_train_seeds(run_dir / "train") if preset else read_train_seeds(run_dir)
    if seed_dirs:
        train_dir = seed_dirs[0]
    seed_runs = [[r for r in _read_jsonl(d / "metrics.jsonl") if mk.STEP in r] for d in seed_dirs or []]
    records = [r for r in _read_jsonl(train_dir / "metrics.jsonl") if mk.STEP in r]
    probes = find_probes(run_dir)
    if not records and not probes:
        raise ReportError(f"{run_dir} holds neither metrics.jsonl nor probe.json; nothing to report")
    findings: list[str] = []
    body: list[str] = []
    config = train_dir / "config.yaml"
    try:
        cfg = (safe_load_yaml(config.read_text()) or {}) if config.exists() else {}  # bounded
        lora_rank = int(cfg.get("lora_rank") or 0)
    except (yaml.YAMLError, TypeError, ValueError, AttributeError):
        cfg, lora_rank = {}, 0
    estimator = cfg.get("estimator") if isinstance(cfg, dict) else None
    if records:
        body += training_section(
            records,
            run_dir,
            findings,
            lora_rank,
            estimator=estimator,
            lens_space=str(cfg.get("lens_space") or "trainable") if isinstance(cfg, dict) else "trainable",
            schedule=schedule_text(cfg) if isinstance(cfg, dict) else None,
        )
        body += completions_section(_read_jsonl(train_dir / "completions.jsonl"))
    for label, probe in probes.items():
        body += probe_section(label, probe, run_dir, findings)
    if len(probes) > 1:
        measure = plots.verdict_measure(probes)  # E₂, what the rank verdict tests
        plots.plot_erank_vs_group_size(probes, run_dir / "erank_vs_R.png", measure=measure)
        body += [
            "## Before vs after training",
            "",
            f"![{plots.MEASURE_ALT[measure]}, before and after](erank_vs_R.png)",
            "",
        ]

    header = ["# grpo-lens report", "", f"Run directory: `{run_dir}`.", ""]
    if probes or any(r.get(mk.PERF_LENS_SECONDS) is not None for r in records):
        # the answers first, the full table in the appendix
        pooled = probes.get("probe") or {}
        pooled_dir = run_dir if (run_dir / "probe.json").exists() else run_dir / "probe"  # demo --preset: probe/
        seeds = seed_probes(pooled, pooled_dir) if pooled.get("seeds") else None  # a pooled probe's G3: its seeds'
        answers = answers_section(probes, records, lora_rank, seed_runs, table=preset, seed_probes=seeds)
        if preset and answers:  # under "## Answers": the stage of a demo --preset run that is not finished
            answers[2:2] = preset_missing_lines(run_dir)
        header += answers
    header += first_figures(body)
    rest = []
    if records and estimator:
        rest += [
            f"Advantage estimator: `{estimator}` (baseline: {ESTIMATOR_BASELINES.get(estimator, 'see docs')}"
            + (f"; std convention `{cfg.get('std')}`" if estimator == "grpo" and cfg.get("std") else "")
            + ").",
            "",
        ]
    config = train_dir / "config.yaml"
    if config.exists():
        rest += [
            "<details><summary>config</summary>",
            "",
            "```yaml",
            config.read_text(errors="replace").strip().replace("```", "` ` `"),  # not UTF-8 or a fence: shown, safe
            "```",
            "",
            "</details>",
            "",
        ]
    if probes or any(r.get(mk.PERF_LENS_SECONDS) is not None for r in records):
        rest += claims_section(probes, records, lora_rank, seed_runs)
    if seed_dirs:
        rest += train_seeds_lines(seed_dirs, seed_runs)
    if (probes.get("probe") or {}).get("seeds"):  # a pooled probe (probe --seeds): each seed beside the pool
        pooled_dir = run_dir if (run_dir / "probe.json").exists() else run_dir / "probe"  # demo --preset: probe/
        rest += seeds_section(probes["probe"], pooled_dir)
    rest += ["## Findings", "", *[f"- {f}" for f in findings], ""]
    lines = few_footnotes(header + appendix(rest + body))
    if any(FEW_MARK in line for line in lines):  # the mark's meaning, once, under the title
        lines[4:4] = [FEW_NOTE, ""]
    return write_file(run_dir / "report.md", "\n".join(lines) + "\n")  # a planted link is replaced, not followed
