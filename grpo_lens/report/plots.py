"""PNG plots for the report, drawn from run-directory records only (metrics.jsonl, probe.json).

Images are kept small (about 6.4 x 3.6 inches at 90 dpi, well under 300 KB) so that a Markdown viewer shows them
inline. Every axis says what it measures and in which unit; integer axes (steps, group sizes, indices) get integer
ticks; a series keeps one colour in every panel of a figure, and a legend appears wherever series differ;
series that coincide are drawn so that each stays visible (:func:`plot_lines`).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from grpo_lens import metrics as mk
from grpo_lens.rundir import write_file

DPI = 90
SIZE = (6.4, 3.6)


#: the colour of a series drawn in more than one figure of the report, the same wherever it appears (S4 and its
#: controls in sparsity.png and sparsity_measures.png; accuracy beside the reward and beside S1)
SERIES_COLOURS = {
    mk.REWARD_ACCURACY: "tab:gray",
    mk.SPARSITY_UPDATE_TOTAL: "tab:orange",
    mk.SPARSITY_UPDATE_TOTAL_BF16_UNCHANGED: "tab:orange",
    mk.SPARSITY_UPDATE_TOTAL_BF16_PERMUTED: "tab:green",
    mk.SPARSITY_UPDATE_TOTAL_BF16_DENSE: "tab:red",
    mk.SPARSITY_UPDATE_TOTAL_F32_UNCHANGED: "tab:purple",
}


def series_colour(key: str) -> str | None:
    """The fixed colour of a metric key drawn in several figures (:data:`SERIES_COLOURS`); None: the axes' next
    colour."""
    return SERIES_COLOURS.get(key)


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if v is not None:
            xs.append(r[mk.STEP])
            ys.append(float(v))
    return xs, ys


#: two series of one panel "coincide" when, at every step both have, they differ by at most this share of the
#: panel's y span: on a panel about 2.5 inches tall that is under a line's width plus a marker's, so one line would
#: hide the other
COINCIDE_SHARE = 0.01

#: the markers (hollow) of the 2nd, 3rd, ... series of a group of coinciding ones, the first keeping its own
COINCIDE_MARKERS = ("o", "s", "^", "D", "v")


def coinciding(
    a: tuple[Sequence[float], Sequence[float]], b: tuple[Sequence[float], Sequence[float]], tol: float
) -> str | None:
    """Whether series ``b`` = (steps, values) lies on series ``a`` wherever both have a value: "equal" (the same
    steps and values), "near" (every common step within ``tol``, in y units), None (apart, or no step in common)."""
    pa, pb = dict(zip(*a)), dict(zip(*b))
    common = pa.keys() & pb.keys()
    if not common or any(abs(pa[x] - pb[x]) > tol for x in common):
        return None
    return "equal" if pa == pb else "near"


def plot_lines(
    ax,
    lines: list[tuple[str, Sequence[float], Sequence[float], str | None, str]],
    span: float | None = None,
    marker: str = ".",
) -> None:
    """Draw (label, steps, values, colour, linestyle) series so that every one stays visible where several coincide
    (:func:`coinciding`, within :data:`COINCIDE_SHARE` of ``span``): a series that another one will lie on is drawn
    wide; a series that lies on ones drawn before it is drawn on top of them, thinner, with a hollow marker of its
    own (:data:`COINCIDE_MARKERS`, larger for each series below it) and, where it is equal at every step to one of
    them, "(= <label> at every step)" in its label. A series that coincides with none is drawn as given.

    Args:
        lines: in drawing order; an empty series is skipped.
        span: the panel's y range in data units (e.g. 1 for a share axis); None: the drawn values' range (1 where
            they are all equal).
    """
    lines = [ln for ln in lines if ln[1]]
    values = [v for ln in lines for v in ln[2]]
    if span is None:
        span = max(values) - min(values) if values else 0.0
    tol = COINCIDE_SHARE * (span or 1.0)
    for i, (label, xs, ys, colour, style) in enumerate(lines):
        under = [(lab, coinciding((dxs, dys), (xs, ys), tol)) for lab, dxs, dys, _, _ in lines[:i]]
        under = [(lab, how) for lab, how in under if how]
        over = any(coinciding((xs, ys), (oxs, oys), tol) for _, oxs, oys, _, _ in lines[i + 1 :])
        if not under:
            ax.plot(xs, ys, marker=marker, label=label, color=colour, linestyle=style, linewidth=3.0 if over else None)
            continue
        equal = [lab for lab, how in under if how == "equal"]
        n = len(under)  # the coinciding series drawn before this one
        ax.plot(
            xs,
            ys,
            marker=COINCIDE_MARKERS[(n - 1) % len(COINCIDE_MARKERS)],
            markerfacecolor="none",
            markersize=4 + 2 * n,
            label=label + (f"\n(= {equal[0]} at every step)" if equal else ""),
            color=colour,
            linestyle=style,
            linewidth=max(2.0 - 0.5 * n, 0.8),
            zorder=2 + 0.1 * n,
        )


def _legend(ax, **kw) -> None:
    """A legend only when something is labelled (matplotlib warns on an empty one)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kw)


