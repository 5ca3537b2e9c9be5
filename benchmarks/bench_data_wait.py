#!/usr/bin/env python
"""How long the step waits for its data, with the prefetching loader on and off (``data.prefetch``).

    python benchmarks/bench_data_wait.py                               # experiment=demo, 30 steps, 3 repeats
    python benchmarks/bench_data_wait.py --steps 10 --repeats 1 -- model=tiny

Two workloads, each trained ``--steps`` steps per run in this process (one rank, CPU or the GPU there is), without
checkpointing, prefetch on and off in alternation ``--repeats`` times:
- ``demo``: the configuration as given (``experiment=demo`` unless overrides are given), on the default corpus;
- ``blend``: the same with ``data.blend`` over three Megatron-format corpora (uint16, int32 and uint16 tokens,
  weights 0.5/0.3/0.2, split 969,30,1) written by megatron-core's own IndexedDatasetBuilder (a test dependency).
A run's figures are over the steps after the first ``--warmup``: the median and the maximum of ``data_wait_ms``
and the median step (``iter_time_s``); the table gives the median over repeats with min..max, and the median
wait as a share of the median step.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
from typing import Optional

import numpy as np

CORPORA = [("web", np.uint16, 2000), ("code", np.int32, 1200), ("books", np.uint16, 600)]  # name, dtype, documents
WEIGHTS = (0.5, 0.3, 0.2)
VOCAB = 256  # the demo's byte vocabulary, so both workloads train the same model


def write_corpora(root: str, seed: int = 0) -> list[str]:
    """Three Megatron corpora of documents of 20..2000 tokens below VOCAB, written by megatron-core."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    prefixes = []
    for name, dtype, documents in CORPORA:
        prefix = os.path.join(root, name)
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
        for _ in range(documents):
            builder.add_item(torch.from_numpy(rng.integers(1, VOCAB, size=int(rng.integers(20, 2000)))))
            builder.end_document()
        builder.finalize(prefix + ".idx")
        prefixes.append(prefix)
    return prefixes


def _single_rank_env() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), WANDB_MODE="disabled")


def one_run(overrides: list[str], steps: int, warmup: int, prefetch: bool, run_dir: str) -> dict:
    """Train ``steps`` steps; the run's figures over the steps after ``warmup``."""
    from megatier.config import compose_config
    from megatier.training.trainer import Trainer

    _single_rank_env()
    cfg = compose_config([*overrides, f"train.iters={steps}", f"train.eval_interval={10 ** 6}",
                          "checkpoint.enabled=false", f"data.prefetch={str(prefetch).lower()}",
                          f"logging.run_dir={run_dir}", "logging.progress=false", "logging.wandb.mode=disabled"])
    trainer = Trainer(cfg)
    records = []
    original = trainer.logger.log

    def keep(record: dict) -> None:
        if "data_wait_ms" in record:
            records.append(record)
        original(record)
    trainer.logger.log = keep
    trainer.train()
    trainer.close()
    window = [r for r in records if r["step"] > warmup]
    waits = [r["data_wait_ms"] for r in window]
    return {"wait_ms": statistics.median(waits), "wait_max_ms": max(waits),
            "step_ms": 1000.0 * statistics.median(r["iter_time_s"] for r in window)}


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}..{max(values):.3f})"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", default="demo,blend")
    parser.add_argument("overrides", nargs="*", help="config overrides after --; default experiment=demo")
    args = parser.parse_args(argv)
    overrides = args.overrides or ["experiment=demo"]
    with tempfile.TemporaryDirectory(prefix="bench_data_wait-") as tmp:
        workloads = {"demo": overrides}
        if "blend" in args.workloads:
            prefixes = write_corpora(tmp)
            blend = ",".join(f"{w},{p}" for w, p in zip(WEIGHTS, prefixes))
            workloads["blend"] = [*overrides, f"data.blend=[{blend}]", "data.split=969/30/1",
                                  f"model.vocab_size={VOCAB}"]
        rows = []
        for name in args.workloads.split(","):
            runs: dict[bool, list[dict]] = {True: [], False: []}
            for repeat in range(args.repeats):
                for prefetch in (True, False):
                    run_dir = os.path.join(tmp, f"{name}-{repeat}-{prefetch}")
                    runs[prefetch].append(one_run(workloads[name], args.steps, args.warmup, prefetch, run_dir))
                    print(f"{name} repeat {repeat} prefetch={prefetch}: {runs[prefetch][-1]}", file=sys.stderr)
            for prefetch in (True, False):
                r = runs[prefetch]
                share = 100.0 * statistics.median(x["wait_ms"] for x in r) / statistics.median(x["step_ms"] for x in r)
                rows.append((name, "on" if prefetch else "off", _spread([x["wait_ms"] for x in r]),
                             _spread([x["wait_max_ms"] for x in r]), _spread([x["step_ms"] for x in r]),
                             f"{share:.3f}%"))
    header = ("workload", "prefetch", "data_wait_ms median", "data_wait_ms max", "step ms", "wait/step")
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(c).rjust(w) for c, w in zip(row, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
