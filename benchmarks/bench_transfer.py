#!/usr/bin/env python
"""Host <-> device copy bandwidth, pinned and pageable: what a checkpoint's trip off the GPU can cost.

    python benchmarks/bench_transfer.py                 # 256 MiB, 5 repeats, median GB/s per direction and memory
    python benchmarks/bench_transfer.py --mib 1024 --repeats 9

Each copy is timed with CUDA events after a warm-up copy; the table gives the median and the min..max of the
repeats. Needs a CUDA device (says so and exits 2 without one).
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch


def time_copy(dst: torch.Tensor, src: torch.Tensor, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` copies of ``src`` into ``dst``, by CUDA events."""
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1000.0)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256, help="bytes per copy, in MiB")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_transfer: no CUDA device here", file=sys.stderr)
        return 2
    n = args.mib << 20
    device = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    print(f"{torch.cuda.get_device_name()}: {args.mib} MiB per copy, median of {args.repeats} (min..max) GB/s")
    for memory in ("pinned", "pageable"):
        host = torch.empty(n, dtype=torch.uint8, pin_memory=memory == "pinned")
        host.random_(0, 255)
        for name, dst, src in (("device-to-host", host, device), ("host-to-device", device, host)):
            rates = [n / s / 1e9 for s in time_copy(dst, src, args.repeats)]
            print(f"  {name:15s} {memory:9s} {statistics.median(rates):7.1f} ({min(rates):.1f}..{max(rates):.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
