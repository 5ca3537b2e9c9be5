#!/usr/bin/env python
"""The same as ``megatier-convert`` (megatier/cli/convert.py), for a checkout without the console scripts."""
import sys

from megatier.cli.convert import main

if __name__ == "__main__":
    sys.exit(main())
