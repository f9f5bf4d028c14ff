"""The docs name real code, at its current home.

- Every backticked ``grpo_lens.…`` dotted name in docs/*.md and README.md, and every ``grpo_lens`` import of their
  Python snippets, resolves by import + attribute look-up (the 0.1 paths, removed in 0.3, do not).
- So does every dotted ``grpo_lens.…`` name in a docstring of the package.
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


#: a dotted name in a docstring: ``grpo_lens.x.y`` (in a role, backticks or plain text), not a path (``grpo_lens/x.py``)
DOCSTRING_DOTTED = re.compile(r"(?<![\w/.])grpo_lens(?:\.[A-Za-z_]\w*)+")


def docstring_names(source: str) -> list[tuple[int, str]]:
    """(line of the documented definition, dotted name) of every ``grpo_lens.…`` name in the module's, classes' and
    functions' docstrings of a Python source text."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False) or ""
            out += [(getattr(node, "lineno", 1), name) for name in DOCSTRING_DOTTED.findall(doc)]
    return out


def test_the_docstring_check_finds_each_name():
    source = '''"""Module: see :func:`grpo_lens.formulas.advantages.compute_advantages`; file grpo_lens/cli.py."""


class A:
    """As ``grpo_lens.diagnostics.GradientCapture`` did."""

    def f(self):
        """Plain grpo_lens.lens.trainer_lens.Lens.rollout_gram."""
        x = "grpo_lens.not_a_docstring"
'''
    assert docstring_names(source) == [
        (1, "grpo_lens.formulas.advantages.compute_advantages"),
        (4, "grpo_lens.diagnostics.GradientCapture"),
        (7, "grpo_lens.lens.trainer_lens.Lens.rollout_gram"),
    ]


def test_every_dotted_name_in_the_package_docstrings_resolves():
    failures, count = [], 0
    for path in sorted((ROOT / "grpo_lens").rglob("*.py")):
        for line, name in docstring_names(path.read_text(encoding="utf8")):
            count += 1
            try:
                resolve(name)
            except (LookupError, ImportError) as e:
                failures.append(f"{path.relative_to(ROOT)}:{line}: {e}")
    assert count > 100, "found too few names: the pattern is stale"
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


# ---------------------------------------------------------------------------------------------------------------------
# One name per concept (docs/theory.md §1, Notation): the group size is R in the docs and `group_size` in code (never
# r, a reward); k is the correct count only; the sketch side is d_s / `sketch_dim` and the Monte Carlo count K_mc /
# `mc_samples` (never k or K)
# ---------------------------------------------------------------------------------------------------------------------

#: files another change is renaming now: checked once their renames land (each must still need one, so
#: the list only shrinks)
PENDING: set[str] = set()

#: old spellings in docstrings, comments and messages: a shape or count K that is the sketch width or the Monte Carlo
#: count, and k for the sketch side
OLD_SPELLINGS = {
    "shape with K (the sketch width is P_s)": re.compile(r"\[(?:[^\]\n]*, )?K\]"),
    "K continuations (the Monte Carlo count is K_mc)": re.compile(r"\bK (?:continuations|Bernoulli|0/1|Monte Carlo)"),
    "K >= (the Monte Carlo count is K_mc)": re.compile(r"\bK >= \d"),
    "Binomial(K, (K_mc)": re.compile(r"Binomial\(K\b"),
    "samples_per_prefix K (K_mc)": re.compile(r"samples_per_prefix\W{0,4} K\b"),
    "K sketch dimensions (P_s)": re.compile(r"\bK sketch"),
    "k for the sketch side (d_s)": re.compile(r"\bk(?: =|:) (?:sketch|\{[^}]*sketch_dim)"),
    "segment k (segments are indexed j)": re.compile(r"segment k\b|V\(b_k\)"),
}


#: an iterable of group sizes (or of a dict keyed by them), and names that spell the group size r
GROUP_SIZES = re.compile(r"group_size|\bper_r\b|\bsizes\b|_by_r\b|\brs\b")
R_NAMES = re.compile(r"^per_r$|_by_r$")


def _int_like(arg: ast.arg, default: ast.expr | None) -> bool:
    annotation = ast.unparse(arg.annotation) if arg.annotation is not None else ""
    return "int" in annotation.split("|")[0] or (isinstance(default, ast.Constant) and type(default.value) is int)


def _holds_group_size(value: ast.expr) -> bool:
    """An expression that is a group size (or a tuple with one): ``group_size``, ``x.group_size`` or a tensor's size
    along a dimension (``x.shape[i]``)."""
    parts = value.elts if isinstance(value, ast.Tuple) else [value]
    return any(
        (isinstance(p, ast.Name) and p.id == "group_size")
        or (isinstance(p, ast.Attribute) and p.attr == "group_size")
        or (isinstance(p, ast.Subscript) and isinstance(p.value, ast.Attribute) and p.value.attr == "shape")
        for p in parts
    )


