"""Report frictions: "too few for an interval" said once, not per cell; the Findings' S1 windows are the
claims table's; error bars only where the table has an interval; step ticks only at drawn steps, legends off the
data; the learning rate plotted; the credit profile's axis naming what it is computed from."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from grpo_lens.formulas.stats import trend_windows
from grpo_lens.report import write_report
from grpo_lens.report.format import (
    FEW_MARK,
    FEW_NOTE,
    ci,
    few_footnotes,
    interval,
    mark_few,
)
from grpo_lens.report.plots import (
    CREDIT_PROFILE_SOURCE,
    plot_credit_profile,
    plot_rank_over_training,
)
from grpo_lens.report.studies import plot_credit_position

_spec = importlib.util.spec_from_file_location("report_cases", Path(__file__).with_name("test_report.py"))
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)


# ---------------------------------------------------------------------------------------------------------------------
# 1. too few for an interval: a mark in the cell, the words once
# ---------------------------------------------------------------------------------------------------------------------
def test_a_mean_without_an_interval_is_marked_and_the_marks_are_counted_once_per_table():
    assert ci({"mean": 1.98, "lo": None, "hi": None, "n": 4}, 2) == f"1.98 (n = 4){FEW_MARK}"
    assert ci({"mean": 1.98, "lo": 1.9, "hi": 2.1, "n": 8}, 2) == "1.98 [1.90, 2.10]"
    # the claims' own words, shortened for the table only; other wordings are left as they are
    assert (
        mark_few("erank 2.13 (n = 7 groups, too few for an interval); x") == f"erank 2.13 (n = 7 groups){FEW_MARK}; x"
    )
    kept = "1 of 2 prompts (too few prompts for an interval)"
    assert mark_few(kept) == kept
    # two tables: the first has 3 marked cells (two in one row), the second none -> one line after the first only
    lines = [
        "| a | b |",
        "|---|---|",
        f"| 1 (n = 2){FEW_MARK} | 2 (n = 2){FEW_MARK} |",
        f"| 3 (n = 4){FEW_MARK} | 4 |",
        "",
        "| c |",
        "|---|",
        "| 5 [4, 6] |",
    ]
    out = few_footnotes(lines)
    assert out[:4] == lines[:4] and out[4:6] == ["", f"{FEW_MARK} 3 cell(s) of this table: n < 8, no interval."]
    assert out[6:] == lines[4:]


def _few_probe() -> dict:
    """The hand-made probe of test_report.py with every interval dropped (n = 2 groups: too few)."""
    probe = cases._probe()
    for d in probe["per_group_size"].values():
        for stats in list(d["summary"].values()) + list(d["strata"]["correct"]["1"].values()):
            stats["lo"] = stats["hi"] = None
    return probe


@pytest.mark.e2e
def test_the_report_says_too_few_for_an_interval_once(tmp_path):
    (tmp_path / "probe.json").write_text(json.dumps(_few_probe()))
    report = write_report(tmp_path).read_text()
    # the old report spelled "(n = 2, too few for an interval)" out in each of dozens of cells
    assert "too few for an interval" not in report.replace(FEW_NOTE, "")
    assert report.count(FEW_NOTE) == 1 and report.index(FEW_NOTE) < report.index("## Answers")
    assert f"1.98 (n = 2){FEW_MARK}" in report  # R = 4's G1 erank in the rank table
    # every table holding a mark is followed by the one line that counts them
    blocks = re.split(r"\n(?!\|)", report)
    for i, block in enumerate(blocks):
        if block.startswith("|") and FEW_MARK in block:
            assert re.match(rf"{FEW_MARK} \d+ cell\(s\) of this table", blocks[i + 2]), block[:80]


# ---------------------------------------------------------------------------------------------------------------------
# 2. S1's windows: one function for the claims table and the Findings
# ---------------------------------------------------------------------------------------------------------------------
def test_trend_windows_are_thirds_of_at_least_one_step():
    assert trend_windows(10) == (slice(0, 3), slice(7, 10))  # 10 // 3 = 3
    assert trend_windows(24) == (slice(0, 8), slice(16, 24))
    assert trend_windows(2) == (slice(0, 1), slice(1, 2))  # 2 // 3 = 0 -> one step each
    assert trend_windows(1) == (slice(0, 1), slice(0, 1))
    with pytest.raises(ValueError, match="at least one value"):
        trend_windows(0)


@pytest.mark.e2e
@pytest.mark.parametrize("n", [10, 24])
def test_findings_and_the_claims_table_give_the_same_s1_windows(tmp_path, n):
    cases._write_metrics(tmp_path, [0.5] * n, lens_steps=(2, 4, 6, 8, 10))
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for r in recs:  # S1 rising with the step: each window has its own mean
        r["reward/frac_zero_std_groups"] = r["step"] / (n + 1)
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    report = write_report(tmp_path).read_text()
    claim = re.search(r"S1 first third ([0-9.]+).*?, last third ([0-9.]+)", report)
    finding = re.search(r"S1 \(zero-variance group share\) rose: ([0-9.]+).*? -> ([0-9.]+)", report)
    assert claim and finding, report
    # thirds of n steps: n = 10 -> steps 1-3 and 8-10, S1 means 2/11 = 0.18 and 9/11 = 0.82 (the old Findings read
    # the first and last 5 steps: 3/11 = 0.27 and 8/11 = 0.73); n = 24 -> steps 1-8, 17-24: 4.5/25, 20.5/25
    first, last = (4.5 / 25, 20.5 / 25) if n == 24 else (2 / 11, 9 / 11)
    assert (
        [float(x) for x in claim.groups()] == [float(x) for x in finding.groups()] == [round(first, 2), round(last, 2)]
    )
    third = max(n // 3, 1)
    assert f"first third of the steps (1–{third})" in report and f"last third ({n - third + 1}–{n})" in report


# ---------------------------------------------------------------------------------------------------------------------
# 3. error bars only where the table prints an interval
# ---------------------------------------------------------------------------------------------------------------------
def test_credit_position_bars_have_error_bars_only_where_an_interval_exists(tmp_path, figures):
    with_ci = {"mean": 0.5, "lo": 0.4, "hi": 0.7, "n": 8}
    few = {"mean": 0.3, "lo": None, "hi": None, "n": 4}
    profile = [with_ci, few, with_ci, few]
    plot_credit_position(profile, tmp_path / "credit_position.png")
    ((_, fig),) = figures
    ax = fig.axes[0]
    bars = [c for c in ax.containers if c.__class__.__name__ == "ErrorbarContainer"]
    segments = [seg for c in bars for coll in c.lines[2] for seg in coll.get_segments()]
    # one vertical segment per bin with an interval, at its x and spanning [lo, hi]: bins 0 and 2 (x = 0.125, 0.625)
    assert sorted((round(s[0][0], 3), round(s[0][1], 3), round(s[1][1], 3)) for s in segments) == [
        (0.125, 0.4, 0.7),
        (0.625, 0.4, 0.7),
    ]
    assert [interval(p) is not None for p in profile] == [True, False, True, False]  # the table's rule
    assert "2 of 4 bins" in " ".join(t.get_text() for t in ax.get_legend().get_texts())


# ---------------------------------------------------------------------------------------------------------------------
# 4. rank over training: ticks at the lens steps drawn, one step sensibly, the legend off the data
# ---------------------------------------------------------------------------------------------------------------------
def _lens_records(steps):
    return [
        {
            "step": s,
            "rank/g1_top2_share": 0.9,
            "rank/g1_top1_share": 0.6,
            "rank/g1_erank": 2.0 + 0.1 * s,
            "rank/g1_stable_rank": 1.5,
        }
        for s in steps
    ]


@pytest.mark.parametrize("steps", [(1, 2), (1, 2, 4), (3,)])
def test_rank_over_training_ticks_only_steps_that_exist_and_keeps_its_legend_off_the_points(tmp_path, figures, steps):
    plot_rank_over_training(_lens_records(steps), tmp_path / "rank.png")
    ((_, fig),) = figures
    fig.canvas.draw()
    for ax in fig.axes:
        # a 2-step run showed a step-3 tick, steps 1, 2, 4 one at 3
        assert [float(t) for t in ax.get_xticks()] == [float(s) for s in steps]
        lo, hi = ax.get_xlim()
        assert lo < min(steps) and max(steps) < hi and (len(steps) > 1 or (lo, hi) == (steps[0] - 1, steps[0] + 1))
        legend = ax.get_legend().get_window_extent()
        assert legend.y1 <= ax.get_window_extent().y0  # under the panel, so it covers no point


# ---------------------------------------------------------------------------------------------------------------------
# 5. the learning rate over training
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_the_train_report_plots_the_learning_rate_with_its_schedule(tmp_path, figures):
    cases._write_metrics(tmp_path, [0.2, 0.4, 0.6, 0.5, 0.7])
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    lrs = [0.0, 5e-6, 5e-6 * 0.75, 5e-6 * 0.25, 0.0]  # 1 warm-up step, then half a cosine
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps({**r, "lr": lr}) for r, lr in zip(recs, lrs)) + "\n")
    (tmp_path / "config.yaml").write_text("model: tiny\nlr_scheduler: cosine\nwarmup_steps: 1\n")
    report = write_report(tmp_path).read_text()
    assert "![learning rate](learning_rate.png)" in report and (tmp_path / "learning_rate.png").exists()
    ((_, fig),) = [(n, f) for n, f in figures if n == "learning_rate.png"]
    ax = fig.axes[0]
    assert list(ax.lines[0].get_ydata()) == lrs and ax.get_ylabel().startswith("learning rate")
    assert "cosine, 1 warm-up steps" in ax.get_title()


# ---------------------------------------------------------------------------------------------------------------------
# 6. the credit profile names its gradient source
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gradients", ["sketch", "exact_gram", "exact"])
def test_the_credit_profile_names_what_it_is_computed_from(tmp_path, figures, gradients):
    # the per-token norms are exact (rank-one delta_t x_t^T per position) whatever meta.gradients says; the old
    # label said "(sketch)" for every probe
    probe = cases._probe()
    probe["meta"]["gradients"] = gradients
    plot_credit_profile(probe, tmp_path / "credit_profile.png")
    ((_, fig),) = figures
    label = fig.axes[0].get_ylabel()
    assert CREDIT_PROFILE_SOURCE in label and "sketch" not in label


@pytest.mark.e2e
@pytest.mark.parametrize("none, lower", [(0.25, True), (4.0, False)])
def test_a_baseline_variance_below_b_stars_says_why(tmp_path, none, lower):
    # a new user read "no baseline at all gives 0.23x" the optimal b*'s variance as a contradiction: below 1 the
    # finding now says why (b* minimises E||(r - b) g||^2, the variance only when E[g] = 0); above 1 it only says it
    probe = cases._probe()
    for d in probe["per_group_size"].values():
        d["baselines"]["relative_variance"]["none"] = none
    (tmp_path / "probe.json").write_text(json.dumps(probe))
    report = write_report(tmp_path).read_text()
    assert (f"with no baseline at all it is {none:.2f}x, lower: b* minimises the second moment" in report) == lower
    assert (f"no baseline at all gives {none:.2f}x" in report) == (not lower)
