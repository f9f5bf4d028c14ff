"""write_report on hand-made run directories: every finding is computed from the numbers in the directory.

The metrics and probe.json here are written by the test with known values, so each expected sentence and table cell
is derived in a comment next to its assert.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from grpo_lens.report import ReportError, write_report

MAX_IMAGE_BYTES = 300 * 1024


def _write_metrics(run: Path, rewards: list[float], lens_steps: tuple[int, ...] = (5, 10)) -> None:
    run.mkdir(parents=True, exist_ok=True)
    lines = []
    for step, r in enumerate(rewards, start=1):
        rec = {
            "step": step,
            "reward/mean": r,
            "reward/accuracy": r,
            "reward/std": 0.4,
            "reward/frac_zero_std_groups": 0.25,
            "completions/mean_length": 6.0 + step,
            "kl/mean": 0.001 * step,
            "clip/ratio_region": 0.0,
            "clip/ratio_high": 0.0,
            "clip/ratio_low": 0.0,
            "perf/step_seconds": 2.0,
        }
        if step in lens_steps:  # a lens step: S4, rank, identity residual, baselines
            rec.update(
                {
                    "reward/frac_zero_std_groups": 0.375,
                    "perf/lens_seconds": 0.5,
                    "sparsity/update_step": 0.9123,
                    "sparsity/update_total": 0.8765,
                    "rank/g1_erank": 1.93,
                    "rank/g1_stable_rank": 1.41,
                    "grad/identity_residual": 3.2e-7,
                    "baseline/b_star": 0.44,
                    "baseline/group_mean": 0.5,
                    "baseline/m_correct": 0.02,
                    "baseline/m_wrong": 0.04,
                }
            )
        lines.append(json.dumps(rec))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def _probe(s1_measured: float = 0.625, g1_erank: float = 1.98) -> dict:
    def ci(mean, half=0.05, n=2):
        return {"mean": mean, "lo": mean - half, "hi": mean + half, "n": n}

    per_r = {}
    for R in (2, 4):
        erank = g1_erank if R == 4 else 1.0
        summary = {
            "rank/g1_erank": ci(erank),
            "rank/g1_null_erank": ci(float(R) - 0.2),
            "rank/g1_erank_vs_null": ci(erank / (R - 0.2), 0.01),
            "rank/g1_stable_rank": ci(1.5),
            "rank/g1_random_erank": ci(float(R) - 0.5),
            "group/distinct_completions": ci(float(R), 0.0),
            "zero_sum/span_energy": ci(0.61),
            "zero_sum/span_energy_null": ci(0.71),
            "zero_sum/span_energy_p": ci(0.6),
            "baseline/b_star": ci(0.41),
            "baseline/group_mean": ci(0.5),
            "baseline/m_correct": ci(0.011, 0.001),
            "baseline/m_wrong": ci(0.013, 0.001),
            "rank/g2_numerical_rank": ci(3.5),
            "rank/g2_rank_bound": ci(11.0),
            "credit/answer_share_mean": ci(0.3),
            "credit/answer_token_frac": ci(0.25),
        }
        rows = [
            {"grad/identity_residual": 4.0e-8, "zero_sum/span_energy_p": 0.01, "credit/adv_var_within_max": 0.0},
            {"grad/identity_residual": 1.0e-9, "zero_sum/span_energy_p": 0.5, "credit/adv_var_within_max": 0.0},
        ]
        per_r[str(R)] = {
            "prompts_sampled": 8,
            "groups_all_equal": 6,
            "groups_mixed": 2,
            "groups_invalid": 0,
            "s1_measured": s1_measured,
            "s1_predicted": 0.58,
            "groups": rows,
            "summary": summary,
            "strata": {"correct": {"1": summary}, "distinct": {str(R): summary}},
            "g3": {"groups": 2, "rank/g3_erank": 1.7, "rank/g3_null_erank": 1.9},
            "spectra": {"G1": [[3.0, 1.0], [2.0, 0.5]]},
            "baselines": {
                "variance": {"none": 4.0, "mean": 1.2, "rloo": 1.5, "optimal": 1.0},
                "relative_variance": {"none": 4.0, "mean": 1.2, "rloo": 1.5, "optimal": 1.0},
                "prompts": 1,
            },
            "credit": {"position_profile": [1.0, 0.8, 0.6]},
            "timing": {"generation_seconds": 1.0, "gradient_seconds": 1.0},
        }
    return {
        "meta": {
            "model": "tiny",
            "task": "arithmetic",
            "gradients": "sketch",
            "sketch_dim": 16,
            "std": "sample",
            "eps": 1e-4,
            "layer": "model.layers.1.mlp.down_proj",
        },
        "per_group_size": per_r,
    }


def _findings(report: str) -> list[str]:
    section = report.split("\n### Findings", 1)[1].split("\n### ", 1)[0]  # a section of the appendix
    return [line[2:] for line in section.splitlines() if line.startswith("- ")]


def _check_tables(report: str) -> int:
    """Every row of every Markdown table has as many unescaped '|' as its header row (a '|' inside a cell, such as
    '|A_i|', must be written '\\|' or the renderer splits the cell or drops the table); returns the tables seen."""
    pipes = re.compile(r"(?<!\\)\|")
    tables, head = 0, None
    for line in report.splitlines():
        if not line.startswith("|"):
            head = None
            continue
        if head is None:
            head, tables = line, tables + 1
        assert len(pipes.findall(line)) == len(pipes.findall(head)), f"row {line!r} vs header {head!r}"
    return tables


def _check_images(run: Path, report: str) -> list[str]:
    """Every image the report links exists, is a PNG, and is under 300 KB; returns their names."""
    names = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report)
    assert names
    for name in names:
        path = run / name
        assert path.is_file(), f"{name} is linked but missing"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert 0 < path.stat().st_size < MAX_IMAGE_BYTES, f"{name}: {path.stat().st_size} bytes"
    return names


# ---------------------------------------------------------------------------------------------------------------------
# Findings follow the numbers
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_reward_finding_rose_for_rising_rewards(tmp_path):
    _write_metrics(tmp_path, [0.1 * s for s in range(1, 11)])
    report = write_report(tmp_path).read_text()
    reward = [f for f in _findings(report) if f.startswith("Mean reward")]
    # first 5 steps: mean(0.1..0.5) = 0.3; last 5 steps: mean(0.6..1.0) = 0.8
    assert reward == ["Mean reward rose over training: 0.300 (first 5 steps) -> 0.800 (last 5 steps)."]


@pytest.mark.e2e
def test_reward_finding_fell_for_falling_rewards(tmp_path):
    _write_metrics(tmp_path, [1.0 - 0.1 * s for s in range(1, 11)])
    report = write_report(tmp_path).read_text()
    reward = [f for f in _findings(report) if f.startswith("Mean reward")]
    # first 5: mean(0.9..0.5) = 0.7; last 5: mean(0.4..0.0) = 0.2
    assert reward == ["Mean reward fell over training: 0.700 (first 5 steps) -> 0.200 (last 5 steps)."]
    assert "rose" not in reward[0]


@pytest.mark.e2e
def test_reward_finding_flat(tmp_path):
    _write_metrics(tmp_path, [0.5] * 4)
    report = write_report(tmp_path).read_text()
    # 4 steps: two non-overlapping windows of 4 // 2 = 2 steps
    assert "Mean reward stayed flat over training: 0.500 (first 2 steps) -> 0.500 (last 2 steps)." in report


@pytest.mark.e2e
def test_short_run_says_too_few_steps_and_zero_gradient(tmp_path):
    _write_metrics(tmp_path, [0.021] * 3, lens_steps=())
    lines = (
        (tmp_path / "metrics.jsonl")
        .read_text()
        .replace('"reward/frac_zero_std_groups": 0.25', '"reward/frac_zero_std_groups": 1.0')
    )
    (tmp_path / "metrics.jsonl").write_text(lines)
    findings = _findings(write_report(tmp_path).read_text())
    # 3 steps < 4: no first/last comparison (the windows would overlap), no "stayed flat"
    assert not any(f.startswith("Mean reward") or f.startswith("S1 (zero-variance") for f in findings)
    assert "3 step(s): too few steps for a trend" in findings[0] and "mean reward 0.021 over the run" in findings[0]
    # S1 = 1 on all 3 steps: every advantage was zero
    assert any(
        f.startswith("S1 = 1.000 on every one of the 3 steps") and "nothing was trained by the policy gradient" in f
        for f in findings
    )


@pytest.mark.e2e
def test_training_tables_show_the_numbers(tmp_path):
    _write_metrics(tmp_path, [0.1 * s for s in range(1, 11)])
    report = write_report(tmp_path).read_text()
    # the S1/S4/rank table has one row per lens step (5 and 10) with the values written above
    for step, acc in ((5, "0.500"), (10, "1.000")):
        assert (f"| {step} | {acc} | 0.375 | 0.912 | 0.876 | 1.930 | 1.410 | 3.2e-07 |") in report
    # baselines: m_C / m_W = 0.02 / 0.04 = 0.5 < 1, so b* sits below the group mean
    assert "| 5 | 0.440 | 0.500 | 0.0200 | 0.0400 | 0.500 |" in report
    assert "m_C / m_W over 2 lens step(s): 0.500: correct rollouts had smaller" in report
    # S1 over the thirds of 10 steps (3 each, too few for an interval): steps 1-3 all 0.25; steps 8-10
    # (0.25 + 0.25 + 0.375) / 3 = 0.2917 -> rose; accuracy 0.2 -> 0.9 over the same steps
    assert (
        "S1 (zero-variance group share) rose: 0.25 (n = 3)† over the first third of the steps (1–3) -> "
        "0.29 (n = 3)† over the last third (8–10), while accuracy went 0.200 -> 0.900"
    ) in report
    # no S1 prediction in training (it would be computed from the groups it predicts)
    assert "S1 predicted" not in report.split("## Training", 1)[1]
    # lens cost: 2 lens steps x 0.5 s against 10 x 2 s - 1 s = 19 s without the lens: 5.3%
    assert "took 1.0 s: 5.3% of the 19.0 s the steps took without it" in report
    assert "0.876 of parameters kept their bf16 value after 10 steps" in report
    names = _check_images(tmp_path, report)
    assert {"learning_curves.png", "sparsity.png", "baselines.png"} <= set(names)


# ---------------------------------------------------------------------------------------------------------------------
# Probe
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_probe_report_shows_s1_and_rank(tmp_path):
    (tmp_path / "probe.json").write_text(json.dumps(_probe(s1_measured=0.625, g1_erank=1.98)))
    report = write_report(tmp_path).read_text()
    # S1 table: R, prompts, all-equal, mixed, S1 measured, S1 predicted, residual max (of 4e-8, 1e-9), distinct
    # completions mean [interval], G2 rank / bound means
    assert "| 2 | 8 | 6 | 2 | 0.625 | 0.580 | 4.0e-08 | 2.00 [2.00, 2.00] | 3.5 / 11.0 |" in report
    assert "| 4 | 8 | 6 | 2 | 0.625 | 0.580 | 4.0e-08 | 4.00 [4.00, 4.00] | 3.5 / 11.0 |" in report
    # rank table: mean [lo, hi] with lo/hi = mean -/+ 0.05; the null row and the ratio row (1.98 / 3.8 = 0.521)
    assert "| 4 | G1 (rows A_i g_i) | 2 | 1.98 [1.93, 2.03] | 1.50 [1.45, 1.55] |" in report
    assert "| 4 | orthogonal null (\\|A_i\\| \\|\\|g_i\\|\\|) | 2 | 3.80 [3.75, 3.85] |" in report
    assert "| 4 | G1 / null (ratio) | 2 | 0.52 [0.51, 0.53] |" in report
    assert "| 4 | G3 (rows = groups' updates) | 2 | 1.70 (null 1.90) |" in report
    # zero-sum table: span energy 0.61 vs relabelled 0.71; one group of two has p < 0.05
    assert "| 4 | 2 | 0.610 [0.560, 0.660] | 0.710 [0.660, 0.760] | 1/2 |" in report
    assert "### Stratified by k" in report and "### Stratified by distinct completions" in report
    # the claims section opens the appendix: one rank row across R = 4 (R = 2 left out), inconclusive (the rank rule
    # reads the per-group rows; this hand-made probe's rows carry no rank keys: 0 groups < 16), naming the flag; the
    # identity is a check under the table: max residual 4e-8 < 1e-4 -> holds
    assert report.index("\n## Appendix") < report.index("\n### Claims") < report.index("\n### Findings")
    claims = report.split("\n### Claims", 1)[1].split("\n### ", 1)[0]
    assert (
        "| the per-rollout gradient matrix G1 has effective rank ≈ 2 (top-2 energy share E₂ > 0.9 > E₁) | "
        "R = 4 (one verdict) |" in claims
    )
    assert "**inconclusive** | 0 groups < 16 at some R" in claims and "To decide: raise `--prompts`" in claims
    assert "Checks (algebra and identities" in claims and "**holds** — relative residual max 4.0e-08" in claims
    assert "Holm" in claims
    findings = _findings(report)
    assert any(
        f.startswith("[probe] R=4: G1 erank 1.98 [1.93, 2.03] vs orthogonal null 3.80 [3.75, 3.85]") for f in findings
    )
    assert any(f.startswith("[probe] R=2: G1 erank 1.00") and "R = 2 caps" in f for f in findings)
    assert any("residual of at most 4.0e-08 over 4 mixed 0/1 groups" in f for f in findings)
    assert any("rloo baseline's gradient variance is 1.50x" in f for f in findings)
    # S1, rank, weightings, two strata, zero-sum, baselines, credit and the claims: 9 tables, none split by a '|'
    assert _check_tables(report) >= 9
    names = _check_images(tmp_path, report)
    assert {
        "erank_vs_R_probe.png",
        "spectra_probe.png",
        "baseline_variance_probe.png",
        "credit_profile_probe.png",
    } <= set(names)


@pytest.mark.e2e
def test_no_structure_rule_prints_its_boundary_rounded(tmp_path):
    # 16 groups whose G1 holds less top-2 energy than its simulated null (reduction -0.004 +- 0.001): the
    # no-structure route decides on the one structure boundary 0 (the 0.3 route printed its margin
    # 1 - 0.9 = 0.09999999999999998 as 0.10); no float noise reaches the text
    probe = _probe()
    probe["per_group_size"]["4"]["groups"] = [
        {
            "rank/g1_top2_share": 0.93 + 0.001 * (i % 3),
            "rank/g1_top1_share": 0.8,
            "rank/g1_null_top2_share": 0.935,
            "rank/g1_simnull_top2_share": 0.935,
            "rank/g1_erank": 2.2,
            "rank/g1_null_erank": 2.2,
            "rank/g1_stable_rank": 1.7,
            "rank/g1_null_stable_rank": 1.7,
        }
        for i in range(16)
    ]
    (tmp_path / "probe.json").write_text(json.dumps(probe))
    report = write_report(tmp_path).read_text()
    assert "no structure (reduction below 0.00)" in report
    assert "999999" not in report
    _check_tables(report)


@pytest.mark.e2e
def test_probe_erank_finding_tracks_the_number(tmp_path):
    (tmp_path / "probe.json").write_text(json.dumps(_probe(g1_erank=3.4)))
    report = write_report(tmp_path).read_text()
    assert any(f.startswith("[probe] R=4: G1 erank 3.40 [3.35, 3.45]") for f in _findings(report))


@pytest.mark.e2e
def test_demo_layout_before_and_after(tmp_path):
    _write_metrics(tmp_path / "train", [0.2, 0.4, 0.6])
    (tmp_path / "train" / "config.yaml").write_text("model: tiny\ngroup_size: 4\n")
    for sub in ("probe_before", "probe_after"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "probe.json").write_text(json.dumps(_probe()))
    report = write_report(tmp_path).read_text()
    assert "## Gradient probe: before" in report and "## Gradient probe: after" in report
    assert "## Before vs after training" in report
    assert "group_size: 4" in report  # the config is shown
    # 3 steps: the first and last windows would overlap -> no trend claimed; mean of 0.2, 0.4, 0.6 = 0.4
    assert "3 step(s): too few steps for a trend" in report and "mean reward 0.400 over the run" in report
    assert "stayed flat" not in report
    names = _check_images(tmp_path, report)
    assert "erank_vs_R.png" in names


# ---------------------------------------------------------------------------------------------------------------------
# Layout: one screen (answers, three figures), then the appendix
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_report_opens_with_answers_and_three_figures_then_the_appendix(tmp_path):
    _write_metrics(tmp_path / "train", [0.1 * s for s in range(1, 11)])  # lens steps 5 and 10 log G1's erank
    (tmp_path / "train" / "config.yaml").write_text("# a comment, not a heading\nmodel: tiny\n")
    for sub in ("probe_before", "probe_after"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "probe.json").write_text(json.dumps(_probe()))
    report = write_report(tmp_path).read_text()
    lines = report.splitlines()
    # the first screen, in order; every section of the old report follows under the appendix, one level deeper
    order = [
        "# grpo-lens report",
        "## Answers",
        "## Figures",
        "## Appendix",
        "### Claims: effective rank, zero-sum structure, the identity, sparsity, credit, baselines",
        "### Findings",
        "### Training",
        "#### Sparsity of the gradient over training",
        "### Gradient probe: before",
        "### Gradient probe: after",
        "### Before vs after training",
    ]
    assert [lines.index(h) for h in order] == sorted(lines.index(h) for h in order)
    appendix = lines.index("## Appendix")
    assert [h for h in lines[appendix + 1 :] if h.startswith("## ")] == []
    # the three figures: erank vs R before and after (two probes), S1/S4 over training, G1's rank over training
    first = lines[lines.index("## Figures") : appendix]
    images = [line for line in first if line.startswith("![")]
    assert images == [
        "![erank vs R, before and after](erank_vs_R.png)",
        "![sparsity](sparsity.png)",
        "![rank over training](rank_over_training.png)",
    ]
    assert all(image in lines[appendix:] for image in images)  # each still in its section
    assert "(appendix: Training, Rank of G1 over training)" in report
    # the config's YAML comment is not a heading: left as it is
    assert "\n# a comment, not a heading\n" in report and "## a comment" not in report
    _check_images(tmp_path, report)


def test_first_figures_pick_by_priority_and_appendix_demotes_headings():
    from grpo_lens.report import appendix, first_figures

    body = [
        "## Gradient probe: probe",
        "",
        "### Baselines",
        "",
        "![baseline variance](baseline_variance_probe.png)",
        "### Credit",
        "![credit profile](credit_profile_probe.png)",
        "## Gradient probe: x",
        "![erank vs R](erank_vs_R_x.png)",
        "![spectra](spectra_x.png)",
        "## Before vs after training",
        "![erank vs R, before and after](erank_vs_R.png)",
    ]
    # priority (FIRST_FIGURES): erank_vs_R.png before erank_vs_R_x.png although later in the body; no sparsity or
    # rank over training (a probe-only body): spectra, then baseline variance; the credit profile is not picked
    assert [line for line in first_figures(body) if line.startswith("![")] == [
        "![erank vs R, before and after](erank_vs_R.png)",
        "![spectra](spectra_x.png)",
        "![baseline variance](baseline_variance_probe.png)",
    ]
    caption = (
        "In order: erank vs R, before and after (appendix: Before vs after training); spectra (appendix: "
        "Gradient probe: x); baseline variance (appendix: Gradient probe: probe, Baselines)."
    )
    assert caption in first_figures(body)
    assert first_figures(["## Training", "no image"]) == []
    assert appendix(["## A", "### B", "```yaml", "# comment", "## not a heading either", "```", "#### C", "#x"]) == [
        "## Appendix",
        "",
        "### A",
        "#### B",
        "```yaml",
        "# comment",
        "## not a heading either",
        "```",
        "##### C",
        "#x",
    ]


# ---------------------------------------------------------------------------------------------------------------------
# Nothing to report
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_empty_directory_raises(tmp_path):
    with pytest.raises(ReportError, match="nothing to report"):
        write_report(tmp_path)
    (tmp_path / "config.yaml").write_text("model: tiny\n")  # a config alone is not enough
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ReportError):
        write_report(tmp_path)
    assert not (tmp_path / "report.md").exists()


@pytest.mark.e2e
def test_missing_directory_raises(tmp_path):
    with pytest.raises(ReportError, match="not a directory"):
        write_report(tmp_path / "nope")


@pytest.mark.e2e
def test_optimal_estimator_run_explains_the_missing_identity_residual(tmp_path):
    _write_metrics(tmp_path, [0.1 * s for s in range(1, 11)])
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for rec in lines:  # --estimator optimal: the lens writes no identity residual
        rec.pop("grad/identity_residual", None)
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    (tmp_path / "config.yaml").write_text("task: arithmetic\nestimator: optimal\n")
    report = write_report(tmp_path).read_text()
    assert "Advantage estimator: `optimal` (baseline: leave-one-out variance-optimal" in report.split("<details>")[0]
    assert "this run's estimator `optimal` has no such constant, so it is not computed" in report
    # a grpo run whose lens steps all have a residual gets no such note, and names its std convention
    _write_metrics(tmp_path, [0.1 * s for s in range(1, 11)])
    (tmp_path / "config.yaml").write_text("task: arithmetic\nestimator: grpo\nstd: sample\n")
    report = write_report(tmp_path).read_text()
    assert (
        "Advantage estimator: `grpo` (baseline: group mean, divided by the group std; std convention `sample`)."
        in report
        and "Identity residual –" not in report
    )


def test_learning_curves_draw_entropy_once_with_integer_step_ticks(tmp_path, monkeypatch):
    from grpo_lens.report import plots

    recs = [{"step": s, "reward/mean": 0.1 * s, "policy/entropy": 1.0 / s, "kl/mean": 0.0} for s in (1, 2, 3)]
    figs = []
    monkeypatch.setattr(plots, "_save", lambda fig, path, _orig=plots._save: (figs.append(fig), _orig(fig, path))[1])
    plots.plot_learning_curves(recs, tmp_path / "lc.png")
    fig = figs[0]
    # beta = 0 (no KL): the entropy is the third panel only, not also a twin axis beside the reward
    entropy_lines = [ln for ax in fig.axes for ln in ax.get_lines() if list(ln.get_ydata()) == [1.0, 0.5, 1 / 3]]
    assert len(entropy_lines) == 1
    # 3 steps: every tick on a step axis is a whole number
    for ax in fig.axes:
        if ax.get_xlabel() == "step":
            assert all(float(t).is_integer() for t in ax.get_xticks())