def name_violations(source: str) -> list[str]:
    """'line: what' for each old spelling in one module's source: a parameter r or R holding a group size (an int),
    a variable r bound to a group size (from ``group_size``, a ``.shape[i]``, a loop over group sizes), a parameter
    k or K of a function about sketches or Monte Carlo continuations, and the :data:`OLD_SPELLINGS` in its text."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            positional = a.posonlyargs + a.args
            defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults) + list(a.kw_defaults)
            doc = ast.get_docstring(node) or ""
            for arg, default in zip(positional + a.kwonlyargs, defaults):
                if arg.arg in ("r", "R") and _int_like(arg, default):
                    out.append(f"{node.lineno}: parameter {arg.arg!r} of {node.name}() is a group size: group_size")
                if arg.arg in ("k", "K") and re.search(r"sketch|continuation|monte carlo", doc, re.I):
                    out.append(f"{node.lineno}: parameter {arg.arg!r} of {node.name}() (sketch side or MC count)")
        elif isinstance(node, (ast.For, ast.comprehension)):
            targets = node.target.elts if isinstance(node.target, ast.Tuple) else [node.target]
            over_sizes = GROUP_SIZES.search(ast.unparse(node.iter))
            if over_sizes and any(isinstance(t, ast.Name) and t.id == "r" for t in targets):
                out.append(f"{getattr(node, 'lineno', node.iter.lineno)}: loop variable 'r' over group sizes")
        elif isinstance(node, (ast.Name, ast.arg)) and R_NAMES.search(getattr(node, "id", None) or node.arg):
            out.append(f"{node.lineno}: name {getattr(node, 'id', None) or node.arg!r} (group sizes: per_group_size)")
        elif isinstance(node, ast.Assign) and _holds_group_size(node.value):
            for target in node.targets:
                names = target.elts if isinstance(target, ast.Tuple) else [target]
                values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value] * len(names)
                for name, value in zip(names, values):
                    if isinstance(name, ast.Name) and name.id == "r" and _holds_group_size(value):
                        out.append(f"{node.lineno}: variable 'r' = {ast.unparse(value)} is a group size")
    for i, line in enumerate(source.splitlines(), 1):
        out += [f"{i}: {what}: {line.strip()[:80]}" for what, pattern in OLD_SPELLINGS.items() if pattern.search(line)]
    return out


def package_name_violations(package: Path) -> dict[str, list[str]]:
    """{module path relative to ``package``: :func:`name_violations`} of every module of a grpo_lens tree that has
    any."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        hits = name_violations(path.read_text(encoding="utf8"))
        if hits:
            found[path.relative_to(package).as_posix()] = hits
    return found


def test_the_name_check_catches_each_old_spelling():
    old = '''
def a(rewards, r: int): ...
def b(x, R=4): ...
def c(grads, k: int = 16):
    """Per-rollout gradients, sketched with k x k projections."""
def d(values, errors, k):
    """Successes among the continuations of each prefix."""
def e(gram):
    r = gram.shape[0]
    for r in config.group_sizes: ...
    for r in sorted(per_r, key=int): ...
    for r, rows in groups_by_r.items(): ...
    m, r = grads.shape[0], group_size
def f(rows):
    """rows: [N, K] sketched rows; K continuations per prefix; k: sketch side; X ~ Binomial(K, p)."""
'''
    hits = name_violations(old)
    for needle in (
        "'r' of a()",
        "'R' of b()",
        "'k' of c()",
        "'k' of d()",
        "'r' = gram.shape[0]",
        "loop variable",
        "'r' = group_size",
        "'per_r'",
        "'groups_by_r'",
        "shape with K",
        "K continuations",
        "k for the sketch side",
        "Binomial(K",
    ):
        assert any(needle in h for h in hits), (needle, hits)
    new = '''
def a(rewards, group_size: int):
    R = group_size
    r = torch.where(valid, rewards, 0)
def c(grads, sketch_dim: int = 16, sketch_in: int = 16):
    """Per-rollout gradients [N, P_s], sketched with d_s x d_s projections; K_mc continuations."""
def g(k: int, group_size: int):
    """Std of R 0/1 rewards with k ones."""
'''
    assert name_violations(new) == []


def test_grpo_lens_uses_one_name_per_concept():
    found = package_name_violations(ROOT / "grpo_lens")
    assert not set(found) - PENDING, "old names (docs/theory.md §1, Notation):\n" + "\n".join(
        f"grpo_lens/{path}:{hit}" for path, hits in found.items() if path not in PENDING for hit in hits
    )
    assert PENDING <= set(found), f"renamed already, take them off PENDING: {sorted(PENDING - set(found))}"


def test_the_docs_use_one_name_per_concept():
    bad = []
    for path in sorted((ROOT / "docs").glob("*.md")):
        for i, line in enumerate(path.read_text(encoding="utf8").splitlines(), 1):
            bad += [f"docs/{path.name}:{i}: {what}" for what, p in OLD_SPELLINGS.items() if p.search(line)]
    assert not bad, "\n".join(bad)
    notation = _sections(THEORY.read_text(encoding="utf8"))[0][1]
    for name in ("`group_size`", "`sketch_dim`", "`mc_samples`", "d_s", "P_s", "K_mc"):
        assert name in notation, f"docs/theory.md §1 (Notation) does not name {name}"
