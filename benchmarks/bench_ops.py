#!/usr/bin/env python
"""Throughput of MegaTier's native ops on this machine, in one run.

* each codec's throughput in GB/s of the dense fp32 tensor it reads (compression) or
  writes (decompression), next to a plain memory copy of the same bytes (the physical
  limit here), and the ratio; like the copy, kernels write into preallocated outputs
  ("(new output)" adds allocating quantize's int8 output: fresh pages from the OS);
* ``sparsify_topk`` against ``torch.topk`` (same k) at each size;
* ``adamw_replay`` for N = 1, 5, 20 against N sequential ``adamw_step`` calls, with
  dense gradients and with adaptive-compressed records.

    python benchmarks/bench_ops.py                 # 1M, 16M, 64M elements (~15 s on 2 cores)
    python benchmarks/bench_ops.py --quick         # 1M and 4M, one repetition (~3 s)
    python benchmarks/bench_ops.py --sizes 2M,8M --adamw-size 4M --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from megatier import ops


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)


def timeit(fn, reps: int, warmup: int = 1) -> float:
    """Best wall time of ``reps`` runs (seconds)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def model_segments(n: int) -> list[tuple[int, int]]:
    """GPT-like segments: per layer a few small vectors (INT8) and big matrices (top-k)."""
    pattern = [768, 768, 2304 * 768, 2304, 768 * 768, 768, 768, 768, 3072 * 768, 3072, 768 * 3072, 768]
    segs, pos, i = [], 0, 0
    while pos < n:
        k = min(pattern[i % len(pattern)], n - pos)
        segs.append((pos, k))
        pos += k
        i += 1
    return segs


def bench_codecs(n: int, reps: int, ratio: float, topk_reps: int, results: dict) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=gen)
    dense_bytes = 4 * n
    dst = torch.empty_like(x)
    t_copy = timeit(lambda: dst.copy_(x), reps)
    copy_bw = gbps(dense_bytes, t_copy)
    rows = []

    def row(name, seconds, note=""):
        bw = gbps(dense_bytes, seconds)
        rows.append((name, seconds, bw, bw / copy_bw, note))

    codes, scales = ops.quantize_int8(x, 256)
    row("quantize_int8", timeit(lambda: ops.quantize_int8(x, 256, out=(codes, scales)), reps))
    row("  (new output)", timeit(lambda: ops.quantize_int8(x, 256), reps), "incl. allocating the int8 output")
    row("dequantize_int8", timeit(lambda: ops.dequantize_int8(codes, scales, 256, out=dst), reps), "(writes)")
    res = ops.sparsify_topk(x, ratio, seed=0)
    t_sp = timeit(lambda: ops.sparsify_topk(x, ratio, seed=0), reps)
    row("sparsify_topk", t_sp, f"kept {res.values.numel()} (k={int(ratio * n + 0.5)})")
    row("densify", timeit(lambda: ops.densify(res.values, res.indices, n, out=dst), reps), "(writes)")
    segs = model_segments(n)
    rec = ops.compress_segments(x, segs, "adaptive", ratio)
    row("compress_segments", timeit(lambda: ops.compress_segments(x, segs, "adaptive", ratio), reps),
        f"adaptive, {len(segs)} segs, {rec.nbytes / dense_bytes:.3f} of fp32")
    out = torch.empty_like(x)
    row("decompress_segments", timeit(lambda: ops.decompress_segments(rec, out=out), reps), "(writes)")

    k = max(1, int(ratio * n + 0.5))
    t_topk = timeit(lambda: torch.topk(x.abs(), k, sorted=False), topk_reps, warmup=0)
    print(f"\n== n = {n:,} elements ({dense_bytes / 1e6:.0f} MB fp32), threads = {torch.get_num_threads()} ==")
    print(f"{'kernel':<22}{'time ms':>10}{'GB/s':>9}{'x memcpy':>10}  note")
    print(f"{'memcpy (same bytes)':<22}{t_copy * 1e3:>10.2f}{copy_bw:>9.2f}{1.0:>10.2f}")
    for name, s, bw, rel, note in rows:
        print(f"{name:<22}{s * 1e3:>10.2f}{bw:>9.2f}{rel:>10.2f}  {note}")
    print(f"sparsify_topk vs torch.topk(|x|, k={k}): {t_topk * 1e3:.1f} ms vs {t_sp * 1e3:.2f} ms "
          f"-> {t_topk / t_sp:.1f}x faster")
    results[str(n)] = {
        "memcpy_gbps": copy_bw,
        "kernels": {name: {"ms": s * 1e3, "gbps": bw, "x_memcpy": rel} for name, s, bw, rel, _ in rows},
        "torch_topk_ms": t_topk * 1e3,
        "topk_speedup": t_topk / t_sp,
    }


