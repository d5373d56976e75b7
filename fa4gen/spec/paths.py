"""Where the generator's templates are: spec/config.py hashes them into the generator fingerprint and
render/jinja.py loads them, so the answer lives here, at the start of the chain."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

__all__ = ["templates_dir"]


def templates_dir() -> Path:
    """The templates/ beside the fa4gen package when it runs from a checkout (a pyproject.toml
    next to it), else the installed package `fa4gen.templates` (pyproject maps it to templates/).

    The checkout comes first so that code and templates always come from one tree: run from another
    checkout or git worktree (PYTHONPATH) while an editable install points elsewhere, the installed
    mapping would pair this tree's lowering with the other tree's templates."""
    here = Path(__file__).resolve().parents[2]
    if (here / "pyproject.toml").is_file() and any((here / "templates").glob("*/*.j2")):
        return here / "templates"
    try:
        root = importlib.resources.files("fa4gen.templates")
        path = Path(str(root))
        if path.is_dir() and any(path.glob("*/*.j2")):
            return path
    except (ModuleNotFoundError, TypeError):
        pass
    path = Path(__file__).resolve().parents[2] / "templates"
    if not path.is_dir():
        raise FileNotFoundError(f"fa4gen templates not found (looked for the package fa4gen.templates and {path})")
    return path
