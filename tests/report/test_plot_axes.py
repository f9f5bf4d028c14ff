"""Every figure the report and compare draw labels both axes of every panel it uses, puts a legend wherever a panel
holds several series, and gives integer axes integer ticks (run on the hand-made run directories of
test_report.py, with before/after probes, lens steps and baselines, and on a two-run comparison)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import matplotlib.colors
import pytest

from grpo_lens.report import write_report
from grpo_lens.report.compare import compare_runs
from grpo_lens.report.plots import INTEGER_AXES, coinciding, gradient_source_label

pytestmark = pytest.mark.e2e  # writes a report (files, matplotlib)

_spec = importlib.util.spec_from_file_location("report_cases", Path(__file__).with_name("test_report.py"))
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)


def check(name, fig):
    for ax in fig.axes:
        if not ax.axison or not (ax.lines or ax.patches or ax.collections):
            continue  # an empty slot of a grid
        shared = ax.get_shared_x_axes().get_siblings(ax)  # a panel above a shared, labelled x axis
        assert any(a.get_xlabel() for a in shared) or ax.get_xticklabels(), (name, ax.get_title(), "x unlabelled")
        assert ax.get_ylabel(), (name, ax.get_title(), "y axis unlabelled")
        series = {ln.get_label() for ln in ax.lines if not ln.get_label().startswith("_")}
        if len(series) > 1:
            assert ax.get_legend() is not None or fig.legends, (name, ax.get_title(), "several series, no legend")
        if ax.get_xlabel() in INTEGER_AXES:
            assert all(float(t).is_integer() for t in ax.get_xticks()), (name, ax.get_title(), "fractional ticks")


#: the sparsity measures of a lens step: with them the report draws sparsity_measures.png (its three panels)
SPARSITY_MEASURES = {
    "sparsity/update_total_bf16_unchanged": 0.88,
    "sparsity/update_total_bf16_dense": 0.61,
    "sparsity/update_total_f32_unchanged": 0.02,
    "sparsity/update_step_hoyer": 0.31,
    "sparsity/update_step_top1_energy": 0.2,
    "sparsity/grad_hoyer": 0.4,
    "sparsity/grad_top1_energy": 0.3,
    "sparsity/attention/update_total_hoyer": 0.25,
    "sparsity/mlp/update_total_hoyer": 0.27,
}


def _add_to_lens_steps(run: Path, extra: dict) -> None:
    """Add ``extra`` to the lens steps (those with perf/lens_seconds) of run/metrics.jsonl."""
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    recs = [{**r, **extra} if "perf/lens_seconds" in r else r for r in recs]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")


def test_every_report_figure_labels_its_axes(tmp_path, figures):
    cases._write_metrics(tmp_path / "train", [0.2, 0.4, 0.6, 0.5, 0.7, 0.6, 0.8, 0.9, 0.7, 0.8])
    _add_to_lens_steps(tmp_path / "train", SPARSITY_MEASURES)
    (tmp_path / "train" / "config.yaml").write_text("model: tiny\ngroup_size: 4\n")
    for sub in ("probe_before", "probe_after"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "probe.json").write_text(json.dumps(cases._probe()))
    write_report(tmp_path)
    names = {n for n, _ in figures}
    assert {
        "sparsity.png",
        "baselines.png",
        "rank_over_training.png",
        "erank_vs_R.png",
        "spectra_before.png",
        "learning_curves.png",
        "sparsity_measures.png",
    } <= names
    for name, fig in figures:
        check(name, fig)
    (sparsity,) = [f for n, f in figures if n == "sparsity.png"]
    assert sparsity.axes[0].get_ylabel().startswith("S1: share of groups with equal rewards")


@pytest.mark.parametrize(
    "extra, lora, source",
    [
        ({}, "", "sketch"),
        ({"grad/gram_coverage": 0.97}, "", "exact Gram"),
        ({}, "lora_rank: 4\n", "exact, LoRA adapter's weights"),
    ],
)
def test_the_baselines_figure_names_the_gradient_source_the_run_used(tmp_path, figures, extra, lora, source):
    # the exact Gram is the only lens path that records grad/gram_coverage; a LoRA lens in the trainable space takes
    # the adapter's exact gradients; otherwise the sketch
    cases._write_metrics(tmp_path, [0.2, 0.4, 0.6, 0.5, 0.7])
    _add_to_lens_steps(tmp_path, extra)
    (tmp_path / "config.yaml").write_text("model: tiny\n" + lora)
    write_report(tmp_path)
    (fig,) = [f for n, f in figures if n == "baselines.png"]
    assert fig.axes[1].get_ylabel() == f"squared gradient norm ({source})"


def test_an_unknown_gradient_source_is_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match="exact_gram, sketch"):
        gradient_source_label("exakt")


@pytest.mark.parametrize("n_runs", [2, 11])  # 11: past matplotlib's ten-colour cycle, where C10 is C0 again
def test_the_comparison_figure_labels_its_axes_and_keeps_run_colours(tmp_path, figures, n_runs):
    runs = [f"run{i:02d}" for i in range(n_runs)]
    for i, run in enumerate(runs):
        cases._write_metrics(tmp_path / run, [0.1 + 0.02 * i, 0.2, 0.3 - 0.01 * i], lens_steps=(2,))
        (tmp_path / run / "config.yaml").write_text(f"task: arithmetic\nseed: {i}\n")
    compare_runs([tmp_path / run for run in runs], tmp_path / "cmp")
    ((name, fig),) = [(n, f) for n, f in figures if n == "compare.png"]
    check(name, fig)
    colours = {}  # run -> the colours its lines have, over every panel
    for ax in fig.axes:
        for ln in ax.lines:
            colours.setdefault(ln.get_label(), set()).add(matplotlib.colors.to_hex(ln.get_color()))
    assert set(colours) == set(runs)
    assert all(len(c) == 1 for c in colours.values()), colours  # a run keeps its colour in every panel
    assert len(set().union(*colours.values())) == n_runs, colours  # no two runs share one
    assert [t.get_text() for t in fig.legends[0].get_texts()] == runs  # one legend, naming every run


def _one_r(probe: dict, r: str = "4") -> dict:
    """``probe`` with only group size ``r`` kept."""
    return {**probe, "per_group_size": {r: probe["per_group_size"][r]}}


def test_a_one_r_before_after_figure_has_one_tick_and_tells_before_from_after_by_colour(tmp_path, figures):
    for sub in ("probe_before", "probe_after"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "probe.json").write_text(json.dumps(_one_r(cases._probe())))
    write_report(tmp_path)
    ((name, fig),) = [(n, f) for n, f in figures if n == "erank_vs_R.png"]
    check(name, fig)
    (ax,) = fig.axes
    assert list(ax.get_xticks()) == [4] and ax.get_xticklabels()[0].get_text() == "R = 4"
    lo, hi = ax.get_xlim()
    xs = {float(x) for ln in ax.lines if ln.get_transform() == ax.transData for x in ln.get_xdata()}
    assert lo < min(xs) < 4 < max(xs) < hi and len(xs) > 1  # the points spread around their one R, inside the axes
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert {"before training", "after training"} <= set(legend), legend
    assert not any(t.strip().replace(".", "").isdigit() for t in legend), legend  # no bare "2"
    by_probe = {}  # "before" / "after" -> colours of its series
    for bars in ax.containers:  # an errorbar's label is its container's; lines[0] is its data line
        by_probe.setdefault(bars.get_label().rsplit(", ", 1)[1], set()).add(
            matplotlib.colors.to_hex(bars.lines[0].get_color())
        )
    assert set(by_probe) == {"before training", "after training"}, by_probe
    assert all(len(c) == 1 for c in by_probe.values()) and len(set().union(*by_probe.values())) == 2, by_probe


def test_learning_curves_put_a_legend_on_each_panel_with_several_series(tmp_path, figures):
    cases._write_metrics(tmp_path, [0.2, 0.4, 0.6])
    write_report(tmp_path)
    ((name, fig),) = [(n, f) for n, f in figures if n == "learning_curves.png"]
    check(name, fig)
    several = [ax for ax in fig.axes if len({ln.get_label() for ln in ax.lines}) > 1]
    assert several and all(ax.get_legend() is not None for ax in several)  # the panel's own, not a figure's


def _styles(lines) -> list[tuple[str, str]]:
    """(linestyle, marker) of each line."""
    return [(ln.get_linestyle(), ln.get_marker()) for ln in lines]


def test_coinciding_series_stay_visible_and_say_when_they_are_equal(tmp_path, figures):
    # under 0/1 rewards accuracy is the reward mean (_write_metrics writes them equal); the permutation control is
    # written equal to bf16-unchanged and the dense control 0.005 off it, under a line's width on the [0, 1] axis
    cases._write_metrics(tmp_path, [0.2, 0.4, 0.6, 0.5, 0.7])
    _add_to_lens_steps(
        tmp_path,
        {**SPARSITY_MEASURES, "sparsity/update_total_bf16_permuted": 0.88, "sparsity/update_total_bf16_dense": 0.875},
    )
    write_report(tmp_path)
    ((_, curves),) = [(n, f) for n, f in figures if n == "learning_curves.png"]
    reward = curves.axes[0]
    assert len(reward.lines) == 2 and len(set(_styles(reward.lines))) == 2, _styles(reward.lines)
    assert reward.lines[1].get_zorder() > reward.lines[0].get_zorder()  # the later one on top
    assert reward.lines[1].get_linewidth() < reward.lines[0].get_linewidth()  # thinner: the wide one shows around it
    assert [t.get_text() for t in reward.get_legend().get_texts()] == [
        "reward mean",
        "accuracy\n(= reward mean at every step)",
    ]
    ((_, measures),) = [(n, f) for n, f in figures if n == "sparsity_measures.png"]
    shares = measures.axes[0]
    bf16 = shares.lines[:3]  # unchanged, permutation control, dense control
    assert len(set(_styles(bf16))) == 3, _styles(bf16)
    assert [t.get_text() for t in shares.get_legend().get_texts()][:3] == [
        "bf16 unchanged",
        "permutation control\n(= bf16 unchanged at every step)",
        "dense control",
    ]
    assert all(t.get_fontsize() >= 8 for ax in measures.axes for t in ax.get_legend().get_texts())  # readable


def test_compare_leaves_a_margin_beyond_the_first_and_last_step_of_every_panel(tmp_path, figures):
    # only run "a" has lens steps (1 and 2): its lens panels span one step, which integer_ticks widens to 2 steps;
    # put at the edge, the end markers were cut in half
    cases._write_metrics(tmp_path / "a", [0.2, 0.4, 0.6], lens_steps=(1, 2))
    cases._write_metrics(tmp_path / "b", [0.3, 0.5, 0.5], lens_steps=())
    for i, run in enumerate("ab"):
        (tmp_path / run / "config.yaml").write_text(f"task: arithmetic\nseed: {i}\n")
    compare_runs([tmp_path / "a", tmp_path / "b"], tmp_path / "cmp")
    ((_, fig),) = [(n, f) for n, f in figures if n == "compare.png"]
    panels = [ax for ax in fig.axes if ax.lines]
    assert any(ax.get_title().startswith("lens:") for ax in panels)
    for ax in panels:
        xs = [float(x) for ln in ax.lines for x in ln.get_xdata()]
        lo, hi = ax.get_xlim()
        margin = 0.02 * (hi - lo)  # a marker's half-width at the saved size is about 1% of a panel's width
        assert lo <= min(xs) - margin and hi >= max(xs) + margin, (ax.get_title(), (lo, hi), (min(xs), max(xs)))


def test_coinciding_tells_equal_from_near_from_apart():
    a = ([1, 2, 4], [0.95, 0.94, 0.93])
    assert coinciding(a, ([1, 2, 4], [0.95, 0.94, 0.93]), 0.01) == "equal"
    assert coinciding(a, ([1, 2, 4], [0.955, 0.94, 0.925]), 0.01) == "near"  # at most 0.005 off
    assert coinciding(a, ([1, 2], [0.95, 0.94]), 0.01) == "near"  # equal where both are, but step 4 missing
    assert coinciding(a, ([1, 2, 4], [0.95, 0.94, 0.95]), 0.01) is None  # 0.02 off at step 4
    assert coinciding(a, ([3], [0.95]), 0.01) is None  # no step in common


def test_before_after_rank_figure_draws_every_g1_line(tmp_path):
    # Two probes (before / after) with every G1 line's summary at R = 2 and 4: one line style per line is needed
    # (the sixth, G1_nll, once had none and the quick demo's report crashed with an IndexError).
    from grpo_lens import metrics as mk
    from grpo_lens.report.plots import G1_LINES, plot_erank_vs_group_size

    def probe(shift: float) -> dict:
        stats = {"mean": 0.8 + shift, "lo": 0.7 + shift, "hi": 0.9 + shift}
        summary = {mk.rank_key(stem, "top2_share"): stats for _, stem, _ in G1_LINES}
        return {"per_group_size": {R: {mk.PROBE_SUMMARY: summary} for R in ("2", "4")}}

    out = tmp_path / "erank_vs_R.png"
    plot_erank_vs_group_size({"before": probe(0.0), "after": probe(0.05)}, out, measure="top2_share")
    assert out.stat().st_size > 0
