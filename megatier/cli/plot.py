"""Pictures of a training run: loss with its failures, step time and stall, recovery points, goodput, tier bytes.

    megatier-plot runs/demo
    megatier-plot runs/demo_drill/<stamp>/drill/run --out /tmp/plots

Reads every launch's metrics in RUN_DIR (metrics.jsonl and the earlier launches' metrics.<n>.jsonl) and
writes one PNG per figure into RUN_DIR, or into ``--out`` (:mod:`megatier.observe.plot`). A figure whose
metrics the run did not log is skipped with the reason.

Exit status: 0 the figures were written; 2 RUN_DIR holds no metrics of a training run.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from megatier.observe.plot import write_plots
from megatier.observe.run_history import MetricsMissing


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="megatier-plot", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (logging.run_dir) holding metrics.jsonl")
    p.add_argument("--out", default=None, help="directory for the PNGs (default: RUN_DIR)")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        result = write_plots(args.run_dir, args.out)
    except MetricsMissing as err:
        print(f"megatier-plot: error: {err}", file=sys.stderr)
        return 2
    for path, what in result.written.items():
        print(f"wrote {path}: {what}")
    for name, why in result.skipped.items():
        print(f"skipped {name}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
