#!/usr/bin/env python
"""Kept so documented commands work: the same as ``megatier-launch`` (megatier/cli/launch.py)."""
import sys

from megatier.cli.launch import main

if __name__ == "__main__":
    sys.exit(main())
