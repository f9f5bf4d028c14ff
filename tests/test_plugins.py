"""A resumed run whose plugin module is not importable names the module and GRPO_LENS_PLUGINS: config.yaml records
the modules in a comment line (YAML ignores it), and --resume checks the run's rewards and task before it starts."""

from __future__ import annotations

import pytest
import yaml

from grpo_lens.cli import main
from grpo_lens.config import ConfigError, TrainConfig
from grpo_lens.plugins import (
    PLUGINS_ENV,
    check_resumed_plugins,
    config_header,
    recorded_plugins,
)
from grpo_lens.probe.partial import PartialProbe
from grpo_lens.rewards import REWARDS
from grpo_lens.rundir import RunDir
from grpo_lens.tasks import TASKS

#: the live registries, as the CLI passes them
REGISTRIES = {"registered_rewards": REWARDS, "registered_tasks": TASKS}


def test_config_yaml_records_the_plugins_in_a_comment(tmp_path, monkeypatch):
    monkeypatch.setenv(PLUGINS_ENV, " my_rewards , my_tasks ")
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    values = {"model": "tiny", "rewards": ["parity"], "resume": False}
    run.write_config(values)
    text = run.config_path.read_text()
    assert text.startswith("# GRPO_LENS_PLUGINS=my_rewards,my_tasks  (")
    assert yaml.safe_load(text) == values  # the fields are unchanged
    assert recorded_plugins(run.config_path) == ["my_rewards", "my_tasks"]
    partial = PartialProbe(tmp_path / "probe")
    partial.start({"model": "tiny"})
    assert recorded_plugins(partial.config_path) == ["my_rewards", "my_tasks"]
    monkeypatch.delenv(PLUGINS_ENV)
    assert config_header() == "" and recorded_plugins(tmp_path / "missing.yaml") == []


def test_check_names_the_recorded_module_and_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(PLUGINS_ENV, raising=False)
    path = tmp_path / "config.yaml"
    path.write_text(config_header("my_rewards") + "rewards: [parity]\n")
    check_resumed_plugins(["correctness", "format:0.1"], "arithmetic", path, **REGISTRIES)  # built-ins: nothing to say
    with pytest.raises(
        ConfigError,
        match=r"reward function 'parity' is not registered; this run was started with "
        r"GRPO_LENS_PLUGINS=my_rewards .*set GRPO_LENS_PLUGINS=my_rewards again, "
        r"with 'my_rewards' importable",
    ):
        check_resumed_plugins(["parity:2"], "arithmetic", path, **REGISTRIES)
    with pytest.raises(ConfigError, match="task 'my_task'"):
        check_resumed_plugins(["correctness"], "my_task", path, **REGISTRIES)
    bare = tmp_path / "old.yaml"
    bare.write_text("rewards: [parity]\n")  # a run written before the record
    with pytest.raises(ConfigError, match="records no plugin module; set GRPO_LENS_PLUGINS to the module"):
        check_resumed_plugins(["parity"], "arithmetic", bare, **REGISTRIES)


def test_train_resume_without_the_plugin_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(PLUGINS_ENV, "helpers_rewards")
    out = tmp_path / "run"
    run = RunDir(out)
    out.mkdir()
    run.write_config(TrainConfig(model="tiny", rewards=["alternating"], out=str(out)).to_dict())
    monkeypatch.delenv(PLUGINS_ENV)
    import grpo_lens.rewards as rewards

    monkeypatch.delitem(rewards.REWARDS._entries, "alternating", raising=False)  # as in a fresh process
    assert main(["train", "--resume", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "reward function 'alternating' is not registered" in err and "GRPO_LENS_PLUGINS=helpers_rewards" in err


def test_a_plugin_in_the_working_folder_loads_without_pythonpath(tmp_path, monkeypatch):
    """``GRPO_LENS_PLUGINS=my_rewards grpo-lens probe ...`` with my_rewards.py beside the user failed with
    "cannot import plugin module" until PYTHONPATH=. (the ``grpo-lens`` script's sys.path has no working folder).
    The folder is added at the end of sys.path: a file there named like an installed module does not shadow it."""
    import os
    import sys

    from grpo_lens.cli import load_plugins
    from grpo_lens.rewards import REWARDS

    (tmp_path / "lens_cwd_rewards.py").write_text(
        "from grpo_lens.rewards import REWARDS\n\n"
        "@REWARDS.register('cwd_reward')\n"
        "def cwd_reward(prompts, completions, **kwargs):\n"
        "    return [0.0 for _ in completions]\n"
    )
    (tmp_path / "tabnanny.py").write_text("SHADOWED = True\n")  # a stdlib module's name
    monkeypatch.chdir(tmp_path)
    # as the grpo-lens script starts: no '' (the working folder) on sys.path
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p and os.path.abspath(p) != str(tmp_path)])
    for name in ("lens_cwd_rewards", "tabnanny"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.delitem(REWARDS._entries, "cwd_reward", raising=False)
    assert load_plugins("lens_cwd_rewards,tabnanny") == ["lens_cwd_rewards", "tabnanny"]
    assert "cwd_reward" in REWARDS
    assert not hasattr(sys.modules["tabnanny"], "SHADOWED"), "the installed module wins over the working folder's"
    assert sys.path[-1] == str(tmp_path)
    with pytest.raises(ImportError, match=r"cannot import plugin module 'no_such_plugin_x' .*put it in the current"):
        load_plugins("no_such_plugin_x")