def bench_adamw(n: int, reps: int, ratio: float, results: dict) -> None:
    gen = torch.Generator().manual_seed(1)
    p, m, v = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)
    decay = torch.tensor([[0, n // 2]], dtype=torch.int64)
    Ns = (1, 5, 20)
    grads = [torch.randn(n, generator=gen) for _ in range(max(Ns))]
    segs = model_segments(n)
    records = [ops.compress_segments(g, segs, "adaptive", ratio, seed=i) for i, g in enumerate(grads)]
    hp = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, decay_segments=decay)
    print(f"\n== AdamW, n = {n:,} elements (state {12 * n / 1e6:.0f} MB), threads = {torch.get_num_threads()} ==")
    print(f"{'N':>3}{'N x step ms':>13}{'replay ms':>11}{'speedup':>9}{'replay(records) ms':>20}{'speedup':>9}")
    out = {}
    for N in Ns:
        steps, lrs = list(range(1, N + 1)), [1e-3] * N

        def seq():
            for i in range(N):
                ops.adamw_step(p, m, v, grads[i], steps[i], lrs[i], **hp)

        t_seq = timeit(seq, reps)
        t_rep = timeit(lambda: ops.adamw_replay(p, m, v, grads[:N], steps, lrs, **hp), reps)
        t_rec = timeit(lambda: ops.adamw_replay(p, m, v, records[:N], steps, lrs, **hp), reps)
        print(f"{N:>3}{t_seq * 1e3:>13.1f}{t_rep * 1e3:>11.1f}{t_seq / t_rep:>8.2f}x{t_rec * 1e3:>20.1f}"
              f"{t_seq / t_rec:>8.2f}x")
        out[str(N)] = {"sequential_ms": t_seq * 1e3, "replay_ms": t_rep * 1e3, "replay_records_ms": t_rec * 1e3,
                       "speedup": t_seq / t_rep, "speedup_records": t_seq / t_rec}
    results["adamw"] = {"n": n, "by_N": out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1M,16M,64M", help="comma-separated element counts (K/M/G suffixes)")
    ap.add_argument("--adamw-size", default="16M", help="shard size for the AdamW benchmark")
    ap.add_argument("--quick", action="store_true", help="1M and 4M elements, AdamW at 4M, one repetition")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per measurement (best is kept)")
    ap.add_argument("--ratio", type=float, default=0.01, help="top-k ratio")
    ap.add_argument("--threads", type=int, default=0, help="torch/OpenMP threads (0: leave as is)")
    ap.add_argument("--json", default="", help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    adamw_n = parse_size(args.adamw_size)
    reps = args.reps
    if args.quick:
        sizes, adamw_n, reps = [1 << 20, 4 << 20], 4 << 20, 1
    info = ops.native_info()
    print(f"megatier.ops backend: {'native' if info['native'] else 'REFERENCE (extension not built)'} {info}")
    results: dict = {"native": info, "sizes": {}}
    for n in sizes:
        bench_codecs(n, reps, args.ratio, 1, results["sizes"])
    bench_adamw(adamw_n, reps, args.ratio, results)

    print("\n== targets ==")
    ok = True
    for n, r in results["sizes"].items():
        for name in ("quantize_int8", "sparsify_topk", "compress_segments"):
            rel = r["kernels"][name]["x_memcpy"]
            good = rel >= 0.5
            ok &= good
            print(f"[{'PASS' if good else 'FAIL'}] {name} at {int(n):,}: {rel:.2f} x memcpy (target >= 0.5)")
    r16 = results["sizes"].get(str(16 << 20))
    if r16:
        good = r16["topk_speedup"] >= 20
        ok &= good
        print(f"[{'PASS' if good else 'FAIL'}] sparsify_topk vs torch.topk at 16M: {r16['topk_speedup']:.1f}x "
              "(target >= 20)")
    s5 = results["adamw"]["by_N"]["5"]["speedup"]
    ok &= s5 >= 2.5
    print(f"[{'PASS' if s5 >= 2.5 else 'FAIL'}] adamw_replay N=5 vs 5 x adamw_step: {s5:.2f}x (target >= 2.5)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
