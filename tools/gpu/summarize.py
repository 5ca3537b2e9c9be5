"""The GPU benchmark's table from ``bench_overhead.py --out-json``: per row, the step time against ``none``, the
checkpoint stall (median, p99, max) and the peak GPU memory.

    python -m tools.gpu.summarize bench.json
"""
from __future__ import annotations

import json
import statistics
import sys


def rows(runs: list[dict]) -> list[str]:
    """One line per row (runs of a row: their median), none first."""
    ok = [r for r in runs if "error" not in r and r.get("tag") != "prime"]
    by_row: dict[str, list[dict]] = {}
    for r in ok:
        by_row.setdefault(r["row"], []).append(r)
    none = statistics.median(r["mean_step_s"] for r in by_row.get("none", [])) if "none" in by_row else None
    lines = [f"{'row':24} {'step ms':>9} {'vs none':>8} {'stall med':>9} {'p99':>7} {'max':>7} {'peak GPU MiB':>12}"]
    for row in sorted(by_row, key=lambda name: (name != "none", name)):
        def med(key: str, runs_of: list[dict] = by_row[row]):
            values = [r[key] for r in runs_of if r.get(key) is not None]
            return statistics.median(values) if values else None

        step = med("mean_step_s")
        vs = f"{100 * (step / none - 1):+7.2f}%" if none and row != "none" else f"{'-':>8}"
        peak = med("peak_gpu_mib")
        lines.append(f"{row:24} {1000 * step:9.2f} {vs} {med('median_stall_ms') or 0.0:9.2f} "
                     f"{med('p99_stall_ms') or 0.0:7.2f} {med('max_stall_ms') or 0.0:7.2f} "
                     f"{(f'{peak:.0f}' if peak is not None else '-'):>12}")
    failed = [f"{r['row']}: {r['error']}" for r in runs if "error" in r]
    return lines + [f"FAILED {f}" for f in failed]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m tools.gpu.summarize BENCH_JSON", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        doc = json.load(f)
    print("\n".join(rows(doc["runs"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
