"""docs/layout.md's import rule holds: the lens and the runtime sit below the trainer and the probe, lora.py on the
ground floor, and no circle runs through them (issue 46). Read from the source with ast; nothing is imported."""

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
                names = [f"{child.module}.{a.name}" for a in child.names] + [child.module]
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
