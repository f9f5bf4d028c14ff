"""One source of configuration fields: the option groups shared by TrainConfig, ProbeConfig and DemoConfig, the names
a config also answers to (deprecated: accepted with one warning; refused: an error naming what to use), and the
probe's bf16-mixed precision (the trainer's forward context, float32 weights)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import warnings
from typing import ClassVar

import helpers_rewards  # noqa: F401 - registers the test_* reward functions
import pytest
import torch
import yaml
from references import dtype_recording_loader

from grpo_lens import models
from grpo_lens.cli import main
from grpo_lens.config import (
    GROUPS,
    ConfigError,
    ConfigNameWarning,
    Names,
    Option,
    TrainConfig,
    add_config_arguments,
    config_from_args,
)
from grpo_lens.demo import DemoConfig
from grpo_lens.probe.config import ProbeConfig
from grpo_lens.probe.run import run_probe

CONFIGS = (TrainConfig, ProbeConfig, DemoConfig)
#: The overrides of a shared option, each written once at the config that takes the field.
OVERRIDDEN_DEFAULTS = {(DemoConfig, "out"): "runs/demo"}
OVERRIDDEN_CHECKS = {(DemoConfig, "max_steps")}


def _field_sources() -> dict[str, dict[type, dataclasses.Field]]:
    """field name -> {config: field} over the three configs."""
    out: dict[str, dict[type, dataclasses.Field]] = {}
    for cls in CONFIGS:
        for f in dataclasses.fields(cls):
            out.setdefault(f.name, {})[cls] = f
    return out


def _default(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


# ---------------------------------------------------------------------------------------------------------------------
# One source per field
# ---------------------------------------------------------------------------------------------------------------------
def test_a_field_two_configs_have_comes_from_one_option():
    shared = {name: per for name, per in _field_sources().items() if len(per) > 1}
    assert len(shared) >= 20  # model, task, ..., out: most of the probe's and the demo's fields
    group_options = {id(opt) for group in GROUPS for opt in vars(group).values() if isinstance(opt, Option)}
    for name, per in shared.items():
        options = {id(f.metadata["option"]) for f in per.values()}
        assert len(options) == 1, f"{name}: {len(options)} sources in {[c.__name__ for c in per]}"
        assert options <= group_options, f"{name} is shared but not in an option group"
        opt = next(iter(per.values())).metadata["option"]
        for cls, f in per.items():
            assert _default(f) == OVERRIDDEN_DEFAULTS.get((cls, name), opt.default), (cls.__name__, name)
            if (cls, name) not in OVERRIDDEN_CHECKS:
                assert f.metadata["check"] is opt.check, (cls.__name__, name)
            if "{" not in opt.help:  # out and overwrite name what each command writes
                assert f.metadata["help"] == opt.help


def test_one_name_per_concept():
    names = set(_field_sources())
    assert "sketch_dim" in names and "lens_sketch_dim" not in names
    assert {f.name for f in dataclasses.fields(TrainConfig)} >= {"sketch_dim", "lens_every"}


@pytest.mark.e2e
def test_the_probe_and_the_demo_check_their_shared_fields_as_the_trainer_does():
    # the trainer's rule and wording, once: probe and demo had no check of top_k / device / rewards before
    for kwargs, fragment in [
        (dict(top_k=-1), "top_k.*>= 0 \\(0 disables\\)"),
        (dict(device="tpu"), "device.*use cpu, cuda, cuda:N or auto"),
        (dict(temperature=0), "temperature.*near-greedy"),
        (dict(task="jsonl"), "task 'jsonl' needs --dataset PATH"),
    ]:
        for cls in (TrainConfig, ProbeConfig):
            with pytest.raises(ConfigError, match=fragment):
                cls(**kwargs)
    with pytest.raises(ConfigError, match="probe field 'rewards'.*weight after ':' must be a number"):
        ProbeConfig(rewards=["correctness:heavy"])
    assert ProbeConfig(rewards="correctness").rewards == ["correctness"]  # YAML `rewards: correctness`
    with pytest.raises(ConfigError, match="demo field 'group_size'.*at least 2"):
        DemoConfig(group_size=1)
    with pytest.raises(ConfigError, match="demo field 'max_steps' \\(flag --max-steps\\) = 0: must be >= 1"):
        DemoConfig(max_steps=0)  # the demo's override: it trains at least one step (train allows 0)
    assert TrainConfig(max_steps=0).max_steps == 0
    with pytest.raises(ConfigError, match="demo field 'probe_group_sizes'.*integer >= 2"):
        DemoConfig(probe_group_sizes=[1])


def test_probe_accepts_every_training_dtype():
    for dtype in ("float32", "bfloat16", "bf16-mixed"):
        assert ProbeConfig(dtype=dtype).dtype == dtype
    with pytest.raises(ConfigError, match="valid names: bf16-mixed, bfloat16, float32"):
        ProbeConfig(dtype="float16")


# ---------------------------------------------------------------------------------------------------------------------
# Names: deprecated (lens_sketch_dim -> sketch_dim) and refused
# ---------------------------------------------------------------------------------------------------------------------
def _parse(argv: list[str], cls=TrainConfig) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    add_config_arguments(parser, cls)
    return parser.parse_args(argv)


def test_deprecated_name_in_from_dict_yaml_and_flags(tmp_path):
    with pytest.warns(
        ConfigNameWarning,
        match="'lens_sketch_dim' \\(--lens-sketch-dim\\) is deprecated: use 'sketch_dim' \\(--sketch-dim\\)",
    ):
        cfg = TrainConfig.from_dict({"lens_sketch_dim": 8})
    assert cfg.sketch_dim == 8
    path = tmp_path / "c.yaml"
    path.write_text("lens_sketch_dim: 4\ngroup_size: 4\n")
    with pytest.warns(ConfigNameWarning, match=f"in {path}"):
        assert TrainConfig.load(path).sketch_dim == 4
    with pytest.warns(ConfigNameWarning, match="on the command line"):
        args = _parse(["--lens-sketch-dim", "2"])
        assert config_from_args(args, TrainConfig).sketch_dim == 2
    with pytest.warns(ConfigNameWarning):  # a flag of the new name wins over the file's old one, as flags do
        assert (
            config_from_args(_parse(["--config", str(path), "--sketch-dim", "3"]), TrainConfig, str(path)).sketch_dim
            == 3
        )
    # the written config holds only current names
    cfg.save(tmp_path / "saved.yaml")
    saved = yaml.safe_load((tmp_path / "saved.yaml").read_text())
    assert saved["sketch_dim"] == 8 and "lens_sketch_dim" not in saved
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # current names: no warning
        assert TrainConfig.load(tmp_path / "saved.yaml") == cfg
    # the deprecated flag is hidden from --help; the current one is documented
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, TrainConfig)
    assert "--sketch-dim" in parser.format_help() and "--lens-sketch-dim" not in parser.format_help()


def test_deprecated_and_current_name_together_is_an_error():
    with pytest.raises(ConfigError, match="deprecated name of 'sketch_dim'.*give only 'sketch_dim'"):
        TrainConfig.from_dict({"lens_sketch_dim": 8, "sketch_dim": 8})
    with pytest.raises(ConfigError, match="on the command line"):
        config_from_args(_parse(["--lens-sketch-dim", "2", "--sketch-dim", "2"]), TrainConfig)


class Refusing(TrainConfig):
    """TrainConfig as it would be once the old name is refused (the shape of a later release or a trap name)."""

    names: ClassVar[Names] = Names(refused={"lens_sketch_dim": "it was renamed; use 'sketch_dim' (--sketch-dim)"})


def test_refused_name_is_an_error_naming_what_to_use(tmp_path):
    msg = "'lens_sketch_dim' \\(--lens-sketch-dim\\).* is not accepted: it was renamed; use 'sketch_dim'"
    with pytest.raises(ConfigError, match=msg):
        Refusing.from_dict({"lens_sketch_dim": 8})
    path = tmp_path / "c.yaml"
    path.write_text("lens_sketch_dim: 8\n")
    with pytest.raises(ConfigError, match=f"in {path} is not accepted"):
        Refusing.load(path)
    with pytest.raises(ConfigError, match="on the command line is not accepted"):
        config_from_args(_parse(["--lens-sketch-dim", "8"], Refusing), Refusing)
    # one config's names never reach another
    assert "lens_sketch_dim" in TrainConfig.names.renamed and "lens_sketch_dim" not in TrainConfig.names.refused
    assert "lens_sketch_dim" not in ProbeConfig.names.renamed and "lens_sketch_dim" not in ProbeConfig.names.refused


@pytest.mark.parametrize("cls", [ProbeConfig, DemoConfig])
def test_exact_is_refused_naming_the_dense_oracle(tmp_path, cls):
    """``exact`` (the dense oracle until 0.3) is a ConfigError naming ``dense_oracle``, in one line, from a dict, a
    YAML file and a flag; no alias sets the field, and ``gram_source: exact`` (the default Gram) still reads."""
    msg = "'exact' \\(--exact\\).* is not accepted: renamed dense_oracle \\(--dense-oracle\\)"
    with pytest.raises(ConfigError, match=msg) as e:
        cls.from_dict({"exact": True})
    assert "\n" not in str(e.value)
    path = tmp_path / "c.yaml"
    path.write_text("exact: true\n")
    with pytest.raises(ConfigError, match=f"in {path} is not accepted: renamed dense_oracle"):
        cls.load(path)
    with pytest.raises(ConfigError, match="on the command line is not accepted: renamed dense_oracle"):
        config_from_args(_parse(["--exact"], cls), cls)
    assert cls.from_dict({"dense_oracle": True}).dense_oracle is True
    if cls is ProbeConfig:  # the demo has no gram_source
        assert cls.from_dict({"gram_source": "exact"}).gram_source == "exact"


def test_names_register_once():
    names = Names(renamed={"old": "new"})
    with pytest.raises(ValueError, match="already registered"):
        names.refuse("old", "use new")
    names.refuse("trap", "means something else here; use 'new'")
    assert names.canonical({"old": 1, "x": 2}, warn=False) == {"new": 1, "x": 2}


TRAIN = [
    "train",
    "--model",
    "tiny",
    "--group-size",
    "2",
    "--prompts-per-step",
    "1",
    "--max-new-tokens",
    "2",
    "--lens-every",
    "0",
    "--no-progress",
    "--device",
    "cpu",
    "--no-save-final-model",
    "--rewards",
    "test_alternating",
    "--checkpoint-every",
    "1",
]


@pytest.mark.e2e
def test_resume_a_run_saved_under_the_deprecated_name(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(TRAIN + ["--max-steps", "1", "--out", str(out)]) == 0
    path = out / "config.yaml"
    saved = yaml.safe_load(path.read_text())
    assert saved["sketch_dim"] == 16 and "lens_sketch_dim" not in saved
    path.write_text(path.read_text().replace("sketch_dim:", "lens_sketch_dim:"))  # a 0.2 run's config.yaml
    capsys.readouterr()
    # a differing value under the new name is still caught against the old saved name
    assert main(["train", "--resume", "--out", str(out), "--sketch-dim", "8"]) == 2
    assert "sketch_dim=8 differs from the run's saved sketch_dim=16" in capsys.readouterr().err
    assert main(["train", "--resume", "--out", str(out), "--max-steps", "2"]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if "warning:" in line]
    assert err == [
        f"grpo-lens train: warning: 'lens_sketch_dim' (--lens-sketch-dim) in {path} is deprecated: use "
        f"'sketch_dim' (--sketch-dim); the old name will stop working in a later release"
    ]
    rewritten = yaml.safe_load(path.read_text())
    assert rewritten["sketch_dim"] == 16 and "lens_sketch_dim" not in rewritten  # written under current names
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


# ---------------------------------------------------------------------------------------------------------------------
# The probe under bf16-mixed: the trainer's forward context
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_bf16_mixed_probe_runs_forwards_in_bf16_and_keeps_float32_weights(tmp_path):
    seen: dict[str, set] = {"generate": set(), "gradients": set()}
    original = models.load_model
    loaded = {}

    load_and_hook = dtype_recording_loader(original, seen, "gradients", loaded)

    config = ProbeConfig(
        model="tiny",
        rewards=["test_parity"],
        group_sizes=[2],
        prompts=4,
        prompts_per_batch=4,
        max_new_tokens=4,
        baseline_prompts=1,
        resamples=4,
        random_draws=2,
        g2_groups=1,
        coverage_groups=1,
        baseline_study_prompts=0,
        credit_groups=0,
        seed=0,
        device="cpu",
        dtype="bf16-mixed",
        out=str(tmp_path / "probe"),
        progress=False,
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("grpo_lens.probe.run.load_model", load_and_hook)  # where the probe looks it up
        out = run_probe(config)
    assert seen == {"generate": {torch.bfloat16}, "gradients": {torch.bfloat16}}
    assert all(p.dtype == torch.float32 for p in loaded["model"].parameters())
    data = json.loads((out / "probe.json").read_text())
    assert data["meta"]["config"]["dtype"] == "bf16-mixed"
    assert data["per_group_size"]["2"]["groups_mixed"] >= 1  # the gradient path ran on at least one group
