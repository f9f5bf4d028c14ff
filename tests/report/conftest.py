"""Fixtures shared by the report tests."""

from __future__ import annotations

from pathlib import Path

import matplotlib.figure
import pytest


@pytest.fixture
def figures(monkeypatch):
    """Every figure the code under test saves, as (file name, Figure), in order (savefig still writes the file)."""
    saved = []
    original = matplotlib.figure.Figure.savefig

    def capture(fig, path, *args, **kwargs):
        saved.append((Path(getattr(path, "name", path)).name, fig))  # a path, or a buffer named after its file
        return original(fig, path, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", capture)
    return saved
