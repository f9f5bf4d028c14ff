"""The docs name real code, at its current home.

- Every backticked ``grpo_lens.…`` dotted name in docs/*.md and README.md, and every ``grpo_lens`` import of their
  Python snippets, resolves by import + attribute look-up (the 0.1 paths, removed in 0.3, do not).
- Every section and subsection of docs/theory.md names at least one function or class that computes its formulas.
- Every ``theory.md §N`` / ``§Name`` citation in the package, the tests, the benchmarks and the docs points at a
  section (or subsection title) that exists.
"""

from __future__ import annotations

import ast
import importlib
import re
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
THEORY = ROOT / "docs" / "theory.md"
DOTTED = re.compile(r"`(grpo_lens(?:\.[A-Za-z_]\w*)+)")


def resolve(dotted: str) -> object:
    """The object ``dotted`` names, found from its current home.

    Raises:
        LookupError: a part does not exist (a module attribute must be in the module's namespace, not served by a
            module ``__getattr__``).
    """
    parts = dotted.split(".")
    obj: object = None
    for i in range(len(parts), 0, -1):  # the longest prefix that is a module
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ModuleNotFoundError as e:
            if e.name is None or not ".".join(parts[:i]).startswith(e.name):
                raise
    for name in parts[i:]:
        if isinstance(obj, types.ModuleType):
            if name not in vars(obj):  # not through a module __getattr__
                raise LookupError(f"{dotted}: module {obj.__name__} has no {name!r}")
            obj = vars(obj)[name]
        elif hasattr(obj, name):
            obj = getattr(obj, name)
        else:
            raise LookupError(f"{dotted}: {obj!r} has no attribute {name!r}")
    return obj


def _snippet_imports(text: str) -> list[str]:
    """The dotted names that the ``python`` code blocks of a markdown text import from grpo_lens."""
    out = []
    for code in re.findall(r"```python\n(.*?)```", text, re.S):
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("grpo_lens"):
                out += [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                out += [a.name for a in node.names if a.name.startswith("grpo_lens")]
    return out


def _doc_names() -> list[tuple[str, str]]:
    """(file, dotted name) of every name the docs show, in order, without repeats."""
    seen: dict[tuple[str, str], None] = {}
    for path in DOCS:
        text = path.read_text(encoding="utf8")
        for name in DOTTED.findall(text) + _snippet_imports(text):
            seen[(path.name, name)] = None
    return list(seen)


def test_resolve_refuses_the_removed_paths():
    # the checker itself: a current path resolves, the 0.1 paths of the same objects (removed in 0.3) do not
    from grpo_lens.formulas.advantages import compute_advantages

    assert resolve("grpo_lens.formulas.advantages.compute_advantages") is compute_advantages
    for old in (
        "grpo_lens.advantages.compute_advantages",
        "grpo_lens.diagnostics.spectrum.rank_measures",
        "grpo_lens.lora.lora_rollout_grads",
        "grpo_lens.claims.band_verdict",
    ):
        with pytest.raises(LookupError, match="has no"):
            resolve(old)
    with pytest.raises(LookupError, match="has no"):
        resolve("grpo_lens.formulas.advantages.no_such_function")


def test_every_dotted_name_in_the_docs_resolves_from_its_current_home():
    names = _doc_names()
    assert len(names) > 100, "found too few names: the pattern is stale"
    failures = []
    for doc, name in names:
        try:
            resolve(name)
        except (LookupError, ImportError) as e:
            failures.append(f"{doc}: {e}")
    assert not failures, "\n".join(failures)


def _sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) of every ## and ### section of a markdown text (the text before the first ## is left out)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    pieces = re.split(r"^(#{2,3} .*)$", text, flags=re.M)
    return list(zip(pieces[1::2], pieces[2::2]))


def test_every_theory_section_names_the_function_that_computes_it():
    sections = _sections(THEORY.read_text(encoding="utf8"))
    assert len(sections) >= 20
    bare = []
    for heading, body in sections:
        objs = [resolve(n) for n in DOTTED.findall(heading + body)]
        if not any(callable(o) and not isinstance(o, types.ModuleType) for o in objs):
            bare.append(heading)
    assert not bare, f"theory.md sections that name no function or class: {bare}"


def _titles() -> tuple[set[str], list[str]]:
    """theory.md's section numbers, and every section and subsection title (without its number, its parenthesis
    and what follows a colon: '## 9. Sparsity' -> 9 and 'Sparsity', '### S1: the share ...' -> 'S1')."""
    numbers, titles = set(), []
    for heading in re.findall(r"^#{2,3} (.*)$", THEORY.read_text(encoding="utf8"), flags=re.M):
        m = re.match(r"(\d+)\. (.*)", heading)
        if m:
            numbers.add(m.group(1))
            heading = m.group(2)
        titles.append(re.split(r"[:(]", heading)[0].strip())
    return numbers, titles


#: §X after "theory.md" (or "theory" in metrics.md), with the further §Y of the same list ("§11 and §12", "§7, §8")
CITATION = re.compile(r"theory(?:\.md)?\)?,? (§[^\n)]*)")
PLACEHOLDERS = ("N", "Name")


def _citations() -> list[tuple[str, str]]:
    """(file, text after §) of every theory.md citation: after 'theory.md' anywhere; in docs/*.md every § that is
    not a paper's section (a number with a dot, or a section number of a cited paper is only in theory.md's own
    source lines, which are checked for named citations only)."""
    out = []
    files = [p for d in ("grpo_lens", "tests", "benchmarks", "tools") for p in (ROOT / d).rglob("*.py")]
    for path in files + [ROOT / "README.md", ROOT / "docs" / "metrics.md"]:
        text = path.read_text(encoding="utf8")
        for span in CITATION.findall(text):
            out += [(path.name, c) for c in re.findall(r"§\s?([^§]*)", span)]
    for path in (ROOT / "docs" / "metrics.md", THEORY):
        for c in re.findall(r"§([A-Z][^§\n]*)", path.read_text(encoding="utf8")):
            out.append((path.name, c))
    return out


def test_every_theory_citation_points_at_a_section():
    numbers, titles = _titles()
    assert {"1", "7", "11", "12", "20"} <= numbers and "S1" in titles and "Token credit" in titles
    citations = _citations()
    assert len(citations) > 100, "found too few citations: the pattern is stale"
    bad = []
    for where, cite in citations:
        cite = cite.strip()
        if re.match(r"\d", cite):
            num = re.match(r"\d+(?:\.\d+)*", cite).group(0)
            if num not in numbers and "." not in num:
                bad.append(f"{where}: §{cite[:40]}")
        elif not cite.startswith(PLACEHOLDERS) or cite.split("`")[0].strip() not in PLACEHOLDERS:
            cut = cite.rstrip(" \"'")  # a title broken over two lines: its first words end the line
            if not any(re.match(re.escape(t) + r"(\W|$)", cite) or (t.startswith(cut) and " " in cut) for t in titles):
                bad.append(f"{where}: §{cite[:40]}")
    assert not bad, "citations of docs/theory.md sections that do not exist:\n" + "\n".join(bad)
