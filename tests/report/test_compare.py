"""grpo-lens compare on hand-written run directories: final means over the last steps, bootstrap intervals, the
config fields that differ, the refusal of different tasks, and the CLI's one-line errors."""

from __future__ import annotations

import json

import pytest
import yaml

from grpo_lens.cli import main
from grpo_lens.report.compare import CompareError, compare_runs

pytestmark = pytest.mark.e2e  # every test here builds a model or runs a command


def make_run(path, rewards, estimator="grpo", task="arithmetic", lens=None, **config):
    path.mkdir(parents=True)
    cfg = {
        "task": task,
        "task_options": {},
        "dataset": None,
        "estimator": estimator,
        "out": str(path),
        "seed": 0,
        **config,
    }
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
    a = make_run(tmp_path / "a", [0.1 * i for i in range(1, 11)], lens={3: 2.0, 6: 3.0})
    b = make_run(tmp_path / "b", [0.5] * 10, estimator="rloo", lens={3: 1.5, 6: 1.5})
    md = compare_runs([a, b], tmp_path / "cmp", last=8)
    data = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    # run a's last 8 rewards are 0.3, 0.4, ..., 1.0: mean 0.65; steps 3-10
    fa = data["final"]["a"]["reward/mean"]
    assert fa["mean"] == pytest.approx(0.65, abs=1e-12) and fa["steps"] == [3, 10] and fa["n"] == 8
    # the bootstrap interval of a mean lies within [min, max] of the values and contains the mean
    assert 0.3 <= fa["low"] < 0.65 < fa["high"] <= 1.0
    # a constant series has a zero-width interval
    fb = data["final"]["b"]["reward/mean"]
    assert fb["low"] == fb["high"] == pytest.approx(0.5)
    # lens keys: their last records are the lens steps 3 and 6 (mean of 2.0 and 3.0): 2 records, no interval (the
    # project's one rule: intervals from >= 8 units, docs/theory.md §7)
    lens = data["final"]["a"]["rank/g1_erank"]
    assert lens["mean"] == pytest.approx(2.5) and lens["steps"] == [3, 6] and lens["low"] is None is lens["high"]
    assert data["differing_config"] == {"estimator": {"a": "grpo", "b": "rloo"}}  # `out` differs too, ignored
    text = md.read_text()
    assert "| `estimator` | `grpo` | `rloo` |" in text
    assert "0.650 [" in text and "2.50 (steps 3–6, n=2: too few for an interval)" in text
    assert "from at least 8)" in text and "{" not in text  # every placeholder filled
    assert (tmp_path / "cmp" / "compare.png").stat().st_size > 10_000
    assert "policy/entropy" not in text  # absent from every run: no row, no panel
    # 7 records: no interval either
    assert (
        compare_runs([a, b], tmp_path / "cmp7", last=7)
        and json.loads((tmp_path / "cmp7" / "compare.json").read_text())["final"]["a"]["reward/mean"]["low"] is None
    )


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
