"""One drilled job: where it lives, its config, launching it on the simulated cluster, what it logged, and the
damage a failure class does to its tiers."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from megatier.config import compose_config
from megatier.drill.cluster import LocalCluster
from megatier.drill.spec import DrillError, LaunchSettings


@dataclass
class Job:
    """Where one job lives and what the drill needs to know of its config."""

    work: str
    overrides: list[str]
    job_id: str = ""
    local_root: str = ""
    run_dir: str = ""
    iters: int = 0
    batch: int = 0
    compression: str = ""
    per_step: bool = True
    decay_iters: int = 0  # the LR schedule's horizon (a reference run stopped early keeps it)
    remote_root: str = ""  # the job's Tier-3 directory
    tp: int = 1
    pp: int = 1

    @property
    def tier1_root(self) -> str:
        return os.path.join(self.local_root, self.job_id)

    def node_area(self, node: str) -> str:
        return os.path.join(self.tier1_root, node)


def node_memory_root(work: str) -> str:
    """Where a drill keeps the job's node memory: in /dev/shm, as a real run does (node memory on a disk stalls
    its writes, the ring's replicas too, behind page-cache writeback), one directory per work directory; under
    the work directory where there is no writable /dev/shm."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        tag = hashlib.sha1(os.path.abspath(work).encode()).hexdigest()[:12]
        return os.path.join(shm, "megatier-drill", tag)
    return os.path.join(work, "shm")


def make_job(work: str, user_overrides: Sequence[str], *, isolated: bool = False, memory_root: Optional[str] = None,
             extra: Sequence[str] = ()) -> Job:
    """The job's overrides and the resolved config: the drill's directories first and the user's win, or with
    ``isolated`` (the fault-free reference) the drill's directories and job id last, so the reference never
    shares a tier with the drilled run whatever the user overrides. Node memory goes to ``memory_root``
    (default: under the work directory); ``extra`` overrides go before the user's (the class's defaults)."""
    ours = [f"checkpoint.local.root={memory_root or os.path.join(work, 'shm')}", f"checkpoint.remote.url={work}/remote",
            f"logging.run_dir={work}/run", f"checkpoint.job_id={'reference' if isolated else 'drill'}",
            "logging.progress=false", *extra] + (["checkpoint.remote.endpoint_url=null"] if isolated else [])
    preset = [] if any(o.lstrip("+~").startswith("checkpoint=") for o in user_overrides) else ["checkpoint=tiered"]
    overrides = preset + (list(user_overrides) + ours if isolated else ours + list(user_overrides))
    cfg = compose_config(overrides)
    c = cfg.checkpoint
    if not c.enabled:
        raise DrillError("the overrides turn checkpointing off (checkpoint.enabled=false); a drill needs it on")
    return Job(work, overrides, c.job_id, c.local.root, cfg.logging.run_dir, cfg.train.iters, c.diff.batch,
               c.diff.compression, c.diff.per_step, cfg.optim.decay_iters or cfg.train.iters,
               os.path.join(c.remote.url, c.job_id), cfg.parallel.tp, cfg.parallel.pp)


def trainer_command(overrides: Sequence[str]) -> list[str]:
    """What torchrun runs for a training job: the installed package's entry point, wherever it lives."""
    return ["-m", "megatier.train", *overrides]


def launch(settings: LaunchSettings, job: Job, log_name: str, node_env: Optional[dict] = None) -> int:
    """Run the job once on the simulated cluster; its output goes to ``<work>/<log_name>.log``."""
    log_path = os.path.join(job.work, f"{log_name}.log")
    # Progress on stderr: the launches take minutes and their own output goes to the log.
    print(f"failure_drill: {log_name} on {settings.nodes} x {settings.procs_per_node} processes (log {log_path})",
          file=sys.stderr, flush=True)
    with open(log_path, "w") as log:
        saved = os.dup(1), os.dup(2)
        os.dup2(log.fileno(), 1)  # the agents inherit the drill's stdout/stderr
        os.dup2(log.fileno(), 2)
        try:
            cluster = LocalCluster(settings.nodes, settings.procs_per_node, trainer_command(job.overrides),
                                   node_env=node_env, recovery=settings.recovery,
                                   spares_per_node=settings.spares_per_node, spare_nodes=settings.spare_nodes)
            cluster.start()
            return cluster.wait(fail_grace_s=settings.fail_grace_s, timeout_s=settings.timeout_s)
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


