"""Package discovery (the rest of the metadata is in pyproject.toml).

Every package under fa4gen/ is found by setuptools' discovery, so a new subpackage can never be left
out of the wheel (tests/test_wheel.py builds one and runs it); the templates, which live at the top
level in templates/, are the package fa4gen.templates (pyproject.toml maps the folder and its files).
"""
from setuptools import find_packages, setup

setup(packages=find_packages(include=["fa4gen", "fa4gen.*"]) + ["fa4gen.templates"])
