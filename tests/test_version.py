"""The version is written once, as ``grpo_lens.__version__``: pyproject.toml reads it, ``grpo-lens --version`` prints
it, and the installed distribution's metadata is it."""

import importlib.metadata
import json
import re
import tomllib
from pathlib import Path

import pytest

import grpo_lens
from grpo_lens.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_pyproject_reads_the_version_from_the_package():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "grpo_lens.__version__"}
    # a version PEP 440 accepts (release, optional .devN)
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+)?", grpo_lens.__version__), grpo_lens.__version__


def test_the_version_is_written_in_one_place():
    # no other file of the package or pyproject.toml spells the version out
    pattern = re.escape(grpo_lens.__version__)
    hits = [
        str(p.relative_to(ROOT))
        for p in [*ROOT.joinpath("grpo_lens").rglob("*.py"), ROOT / "pyproject.toml", ROOT / "CITATION.cff"]
        if re.search(rf"['\"]{pattern}['\"]|: {pattern}$", p.read_text(encoding="utf8"), re.M)
    ]
    assert hits == ["grpo_lens/__init__.py"], hits


@pytest.mark.e2e
def test_version_flag_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"grpo-lens {grpo_lens.__version__}"


def test_the_installed_metadata_is_the_package_version():
    # what pip installed from this checkout carries __version__; an install of another checkout (a worktree run
    # against a shared venv) has its own version and is not this test's business
    dist = importlib.metadata.distribution("grpo-lens")
    url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
    if url.removeprefix("file://").rstrip("/") != str(ROOT):
        pytest.skip(f"grpo-lens is installed from {url or 'an index'}, not from {ROOT}")
    assert dist.version == grpo_lens.__version__
