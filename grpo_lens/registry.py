"""Name -> callable registries whose unknown names fail with the list of valid ones, and renamed keywords."""

from __future__ import annotations

import ast
import functools
import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """A named table of functions (estimators, loss aggregations, KL estimators, rank measures, tasks).

    Args:
        kind: what the entries are, used in error messages (e.g. ``"advantage estimator"``).

    Raises:
        ValueError: from :meth:`get` for an unknown name, listing the valid names; from :meth:`register` for a
            name registered twice.
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator that files ``fn`` under ``name``."""

        def add(fn: F) -> F:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = fn
            return fn

        return add

    def get(self, name: str) -> F:
        """The entry called ``name``; ValueError listing the valid names if there is none."""
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; valid names: {', '.join(sorted(self._entries))}") from None

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


def declared_names(module: str, registry: str) -> list[str]:
    """The sorted names of ``module``'s registry ``registry`` (as :meth:`Registry.names`), without importing ``module``
    when it is not imported yet: ``grpo-lens --help`` builds its flags' help from them and must not load torch.

    Once ``module`` is imported, the live registry's names (a plugin's registrations included); before, the names of
    every ``REGISTRY.register("name")`` call with a literal name in its source (:func:`declared_constant` reads
    constants the same way). tests/test_cli_speed.py checks that the two agree for every registry the config names.

    Raises:
        ValueError: ``module`` cannot be found, or registers nothing under ``registry``.
    """
    loaded = sys.modules.get(module)
    if loaded is not None:
        return getattr(loaded, registry).names()
    # register's first argument is a name (str)
    names = sorted(  # type: ignore[type-var]
        {
            node.args[0].value
            for node in ast.walk(_source_tree(module))
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "register"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == registry
            and node.args
            and isinstance(node.args[0], ast.Constant)
        }
    )
    if not names:
        raise ValueError(f"{module} registers nothing under {registry}")
    # register's first argument is a name (str)
    return names  # type: ignore[return-value]


def declared_constant(module: str, name: str) -> Any:
    """The value of ``module``'s module-level literal constant ``name`` (``NAME = ("a", "b")``), without importing
    ``module`` when it is not imported yet (see :func:`declared_names`); the live value once it is.

    Raises:
        ValueError: ``module`` cannot be found, or assigns no literal to ``name`` at module level.
    """
    loaded = sys.modules.get(module)
    if loaded is not None:
        return getattr(loaded, name)
    for node in _source_tree(module).body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        # targets is [] unless node is an (Ann)Assign
        if any(isinstance(t, ast.Name) and t.id == name for t in targets) and node.value is not None:  # type: ignore[attr-defined]
            return ast.literal_eval(node.value)  # type: ignore[attr-defined]
    raise ValueError(f"{module} assigns no literal constant {name}")


@functools.cache
def _source_tree(module: str) -> ast.Module:
    """The parsed source of ``module``, found without executing it (its parent packages are imported)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise ValueError(f"cannot find the source of module {module}")
    return ast.parse(Path(spec.origin).read_text(encoding="utf-8"), filename=spec.origin)
