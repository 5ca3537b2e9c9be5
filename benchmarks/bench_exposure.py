#!/usr/bin/env python
"""What a step waits for on communication (``dp_wait_ms``, ``pp_bubble_ms``), and what ``model.compile`` does.

    python benchmarks/bench_exposure.py                              # experiment=demo, 12 steps, 3 repeats
    python benchmarks/bench_exposure.py --steps 6 --warmup 2 --repeats 2 --parts layouts
    python benchmarks/bench_exposure.py --steps 8 --warmup 2 --repeats 2 --parts overlap
    python benchmarks/bench_exposure.py --steps 8 --warmup 2 --repeats 3 --parts interleaved

Four parts:
- ``layouts``: ``--procs`` gloo processes on this machine (a FileStore, one torch thread each) train the demo
  model without checkpointing in two layouts, alternately ``--repeats`` times: dp=4, and pp=2 x dp=2 (1F1B).
  ``train.micro_batch_size=2`` in both, so each dp rank of dp=4 runs 2 micro-batches a step and each pipeline of
  pp=2 x dp=2 runs 4 (its bubble is (pp - 1) / m = 1/4 of the step in theory). Every rank keeps its own step
  records; a run's figures are the median over the steps after the first ``--warmup`` of the step time (rank
  0's ``iter_time_s``), and of ``dp_wait_ms`` and ``pp_bubble_ms`` averaged over the ranks (pp: each stage's
  too). The table gives the median over repeats with min..max.
- ``overlap``: the two layouts of ``layouts``, each with the overlapped data-parallel communication off, the
  gradient reduction's on, the parameter gather's on, and both (``parallel.overlap_grad_reduce``,
  ``parallel.overlap_param_gather``; the buckets' size ``--bucket-mb``), alternately ``--repeats`` times; the same
  figures.
- ``interleaved``: pp=2 x dp=2 with plain 1F1B and with the interleaved schedule
  (``parallel.virtual_stages=2``: two model chunks per rank; in theory the bubble falls from (pp - 1) / (m + pp -
  1) toward (pp - 1) / (v * m + pp - 1)), alternately ``--repeats`` times; the figures of ``layouts``.
- ``compile``: one process, the demo model as configured, ``model.compile`` off and on (inductor, unless
  ``--backend``) alternately ``--repeats`` times: the first step (compilation happens there) and the median
  step after ``--warmup``.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import uuid
from datetime import timedelta
from typing import Optional

LAYOUTS = {"dp=4": 1, "pp=2 x dp=2": 2}  # name -> parallel.pp (dp is what the world leaves)
OVERLAP = {"off": [], "grad": ["parallel.overlap_grad_reduce=true"], "param": ["parallel.overlap_param_gather=true"],
           "both": ["parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true"]}
COMMON = ["checkpoint.enabled=false", "logging.progress=false", "logging.wandb.mode=disabled",
          f"train.eval_interval={10 ** 6}", "train.micro_batch_size=2"]


def _records(overrides: list[str], steps: int, run_dir: str) -> tuple[list[dict], int]:
    """Train ``steps`` steps of ``overrides`` in this process's world; this rank's step records and stage."""
    from megatier.config import compose_config
    from megatier.training.trainer import Trainer

    cfg = compose_config([*overrides, *COMMON, f"train.iters={steps}", f"logging.run_dir={run_dir}"])
    trainer = Trainer(cfg)
    records, step = [], trainer.train_step

    def keep(s: int) -> dict:
        records.append(step(s))
        return records[-1]
    trainer.train_step = keep
    trainer.train()
    trainer.close()
    return records, trainer.ps.pp_rank


def _rank_main(rank: int, world: int, store: str, out: str, overrides: list[str], steps: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      WANDB_MODE="disabled")
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    try:
        records, stage = _records([*overrides, "train.threads=1"], steps, os.path.join(out, "run"))
        torch.save({"records": records, "stage": stage}, os.path.join(out, f"rank{rank}.pt"))
    finally:
        if dist.is_initialized():  # Trainer.close destroys it when the run ends well
            dist.destroy_process_group()


def layout_run(procs: int, pp: int, overrides: list[str], steps: int, warmup: int, tmp: str) -> dict:
    """One launch of ``procs`` ranks at ``parallel.pp=pp``; its figures (module docstring)."""
    import torch
    import torch.multiprocessing as mp

    out = os.path.join(tmp, uuid.uuid4().hex[:8])
    os.makedirs(out)
    mp.start_processes(_rank_main, args=(procs, os.path.join(out, "store"), out, [*overrides, f"parallel.pp={pp}"],
                                         steps), nprocs=procs, join=True, start_method="spawn")
    ranks = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(procs)]
    window = [[r for r in rank["records"] if r["step"] > warmup] for rank in ranks]

    def over_ranks(key: str, which) -> float:
        return statistics.median(statistics.mean(window[r][i][key] for r in which) for i in range(len(window[0])))

    stages = [[r for r in range(procs) if ranks[r]["stage"] == s] for s in range(pp)] if pp > 1 else []
    return {"step_ms": 1000.0 * statistics.median(r["iter_time_s"] for r in window[0]),
            "dp_wait_ms": over_ranks("dp_wait_ms", range(procs)),
            "dp_grad_wait_ms": over_ranks("dp_grad_wait_ms", range(procs)),
            "dp_param_wait_ms": over_ranks("dp_param_wait_ms", range(procs)),
            "pp_bubble_ms": over_ranks("pp_bubble_ms", range(procs)),
            "pp_bubble_by_stage_ms": [over_ranks("pp_bubble_ms", s) for s in stages]}


def compile_run(overrides: list[str], compiled: bool, backend: str, steps: int, warmup: int, tmp: str) -> dict:
    """One process: the first step and the median step after ``warmup`` with model.compile on or off."""
    import torch
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), WANDB_MODE="disabled")
    flags = [f"model.compile={str(compiled).lower()}", f"model.compile_backend={backend}"]
    torch._dynamo.reset()  # each compiled run compiles afresh (the inductor caches are off: main)
    records, _ = _records([*overrides, *flags], steps, os.path.join(tmp, uuid.uuid4().hex[:8]))
    return {"first_step_ms": 1000.0 * records[0]["iter_time_s"],
            "step_ms": 1000.0 * statistics.median(r["iter_time_s"] for r in records if r["step"] > warmup)}


def spread(values: list[float]) -> str:
    """Median (min..max)."""
    return f"{statistics.median(values):.1f} ({min(values):.1f}..{max(values):.1f})"


def _table(header: tuple, rows: list[tuple]) -> str:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(str(c).rjust(w) for c, w in zip(row, widths)) for row in [header, *rows])


def layouts_table(runs: dict[str, list[dict]]) -> str:
    rows = []
    for name, r in runs.items():
        stages = " / ".join(spread([x["pp_bubble_by_stage_ms"][s] for x in r])
                            for s in range(len(r[0]["pp_bubble_by_stage_ms"]))) or "-"
        rows.append((name, spread([x["step_ms"] for x in r]), spread([x["dp_wait_ms"] for x in r]),
                     spread([x["dp_grad_wait_ms"] for x in r]), spread([x["dp_param_wait_ms"] for x in r]),
                     spread([x["pp_bubble_ms"] for x in r]), stages))
    return _table(("layout", "step ms", "dp_wait_ms", "dp_grad_wait_ms", "dp_param_wait_ms", "pp_bubble_ms",
                   "pp_bubble_ms by stage"), rows)


def overlap_table(runs: dict[tuple[str, str], list[dict]]) -> str:
    rows = [(layout, setting, spread([x["step_ms"] for x in r]), spread([x["dp_wait_ms"] for x in r]),
             spread([x["dp_grad_wait_ms"] for x in r]), spread([x["dp_param_wait_ms"] for x in r]))
            for (layout, setting), r in runs.items()]
    return _table(("layout", "overlap", "step ms", "dp_wait_ms", "dp_grad_wait_ms", "dp_param_wait_ms"), rows)


def overlap_part(args, overrides: list[str], tmp: str) -> str:
    """The ``overlap`` part's runs, alternating settings within each repeat; its table."""
    runs: dict[tuple[str, str], list[dict]] = {(n, s): [] for n in LAYOUTS for s in OVERLAP}
    for repeat in range(args.repeats):
        for (name, setting), results in runs.items():
            flags = [*OVERLAP[setting], f"parallel.bucket_mb={args.bucket_mb}"]  # the buckets' size only
            results.append(layout_run(args.procs, LAYOUTS[name], [*overrides, *flags], args.steps, args.warmup, tmp))
            print(f"{name} overlap={setting} repeat {repeat}: {results[-1]}", file=sys.stderr)
    return overlap_table(runs)


