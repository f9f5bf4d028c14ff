"""Name -> callable registries whose unknown names fail with the list of valid ones."""

from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

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
            raise ValueError(
                f"unknown {self.kind} {name!r}; valid names: {', '.join(sorted(self._entries))}"
            ) from None

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