def legend_below(ax, ncol: int = 2, **kw) -> None:
    """A legend under the panel, outside the data (where a legend inside would cover points), when something is
    labelled; :func:`_save`'s tight layout makes room for it."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=ncol, frameon=False, **kw)


#: x-axis labels of whole-number axes: they get integer ticks (no 1.5 on a short run).
INTEGER_AXES = ("step", "index k", "completion token position")  # R axes set their own ticks


#: at most this many distinct x values drawn: the ticks are those values themselves (a 2-step run shows 1 and 2 only)
MAX_DATA_TICKS = 12


def integer_ticks(ax) -> None:
    """Whole-number ticks on the x axis; a range under 2 (one or two steps drawn) is widened to a width of 2 around
    its centre, where matplotlib would otherwise fall back to fractional ticks: one step s gets [s - 1, s + 1], two
    steps s, s + 1 get half a step either side (the markers at the ends stay whole)."""
    lo, hi = ax.get_xlim()
    if hi - lo < 2:
        mid = (lo + hi) / 2
        ax.set_xlim(mid - 1, mid + 1)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def drawn_x(axes) -> list[float]:
    """The distinct x values of the data lines of ``axes`` (lines in data coordinates: not axhline/axvline), sorted."""
    return sorted(
        {float(x) for a in axes for ln in a.lines if ln.get_transform() == a.transData for x in ln.get_xdata()}
    )


def data_ticks(ax, xs: list[float]) -> None:
    """Ticks of an integer x axis: the drawn values themselves when they are at most :data:`MAX_DATA_TICKS` whole
    numbers (no tick at a step that was not logged; one step: one tick, centred with room either side), else
    :func:`integer_ticks`."""
    if not xs or len(xs) > MAX_DATA_TICKS or not all(x.is_integer() for x in xs):
        integer_ticks(ax)
        return
    ax.set_xticks(xs)
    if len(xs) == 1:
        ax.set_xlim(xs[0] - 1, xs[0] + 1)


def _save(fig, path: Path) -> Path:
    for ax in fig.axes:  # steps and indices are whole numbers: no 1.5 ticks, no tick at a step not drawn
        siblings = ax.get_shared_x_axes().get_siblings(ax)
        if ax.get_xlabel() in INTEGER_AXES or any(a.get_xlabel() in INTEGER_AXES for a in siblings):
            data_ticks(ax, drawn_x(siblings))
    fig.tight_layout()
    buffer = io.BytesIO()
    buffer.name = str(path)  # what a test's savefig hook sees (tests/report/conftest.py)
    fig.savefig(buffer, dpi=DPI, bbox_inches="tight", format="png")  # legends below the panels stay inside the image
    plt.close(fig)
    return write_file(path, buffer.getvalue())  # a planted link at ``path`` is replaced, never followed


def plot_learning_curves(records: list[dict[str, Any]], path: Path, beta: float | None = None) -> Path:
    """Reward mean and accuracy (with the policy entropy on a right axis when beta > 0), completion length, the KL
    to the reference (only when beta > 0; the policy entropy otherwise) and clip ratio per step: four panels; the
    entropy is drawn once.

    Args:
        beta: the run's KL coefficient; None: the KL panel appears when any step logged a non-zero KL.
    """
    if beta is None:
        beta = 1.0 if any((r.get(mk.KL_MEAN) or 0.0) != 0.0 for r in records) else 0.0
    fig, axes = plt.subplots(2, 2, figsize=(SIZE[0], SIZE[1] * 1.4), sharex=True)
    third = (
        (axes[1, 0], [(mk.KL_MEAN, "KL to reference")], "nats/token", "KL to the reference model")
        if beta > 0
        else (axes[1, 0], [(mk.POLICY_ENTROPY, "token-mean entropy")], "nats/token", "policy entropy")
    )
    panels = [
        (axes[0, 0], [(mk.REWARD_MEAN, "reward mean"), (mk.REWARD_ACCURACY, "accuracy")], "reward", "reward"),
        (axes[0, 1], [(mk.COMPLETIONS_MEAN_LENGTH, "mean length")], "tokens", "completion length"),
        third,
        (
            axes[1, 1],
            [(mk.CLIP_RATIO_REGION, "clipped share"), (mk.CLIP_RATIO_HIGH, "high"), (mk.CLIP_RATIO_LOW, "low")],
            "share of tokens",
            "clip ratio",
        ),
    ]
    styles = ("-", "--", ":")  # the 2nd and 3rd series of a panel: under 0/1 rewards accuracy is the reward mean
    for ax, keys, ylabel, title in panels:
        ax.set_title(title, fontsize=9)
        plot_lines(
            ax,
            [(label, *_series(records, key), series_colour(key), style) for (key, label), style in zip(keys, styles)],
        )
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if len(keys) > 1:  # see-through: with "(= ... at every step)" it may have to sit on a line
            _legend(ax, fontsize=7, framealpha=0.6)
    xs, ys = _series(records, mk.POLICY_ENTROPY)  # entropy beside the reward: collapse shows as both moving
    if xs and beta > 0:  # with beta = 0 the third panel already draws it
        twin = axes[0, 0].twinx()
        twin.plot(xs, ys, color="tab:purple", alpha=0.6, linestyle="--", label="entropy (right)")
        twin.set_ylabel("entropy, nats/token", fontsize=7)
        twin.tick_params(labelsize=7)
        _legend(twin, fontsize=7, loc="lower right")
    for ax in axes[1]:
        ax.set_xlabel("step")
    return _save(fig, path)


def plot_learning_rate(records: list[dict[str, Any]], path: Path, schedule: str | None = None) -> Path:
    """The learning rate of each step (``lr``, the value the step's optimizer updates used), one line; the title
    names the schedule when given (e.g. "cosine, 2 warm-up steps")."""
    fig, ax = plt.subplots(figsize=(SIZE[0], SIZE[1] * 0.8))
    xs, ys = _series(records, mk.LR)
    if xs:
        ax.plot(xs, ys, marker=".", color="tab:gray")
    ax.set_xlabel("step")
    ax.set_ylabel("learning rate (AdamW lr)")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    ax.set_ylim(bottom=0)
    ax.set_title("learning rate per step" + (f" ({schedule})" if schedule else ""), fontsize=9)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_sparsity(records: list[dict[str, Any]], path: Path) -> Path:
    """S1 measured, and S4 bf16 update sparsity per step and since the start beside its within-tensor permutation
    control, the dense-update control and the float32-unchanged share the S4 claim rests on. Legends under the panels:
    the shares sit near 0 and 1, where a legend inside covers them."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(SIZE[0], SIZE[1] * 1.5))
    for key, label in [(mk.REWARD_FRAC_ZERO_STD_GROUPS, "S1 measured")]:
        xs, ys = _series(records, key)
        if xs:
            a1.plot(xs, ys, marker=".", label=label)
    xs, ys = _series(records, mk.REWARD_ACCURACY)
    if xs:
        a1.plot(xs, ys, color=series_colour(mk.REWARD_ACCURACY), alpha=0.5, label="accuracy")
    a1.set_title("zero-variance groups (S1)", fontsize=9)
    a1.set_xlabel("step")
    a1.set_ylabel(
        "S1: share of groups with equal rewards" + ("\n(accuracy: share of rollouts)" if xs else ""), fontsize=8
    )  # a TRL run logs no accuracy: the label names only what is drawn
    a1.set_ylim(-0.02, 1.02)
    legend_below(a1, ncol=1, fontsize=7)
    a1.grid(alpha=0.3)
    plot_lines(
        a2,
        [
            (label, *_series(records, key), series_colour(key), style)
            for key, label, style in [
                (mk.SPARSITY_UPDATE_STEP, "this step", "-"),
                (mk.SPARSITY_UPDATE_TOTAL, "since start", "-"),
                (mk.SPARSITY_UPDATE_TOTAL_BF16_PERMUTED, "since start, permutation control", "--"),
                (mk.SPARSITY_UPDATE_TOTAL_BF16_DENSE, "since start, dense control", ":"),
                (mk.SPARSITY_UPDATE_TOTAL_F32_UNCHANGED, "since start, float32 unchanged", "-."),
            ]
        ],
        span=1.0,
    )  # a share axis
    a2.set_title("bf16 update sparsity (S4)", fontsize=9)
    a2.set_xlabel("step")
    a2.set_ylabel("share of parameters unchanged")
    a2.set_ylim(-0.02, 1.02)
    legend_below(a2, ncol=1, fontsize=7)
    a2.grid(alpha=0.3)
    return _save(fig, path)


#: gradient sources (probe.json meta ``gradients``, or the training lens's, see :func:`lens_gradient_source`) -> the
#: name the axes give them
GRADIENT_SOURCES = {
    "exact_gram": "exact Gram",
    "sketch": "sketch",
    "exact": "exact gradients",
    "exact_adapter": "exact, LoRA adapter's weights",
}


def gradient_source_label(gradients: str) -> str:
    """The axis name of a gradient source (a key of :data:`GRADIENT_SOURCES`).

    Raises:
        ValueError: an unknown source (the message lists the valid ones).
    """
    if gradients not in GRADIENT_SOURCES:
        raise ValueError(f"unknown gradient source {gradients!r}; valid: {', '.join(GRADIENT_SOURCES)}")
    return GRADIENT_SOURCES[gradients]


def plot_baselines(records: list[dict[str, Any]], path: Path, gradients: str) -> Path:
    """b* vs the group mean, and m_C / m_W (mean squared gradient norm of correct / wrong rollouts) over training.

    Args:
        gradients: where the squared norms came from, a key of :data:`GRADIENT_SOURCES` (named on the y axis).

    Raises:
        ValueError: an unknown ``gradients``.
    """
    source = gradient_source_label(gradients)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=SIZE)
    for key, label in [(mk.BASELINE_B_STAR, "b* (variance-optimal)"), (mk.BASELINE_GROUP_MEAN, "group mean")]:
        xs, ys = _series(records, key)
        if xs:
            a1.plot(xs, ys, marker="o", label=label)
    a1.set_xlabel("step")
    a1.set_ylabel("reward units")
    a1.set_title("baseline, mean over mixed groups only", fontsize=9)
    _legend(a1, fontsize=7)
    a1.grid(alpha=0.3)
    for key, label in [(mk.BASELINE_M_CORRECT, "m_C (correct)"), (mk.BASELINE_M_WRONG, "m_W (wrong)")]:
        xs, ys = _series(records, key)
        if xs:
            a2.plot(xs, ys, marker="o", label=label)
    a2.set_xlabel("step")
    a2.set_ylabel(f"squared gradient norm ({source})")
    a2.set_title("mean ||g||^2 by outcome", fontsize=9)
    a2.set_yscale("log")
    a2.margins(y=0.15)  # a log axis puts the extreme points on its edges, under the legend
    legend_below(a2, ncol=2, fontsize=7)
    a2.grid(alpha=0.3)
    return _save(fig, path)


