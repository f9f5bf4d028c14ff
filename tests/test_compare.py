"""grpo-lens compare on hand-written run directories: final means over the last steps, bootstrap intervals, the
config fields that differ, the refusal of different tasks, and the CLI's one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from grpo_lens.cli import main
from grpo_lens.compare import CompareError, bootstrap_mean_interval, compare_runs


def make_run(path, rewards, estimator="grpo", task="arithmetic", lens=None, **config):
    path.mkdir(parents=True)
    cfg = {"task": task, "task_options": {}, "dataset": None, "estimator": estimator, "out": str(path),
           "seed": 0, **config}
    (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    lines = []
    for step, r in enumerate(rewards, start=1):
        rec = {"step": step, "reward/mean": r, "reward/accuracy": r, "reward/frac_zero_std_groups": 1 - r}
        if lens and step in lens:
            rec["rank/g1_erank"] = lens[step]
        lines.append(json.dumps(rec))
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return path


def test_final_numbers_config_diff_and_report(tmp_path):
    a = make_run(tmp_path / "a", [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], lens={3: 2.0, 6: 3.0})
    b = make_run(tmp_path / "b", [0.5, 0.5, 0.5, 0.5, 0.5, 0.5], estimator="rloo", lens={3: 1.5, 6: 1.5})
    md = compare_runs([a, b], tmp_path / "cmp", last=4)
    data = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    # run a's last 4 rewards are 0.3, 0.4, 0.5, 0.6: mean 0.45; steps 3-6
    fa = data["final"]["a"]["reward/mean"]
    assert fa["mean"] == pytest.approx(0.45, abs=1e-12) and fa["steps"] == [3, 6] and fa["n"] == 4
    # the bootstrap interval of a mean lies within [min, max] of the values and contains the mean
    assert 0.3 <= fa["low"] < 0.45 < fa["high"] <= 0.6
    # a constant series has a zero-width interval
    fb = data["final"]["b"]["reward/mean"]
    assert fb["low"] == fb["high"] == pytest.approx(0.5)
    # lens keys: their last records are the lens steps 3 and 6 (mean of 2.0 and 3.0)
    assert data["final"]["a"]["rank/g1_erank"]["mean"] == pytest.approx(2.5) and \
        data["final"]["a"]["rank/g1_erank"]["steps"] == [3, 6]
    assert data["differing_config"] == {"estimator": {"a": "grpo", "b": "rloo"}}  # `out` differs too, ignored
    text = md.read_text()
    assert "| `estimator` | `grpo` | `rloo` |" in text
    assert "0.450 [" in text and (tmp_path / "cmp" / "compare.png").stat().st_size > 10_000
    assert "policy/entropy" not in text  # absent from every run: no row, no panel


def test_bootstrap_interval_matches_the_normal_approximation():
    # For n = 400 draws of N(0, 1), the bootstrap 95% interval of the mean is close to mean +- 1.96 s / sqrt(n)
    # (s / sqrt(n) ~ 0.05: half-width ~ 0.098); the percentile bootstrap is within a few percent of it.
    x = np.random.default_rng(1).standard_normal(400)
    mean, lo, hi = bootstrap_mean_interval(list(x), resamples=4000)
    half = 1.96 * x.std(ddof=1) / np.sqrt(400)
    assert mean == pytest.approx(x.mean())
    assert (hi - lo) / 2 == pytest.approx(half, rel=0.08)
    assert bootstrap_mean_interval([2.0])[0] == 2.0


def test_different_tasks_are_refused_unless_asked(tmp_path):
    a = make_run(tmp_path / "a", [0.1, 0.2])
    g = make_run(tmp_path / "g", [0.0, 0.0], task="gsm8k")
    with pytest.raises(CompareError, match="different tasks .*--allow-different-tasks"):
        compare_runs([a, g], tmp_path / "cmp")
    assert not (tmp_path / "cmp").exists()
    md = compare_runs([a, g], tmp_path / "cmp", allow_different_tasks=True)
    assert "| `task` | `arithmetic` | `gsm8k` |" in md.read_text()


def test_cli_errors_are_one_line(tmp_path, capsys):
    a = make_run(tmp_path / "a", [0.1, 0.2])
    assert main(["compare", str(a), str(tmp_path / "missing"), "--out", str(tmp_path / "cmp")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "is not a training run" in err
    assert main(["compare", str(a), "--out", str(tmp_path / "cmp")]) == 2
    assert "at least two" in capsys.readouterr().err
    assert not (tmp_path / "cmp").exists()
    b = make_run(tmp_path / "b", [0.3, 0.4])
    assert main(["compare", str(a), str(b), "--out", str(tmp_path / "cmp"), "--last", "1"]) == 0
    assert "comparison written to" in capsys.readouterr().out
