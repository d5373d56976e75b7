"""Jinja environment over the `templates/` tree: `render(template_name, ctx) -> str`.

Templates only spell instructions; every value they print is computed in Python (fa4gen.lower.*).
StrictUndefined turns a missing context key into an error instead of an empty string in the PTX.
"""

from __future__ import annotations

import functools
import importlib.resources
import itertools
from pathlib import Path

import jinja2

__all__ = ["FILTERS", "render", "templates_dir", "environment"]


def templates_dir() -> Path:
    """The templates/ beside this fa4gen package when it runs from a checkout (a pyproject.toml
    next to it), else the installed package `fa4gen.templates` (pyproject maps it to templates/).

    The checkout comes first so that code and templates always come from one tree: run from another
    checkout or git worktree (PYTHONPATH) while an editable install points elsewhere, the installed
    mapping would pair this tree's lowering with the other tree's templates."""
    here = Path(__file__).resolve().parent.parent
    if (here / "pyproject.toml").is_file() and any((here / "templates").glob("*/*.j2")):
        return here / "templates"
    try:
        root = importlib.resources.files("fa4gen.templates")
        path = Path(str(root))
        if path.is_dir() and any(path.glob("*/*.j2")):
            return path
    except (ModuleNotFoundError, TypeError):
        pass
    path = Path(__file__).resolve().parent.parent / "templates"
    if not path.is_dir():
        raise FileNotFoundError(f"fa4gen templates not found (looked for the package fa4gen.templates and {path})")
    return path


def _comment(note) -> str:
    """`{{ note | comment }}`: " // note" after an instruction, or nothing for an empty note. The
    notes are computed by the lowering (barrier, slot and phase names, decoded descriptors); a
    comment never changes an instruction (fa4gen/check.py and the emulator strip them)."""
    if not note:
        return ""
    note = str(note)
    if "\n" in note or ";" in note:
        raise ValueError(f"PTX comment {note!r}: one line, no ';' (line-based readers split on it)")
    return " // " + note


FILTERS = {"comment": _comment}  # what every environment rendering these templates needs


@functools.lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters.update(FILTERS)
    return env


def render(template_name: str, ctx: dict) -> str:
    """Render one template. `uid()` gives each expansion of a macro a fresh label suffix."""
    counter = itertools.count()
    return environment().get_template(template_name).render(**ctx, uid=lambda: next(counter))
