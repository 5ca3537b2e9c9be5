#!/usr/bin/env python
"""A shard's compression on a device, two ways side by side, with the host syncs each makes:

* ``batched``: what ``compress_segments`` does on a GPU (``megatier.ops.batched``): every segment in one
  fixed sequence of tensor ops, the record copied to pinned memory in one transfer;
* ``per_chunk``: segment by segment with the per-chunk kernels (``quantize_int8``, ``sparsify_topk``), each
  top-k chunk reading its sampled threshold and count back to the host, each part copied on its own.

Both make the same record (checked). Times are wall clock from a synchronized device to the record on the
host, median and spread over the repetitions; syncs are counted by torch's CUDA sync debug mode.

    python benchmarks/bench_compression.py --device cuda --size 124M     # GPT-2 small's parameter count
    python benchmarks/bench_compression.py --device cpu --size 1M --reps 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.bench_ops import model_segments, parse_size  # noqa: E402
from megatier import ops  # noqa: E402
from megatier.ops import batched, reference  # noqa: E402
from megatier.ops.compression import _codecs, _record_header  # noqa: E402

RATIO, SMALL, BLOCK, SAMPLE = 0.01, 100_000, 256, 16384


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def batched_path(x: torch.Tensor, offsets: list[int], numels: list[int], seed: int) -> dict[str, torch.Tensor]:
    h = _record_header("bench", x.numel(), "adaptive", RATIO, SMALL, BLOCK, SAMPLE, seed, 2**31 - 1)
    pools, counts, plan = batched.compress_pools(x, offsets, numels, _codecs("adaptive", numels, SMALL), h, False)
    host, _ = batched.PendingRecord(pools, counts, plan).wait()
    return {k: v for k, v in host.items() if v.numel()}


def per_chunk_path(x: torch.Tensor, offsets: list[int], numels: list[int], seed: int) -> dict[str, torch.Tensor]:
    parts: dict[str, list[torch.Tensor]] = {}
    for s, (off, num, codec) in enumerate(zip(offsets, numels, _codecs("adaptive", numels, SMALL))):
        piece = x[off : off + num]
        if codec == "int8":
            names, tensors = ("int8_codes", "int8_scales"), ops.quantize_int8(piece, BLOCK)
        else:
            names, tensors = ("topk_values", "topk_indices"), ops.sparsify_topk(piece, RATIO, SAMPLE,
                                                                                seed=reference.chunk_seed(
                                                                                    seed, s, 0))[:2]
        for name, t in zip(names, tensors):
            parts.setdefault(name, []).append(t.cpu())
    return {name: torch.cat(p) for name, p in parts.items()}


def record_differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """One line per part the two records do not share bit for bit: its name, how many entries differ, the first."""
    lines = [f"{k}: only in the {'batched' if k in a else 'per-chunk'} record" for k in sorted(a.keys() ^ b.keys())]
    for k in sorted(a.keys() & b.keys()):
        x, y = a[k], b[k]
        if x.shape != y.shape:
            lines.append(f"{k}: {x.numel()} entries batched, {y.numel()} per chunk")
            continue
        diff = (x.view(torch.uint8).view(x.numel(), -1) != y.view(torch.uint8).view(y.numel(), -1)).any(1)
        if bool(diff.any()):
            i = int(diff.nonzero()[0])
            lines.append(f"{k}: {int(diff.sum())} of {x.numel()} entries differ, first at {i} "
                         f"({x[i].item()!r} batched, {y[i].item()!r} per chunk)")
    return lines


def measure(path, x, offsets, numels, reps: int) -> dict:
    device = x.device
    path(x, offsets, numels, 0)  # warm-up: allocator, kernels
    times = []
    for r in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        path(x, offsets, numels, r + 1)
        times.append(time.perf_counter() - t0)
    syncs = 0
    if device.type == "cuda":
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                path(x, offsets, numels, 99)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchroniz" in str(w.message) for w in seen)
    ms = [t * 1e3 for t in times]
    return {"ms_median": statistics.median(ms), "ms_min": min(ms), "ms_max": max(ms), "host_syncs": syncs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", default="124M", help="shard elements (K/M/G suffixes), GPT-like segments")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default="", help="also write the results here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    n = parse_size(args.size)
    segments = model_segments(n)
    offsets, numels = [o for o, _ in segments], [k for _, k in segments]
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)
    a, b = batched_path(x, offsets, numels, 7), per_chunk_path(x, offsets, numels, 7)
    differing = record_differences(a, b)
    for line in differing:  # still timed below: the times say where the paths stand even when they disagree
        print(f"the two paths made different records: {line}", file=sys.stderr)
    print(f"{device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), {n:,} elements, "
          f"{len(segments)} segments, {'DIFFERENT records' if differing else 'the same record both ways'}")
    print(f"{'path':<11}{'median ms':>10}{'min':>9}{'max':>9}{'host syncs':>12}")
    results = {"device": str(device), "n": n, "segments": len(segments)}
    for name, path in (("batched", batched_path), ("per_chunk", per_chunk_path)):
        r = results[name] = measure(path, x, offsets, numels, args.reps)
        print(f"{name:<11}{r['ms_median']:>10.2f}{r['ms_min']:>9.2f}{r['ms_max']:>9.2f}{r['host_syncs']:>12}")
    if device.type == "cuda":
        print(f"peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB "
              f"(the shard itself {4 * n / 2**30:.2f} GiB)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
