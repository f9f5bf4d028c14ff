"""TrainConfig: YAML + command-line flags with the precedence defaults <- YAML <- flags, list/dict/bool fields,
helpful errors, and one non-empty help per field (STYLE.md 4: the field's help is its CLI help and its YAML key)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import yaml

from grpo_lens.config import (
    ConfigError,
    TrainConfig,
    add_config_arguments,
    config_from_args,
)


def _parse(argv: list[str], cls=TrainConfig) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    add_config_arguments(parser, cls)
    return parser.parse_args(argv)


def _load(argv: list[str], cls=TrainConfig):
    args = _parse(argv, cls)
    return config_from_args(args, cls, args.config)


@pytest.fixture
def yaml_file(tmp_path):
    def write(values: dict) -> str:
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(values))
        return str(path)

    return write


# ---------------------------------------------------------------------------------------------------------------------
# Precedence
# ---------------------------------------------------------------------------------------------------------------------
def test_precedence_defaults_yaml_flags(yaml_file):
    path = yaml_file({"group_size": 3, "max_steps": 7, "learning_rate": 0.5, "task": "gsm8k"})
    cfg = _load(["--config", path, "--group-size", "5", "--seed", "11"])
    defaults = TrainConfig()
    assert cfg.group_size == 5  # YAML 3, flag 5: the flag wins
    assert cfg.seed == 11  # flag only
    assert cfg.max_steps == 7 and cfg.learning_rate == 0.5 and cfg.task == "gsm8k"  # YAML only
    assert cfg.temperature == defaults.temperature and cfg.beta == defaults.beta  # neither: the default
    assert isinstance(cfg.learning_rate, float)


def test_no_yaml_no_flags_gives_defaults():
    assert _load([]) == TrainConfig()


def test_flags_without_yaml():
    cfg = _load(["--max-new-tokens", "8", "--beta", "0.04", "--kl-estimator", "k2", "--dual-clip", "3"])
    assert (cfg.max_new_tokens, cfg.beta, cfg.kl_estimator, cfg.dual_clip) == (8, 0.04, "k2", 3.0)


def test_yaml_float_in_exponent_notation(yaml_file):
    # PyYAML (YAML 1.1) reads "1e-3" without a dot as the *string* '1e-3'; people write learning rates that way.
    path = yaml_file({})
    with open(path, "w") as f:
        f.write("learning_rate: 1e-3\nbeta: 4e-2\n")
    cfg = _load(["--config", path])
    assert cfg.learning_rate == pytest.approx(1e-3) and isinstance(cfg.learning_rate, float)
    assert cfg.beta == pytest.approx(0.04)


# ---------------------------------------------------------------------------------------------------------------------
# List, dict, optional and bool fields
# ---------------------------------------------------------------------------------------------------------------------
def test_list_field_from_yaml_and_flags(yaml_file):
    path = yaml_file({"rewards": ["correctness", "format:0.1"]})
    assert _load(["--config", path]).rewards == ["correctness", "format:0.1"]
    # a flag replaces the YAML list as a whole (no merging)
    assert _load(["--config", path, "--rewards", "format"]).rewards == ["format"]
    assert _load(["--rewards", "correctness", "format:0.5"]).rewards == ["correctness", "format:0.5"]


def test_list_field_item_type_is_applied():
    from grpo_lens.probe.config import ProbeConfig

    cfg = _load(["--group-sizes", "2", "4"], ProbeConfig)
    assert cfg.group_sizes == [2, 4] and all(isinstance(r, int) for r in cfg.group_sizes)


def test_dict_field_from_yaml_and_flags(yaml_file):
    path = yaml_file({"task_options": {"max_operand": 5}})
    assert _load(["--config", path]).task_options == {"max_operand": 5}
    assert _load(["--config", path, "--task-options", "{max_operand: 9}"]).task_options == {"max_operand": 9}
    with pytest.raises(SystemExit):  # argparse rejects a value that is not a YAML mapping
        _parse(["--task-options", "[1, 2]"])


def test_mutable_defaults_are_not_shared():
    a, b = TrainConfig(), TrainConfig()
    a.rewards.append("format")
    a.task_options["x"] = 1
    assert b.rewards == ["correctness"] and b.task_options == {}


def test_optional_fields():
    cfg = _load(["--rollout-batch-size", "12", "--group-size", "4"])
    assert cfg.rollout_batch_size == 12 and cfg.prompts_per_step == 3  # derived in __post_init__
    assert TrainConfig().dual_clip is None and TrainConfig().out is None


def test_bool_flags(yaml_file):
    assert TrainConfig().progress is True and TrainConfig().resume is False
    assert _load(["--no-progress"]).progress is False
    assert _load(["--resume"]).resume is True
    path = yaml_file({"progress": False, "mask_truncated": True})
    cfg = _load(["--config", path])
    assert cfg.progress is False and cfg.mask_truncated is True  # no flag: YAML's value stays
    cfg = _load(["--config", path, "--progress", "--no-mask-truncated"])
    assert cfg.progress is True and cfg.mask_truncated is False  # the flags win both ways


# ---------------------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------------------
def test_unknown_yaml_key_lists_valid_keys(yaml_file):
    path = yaml_file({"group_sise": 4})
    with pytest.raises(ConfigError) as err:
        _load(["--config", path])
    msg = str(err.value)
    assert "group_sise" in msg
    for name in ("group_size", "learning_rate", "max_steps", "rewards"):
        assert name in msg


def test_bad_yaml_values_name_the_field(yaml_file, tmp_path):
    with pytest.raises(ConfigError, match="group_size.*type int"):
        _load(["--config", yaml_file({"group_size": "four"})])
    with pytest.raises(ConfigError, match="group_size"):
        _load(["--config", yaml_file({"group_size": 1})])
    with pytest.raises(ConfigError, match="group_size.*type int"):  # a bool is not an int here
        _load(["--config", yaml_file({"group_size": True})])
    with pytest.raises(ConfigError, match="learning_rate.*float"):
        _load(["--config", yaml_file({"learning_rate": "fast"})])
    with pytest.raises(ConfigError, match="estimator.*valid names: .*grpo"):
        _load(["--config", yaml_file({"estimator": "ppo"})])
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        _load(["--config", str(tmp_path / "list.yaml")])
    with pytest.raises(ConfigError, match="does not exist"):
        _load(["--config", str(tmp_path / "missing.yaml")])


def test_flag_value_is_validated():
    with pytest.raises(ConfigError, match="num_mini_batches"):
        _load(["--prompts-per-step", "3", "--num-mini-batches", "2"])
    with pytest.raises(SystemExit):  # argparse's type check: not an int
        _parse(["--group-size", "x"])


# ---------------------------------------------------------------------------------------------------------------------
# Round trip and help
# ---------------------------------------------------------------------------------------------------------------------
def test_save_and_load_round_trip(tmp_path):
    cfg = TrainConfig(
        group_size=3, rewards=["format:0.2"], task_options={"max_operand": 4}, dual_clip=2.5, progress=False
    )
    cfg.save(tmp_path / "c.yaml")
    assert TrainConfig.load(tmp_path / "c.yaml") == cfg


@pytest.mark.parametrize(
    "cls_path", ["grpo_lens.config:TrainConfig", "grpo_lens.probe:ProbeConfig", "grpo_lens.demo:DemoConfig"]
)
def test_every_field_has_help(cls_path):
    import importlib

    module, name = cls_path.split(":")
    cls = getattr(importlib.import_module(module), name)
    missing = [f.name for f in dataclasses.fields(cls) if not str(f.metadata.get("help", "")).strip()]
    assert not missing, f"fields without help: {missing}"
    # and the help reaches the CLI, next to the default
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, cls)
    text = parser.format_help().replace("\n", " ")
    text = " ".join(text.split())
    for f in dataclasses.fields(cls):
        assert "--" + f.name.replace("_", "-") in text
        first_words = " ".join(f.metadata["help"].split()[:3])
        assert first_words in text, f"help of {f.name} not in --help"