#: (label, summary-key stem, marker) of the G1 matrices drawn against R.
G1_LINES = (
    ("G1", "g1", "o"),
    ("simulated null", "g1_simnull", "P"),
    ("orthogonal null", "g1_null", "s"),
    ("G1_no_adv", "g1_no_adv", "^"),
    ("G1_random_zero_sum", "g1_random", "D"),
    ("G1_nll", "g1_nll", "v"),
)

#: the legend's name of a probe label of the report (a label not listed is shown as it is)
PROBE_NAMES = {"before": "before training", "after": "after training"}

#: the colour of each probe when several are drawn in one figure (before: blue, after: red), in order
PROBE_COLOURS = ("tab:blue", "tab:red", "tab:green")


#: the line each measure's figure draws: (value, legend label); E₂'s is the rank rule's boundary
RANK_REFERENCE = {"top2_share": (0.9, "E₂ = 0.9 (the verdict's boundary)"), "top1_share": (0.9, "E₁ = 0.9")}

#: the axis name of a measure
MEASURE_AXIS = {"top2_share": "E₂, top-2 energy share", "top1_share": "E₁, top-1 energy share"}


def verdict_measure(probes: dict[str, dict[str, Any]]) -> str:
    """The measure the rank figure draws: ``top2_share`` (E₂, what the rank verdict tests) where every probe's summary
    has G1's, else ``erank`` (a probe.json from before E₂ was summarised)."""
    key = mk.rank_key("g1", "top2_share")
    has = all(
        any((d.get(mk.PROBE_SUMMARY) or {}).get(key) for d in p.get("per_group_size", {}).values())
        for p in probes.values()
    )
    return "top2_share" if probes and has else "erank"


