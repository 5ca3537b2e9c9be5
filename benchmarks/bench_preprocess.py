"""megatier-preprocess's throughput in tokens per second at 1 and 2 worker processes (docs/benchmarks.md).

The input is the default corpus (Python's standard library source) as JSON lines, one file a document, so it
needs no download; the BPE tokenizer is trained on it once, before the timed runs. Each configuration runs
``--repeats`` times, alternating worker counts so that a change in the machine's load touches both, and the
table gives the median with the spread (min-max) and the machine's 1-minute load average over the runs (the
box is shared: a load above its core count means the runs got less than the cores). Every run's output is
compared with the first of its tokenizer: the bytes must not depend on the worker count.

    .venv/bin/python benchmarks/bench_preprocess.py --mib 16 --repeats 3
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from megatier.data.corpus import stdlib_files
from megatier.data.tokenizer import train_bpe

PREPROCESS = [sys.executable, "-m", "megatier.cli.preprocess"]


def write_input(path: str, mib: float) -> int:
    """The standard library's sources up to ``mib`` MiB as JSON lines; returns the number of documents."""
    files = stdlib_files(int(mib * 2**20))
    with open(path, "w", encoding="utf-8") as out:
        for name in files:
            with open(name, encoding="utf-8", errors="replace") as f:
                out.write(json.dumps({"text": f.read()}) + "\n")
    return len(files)


def run_once(source: str, prefix: str, tokenizer_args: list[str], workers: int) -> tuple[float, int, float]:
    """One megatier-preprocess run: its own tokens/s (reading, tokenizing on the workers, writing, from the start
    of the workers to the closed files), its tokens, and the CPU seconds of the command and its workers."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([*PREPROCESS, "--input", source, "--output-prefix", prefix, *tokenizer_args,
                           "--workers", str(workers), "--no-progress"], check=True, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    line = proc.stdout.strip().splitlines()[-1]
    tokens = int(line.split(" documents, ")[1].split(" tokens")[0].replace(",", ""))
    rate = float(line.split(" documents/s, ")[1].split(" tokens/s")[0].replace(",", ""))
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return rate, tokens, cpu


def burn(iterations: int) -> int:
    total = 0
    for i in range(iterations):
        total += i * i
    return total


def control(workers_list: list[int], repeats: int, tasks: int = 8, iterations: int = 2_000_000) -> list[tuple]:
    """The same pure-Python work on 1 and 2 processes: how much of a second core the box gives right now (on an
    idle 2-core box, 2 processes do it at nearly 2x)."""
    import multiprocessing

    rates: dict[int, list[float]] = {w: [] for w in workers_list}
    for _ in range(repeats):
        for workers in workers_list:
            start = time.perf_counter()
            with multiprocessing.get_context("spawn").Pool(workers) as pool:
                pool.map(burn, [0] * workers)  # the clock starts with the pool up: this row is about cores only
                start = time.perf_counter()
                pool.map(burn, [iterations] * tasks, chunksize=1)
            rates[workers].append(tasks * iterations / (time.perf_counter() - start))
    return [("control: CPU burn, loop iterations/s", w, tasks * iterations, statistics.median(rates[w]),
             min(rates[w]), max(rates[w]), None, f"{os.getloadavg()[0]:.1f}") for w in workers_list]


def same_output(a: str, b: str) -> bool:
    return all(open(a + s, "rb").read() == open(b + s, "rb").read() for s in (".bin", ".idx"))


def measure(root: str, source: str, name: str, tokenizer_args: list[str], workers_list: list[int],
            repeats: int) -> list[tuple]:
    rates: dict[int, list[float]] = {w: [] for w in workers_list}
    cpus: dict[int, list[float]] = {w: [] for w in workers_list}
    loads: list[float] = []
    first, tokens = None, 0
    for r in range(repeats):
        for workers in workers_list:
            prefix = os.path.join(root, f"{name}_{workers}_{r}")
            rate, tokens, cpu = run_once(source, prefix, tokenizer_args, workers)
            rates[workers].append(rate)
            cpus[workers].append(cpu)
            loads.append(os.getloadavg()[0])
            first = first or prefix
            if not same_output(first, prefix):
                raise SystemExit(f"{prefix} differs from {first}: the output depends on the worker count")
    load = f"{min(loads):.1f}-{max(loads):.1f}"
    return [(name, w, tokens, statistics.median(rates[w]), min(rates[w]), max(rates[w]),
             statistics.median(cpus[w]), load) for w in workers_list]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=float, default=16.0, help="size of the input")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--bpe-vocab", type=int, default=8192)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_preprocess") as root:
        os.environ["MEGATIER_CACHE"] = os.path.join(root, "cache")
        source = os.path.join(root, "stdlib.jsonl")
        documents = write_input(source, args.mib)
        start = time.perf_counter()
        bpe = train_bpe((json.loads(line)["text"] for line in open(source, encoding="utf-8")), args.bpe_vocab,
                        os.path.join(root, "bpe.tokenizer.json"))
        print(f"input: {documents} documents, {os.path.getsize(source) / 2**20:.1f} MiB of JSON lines; BPE "
              f"{args.bpe_vocab} trained in {time.perf_counter() - start:.1f}s")
        rows = measure(root, source, "byte", [], args.workers, args.repeats)
        rows += measure(root, source, f"bpe {args.bpe_vocab}", ["--tokenizer", "bpe", "--tokenizer-file", bpe.path],
                        args.workers, args.repeats)
        rows += control(args.workers, args.repeats)
    print(f"\n| tokenizer | workers | tokens (iterations) | tokens/s, median of {args.repeats} | min-max | "
          f"vs 1 worker | CPU s (command + workers) | load average |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    base = {}
    for name, workers, tokens, median, low, high, cpu, load in rows:
        base.setdefault(name, median)
        print(f"| {name} | {workers} | {tokens:,} | {median:,.0f} | {low:,.0f}-{high:,.0f} | "
              f"{median / base[name]:.2f}x | {'-' if cpu is None else f'{cpu:.1f}'} | {load} |")


if __name__ == "__main__":
    main()
