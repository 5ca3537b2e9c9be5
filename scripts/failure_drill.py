#!/usr/bin/env python
"""Kept so documented commands work: the same as ``megatier-drill`` (megatier/cli/drill.py)."""
import sys

from megatier.cli.drill import main

if __name__ == "__main__":
    sys.exit(main())
