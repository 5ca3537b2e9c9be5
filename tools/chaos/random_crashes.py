"""A seeded randomized drill of in-process recovery: crash points, steps and ranks drawn at random.

    python tools/chaos/random_crashes.py --cases 100 --seed 1

Each case is one launch of the same small job (2 nodes x 2 processes, tp=2 x dp=2, lossless diffs, tiers
local, peer and remote) under ``megatier-launch --recovery inprocess`` with a spare on every node and a node
of spares. A case arms one failure, sometimes two: any crash point (:class:`megatier.faults.CrashPoint`, on
the training loop's thread and on the checkpoint threads), at a random step or version, on a random rank;
a crash at a step's end may take its whole node (agent, ranks and spare at once); a second failure may strike
during the recovery of the first (its consensus or replay). The case must end one of two ways:

* recovered in place: exit 0, no traceback, the final ``state_digest`` equal to the fault-free run's;
* or exit 7 (the job could not be re-formed) with one line, and then a relaunch of the same command without
  the failure must end as above.

Prints one row per case and a summary: how each ended, kill to the first step after each recovery, steps
lost. Exit status 0 when every case ended one of those ways.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatier.faults import CrashPoint  # noqa: E402

ITERS = 24
JOB = ["model=tiny", "parallel.tp=2", f"train.iters={ITERS}", "checkpoint=tiered", "checkpoint.base_interval=10",
       "checkpoint.diff.compression=fp32", "logging.wandb.mode=disabled", "logging.progress=false",
       "data.seq_len=64", "train.global_batch_size=4", "train.micro_batch_size=2", "parallel.timeout_s=30",
       "optim.decay_iters=100", "train.eval_interval=1000"]
WORLD = 4
# Points a recovery passes through: the second failure of a case strikes there (a survivor's in-place restore
# reports its step, so ``recover.consensus:1`` fires only after a failure; a replay fires from version 0).
DURING_RECOVERY = [f"{CrashPoint.REPLAY_MID_BATCH}:0", f"{CrashPoint.RECOVER_CONSENSUS}:1"]


@dataclass
class Case:
    index: int
    faults: list[str]
    status: Optional[int] = None
    ended: str = "-"
    fired: list[str] = field(default_factory=list)
    recoveries: list[dict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def draw(rng: random.Random, index: int) -> Case:
    """One case: a crash point at a random step and rank (at a step's end, maybe the whole node), and with
    probability 1/3 a second failure on another rank, during the recovery or at a later step."""
    # The first failure strikes in training (a recovery's own points are reached only after one).
    points = [p for p in CrashPoint if p not in (CrashPoint.REPLAY_MID_BATCH, CrashPoint.RECOVER_CONSENSUS,
                                                 CrashPoint.LAUNCH_FIRST_WORLD)]
    point = rng.choice(points)
    rank = rng.randrange(WORLD)
    step = rng.randint(2, ITERS - 2)
    node = point is CrashPoint.TRAIN_STEP_END and rng.random() < 0.3
    faults = [f"{point}:{step}:{rank}" + (":node" if node else "")]
    if rng.random() < 1 / 3:
        other = rng.choice([r for r in range(WORLD) if r != rank])
        second = rng.choice(DURING_RECOVERY + [f"{CrashPoint.TRAIN_STEP_BEGIN}:{rng.randint(step + 1, ITERS)}"])
        faults.append(f"{second}:{other}")
    return Case(index, faults)


def launch(work: Path, crash_at: Optional[str], timeout_s: float) -> tuple[int, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MEGATIER_NODE_NAME",
                "MEGATIER_CRASH_AT"):
        env.pop(var, None)
    if crash_at:
        env["MEGATIER_CRASH_AT"] = crash_at
    cmd = [sys.executable, "-m", "megatier.cli.launch", "--nodes", "2", "--procs-per-node", "2", "--recovery",
           "inprocess", "--spares-per-node", "1", "--spare-nodes", "1", "--", str(REPO / "pretrain_gpt.py"), *JOB,
           f"checkpoint.local.root={work}/shm", f"checkpoint.remote.url={work}/remote", f"logging.run_dir={work}/run"]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return 124, out
    return proc.returncode, proc.stdout + proc.stderr


def metrics(work: Path) -> list[dict]:
    run = work / "run"
    names = sorted(n for n in os.listdir(run) if n.startswith("metrics")) if run.is_dir() else []
    return [json.loads(line) for n in names for line in (run / n).read_text().splitlines() if line.strip()]


def digest(work: Path) -> Optional[str]:
    summaries = [r for r in metrics(work) if r.get("event") == "summary"]
    return summaries[-1]["state_digest"] if summaries else None


def run_case(case: Case, work: Path, reference: str, timeout_s: float) -> None:
    case.status, out = launch(work, ",".join(case.faults), timeout_s)
    (work / "launch.log").write_text(out)
    case.fired = [line.split("MEGATIER_CRASH_AT: ")[1] for line in out.splitlines() if "MEGATIER_CRASH_AT: " in line]
    case.recoveries = [r for r in metrics(work) if "recovery_total_s" in r]
    if "Traceback" in out:
        case.problems.append("a traceback in the output")
    if case.status == 0:
        case.ended = "in place" if case.fired else "never fired"
    elif case.status == 7:
        case.ended = "exit 7 + relaunch"
        case.status, out = launch(work, None, timeout_s)
        (work / "relaunch.log").write_text(out)
    else:
        case.problems.append(f"exit {case.status}: {_last_lines(out)}")
        return
    if case.status != 0:
        case.problems.append(f"the relaunch exited {case.status}: {_last_lines(out)}")
    elif digest(work) != reference:
        case.problems.append(f"state_digest {digest(work)} differs from the fault-free {reference}")


def _last_lines(out: str) -> str:
    lines = [ln for ln in out.splitlines() if ln.strip() and "%|" not in ln]
    return " | ".join(lines[-3:])[:400]


def report(cases: list[Case], seed: int) -> str:
    rows = [f"{'#':>3} {'armed':<66} {'fired':>5} {'ended':<18} {'rounds':>6} {'lost':>4} {'kill->step s':>12}  "
            f"problems"]
    totals, lost = [], []
    for c in cases:
        times = [r["recovery_total_s"] for r in c.recoveries]
        steps = [r.get("recovery_steps_rerun", 0) for r in c.recoveries]
        totals += times
        lost += steps
        rows.append(f"{c.index:>3} {','.join(c.faults):<66} {len(c.fired):>5} {c.ended:<18} {len(c.recoveries):>6} "
                    f"{max(steps, default=0):>4} {max(times, default=0.0):>12.2f}  {'; '.join(c.problems)}")
    ok = sum(1 for c in cases if not c.problems)
    ended = {k: sum(1 for c in cases if c.ended == k and not c.problems) for k in sorted({c.ended for c in cases})}
    rows.append(f"random in-process crashes: seed {seed}, {len(cases)} cases, {ok} ended as required "
                f"({', '.join(f'{k}: {v}' for k, v in ended.items())})")
    if totals:
        p90 = sorted(totals)[max(0, -(-9 * len(totals) // 10) - 1)]  # nearest rank
        rows.append(f"kill to the first step after it: {len(totals)} recoveries, median {statistics.median(totals):.2f}"
                    f" s, p90 {p90:.2f} s, max {max(totals):.2f} s; steps rerun per recovery: max {max(lost)}")
    rows.append("RESULT: " + ("every case recovered exactly" if ok == len(cases) else "some cases failed"))
    return "\n".join(rows)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", help="where each case's job goes (default: a new temp dir)")
    p.add_argument("--launch-timeout-s", type=float, default=300.0)
    args = p.parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="megatier_random_crashes_")).resolve()
    rng = random.Random(args.seed)
    status, out = launch(work / "reference", None, args.launch_timeout_s)
    reference = digest(work / "reference")
    if status != 0 or reference is None:
        print(f"random_crashes: the fault-free run failed (exit {status}): {_last_lines(out)}", file=sys.stderr)
        return 1
    cases = []
    for i in range(args.cases):
        case = draw(rng, i + 1)
        run_case(case, work / f"case{case.index}", reference, args.launch_timeout_s)
        shutil.rmtree(work / f"case{case.index}" / "shm", ignore_errors=True)
        print(f"random_crashes: case {case.index}/{args.cases} {','.join(case.faults)}: {case.ended}"
              f"{' FAILED: ' + '; '.join(case.problems) if case.problems else ''}", file=sys.stderr, flush=True)
        cases.append(case)
    print(report(cases, args.seed))
    return 0 if all(not c.problems for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
