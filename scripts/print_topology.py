#!/usr/bin/env python
"""Kept so documented commands work: the same as ``megatier-topology`` (megatier/cli/topology.py)."""
import sys

from megatier.cli.topology import main

if __name__ == "__main__":
    sys.exit(main())
