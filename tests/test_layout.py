"""docs/layout.md's import rule holds: the lens and the runtime sit below the trainer and the probe, lora.py on the
ground floor, no circle runs through them, and the package is imported at the top of each module, never inside a
function (but in cli.py's commands). Read from the source with ast; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "grpo_lens"

# which parts of the package each part may not import (module-level or inside a function)
FORBIDDEN = {
    "lora": {"*"},  # its callers hand it what it needs (the model's linear layers)
    "runtime": {"train", "probe", "lens", "integrations", "report", "cli", "demo", "calibrate"},
    "lens": {"train", "probe", "integrations", "report", "cli", "demo", "calibrate"},
    "train": {"probe", "integrations", "cli", "demo", "calibrate"},
    "probe": {"train", "lens", "integrations", "cli", "demo", "calibrate"},
}
CHECKED = set(FORBIDDEN) | {"integrations"}


def part(module: str) -> str:
    """``grpo_lens.lens.trainer_lens`` -> ``lens``; ``grpo_lens.lora`` -> ``lora``."""
    return module.split(".")[1] if module.count(".") else ""


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> list[tuple[str, bool]]:
    """(imported grpo_lens module, at module level) for every import in ``path`` outside ``if TYPE_CHECKING``."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            names = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                names = [f"{child.module}.{a.name}" for a in child.names]
                if any(name not in known for name in names):  # not only submodules: the module's own names
                    names.append(child.module)
            for name in names:
                while name not in known and "." in name:
                    name = name.rsplit(".", 1)[0]
                if name in known:
                    found.append((name, not in_function))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(path.read_text(encoding="utf8")), False)
    return found


def test_no_arrow_runs_back_up():
    known = modules()
    wrong = []
    for module, path in known.items():
        forbidden = FORBIDDEN.get(part(module), set())
        for target, _ in imports(path, known):
            if part(target) != part(module) and ("*" in forbidden or part(target) in forbidden):
                wrong.append(f"{module} -> {target}")
    assert not wrong, f"imports against docs/layout.md's rule: {sorted(set(wrong))}"


def test_no_import_circle_through_the_lens_runtime_train_or_probe():
    known = modules()
    graph = {m: {t for t, top in imports(p, known) if top and t != m} for m, p in known.items()}
    circles = []
    for start in (m for m in graph if part(m) in CHECKED):
        # depth-first from start: a path back to start is a circle
        stack, seen = [(start, (start,))], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    circles.append(" -> ".join((*path, start)))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, (*path, nxt)))
    assert not circles, f"module-level import circles: {circles[:3]}"


# ---------------------------------------------------------------------------------------------------------------------
# Sizes: no module over 1,000 lines, no function over 100, unless its docstring says why
# ---------------------------------------------------------------------------------------------------------------------
MAX_MODULE_LINES = 1000
MAX_FUNCTION_LINES = 100
#: a function this long says why in its docstring with these words
WHY_LONG = "is longer than 100 lines because"


def oversized(source: str, name: str) -> list[str]:
    """What in ``source`` (the text of module ``name``) is over the limits: the module itself ("name: N lines") and
    each function or method ("name:line function: N lines") counted from its ``def`` line to its last line, unless
    its docstring contains :data:`WHY_LONG`."""
    tree = ast.parse(source)
    found = []
    lines = len(source.splitlines())
    if lines > MAX_MODULE_LINES:
        found.append(f"{name}: {lines} lines")
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES and WHY_LONG not in (ast.get_docstring(node) or ""):
                found.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    return found


def test_the_size_check_counts_what_it_should():
    # a 101-line function: the def line, the docstring line, 99 statements; 100 lines pass; the reason excuses it
    def function(body_lines: int, doc: str = "f") -> str:
        return f'def f():\n    """{doc}"""\n' + "    x = 1\n" * (body_lines - 2)

    assert oversized(function(101), "m.py") == ["m.py:1 f: 101 lines"]
    assert oversized(function(100), "m.py") == []
    assert oversized(function(101, f"f {WHY_LONG} it is one table"), "m.py") == []
    assert oversized("x = 1\n" * 1001, "m.py") == ["m.py: 1001 lines"]
    assert oversized("x = 1\n" * 1000, "m.py") == []
    # a method counts, nested in its class
    method = "class C:\n" + "\n".join("    " + line for line in function(101).splitlines()) + "\n"
    assert oversized(method, "m.py") == ["m.py:2 f: 101 lines"]


def test_no_module_over_1000_lines_and_no_function_over_100():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = str(path.relative_to(PACKAGE.parent))
        found += oversized(path.read_text(encoding="utf8"), name)
    assert not found, "split these (or say why in the docstring: '... " + WHY_LONG + " ...'):\n" + "\n".join(found)


#: the one place the package is imported inside functions: the CLI's commands import their modules when they run, so
#: ``grpo-lens --help`` loads no torch (tests/test_cli_speed.py)
LAZY = {"grpo_lens.cli"}


def test_no_function_imports_the_package():
    known = modules()
    local = sorted(
        {f"{module} imports {target}" for module, p in known.items() for target, top in imports(p, known) if not top}
    )
    allowed = LAZY
    assert not [line for line in local if line.split()[0] not in allowed], (
        "import the package at the top of the module (restructure where that would close a circle): "
        + "; ".join(line for line in local if line.split()[0] not in allowed)
    )


def test_the_function_import_check_sees_one(tmp_path):
    path = tmp_path / "module.py"
    path.write_text("from grpo_lens.config import TrainConfig\n\n\ndef f():\n    from grpo_lens.rundir import RunDir\n")
    known = {"grpo_lens.config": path, "grpo_lens.rundir": path}
    assert set(imports(path, known)) == {("grpo_lens.config", True), ("grpo_lens.rundir", False)}


def test_no_import_circle_in_the_package():
    known = modules()
    graph = {m: {t for t, top in imports(p, known) if top and t != m} for m, p in known.items()}
    state: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(node: str, path: tuple[str, ...]) -> str | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return " -> ".join((*path[path.index(nxt) :], nxt))
            if nxt not in state and (found := visit(nxt, (*path, nxt))):
                return found
        state[node] = 2
        return None

    circles = [c for m in sorted(graph) if m not in state and (c := visit(m, (m,)))]
    assert not circles, f"module-level import circles: {circles}"