def interleaved_part(args, overrides: list[str], tmp: str) -> str:
    """The ``interleaved`` part's runs, alternating v within each repeat; its table."""
    runs: dict[str, list[dict]] = {f"pp=2 x dp=2, v={v}": [] for v in (1, 2)}
    for repeat in range(args.repeats):
        for v, (name, results) in zip((1, 2), runs.items()):
            flags = [f"parallel.virtual_stages={v}"]
            results.append(layout_run(args.procs, 2, [*overrides, *flags], args.steps, args.warmup, tmp))
            print(f"{name} repeat {repeat}: {results[-1]}", file=sys.stderr)
    return layouts_table(runs)


def compile_table(runs: dict[bool, list[dict]]) -> str:
    rows = [("on" if on else "off", spread([x["first_step_ms"] for x in r]), spread([x["step_ms"] for x in r]))
            for on, r in runs.items()]
    return _table(("model.compile", "first step ms", "step ms (median after warmup)"), rows)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--parts", default="layouts,overlap,interleaved,compile")
    parser.add_argument("--bucket-mb", type=float, default=1.0, help="parallel.bucket_mb of the overlap part")
    parser.add_argument("--backend", default="inductor", help="model.compile_backend of the compile part")
    parser.add_argument("overrides", nargs="*", help="config overrides after --; default experiment=demo")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps={args.steps} must exceed --warmup={args.warmup}")
    overrides = args.overrides or ["experiment=demo"]
    with tempfile.TemporaryDirectory(prefix="bench_exposure-") as tmp:
        if "layouts" in args.parts:
            runs: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
            for repeat in range(args.repeats):
                for name, pp in LAYOUTS.items():
                    runs[name].append(layout_run(args.procs, pp, overrides, args.steps, args.warmup, tmp))
                    print(f"{name} repeat {repeat}: {runs[name][-1]}", file=sys.stderr)
            print(layouts_table(runs))
        if "overlap" in args.parts:
            print(overlap_part(args, overrides, tmp))
        if "interleaved" in args.parts:
            print(interleaved_part(args, overrides, tmp))
        if "compile" in args.parts:
            os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"  # the first step pays the whole compilation
            compiled: dict[bool, list[dict]] = {False: [], True: []}
            for repeat in range(args.repeats):
                for on in (False, True):
                    compiled[on].append(compile_run(overrides, on, args.backend, args.steps, args.warmup, tmp))
                    print(f"compile={on} repeat {repeat}: {compiled[on][-1]}", file=sys.stderr)
            print(compile_table(compiled))
    return 0


if __name__ == "__main__":
    sys.exit(main())
