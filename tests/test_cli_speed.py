"""The CLI answers at once: ``--help``, ``--version`` and every subcommand's ``--help`` build the parser
from the config dataclasses without importing torch, transformers, trl or matplotlib; the registries' names that the
help lists are read from their modules' source (:func:`grpo_lens.registry.declared_names`) and agree with the live
registries."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_lens.registry import Registry, _source_tree, declared_constant, declared_names

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "trl", "matplotlib", "safetensors", "numpy")
COMMANDS = ("train", "probe", "demo", "model", "report", "compare", "calibrate")

# In a fresh interpreter: run main(argv) (argparse exits after help / version), then list the heavy modules loaded.
_PROBE = f"""
import json, sys, time
t0 = time.perf_counter()
import grpo_lens.cli
try:
    grpo_lens.cli.main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(json.dumps({{"code": code, "seconds": time.perf_counter() - t0,
                  "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}), file=sys.stderr)
"""


def _run(argv: list[str]) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    return json.loads(done.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [["--help"], ["--version"]] + [[c, "--help"] for c in COMMANDS])
def test_help_and_version_import_nothing_heavy(argv):
    result = _run(argv)
    assert result["code"] == 0
    assert result["heavy"] == [], f"grpo-lens {' '.join(argv)} imported {result['heavy']}"
    # 10 s when the parser imported the commands (torch and transformers loaded first); about 0.3 s without, on a
    # 2-core CPU. The bound is generous for a loaded machine, and still fails if torch comes back (it alone takes
    # > 2 s to import here).
    assert result["seconds"] < 5.0


def test_import_of_the_cli_module_is_light():
    t0 = time.perf_counter()
    result = _run(["--version"])
    assert result["heavy"] == [] and time.perf_counter() - t0 < 10.0


# Every registry and constant that config/groups.py, config/train.py and cli.py read from source.
DECLARED_REGISTRIES = [
    ("grpo_lens.formulas.advantages", "ADVANTAGE_ESTIMATORS"),
    ("grpo_lens.formulas.losses", "LOSS_AGGREGATIONS"),
    ("grpo_lens.formulas.losses", "KL_ESTIMATORS"),
    ("grpo_lens.runtime.sharding", "PARALLELISMS"),
]
DECLARED_CONSTANTS = [
    ("grpo_lens.formulas.advantages", "STD_CONVENTIONS"),
    ("grpo_lens.formulas.overlong", "OVERLONG_MODES"),
    ("grpo_lens.models", "DEFAULT_MODEL"),
]


@pytest.mark.parametrize("module,name", DECLARED_REGISTRIES)
def test_names_read_from_source_are_the_live_registry(module, name, monkeypatch):
    live = getattr(importlib.import_module(module), name)
    assert isinstance(live, Registry) and len(live.names()) >= 2
    monkeypatch.delitem(sys.modules, module)  # as before the import: read from source
    assert declared_names(module, name) == live.names()


@pytest.mark.parametrize("module,name", DECLARED_CONSTANTS)
def test_constants_read_from_source_are_the_live_ones(module, name, monkeypatch):
    live = getattr(importlib.import_module(module), name)
    monkeypatch.delitem(sys.modules, module)
    assert declared_constant(module, name) == live


def test_declared_names_fail_on_a_wrong_name(monkeypatch):
    _source_tree.cache_clear()
    monkeypatch.delitem(sys.modules, "grpo_lens.formulas.losses", raising=False)
    with pytest.raises(ValueError, match="registers nothing"):
        declared_names("grpo_lens.formulas.losses", "NO_SUCH_REGISTRY")
    with pytest.raises(ValueError, match="no literal constant"):
        declared_constant("grpo_lens.formulas.losses", "NO_SUCH_CONSTANT")
    with pytest.raises(ValueError, match="cannot find"):
        declared_names("grpo_lens.no_such_module", "X")


def test_a_plugin_registration_counts_once_the_module_is_imported():
    # Imported modules answer from the live registry: a name registered by a plugin is valid and listed.
    from grpo_lens.formulas import advantages

    advantages.ADVANTAGE_ESTIMATORS.register("test_plugin_estimator")(lambda *a, **k: None)
    try:
        assert "test_plugin_estimator" in declared_names("grpo_lens.formulas.advantages", "ADVANTAGE_ESTIMATORS")
        from grpo_lens.config import TrainConfig

        assert TrainConfig(estimator="test_plugin_estimator").estimator == "test_plugin_estimator"
    finally:
        del advantages.ADVANTAGE_ESTIMATORS._entries["test_plugin_estimator"]
