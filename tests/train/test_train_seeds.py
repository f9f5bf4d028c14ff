"""`grpo-lens train --seeds`: one run per seed, the pooled record, the report over the seeds."""

from __future__ import annotations

import json

import pytest
from helpers_cli import tiny_train_args

from grpo_lens import metrics as mk
from grpo_lens.cli import main
from grpo_lens.report import write_report
from grpo_lens.rundir import read_train_seeds
from grpo_lens.train.seeds import write_seeds_record

TRAIN = tiny_train_args(max_steps=3) + ["--rewards", "test_parity"]


@pytest.mark.e2e
def test_train_seeds_writes_each_run_the_pooled_record_and_the_report(tmp_path, capsys):
    out = tmp_path / "runs"
    assert main(TRAIN + ["--seeds", "0", "1", "--out", str(out)]) == 0
    record = json.loads((out / "train_seeds.json").read_text())
    assert record == {"seeds": [0, 1], "dirs": ["seed_0", "seed_1"], "steps": [3, 3]}
    for s in (0, 1):  # each seed an ordinary run directory, with its own seed
        steps = [json.loads(line)["step"] for line in (out / f"seed_{s}" / "metrics.jsonl").read_text().splitlines()]
        assert steps == [1, 2, 3]
        assert f"seed: {s}" in (out / f"seed_{s}" / "config.yaml").read_text()
    report = (out / "report.md").read_text()
    assert "## Seeds (`train --seeds`)" in report and "`seed_1`" in report
    assert "train_seeds.json" in capsys.readouterr().out
    # again without --resume: refused before anything is written; with it, the finished seeds are kept
    assert main(TRAIN + ["--seeds", "0", "1", "--out", str(out)]) == 2
    assert "pass --resume" in capsys.readouterr().err
    assert main(["train", "--seeds", "0", "1", "--out", str(out), "--resume", "--no-progress"]) == 0
    assert json.loads((out / "train_seeds.json").read_text())["steps"] == [3, 3]
    assert main(TRAIN + ["--seeds", "0", "--out", str(tmp_path / "one")]) == 2  # one seed: use --seed
    assert main(TRAIN + ["--seed", "1", "--seeds", "0", "1", "--out", str(tmp_path / "both")]) == 2


def _write_run(path, slope: float) -> None:
    path.mkdir(parents=True)
    s1 = {s: 0.3 + slope * s + (0.02 if s % 2 else -0.02) for s in range(1, 13)}
    lines = [
        {mk.STEP: s, mk.LR: 1e-6, mk.PERF_LENS_SECONDS: 0.0, mk.REWARD_FRAC_ZERO_STD_GROUPS: v} for s, v in s1.items()
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_report_of_a_pooled_directory_decides_s1_over_the_seeds(tmp_path):
    # three seeds whose S1 rises 0.010, 0.012, 0.014 per step (+ the zig-zag's slope, the same in each): t over seeds
    # > 8 with 2 df (tests/claims/test_trends.py), so the pooled row holds; one seed alone reads the same slope
    for s, b in zip((0, 1, 2), (0.010, 0.012, 0.014)):
        _write_run(tmp_path / f"seed_{s}", b)
    write_seeds_record(tmp_path, [0, 1, 2])
    assert read_train_seeds(tmp_path) == [tmp_path / "seed_0", tmp_path / "seed_1", tmp_path / "seed_2"]
    report = write_report(tmp_path).read_text()
    (row,) = [line for line in report.splitlines() if line.startswith("| the share of groups without reward contrast")]
    assert "3 seeds × 12 steps" in row and "**holds**" in row and "mean OLS slope over 3 seeds" in row
    assert "## Seeds (`train --seeds`)" in report
    (tmp_path / "train_seeds.json").write_text('{"dirs": ["../elsewhere", "seed_0"]}')  # names outside are not followed
    assert read_train_seeds(tmp_path) == [tmp_path / "seed_0"]
