"""``megatier.train`` with global rank 0 reaching its work LATE_RANK0_S seconds after the other ranks, as on a
loaded machine (a worker script for megatier-run in tests)."""
import os
import time

from megatier.train import cli

if __name__ == "__main__":
    if os.environ.get("RANK") == "0":
        time.sleep(float(os.environ.get("LATE_RANK0_S", "3")))
    cli()
