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
        rec = {"step": step, "reward/mean": r, "reward/accuracy": r, "reward/std": 0.4,
               "reward/frac_zero_std_groups": 0.25, "completions/mean_length": 6.0 + step,
               "kl/mean": 0.001 * step, "clip/ratio_region": 0.0, "clip/ratio_high": 0.0, "clip/ratio_low": 0.0,
               "perf/step_seconds": 2.0}
        if step in lens_steps:  # a lens step: S1 predicted, S4, rank, identity residual, baselines
            rec.update({"reward/frac_zero_std_groups": 0.375, "sparsity/zero_var_groups_predicted": 0.412,
                        "sparsity/update_step": 0.9123, "sparsity/update_total": 0.8765, "rank/g1_erank": 1.93,
                        "rank/g1_stable_rank": 1.41, "grad/identity_residual": 3.2e-7,
                        "baseline/b_star": 0.44, "baseline/group_mean": 0.5, "baseline/m_correct": 0.02,
                        "baseline/m_wrong": 0.04})
        lines.append(json.dumps(rec))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def _probe(s1_measured: float = 0.625, g1_erank: float = 1.98) -> dict:
    def rank(erank):
        return {"erank": {"mean": erank, "std": 0.01}, "stable_rank": {"mean": 1.5, "std": 0.1},
                "participation_ratio": {"mean": 1.7, "std": 0.1}, "k90": {"mean": 2.0, "std": 0.0},
                "k99": {"mean": 2.0, "std": 0.0}, "groups": 2}

    per_r = {}
    for R in (2, 4):
        per_r[str(R)] = {
            "groups_sampled": 8, "groups_all_equal": 5, "groups_mixed": 2, "s1_measured": s1_measured,
            "s1_predicted": 0.58, "distinct_completions_mean": float(R),
            "rank": {"G1": rank(g1_erank if R == 4 else 1.0), "G1_random_zero_sum": rank(float(R) - 0.5)},
            "spectra": {"G1": [[3.0, 1.0], [2.0, 0.5]]},
            "identity_residual": {"max": 4.0e-8, "mean": 2.0e-8, "per_group": [4.0e-8, 1.0e-9]},
            "g2": {"numerical_rank": [3, 4], "rank_bound": [10, 12], "shape": [64, 128]},
            "baselines": {"b_star": 0.41, "group_mean": 0.5, "m_correct": 0.011, "m_wrong": 0.013,
                          "variance": {"none": 4.0, "mean": 1.2, "rloo": 1.5, "optimal": 1.0},
                          "relative_variance": {"none": 4.0, "mean": 1.2, "rloo": 1.5, "optimal": 1.0},
                          "prompts": 1},
            "credit": {"within_rollout_adv_var_max": 0.0, "answer_grad_share": 0.3, "answer_token_share": 0.25,
                       "position_profile": [1.0, 0.8, 0.6]},
            "timing": {"generation_seconds": 1.0, "gradient_seconds": 1.0},
        }
    return {"meta": {"model": "tiny", "task": "arithmetic", "gradients": "sketch", "sketch_dim": 16,
                     "std": "sample", "eps": 1e-4, "layer": "model.layers.1.mlp.down_proj"},
            "per_group_size": per_r}


def _findings(report: str) -> list[str]:
    section = report.split("## Findings", 1)[1].split("\n## ", 1)[0]
    return [line[2:] for line in section.splitlines() if line.startswith("- ")]


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
def test_reward_finding_rose_for_rising_rewards(tmp_path):
    _write_metrics(tmp_path, [0.1 * s for s in range(1, 11)])
    report = write_report(tmp_path).read_text()
    reward = [f for f in _findings(report) if f.startswith("Mean reward")]
    # first 5 steps: mean(0.1..0.5) = 0.3; last 5 steps: mean(0.6..1.0) = 0.8
    assert reward == ["Mean reward rose over training: 0.300 (first 5 steps) -> 0.800 (last 5 steps)."]


def test_reward_finding_fell_for_falling_rewards(tmp_path):
    _write_metrics(tmp_path, [1.0 - 0.1 * s for s in range(1, 11)])
    report = write_report(tmp_path).read_text()
    reward = [f for f in _findings(report) if f.startswith("Mean reward")]
    # first 5: mean(0.9..0.5) = 0.7; last 5: mean(0.4..0.0) = 0.2
    assert reward == ["Mean reward fell over training: 0.700 (first 5 steps) -> 0.200 (last 5 steps)."]
    assert "rose" not in reward[0]


