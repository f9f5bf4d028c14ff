"""``grpo-lens demo --preset FILE``: probe --seeds and train --seeds into OUT/probe and OUT/train, one report with
every primary claim in one table under one Holm family; the time estimate first; finished stages skipped; other
settings refused. A tiny preset (2 probe seeds, 2 training seeds of 2 steps); the shipped decide preset checked as a
file: the budgets the lead fixed, the same stage settings as the commands run by hand."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
import yaml

from grpo_lens.claims.base import evaluate_claims
from grpo_lens.claims.sparsity import TRAINING_CLAIMS
from grpo_lens.cli import main
from grpo_lens.config import ConfigError, TrainConfig
from grpo_lens.demo import estimate_lines, read_preset
from grpo_lens.probe.config import ProbeConfig
from grpo_lens.report.answers import ANSWER_COLUMNS, LINE_WIDTH, training_data
from grpo_lens.report.format import md_row
from grpo_lens.rundir import read_records

DECIDE = Path(__file__).resolve().parent.parent / "configs" / "decide-cpu.yaml"

TINY = {
    "probe_seeds": [0, 1],
    "probe": {
        "model": "tiny",
        "rewards": ["test_parity"],
        "group_sizes": [4],
        "prompts": 8,
        "max_new_tokens": 6,
        "baseline_study_prompts": 0,
        "credit_groups": 0,
        "g2_groups": 0,
        "progress": False,
    },
    "train_seeds": [0, 1],
    "train": {
        "model": "tiny",
        "rewards": ["test_parity"],
        "group_size": 2,
        "prompts_per_step": 1,
        "max_new_tokens": 2,
        "max_steps": 2,
        "lens_every": 1,
        "progress": False,
        "save_final_model": False,
    },
    # 2 probe seeds x 1.5 min; training 2 seeds x 2 steps, every one a lens step (the first and the last) x 30 s
    "estimate": {"cpu": {"probe_seed_minutes": 1.5, "train_step_seconds": 10, "lens_step_seconds": 30}},
}


def _preset(tmp_path, **changes) -> Path:
    path = tmp_path / "tiny-preset.yaml"
    path.write_text(yaml.safe_dump({**TINY, **changes}))
    return path


def _argv(preset: Path, out: Path) -> list[str]:
    return ["demo", "--preset", str(preset), "--out", str(out), "--device", "cpu"]


def _by_hand(argv: list[str], cls: type) -> dict:
    """The settings ``grpo-lens`` builds from ``argv`` (what ``probe --seeds`` / ``train --seeds`` store in
    OUT/config.yaml)."""
    from grpo_lens.cli import build_parser
    from grpo_lens.config.base import config_from_args

    args = build_parser().parse_args(argv)
    return config_from_args(args, cls, args.config).to_dict()


def test_decide_preset_holds_the_fixed_budgets_as_the_commands_by_hand():
    preset = read_preset(DECIDE)
    probe, train = preset.probe_config(Path("runs/decide"), "auto"), preset.train_config(Path("runs/decide"), "auto")
    # the budgets fixed before any result, and the same stage settings as the two commands run by hand, so that the
    # preset over their folders skips both stages
    assert preset.probe_seeds == [0, 1, 2] and preset.train_seeds == [0, 1, 2, 3, 4]
    hand = ["probe", "--seeds", "0", "1", "2", "--mc-groups", "6", "--out", "runs/decide/probe"]
    assert probe.to_dict() == _by_hand(hand, ProbeConfig)
    hand = ["train", "--seeds", *"01234", "--max-steps", "30", "--lens-every", "5", "--out", "runs/decide/train"]
    assert train.to_dict() == _by_hand(hand, TrainConfig)
    assert probe.mc_groups == 6 and train.max_steps == 30 and train.lens_every == 5


def test_decide_estimate_is_the_measured_costs_times_the_work():
    preset = read_preset(DECIDE)
    lines = estimate_lines(preset, Path("/nonexistent/decide"), "cpu")
    # probe 3 seeds x 11.4-19.5 min (measured: 58 min 23 s for 3 seeds) = 34.2-58.5 min; lens at steps 1, 5, 10, ...,
    # 30 = 7 of 30 steps: per seed 23 x 14.8 s + 7 x 24.2 s = 509.8 s (measured medians), x 5 seeds = 2,549 s = 42.5
    # min; total 76.7-101.0 min
    assert "probe 34–58 min, training 42 min; total about 77–101 min" in lines[1]
    assert "115 training steps with the lens off and 35 lens steps" in lines[1]
    assert "not measured on GPU" in estimate_lines(preset, Path("/nonexistent"), "cuda")[0]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"probe": {"out": "x"}}, "probe.out cannot be set in a preset"),
        ({"train_seeds": [3]}, "train_seeds needs at least two distinct seeds"),
        ({"probe": {"group_sizes": [1]}}, "group_sizes"),
        ({"estimate": {"cpu": {"train_step_seconds": "fast"}}}, "estimate.cpu.train_step_seconds must be a number"),
    ],
)
def test_bad_preset_is_one_line_error(tmp_path, change, message):
    with pytest.raises(ConfigError, match=message):
        read_preset(_preset(tmp_path, **change))
    with pytest.raises(ConfigError, match="unknown key 'seeds'"):
        read_preset(_preset(tmp_path, seeds=[0, 1]))


@pytest.fixture(scope="module")
def decided(tmp_path_factory):
    """A finished tiny preset run: (OUT, the preset file, what the command printed)."""
    tmp = tmp_path_factory.mktemp("preset")
    out, preset, printed = tmp / "decide", _preset(tmp), io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(_argv(preset, out)) == 0
    return out, preset, printed.getvalue()


def _no_model(monkeypatch) -> None:
    """Any model load, probe or training run fails the test."""

    def no_model(*a, **k):
        raise AssertionError("a finished stage loaded a model")

    monkeypatch.setattr("grpo_lens.models.load_model", no_model)
    monkeypatch.setattr("grpo_lens.train.loop.train", no_model)
    monkeypatch.setattr("grpo_lens.probe.run.run_probe", no_model)


@pytest.mark.e2e
def test_preset_prints_its_estimate_first_and_reports_one_table(decided):
    out, _, printed = decided
    # the estimate comes first: 2 x 1.5 min probe; 2 seeds x 2 lens steps x 30 s = 2 min training; total 5 min
    assert printed.index("time estimate for") < printed.index("demo report:")
    assert "probe 3 min, training 2 min; total about 5 min" in printed
    for stage in ("probe", "train"):
        assert all((out / stage / f"seed_{s}").is_dir() for s in (0, 1))
    assert (out / "probe" / "probe.json").is_file() and (out / "train" / "train_seeds.json").is_file()
    report = (out / "report.md").read_text()
    screen = report[: report.index("## Appendix")]
    rows = [line for line in screen.splitlines() if line.startswith("| ") and not line.startswith("| claim (where)")]
    rows = [r for r in rows if "(probe, " in r or "(training, " in r]
    # one row per primary claim of both sources: the pooled probe's and the training claims decided over the seeds
    probe = json.loads((out / "probe" / "probe.json").read_text())
    seed_runs = [read_records(out / "train" / f"seed_{s}" / "metrics.jsonl") for s in (0, 1)]
    training = evaluate_claims(training_data(seed_runs[0], 0, seed_runs), list(TRAINING_CLAIMS))
    primary = [c.claim for c in [*evaluate_claims(probe), *training] if c.kind == "claim"]
    assert len(rows) == len(primary) >= 5 and all(sum(f"| {c} (" in r for r in rows) == 1 for c in primary)
    assert "| claim (where) | verdict | primary number (95% interval) | n | power of this verdict's branch |" in screen
    assert "### Rank ≈ 2: every reading side by side" in screen and "## Seeds pooled" in report


@pytest.mark.e2e
def test_rerun_skips_finished_stages_without_a_model(decided, capsys, monkeypatch):
    out, preset, _ = decided
    stamps = {p: p.stat().st_mtime_ns for d in ("probe", "train") for p in (out / d).rglob("*") if p.is_file()}
    _no_model(monkeypatch)
    assert main(_argv(preset, out)) == 0
    assert "left: 0 of 2 probe seeds, 0 training steps with the lens off and 0 lens steps" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps


@pytest.mark.e2e
def test_stage_folders_run_by_hand_are_adopted_if_their_settings_match(decided, tmp_path, capsys, monkeypatch):
    out, preset, _ = decided
    _no_model(monkeypatch)
    hand = tmp_path / "by-hand"  # the stage folders alone, as `probe --seeds` and `train --seeds` by hand write them
    for stage in ("probe", "train"):
        shutil.copytree(out / stage, hand / stage)
    assert main(_argv(preset, hand)) == 0 and (hand / "report.md").is_file() and (hand / "demo.yaml").is_file()
    assert "left: 0 of 2 probe seeds" in capsys.readouterr().out
    shutil.rmtree(hand / "probe"), (hand / "demo.yaml").unlink()
    shutil.copytree(out / "probe", hand / "probe")
    other = _preset(tmp_path, probe={**TINY["probe"], "prompts": 6})
    assert main(_argv(other, hand)) == 2
    assert "probe/config.yaml was written with other settings than" in capsys.readouterr().err


@pytest.mark.e2e
def test_other_settings_are_refused_before_anything_is_written(decided, tmp_path, capsys):
    out, preset, _ = decided
    other = _preset(tmp_path, train={**TINY["train"], "max_steps": 3})
    before = sorted((p.name, p.stat().st_mtime_ns) for p in out.rglob("*"))
    assert main(_argv(other, out)) == 2
    err = capsys.readouterr()
    assert "holds a demo run with other settings (train.max_steps=2 (now 3))" in err.err
    assert "time estimate" not in err.out and sorted((p.name, p.stat().st_mtime_ns) for p in out.rglob("*")) == before
    (tmp_path / "mine").mkdir(), (tmp_path / "mine" / "notes.txt").write_text("keep")  # not a demo run: kept
    assert main([*_argv(preset, tmp_path / "mine"), "--overwrite"]) == 2
    assert "they are never deleted" in capsys.readouterr().err and (tmp_path / "mine" / "notes.txt").is_file()
    bad = _preset(tmp_path, train={**TINY["train"], "rewards": ["no_such_reward"]})
    assert main(_argv(bad, tmp_path / "x")) == 2 and not (tmp_path / "x").exists()
    assert "unknown reward function 'no_such_reward'" in capsys.readouterr().err
    assert main([*_argv(preset, tmp_path / "x"), "--max-steps", "5"]) == 2
    assert "--max-steps cannot be combined with --preset" in capsys.readouterr().err


@pytest.mark.e2e
def test_report_only_writes_the_finished_stages_table_and_names_the_missing(decided, tmp_path, capsys, monkeypatch):
    out, preset, _ = decided
    _no_model(monkeypatch)
    part = tmp_path / "training-still-runs"  # probe/ finished; train/ started by hand, its first seed mid-run
    shutil.copytree(out / "probe", part / "probe")
    (part / "train").mkdir(), shutil.copy(out / "train" / "config.yaml", part / "train" / "config.yaml")
    shutil.copytree(out / "train" / "seed_0", part / "train" / "seed_0")
    stamps = {p: p.stat().st_mtime_ns for p in part.rglob("*") if p.is_file()}
    assert main([*_argv(preset, part), "--report-only"]) == 0
    printed = capsys.readouterr().out
    assert "report only: probe finished; train NOT finished (left out)" in printed and "time estimate" not in printed
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps  # no stage file written
    screen = (part / "report.md").read_text().split("## Appendix")[0]
    lines = screen.splitlines()
    missing = [line for line in lines if line.startswith("**Stage not finished: ")]
    assert len(missing) == 1 and missing[0].startswith("**Stage not finished: train/**")
    assert len(missing[0]) <= LINE_WIDTH
    start = lines.index(md_row(*ANSWER_COLUMNS)) + 2  # the claims table: its header, its rule, then its rows
    rows = lines[start : lines.index("", start)]
    probe = json.loads((part / "probe" / "probe.json").read_text())
    primary = [c.claim for c in evaluate_claims(probe) if c.kind == "claim"]
    # the probe's primary claims alone (rank, labels: its studies are off), one row each; nothing of the training seed
    assert len(rows) == len(primary) >= 2 and all(sum(f"| {c} (" in r for r in rows) == 1 for c in primary)
    assert yaml.safe_load((part / "demo.yaml").read_text())["train_seeds"] == [0, 1]
    # refused, one line, nothing written: no finished stage; with --overwrite; without --preset
    (tmp_path / "none" / "train").mkdir(parents=True)
    assert main([*_argv(preset, tmp_path / "none"), "--report-only"]) == 2
    assert "no stage finished" in capsys.readouterr().err and not (tmp_path / "none" / "report.md").exists()
    assert main([*_argv(preset, part), "--report-only", "--overwrite"]) == 2
    assert "cannot be combined with --overwrite" in capsys.readouterr().err
    assert main(["demo", "--out", str(part), "--report-only"]) == 2
    assert "--report-only needs --preset" in capsys.readouterr().err
    # a stage folder of other settings is refused as a run refuses it
    other = _preset(tmp_path, probe={**TINY["probe"], "prompts": 6})
    (part / "demo.yaml").unlink()
    assert main([*_argv(other, part), "--report-only"]) == 2
    assert "probe/config.yaml was written with other settings than" in capsys.readouterr().err
