#!/usr/bin/env python
"""Kept so documented commands work: the same as ``megatier-preprocess`` (megatier/cli/preprocess.py)."""
import sys

from megatier.cli.preprocess import main

if __name__ == "__main__":
    sys.exit(main())