_ERROR_LINE = re.compile(r"^(config error: .*|refusing to .*|\S*(Error|Exception): .*)$")


def first_error(log_path: str) -> str:
    """The first error line of a launch's log (e.g. "config error: ..."), or a note that there is none."""
    try:
        with open(log_path, errors="replace") as f:
            for line in f:
                line = re.sub(r"^\[(default)?\d+\]:", "", line.strip()).strip()  # torchrun's rank prefixes
                if _ERROR_LINE.match(line):
                    return line
    except OSError:
        return "no log"
    return "no error line in its log"


def read_metrics(job: Job, every_launch: bool = False) -> list[dict]:
    """The current launch's metrics records; ``every_launch``: also those of the launches before it, which the
    logger kept as metrics.<n>.jsonl, oldest launch first."""
    names = ["metrics.jsonl"]
    if every_launch and os.path.isdir(job.run_dir):
        older = [n for n in os.listdir(job.run_dir) if re.fullmatch(r"metrics\.\d+\.jsonl", n)]
        names = sorted(older, key=lambda n: int(n.split(".")[1])) + names
    out = []
    for name in names:
        path = os.path.join(job.run_dir, name)
        if os.path.exists(path):
            with open(path) as f:
                out += [json.loads(line) for line in f if line.strip()]
    return out


def recovery_record(records: list[dict]) -> Optional[dict]:
    found = [r for r in records if r.get("event") == "recovery"]
    return found[0] if found else None


def recovery_timeline(records: list[dict]) -> Optional[dict]:
    """The ``recovery_*`` fields of the first step after the launch's restore (the goodput ledger's timing of
    the recovery, from the failure to that step), or None."""
    found = [r for r in records if "recovery_total_s" in r]
    return {k: v for k, v in found[0].items() if k.startswith("recovery_")} if found else None


def summary_record(records: list[dict]) -> dict:
    found = [r for r in records if r.get("event") == "summary"]
    return found[-1] if found else {}


def stage_ranks(stage: int, world_size: int, pp: int) -> list[int]:
    """The global ranks of pipeline stage ``stage`` (the rank formula: tp fastest, then dp, then pp)."""
    per_stage = world_size // pp
    return list(range(stage * per_stage, (stage + 1) * per_stage))


def wipe_ranks(job: Job, ranks: list[int]) -> list[str]:
    """Delete every copy of ``ranks``' units: their own Tier-1 areas and replicas on every node and their Tier-3
    objects (commit records kept: the objects went missing). Returns what was deleted."""
    gone = []
    for r in ranks:
        name = f"rank{r:05d}"
        areas = [os.path.join(job.tier1_root, node, kind, name) for node in
                 (os.listdir(job.tier1_root) if os.path.isdir(job.tier1_root) else []) for kind in ("own", "replica")]
        for path in [a for a in areas if os.path.isdir(a)]:
            shutil.rmtree(path)
            gone.append(path)
        for path in Path(job.remote_root).glob(f"*/*/{name}.*"):
            path.unlink()
            gone.append(str(path))
    return gone


def flip_newest_base_byte(job: Job, node: str) -> str:
    """Flip one byte in the middle of the newest base in ``node``'s own Tier-1 area (first rank there)."""
    own = os.path.join(job.node_area(node), "own")
    ranks = sorted(os.listdir(own)) if os.path.isdir(own) else []
    bases = sorted(Path(own, ranks[0], "base").glob("v*.safetensors")) if ranks else []
    if not bases:
        raise DrillError(f"--corrupt: no base payload in {own} to corrupt")
    path = str(bases[-1])
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    print(f"failure_drill: flipped one byte of {path}", file=sys.stderr)
    return path
