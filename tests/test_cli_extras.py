"""Bad input found by trying the CLI as a new user: each gives one clear line, exit status 2, and changes nothing."""

import re

import pytest
import torch
import yaml

from grpo_lens.cli import main
from grpo_lens.config import ConfigError, TrainConfig, resolve_device


@pytest.mark.e2e
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("command", ["train", "probe"])
def test_cuda_without_cuda_is_one_clear_error(tmp_path, capsys, command):
    # A CPU build of torch must not silently train on the CPU when --device cuda is asked for.
    assert main([command, "--model", "tiny", "--device", "cuda", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "torch sees no CUDA device" in err and "--device cpu" in err
    assert not (tmp_path / "x").exists()
    with pytest.raises(ConfigError, match="cuda:1"):
        resolve_device("cuda:1")
    assert resolve_device("auto") == "cpu"


def test_resume_and_overwrite_together_are_refused():
    with pytest.raises(ConfigError, match="pass one of them"):
        TrainConfig(out="x", resume=True, overwrite=True)


def test_yaml_scalar_reward_is_a_list_of_one(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rewards: correctness\n")
    assert TrainConfig.load(path).rewards == ["correctness"]


@pytest.mark.e2e
def test_demo_rerun_with_other_settings_is_refused(tmp_path, capsys):
    # OUT/demo.yaml records the settings of a demo; rerunning with others would silently reuse stale stages.
    out = tmp_path / "demo"
    out.mkdir()
    (out / "demo.yaml").write_text(yaml.safe_dump({"out": str(out), "model": "tiny", "group_size": 4}))
    before = sorted(p.name for p in out.iterdir())
    assert main(["demo", "--model", "tiny", "--group-size", "8", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "group_size=4" in err and "--overwrite" in err
    assert sorted(p.name for p in out.iterdir()) == before


@pytest.mark.e2e
def test_demo_refuses_a_folder_that_is_not_a_demo(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert main(["demo", "--model", "tiny", "--out", str(out), "--overwrite"]) == 2
    assert "never deleted" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "keep me"


def test_probe_accepts_no_progress():
    from grpo_lens.cli import build_parser
    from grpo_lens.probe.config import ProbeConfig

    # train has --no-progress; probe takes it too and it reaches ProbeConfig.progress
    args = build_parser().parse_args(["probe", "--model", "tiny", "--no-progress"])
    assert args.progress is False and ProbeConfig().progress is True


@pytest.mark.e2e
def test_probe_prints_its_time_and_mixed_groups(tmp_path, capsys):
    # The probe's one-line summary: wall time, and per R the mixed groups of the prompts sampled and that R's seconds
    out = tmp_path / "p"
    assert (
        main(
            [
                "probe",
                "--model",
                "tiny",
                "--group-sizes",
                "2",
                "--prompts",
                "2",
                "--max-new-tokens",
                "4",
                "--baseline-study-prompts",
                "0",
                "--credit-groups",
                "0",
                "--g2-groups",
                "0",
                "--coverage-groups",
                "0",
                "--baseline-prompts",
                "0",
                "--no-progress",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"probe written to {re.escape(str(out))} in \d+ s \(R = 2: \d+ mixed of 2 prompts in \d+ s; "
        r"studies \d+ s\)",
        line,
    ), line


def test_unknown_hub_id_error_has_no_default_model_hint(monkeypatch):
    from grpo_lens import models

    def fail(path, **kwargs):
        raise OSError("no such repo")

    monkeypatch.setattr(models, "_from_pretrained", fail)
    monkeypatch.setattr(models, "hub_reachable", lambda timeout=0: True)  # the hub answers, the id is unknown
    with pytest.raises(models.ModelNotFoundError) as info:
        models._from_hub(models.ModelSource(kind="hub", path="nobody/no-model", name="nobody/no-model"))
    msg = str(info.value)
    assert "Check the hub id" in msg and models.INSTALL_HINT not in msg and "\n" not in msg