def test_reward_finding_flat(tmp_path):
    _write_metrics(tmp_path, [0.5] * 4)
    report = write_report(tmp_path).read_text()
    assert "Mean reward stayed flat over training: 0.500 (first 4 steps) -> 0.500 (last 4 steps)." in report


def test_training_tables_show_the_numbers(tmp_path):
    _write_metrics(tmp_path, [0.1 * s for s in range(1, 11)])
    report = write_report(tmp_path).read_text()
    # the S1/S4/rank table has one row per lens step (5 and 10) with the values written above
    for step, acc in ((5, "0.500"), (10, "1.000")):
        assert (f"| {step} | {acc} | 0.375 | 0.412 | 0.912 | 0.876 | 1.930 | 1.410 | 3.2e-07 |") in report
    # baselines: m_C / m_W = 0.02 / 0.04 = 0.5 < 1, so b* sits below the group mean
    assert "| 5 | 0.440 | 0.500 | 0.0200 | 0.0400 | 0.500 |" in report
    assert "m_C / m_W over 2 lens step(s): 0.500: correct rollouts had smaller" in report
    # S1: mean of the first 5 = (4 * 0.25 + 0.375) / 5 = 0.275; last 5 the same -> flat
    assert "S1 (zero-variance group share) stayed flat: 0.275 (first steps) -> 0.275 (last steps)" in report
    # |S1 measured - predicted| = 0.412 - 0.375 = 0.037 on both lens steps
    assert "S1 measured vs predicted differ by 0.037 on average over the 2 lens steps" in report
    assert "0.876 of parameters kept their bf16 value after 10 steps" in report
    names = _check_images(tmp_path, report)
    assert {"learning_curves.png", "sparsity.png", "baselines.png"} <= set(names)


# ---------------------------------------------------------------------------------------------------------------------
# Probe
# ---------------------------------------------------------------------------------------------------------------------
def test_probe_report_shows_s1_and_rank(tmp_path):
    (tmp_path / "probe.json").write_text(json.dumps(_probe(s1_measured=0.625, g1_erank=1.98)))
    report = write_report(tmp_path).read_text()
    # S1 table: R, groups sampled, all-equal, mixed, S1 measured, S1 predicted, residual max, distinct mean
    assert "| 2 | 8 | 5 | 2 | 0.625 | 0.580 | 4.0e-08 | 2.00 |" in report
    assert "| 4 | 8 | 5 | 2 | 0.625 | 0.580 | 4.0e-08 | 4.00 |" in report
    # rank table row and findings: |1.98 - 2| <= 0.5 -> "within"; R=2 G1 erank 1.0 -> "outside"
    assert "| 4 | G1 | 2 | 1.98 ± 0.01 | 1.50 ± 0.10 |" in report
    findings = _findings(report)
    assert any(f.startswith("[probe] R=4: G1 erank 1.98 ± 0.01") and "within ±0.5 of 2" in f for f in findings)
    assert any(f.startswith("[probe] R=2: G1 erank 1.00") and "outside ±0.5 of 2" in f
               and "R = 2 caps" in f for f in findings)
    assert any("residual of at most 4.0e-08" in f for f in findings)
    assert any("rloo baseline's gradient variance is 1.50x" in f for f in findings)
    names = _check_images(tmp_path, report)
    assert {"erank_vs_R_probe.png", "spectra_probe.png", "baseline_variance_probe.png",
            "credit_profile_probe.png"} <= set(names)


def test_probe_erank_finding_tracks_the_number(tmp_path):
    (tmp_path / "probe.json").write_text(json.dumps(_probe(g1_erank=3.4)))
    report = write_report(tmp_path).read_text()
    assert any(f.startswith("[probe] R=4: G1 erank 3.40") and "outside ±0.5 of 2" in f for f in _findings(report))


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
    # 3 steps: head and tail are all 3 -> the same mean 0.4
    assert "Mean reward stayed flat over training: 0.400 (first 3 steps) -> 0.400 (last 3 steps)." in report
    names = _check_images(tmp_path, report)
    assert "erank_vs_R.png" in names


# ---------------------------------------------------------------------------------------------------------------------
# Nothing to report
# ---------------------------------------------------------------------------------------------------------------------
def test_empty_directory_raises(tmp_path):
    with pytest.raises(ReportError, match="nothing to report"):
        write_report(tmp_path)
    (tmp_path / "config.yaml").write_text("model: tiny\n")  # a config alone is not enough
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ReportError):
        write_report(tmp_path)
    assert not (tmp_path / "report.md").exists()


def test_missing_directory_raises(tmp_path):
    with pytest.raises(ReportError, match="not a directory"):
        write_report(tmp_path / "nope")
