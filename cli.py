#!/usr/bin/env python3
"""Thin entry so `python cli.py ...` works from a checkout: the CLI lives in fa4gen.cli."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fa4gen.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
