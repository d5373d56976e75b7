"""Jinja environment over the `templates/` tree: `render(template_name, ctx) -> str`.

Templates only spell instructions; every value they print is computed in Python (fa4gen.lower.*).
StrictUndefined turns a missing context key into an error instead of an empty string in the PTX.
"""

from __future__ import annotations

import functools
import itertools

import jinja2

from ..spec.paths import templates_dir

__all__ = ["FILTERS", "render", "templates_dir", "environment"]


def _comment(note) -> str:
    """`{{ note | comment }}`: " // note" after an instruction, or nothing for an empty note. The
    notes are computed by the lowering (barrier, slot and phase names, decoded descriptors); a
    comment never changes an instruction (fa4gen/evidence/check.py and the emulator strip them)."""
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
