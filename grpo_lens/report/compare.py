"""``grpo-lens compare RUN_DIR... --out DIR``: several training runs in one report.

Reads only each run's config.yaml and metrics.jsonl. Writes ``DIR/compare.md`` (the config fields that differ, a
table of final numbers with intervals, the curves) and ``DIR/compare.png`` (one panel per metric, one line per run),
and ``DIR/compare.json`` (the table's numbers).

Final numbers: for each run and metric, the mean of the metric over the run's last ``last`` records that have it
(lens keys exist only on lens steps, so their "last" records are the last lens steps), with the project's one 95%
interval (Hall's transformed t, :func:`grpo_lens.formulas.stats.mean_interval`, docs/theory.md §7 and §Comparing runs),
given
only from at least MIN_INTERVAL_UNITS (8) records. Consecutive training steps are correlated, so the interval
describes the spread of the last steps' values, not the uncertainty of a rerun with another seed: runs that differ by
less than it cannot be told apart.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.colors
import matplotlib.pyplot as plt
import yaml

from grpo_lens import metrics as mk
from grpo_lens.config import TrainConfig
from grpo_lens.config.base import safe_load_yaml, yaml_error_line
from grpo_lens.config.trl_names import grpo_lens_settings
from grpo_lens.formulas.stats import MIN_INTERVAL_UNITS, mean_interval
from grpo_lens.models import same_model_key
from grpo_lens.report.format import fmt_sig, md_row, md_table
from grpo_lens.report.plots import integer_ticks
from grpo_lens.report.seeds import compare_seeds_section, pooled_finals
from grpo_lens.report.training_measures import dynamic_sampling_summary
from grpo_lens.rundir import RunDirError, read_records, write_file, writes_confined_to

#: The metrics compared: (key, label). A metric absent from every run is left out.
COMPARED = (
    (mk.REWARD_MEAN, "reward"),
    (mk.REWARD_ACCURACY, "accuracy"),
    (mk.EVAL_GREEDY_ACCURACY, "held-out accuracy, greedy (--eval-every)"),
    (mk.EVAL_SAMPLED_ACCURACY, "held-out accuracy, sampled (--eval-every)"),
    (mk.POLICY_ENTROPY, "policy entropy (nats/token)"),
    (mk.REWARD_FRAC_ZERO_STD_GROUPS, "S1: zero-variance groups"),
    (mk.DYNAMIC_MIXED_GROUPS, "mixed groups trained on (dynamic sampling)"),
    (mk.DYNAMIC_HIT_CAP, "share of steps at the dynamic-sampling cap"),
    (mk.DYNAMIC_KEPT_REWARD_MEAN, "reward of the kept groups only (dynamic sampling)"),
    (mk.rank_key("g1", "erank"), "lens: G1 effective rank"),
    (mk.rank_key("g1_random", "erank"), "lens: G1 random zero-sum control"),
    (mk.SPARSITY_UPDATE_TOTAL, "lens: S4 bf16-unchanged since start"),
    (mk.BASELINE_B_STAR, "lens: b*"),
    (mk.COMPLETIONS_MEAN_LENGTH, "completion length (tokens)"),
)


#: Config fields that say how a run was executed, not what it computes: never reported as differences.
IGNORED_FIELDS = (
    "out",
    "resume",
    "overwrite",
    "progress",
    "device",
    "report_to",
    "log_completions",
    "checkpoint_every",
    "keep_checkpoints",
    "save_final_model",
    "reward_timeout",
    "metric_names",
)


#: Keys of a TRL run's config.yaml (grpo_lens.integrations.trl.run_config) that describe the trainer, not a setting.
TRL_RUN_KEYS = ("trainer", "trl_version", "trl")


def is_trl_run(config: dict[str, Any]) -> bool:
    """Whether a config.yaml was written by the TRL integration (it records only some of grpo-lens' settings)."""
    return config.get("trainer") == "trl"


def comparable_config(config: dict[str, Any]) -> dict[str, Any]:
    """A run's settings under grpo-lens' field names. A grpo-lens run's config is returned as it is; a TRL run's
    (``trainer: trl``) is its ``trl`` block translated through TRL's aliases
    (:func:`grpo_lens.config.trl_names.grpo_lens_settings`), overlaid by the grpo-lens names the integration wrote
    itself, without the trainer's own keys (:data:`TRL_RUN_KEYS`)."""
    if not is_trl_run(config):
        return config
    settings = grpo_lens_settings(config.get("trl") or {})
    settings.update({k: v for k, v in config.items() if k not in TRL_RUN_KEYS})
    batch, group = settings.pop("rollout_batch_size", None), settings.get("group_size")
    if isinstance(batch, int) and isinstance(group, int) and group > 0 and batch % group == 0:
        settings["prompts_per_step"] = batch // group  # TRL's generation batch, as grpo-lens' default states it
    return settings


#: Config fields that define the task: runs must agree on them unless ``allow_different_tasks``.
TASK_FIELDS = ("task", "dataset", "task_options")


class CompareError(ValueError):
    """The runs cannot be compared as asked (not a run, no metrics, different tasks)."""


def read_run(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(config, metric records) of a run directory.

    Raises:
        CompareError: no config.yaml / metrics.jsonl, or unreadable.
    """
    cfg, met = path / "config.yaml", path / "metrics.jsonl"
    if not cfg.is_file() or not met.is_file():
        raise CompareError(
            f"{path} is not a training run (needs config.yaml and metrics.jsonl, written by grpo-lens train)"
        )
    try:
        config = safe_load_yaml(cfg.read_text()) or {}  # bounded: an alias bomb is refused
        config = TrainConfig.canonical(config, warn=False) if isinstance(config, dict) else config  # current names
        records = read_records(met)
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as e:
        why = f"{type(e).__name__}: {yaml_error_line(e)}" if isinstance(e, yaml.YAMLError) else type(e).__name__
        raise CompareError(f"cannot read run {path}: {cfg} ({why}); is it a grpo-lens run?") from None
    except RunDirError as e:  # names the file and line
        raise CompareError(str(e)) from None
    if not records:
        raise CompareError(f"run {path} has no metrics yet (metrics.jsonl is empty)")
    return config, records


def differing_fields(
    configs: dict[str, dict[str, Any]], partial: frozenset[str] = frozenset()
) -> dict[str, dict[str, Any]]:
    """{field: {run: value}} for every config field whose value is not the same in all runs (IGNORED_FIELDS aside).

    ``partial``: runs whose config records only some settings (TRL runs); a field one of them does not record is
    compared among the runs that do."""
    keys = sorted(set().union(*configs.values()) - set(IGNORED_FIELDS))
    out = {}
    for k in keys:
        values = {run: cfg.get(k) for run, cfg in configs.items() if run not in partial or k in cfg}
        if len({json.dumps(v, sort_keys=True) for v in values.values()}) > 1:
            out[k] = values
    return out


def final_numbers(records: list[dict[str, Any]], key: str, last: int) -> dict[str, Any] | None:
    """Mean and 95% interval of ``key`` over the last ``last`` records that have a finite value of it (None if none):
    {"mean", "low", "high" (None below MIN_INTERVAL_UNITS records), "n", "steps": [first, last]}."""
    pts = [(r[mk.STEP], r[key]) for r in records if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    if not pts:
        return None
    pts = pts[-last:]
    ci = mean_interval([v for _, v in pts])
    return {"mean": ci["mean"], "low": ci["lo"], "high": ci["hi"], "n": len(pts), "steps": [pts[0][0], pts[-1][0]]}


def literal(value: Any) -> str:
    """``value`` as one Markdown code span on one line: run names, paths and config values come from the user's
    files, so whitespace (newlines: no injected heading) is collapsed, and the span's backtick fence is longer than
    any run of backticks inside it (the value cannot close it early); inside a code span ``<img onerror=...>`` is
    shown as text, not HTML."""
    text = " ".join(str(value).split())
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def check_out(out: Path) -> None:
    """``--out`` must be a folder (or not exist yet) under a folder this user can write.

    Raises:
        CompareError: naming the file or unwritable folder on the way; before anything is computed or written.
    """
    base = out
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise CompareError(f"--out {out}: {base} is a file, not a folder; choose another --out")
    if not os.access(base, os.W_OK | os.X_OK):
        raise CompareError(f"--out {out}: {base} is not writable by this user; choose another --out")


def _label(paths: list[Path]) -> list[str]:
    names = [p.name for p in paths]
    return names if len(set(names)) == len(names) else [str(p) for p in paths]


def run_colours(n: int) -> list[str]:
    """``n`` distinct colours (hex), one per run: matplotlib's ten default ones up to 10 runs, tab20 up to 20, then
    ``n`` evenly spaced points of the turbo colour map (the default cycle repeats after 10, which gave an eleventh run
    the first run's colour)."""
    if n <= 10:
        return [matplotlib.colors.to_hex(f"C{i}") for i in range(n)]
    cmap = matplotlib.colormaps["tab20" if n <= 20 else "turbo"]
    return [matplotlib.colors.to_hex(cmap(i if n <= 20 else i / (n - 1))) for i in range(n)]


def plot_compare(runs: dict[str, list[dict[str, Any]]], metrics: list[tuple[str, str]], path: Path) -> Path:
    """One panel per metric, one line per run in the same colour in every panel (markers on lens keys, which exist
    only on lens steps), the metric's unit on the y axis, integer step ticks and one legend for the figure above the
    panels (as many rows as its four columns need). Runs are drawn from the widest line to the thinnest, so a run
    whose values equal an earlier one's shows as a thin line on a wider one instead of hiding it."""
    matplotlib.use("Agg")
    cols, legend_cols = 2, 4
    rows = math.ceil(len(metrics) / cols)
    header = 0.1 + 0.2 * math.ceil(len(runs) / legend_cols)  # inches above the panels for the legend
    fig, axes = plt.subplots(rows, cols, figsize=(11, 3.2 * rows + header), squeeze=False)
    colours = dict(zip(runs, run_colours(len(runs))))
    widths = {run: 1.0 + 1.5 * (len(runs) - 1 - i) / max(len(runs) - 1, 1) for i, run in enumerate(runs)}
    handles: dict[str, Any] = {}
    for ax, (key, label) in zip(axes.flat, metrics):
        for run, records in runs.items():
            pts = [(r[mk.STEP], r[key]) for r in records if isinstance(r.get(key), (int, float))]
            if pts:
                (line,) = ax.plot(
                    *zip(*pts),
                    marker="o" if len(pts) < 12 else None,
                    ms=1.5 + 1.5 * widths[run],
                    color=colours[run],
                    linewidth=widths[run],
                    label=run,
                )
                handles.setdefault(run, line)
        found = mk.lookup(key, mk.JSONL)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(found[0].unit if found else key, fontsize=8)
        integer_ticks(ax)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(metrics) :]:
        ax.axis("off")
    if handles:
        fig.legend(
            list(handles.values()), list(handles), loc="upper center", ncol=min(len(handles), legend_cols), fontsize=8
        )
    fig.tight_layout(rect=(0, 0, 1, 1 - header / (3.2 * rows + header)))
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    buffer.name = str(path)  # what a test's savefig hook sees (tests/report/conftest.py)
    fig.savefig(buffer, dpi=110, format="png")
    plt.close(fig)
    return write_file(path, buffer.getvalue())  # a planted link at ``path`` is replaced, never followed


def _same_model_same_name(configs: dict[str, dict[str, Any]]) -> None:
    """Give runs whose ``model`` fields name the same model (:func:`grpo_lens.models.same_model_key`: e.g. the default
    model's alias and the converted folder a TRL run records) the first such run's spelling, in place, so compare
    does not list the model as a difference."""
    first: dict[str, Any] = {}
    for cfg in configs.values():
        if isinstance(cfg.get("model"), str):
            cfg["model"] = first.setdefault(same_model_key(cfg["model"]), cfg["model"])


def _steps(span: tuple[int, int] | list[int]) -> str:
    """'steps 3–10', or 'step 2' when the span is one step (not 'steps 2–2')."""
    first, last = span[0], span[1]
    return f"step {first}" if first == last else f"steps {first}–{last}"


def _tasks_line(labels: list[str], tasks: dict[str, dict[str, Any]]) -> str:
    """compare.md's task line: the one task when every run records the same one, else each run's (a TRL run's
    task is not recorded: it lives in the user's script)."""

    def one(t: dict[str, Any] | None) -> str:
        if t is None:
            return "not recorded (a TRL run: the task is its script's)"
        return literal(
            str(t["task"])
            + (f" {t['task_options']}" if t.get("task_options") else "")
            + (f" ({t['dataset']})" if t.get("dataset") else "")
        )

    shown = [one(tasks.get(label)) for label in labels]
    if len(set(shown)) == 1:
        return shown[0]
    return "; ".join(f"{literal(label)}: {s}" for label, s in zip(labels, shown)) + " (compared on request)"


def compare_runs(
    run_dirs: list[str | Path], out: str | Path, *, last: int = 10, allow_different_tasks: bool = False
) -> Path:
    """Write ``out/compare.md``, ``out/compare.png`` and ``out/compare.json`` for two or more runs.

    Args:
        run_dirs: run directories written by ``grpo-lens train``.
        out: where the report goes (created; files of the same names are replaced).
        last: how many of each run's last records (per metric) the final numbers average.
        allow_different_tasks: compare runs of different tasks anyway.

    Returns:
        the path of compare.md.

    Raises:
        CompareError: fewer than two runs, a directory that is not a run, runs of different tasks or a TRL run
            (whose task is not recorded) unless ``allow_different_tasks``, ``last`` < 1. Raised before ``out`` is
            touched.
    """
    paths = [Path(p) for p in run_dirs]
    if len(paths) < 2:
        raise CompareError("compare needs at least two run directories")
    if last < 1:
        raise CompareError(f"--last {last}: must be >= 1")
    if len({p.resolve() for p in paths}) < len(paths):
        raise CompareError("a run directory is given twice; name each run once")
    check_out(Path(out))
    labels = _label(paths)
    configs, runs = {}, {}
    for label, p in zip(labels, paths):
        configs[label], runs[label] = read_run(p)
    partial = frozenset(label for label, cfg in configs.items() if is_trl_run(cfg))
    configs = {label: comparable_config(cfg) for label, cfg in configs.items()}
    tasks = {
        label: {k: cfg.get(k) for k in TASK_FIELDS}
        for label, cfg in configs.items()
        if label not in partial or "task" in cfg
    }  # a TRL run's task lives in the user's script
    if len({json.dumps(t, sort_keys=True) for t in tasks.values()}) > 1 and not allow_different_tasks:
        shown = "; ".join(
            f"{label}: {t['task']}"
            + (f" {t['task_options']}" if t.get("task_options") else "")
            + (f" ({t['dataset']})" if t.get("dataset") else "")
            for label, t in tasks.items()
        )
        raise CompareError(
            f"the runs are on different tasks ({shown}); their rewards are not comparable. Pass "
            f"--allow-different-tasks to compare them anyway"
        )
    unrecorded = sorted(set(configs) - set(tasks))  # TRL runs: the dataset and reward functions are the script's
    if unrecorded and not allow_different_tasks:
        raise CompareError(
            f"{', '.join(unrecorded)}: a TRL run does not record its task (the dataset and reward "
            f"functions live in its script), so compare cannot check that the runs trained on the "
            f"same task. Pass --allow-different-tasks to compare them anyway"
        )

    out = Path(out)
    metrics = [(k, lab) for k, lab in COMPARED if any(k in r for recs in runs.values() for r in recs)]
    table = {label: {k: final_numbers(recs, k, last) for k, _ in metrics} for label, recs in runs.items()}
    _same_model_same_name(configs)
    diff = differing_fields(configs, partial)
    # runs that differ only in their seed are reruns of one configuration: their final numbers pool (report/seeds.py)
    pooled = pooled_finals(table, [k for k, _ in metrics], labels) if set(diff) == {"seed"} else {}

    out.mkdir(parents=True, exist_ok=True)
    with writes_confined_to(out):
        return _write_compare(out, runs, metrics, table, diff, pooled, labels, paths, tasks, partial, last)


def _write_compare(out, runs, metrics, table, diff, pooled, labels, paths, tasks, partial, last) -> Path:
    """compare.png, compare.json and compare.md into ``out`` (:func:`compare_runs`' writes, confined to ``out``)."""
    plot_compare(runs, metrics, out / "compare.png")
    write_file(
        out / "compare.json",
        json.dumps(
            {
                "runs": {lab: str(p) for lab, p in zip(labels, paths)},
                "last": last,
                "differing_config": diff,
                "final": table,
                "pooled_over_seeds": pooled,
            },
            indent=1,
            default=str,
        ),
    )
    lines = [
        "# grpo-lens compare",
        "",
        "Runs: " + ", ".join(f"{literal(lab)} ({literal(p)}, {len(runs[lab])} steps)" for lab, p in zip(labels, paths)),
        "",
    ]
    lines += ["Task: " + _tasks_line(labels, tasks), ""]

    notes = {lab: dynamic_sampling_summary(runs[lab]) for lab in labels}
    if any(notes.values()):
        lines += ["## Dynamic sampling", ""]
        lines += [
            f"- {literal(lab)}: " + (notes[lab] or "no dynamic sampling (every sampled group was trained on).")
            for lab in labels
        ]
        lines += [""]
    lines += ["## Config fields that differ", ""]
    if diff:
        lines += md_table(
            ["field", *map(literal, labels)],
            [[literal(k), *(literal(v[lab]) for lab in labels)] for k, v in diff.items()],
        )
    else:
        lines += ["None: the runs share every setting (a difference then comes from code or randomness)."]
    if partial:
        lines += [
            "",
            "TRL runs (" + ", ".join(literal(lab) for lab in labels if lab in partial) + ") record TRL's "
            "settings, compared under grpo-lens' names; a setting a TRL run does not record is compared among "
            "the runs that do.",
        ]
    lines += [
        "",
        f"## Final numbers (mean over each run's last {last} records with the metric, 95% "
        f"interval over those steps (Hall's transformed t), from at least {MIN_INTERVAL_UNITS})",
        "",
        "Consecutive steps are correlated: the interval is the spread of the last steps, not a rerun-to-rerun "
        "uncertainty; differences smaller than it are not resolved by these runs.",
        "",
        *md_table(["metric", *map(literal, labels)]),
    ]
    for key, label in metrics:
        cells = []
        for lab in labels:
            f = table[lab][key]
            if f is None:
                cells.append("–")
            elif f["low"] is None:
                cells.append(f"{fmt_sig(f['mean'])} ({_steps(f['steps'])}, n={f['n']}: too few for an interval)")
            else:
                cells.append(
                    f"{fmt_sig(f['mean'])} [{fmt_sig(f['low'])}, {fmt_sig(f['high'])}] "
                    f"({_steps(f['steps'])}, n={f['n']})"
                )
        lines.append(md_row(f"{label} (`{key}`)", *cells))
    lines += ["", *compare_seeds_section(pooled, metrics, diff.get("seed", {}))]
    lines += ["", "## Curves", "", "![curves](compare.png)", ""]
    return write_file(out / "compare.md", "\n".join(lines))
