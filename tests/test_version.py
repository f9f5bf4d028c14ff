"""``grpo-lens --version`` prints the installed distribution's version, which is the package's ``__version__``."""

import importlib.metadata

import pytest

import grpo_lens
from grpo_lens.cli import main

pytestmark = pytest.mark.e2e  # every test here builds a model or runs a command


def test_version_flag_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"grpo-lens {grpo_lens.__version__}"
    # pyproject.toml's version (what pip installed) and __version__ must not drift apart
    assert importlib.metadata.version("grpo-lens") == grpo_lens.__version__

