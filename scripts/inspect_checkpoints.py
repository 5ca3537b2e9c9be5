#!/usr/bin/env python
"""Kept so documented commands work: the same as ``megatier-inspect`` (megatier/cli/inspect.py)."""
import sys

from megatier.cli.inspect import main

if __name__ == "__main__":
    sys.exit(main())