#: the report's alt text of the rank figure per measure
MEASURE_ALT = {"top2_share": "E2 of G1 vs R, the rank verdict's measure", "erank": "erank vs R"}


def plot_erank_vs_group_size(probes: dict[str, dict[str, Any]], path: Path, measure: str = "erank") -> Path:
    """A rank measure (erank by default; the report draws ``top2_share``, E₂, the measure the rank verdict tests,
    with its boundary 0.9) vs R for G1, its simulated and orthogonal nulls and its controls (mean and 95%
    interval over groups; a point without bars has fewer than 8 groups, and the title says so), one marker per
    matrix. One probe: one colour per matrix. Several (before / after training): one colour per probe
    (:data:`PROBE_COLOURS`), named in the legend (:data:`PROBE_NAMES`), the matrices told apart by marker and line
    style. The points of one R are spread a little along x so that with one R (or equal values) they do not hide
    one another; the legend sits under the panel.

    Args:
        probes: label -> probe.json content (at most len(PROBE_COLOURS) probes).

    Raises:
        ValueError: more probes than :data:`PROBE_COLOURS`.
    """
    if len(probes) > len(PROBE_COLOURS):
        raise ValueError(f"{len(probes)} probes in one figure; at most {len(PROBE_COLOURS)}")
    fig, ax = plt.subplots(figsize=(SIZE[0], SIZE[1] * 1.3))
    styles = ["-", "--", ":", "-.", (0, (1, 3)), (0, (5, 1, 1, 1, 1, 1))]  # one per G1_LINES entry
    several = len(probes) > 1
    rs_all = sorted({int(R) for p in probes.values() for R in p["per_group_size"]})
    spacing = min((b - a for a, b in zip(rs_all, rs_all[1:])), default=2)
    width = 0.3 * spacing  # the spread of one R's points: under a third of the gap to the next R
    n_series = len(G1_LINES) * len(probes)
    drawn: set[str] = set()
    bare = False  # a point without an interval (fewer than 8 groups)
    ref, ref_label = RANK_REFERENCE.get(measure, (2, f"{measure} = 2 (the rank-2 claim)"))
    for pi, (label, probe) in enumerate(probes.items()):
        per_group_size = probe["per_group_size"]
        rs = sorted(per_group_size, key=int)
        for mi, (name, stem, marker) in enumerate(G1_LINES):
            xs, ys, lo, hi = [], [], [], []
            offset = width * ((mi * len(probes) + pi) / max(n_series - 1, 1) - 0.5)
            for R in rs:
                stats = per_group_size[R].get(mk.PROBE_SUMMARY, {}).get(mk.rank_key(stem, measure))
                if stats and stats.get("mean") is not None:
                    bare = bare or stats.get("lo") is None
                    xs.append(int(R) + offset)
                    ys.append(stats["mean"])
                    lo.append(stats["mean"] - (stats["lo"] if stats.get("lo") is not None else stats["mean"]))
                    hi.append((stats["hi"] if stats.get("hi") is not None else stats["mean"]) - stats["mean"])
            if xs:
                drawn.add(name)
                ax.errorbar(
                    xs,
                    ys,
                    yerr=[lo, hi],
                    linestyle=styles[mi] if several else "-",
                    marker=marker,
                    capsize=3,
                    color=PROBE_COLOURS[pi] if several else f"C{mi}",
                    label=f"{name}, {PROBE_NAMES.get(label, label)}" if several or label in PROBE_NAMES else name,
                )
    if rs_all:
        ax.axhline(ref, color="k", alpha=0.3, linewidth=1, label=ref_label)
        ax.set_xticks(rs_all)
        ax.set_xticklabels([f"R = {R}" for R in rs_all])
        ax.set_xlim(rs_all[0] - spacing / 2, rs_all[-1] + spacing / 2)
    ax.set_xlabel("group size R")
    name = MEASURE_AXIS.get(measure, measure)
    ax.set_ylabel(f"{name} (dimensionless)")
    why = "; no bars: fewer than 8 groups" if bare else ""
    ax.set_title(f"{name.split(',')[0]} of G1 vs R (95% intervals over groups{why})", fontsize=9)
    if several:  # the legend says what a colour and what a marker means, once each
        handles = [
            Line2D([], [], color=c, linewidth=4, label=PROBE_NAMES.get(label, label))
            for c, label in zip(PROBE_COLOURS, probes)
        ]
        handles += [
            # matplotlib's dash styles
            Line2D([], [], color="k", marker=marker, linestyle=style, label=name)  # type: ignore[arg-type]
            for (name, _, marker), style in zip(G1_LINES, styles)
            if name in drawn
        ]
        # the reference line is a Line2D
        handles += [h for h, lab in zip(*ax.get_legend_handles_labels()) if lab == ref_label]  # type: ignore[misc]
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, frameon=False, fontsize=7)
    else:
        legend_below(ax, ncol=2, fontsize=7)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_spectra(probe: dict[str, Any], path: Path, matrix: str = "G1") -> Path:
    """Normalised singular values (s_k / s_1) of ``matrix``, averaged over groups, one line per R."""
    fig, ax = plt.subplots(figsize=SIZE)
    for R in sorted(probe["per_group_size"], key=int):
        spectra = probe["per_group_size"][R].get(mk.PROBE_SPECTRA, {}).get(matrix) or []
        if not spectra:
            continue
        k = max(len(s) for s in spectra)
        mean = []
        for j in range(k):
            vals = [s[j] / s[0] for s in spectra if len(s) > j and s[0] > 0]
            mean.append(sum(vals) / len(vals) if vals else 0.0)
        ax.semilogy(range(1, k + 1), [max(v, 1e-8) for v in mean], marker="o", label=f"R={R}")
    ax.set_xlabel("index k")
    ax.set_ylabel("s_k / s_1, mean over groups (ratio)")
    ax.set_title(f"singular-value spectra of {matrix}", fontsize=9)
    _legend(ax, fontsize=7)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_baseline_variance(probe: dict[str, Any], path: Path) -> Path:
    """Variance of the gradient estimate under each baseline, relative to the optimal one, per R (bars)."""
    fig, ax = plt.subplots(figsize=SIZE)
    rs = sorted(probe["per_group_size"], key=int)
    names: list[str] = []
    for R in rs:
        rel = probe["per_group_size"][R].get(mk.PROBE_BASELINES, {}).get("relative_variance", {})
        names += [n for n in rel if n not in names]
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        ys = [
            probe["per_group_size"][R].get(mk.PROBE_BASELINES, {}).get("relative_variance", {}).get(name) or 0.0
            for R in rs
        ]
        ax.bar([j + i * width for j in range(len(rs))], ys, width=width, label=name)
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(rs))])
    ax.set_xticklabels([f"R={R}" for R in rs])
    ax.set_xlabel("group size")
    ax.set_ylabel("Var / Var(optimal) (ratio)")
    ax.set_yscale("log")
    ax.set_title("gradient variance by baseline", fontsize=9)
    _legend(ax, fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


#: what the probe's per-position credit profile is computed from, in every gradient source (exact, sketch or exact
#: Gram): each position's contribution to a linear layer's weight gradient is the rank-one delta_t x_t^T, so its norm
#: is exact without materialising the gradient (:func:`grpo_lens.gradients.sketch.token_grad_sq_norms`)
CREDIT_PROFILE_SOURCE = "exact, nn.Linear weights"


def plot_credit_profile(probe: dict[str, Any], path: Path) -> Path:
    """Per-position gradient norm of completion tokens, averaged over rollouts, one line per R; the y axis names
    :data:`CREDIT_PROFILE_SOURCE` (the same whatever the probe's ``meta.gradients``: the sketch does not enter it)."""
    fig, ax = plt.subplots(figsize=SIZE)
    for R in sorted(probe["per_group_size"], key=int):
        prof = probe["per_group_size"][R].get(mk.PROBE_CREDIT, {}).get("position_profile") or []
        if prof:
            ax.plot(range(1, len(prof) + 1), prof, marker=".", label=f"R={R}")
    ax.set_xlabel("completion token position")
    ax.set_ylabel(f"mean per-token gradient norm\n({CREDIT_PROFILE_SOURCE})", fontsize=8)
    ax.set_title("where the gradient sits along a completion", fontsize=9)
    _legend(ax, fontsize=7)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_rank_over_training(records: list[dict[str, Any]], path: Path) -> Path:
    """G1's rank per lens step, mean over the step's mixed groups with its 95% interval (error bars) where there are
    >= 8 groups:
    the top-2 / top-1 energy shares against the 0.9 line of "k90 = 2" (left), erank and stable rank against the
    band [1.5, 2.5] of "≈ 2" (right); docs/theory.md §11. The legends sit under the panels (inside, they covered
    points); the step ticks are the lens steps drawn (:func:`data_ticks`), one lens step: one tick."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(SIZE[0], SIZE[1] * 1.2))
    for ax, measures, title in (
        (a1, ("top2_share", "top1_share"), "energy shares of G1's top directions"),
        (a2, ("erank", "stable_rank"), "effective rank of G1"),
    ):
        for m in measures:
            xs, ys = _series(records, mk.rank_key("g1", m))
            if not xs:
                continue
            (line,) = ax.plot(xs, ys, marker=".", label=m.replace("_", " "))
            lo = {r[mk.STEP]: r[mk.RANK_G1_LO.format(m=m)] for r in records if mk.RANK_G1_LO.format(m=m) in r}
            hi = {r[mk.STEP]: r[mk.RANK_G1_HI.format(m=m)] for r in records if mk.RANK_G1_HI.format(m=m) in r}
            steps = [x for x in xs if x in lo and x in hi]
            if steps:  # an interval only where the lens step had >= 8 mixed groups
                mid = [ys[xs.index(x)] for x in steps]
                ax.errorbar(
                    steps,
                    mid,
                    yerr=[[m - lo[x] for m, x in zip(mid, steps)], [hi[x] - m for m, x in zip(mid, steps)]],
                    fmt="none",
                    ecolor=line.get_color(),
                    capsize=3,
                    alpha=0.7,
                )
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")  # lens steps only: the points are the steps the lens measured
        ax.grid(alpha=0.3)
    a1.axhline(0.9, color="gray", linestyle="--", linewidth=1, label="0.9 (k90 = 2)")
    a1.set_ylim(-0.02, 1.02)
    a1.set_ylabel("share of G1's squared singular values")
    a2.set_ylabel("rank (dimensionless)")
    a2.axhspan(1.5, 2.5, color="gray", alpha=0.15, label="≈ 2: [1.5, 2.5]")
    a2.set_ylim(bottom=0)
    legend_below(a1, fontsize=7)
    legend_below(a2, fontsize=7)
    return _save(fig, path)
