"""Package discovery (the rest of the metadata is in pyproject.toml).

Every package under fa4gen/ is found by setuptools' discovery, so a new subpackage can never be left
out of the wheel (tests/test_wheel.py builds one and runs it); the templates, which live at the top
level in templates/, are the package fa4gen.templates (pyproject.toml maps the folder and its files).
"""
from pathlib import Path

from setuptools import find_packages, setup

# templates/<target>/ folders are subpackages of fa4gen.templates too (named, so setuptools does not
# warn that it would ignore them; their *.j2 files are package data either way)
TEMPLATE_DIRS = sorted(d.name for d in (Path(__file__).parent / "templates").iterdir() if d.is_dir() and d.name != "__pycache__")
setup(packages=find_packages(include=["fa4gen", "fa4gen.*"]) + ["fa4gen.templates"]
      + [f"fa4gen.templates.{name}" for name in TEMPLATE_DIRS])
