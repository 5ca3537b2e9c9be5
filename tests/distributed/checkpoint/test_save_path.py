"""The tiered save path in real training: 2 simulated nodes x 2 processes, gloo, tiny GPT.

Each worker runs the Trainer with checkpointing on, then inspects the tiers
after close(): its own Tier-1 units, the replicas its node holds for the ring
predecessor, and (rank 0) Tier-3's commit records. Payloads are decoded and
compared with the optimizer shard they claim to be.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megatier import ops
from megatier.checkpoint.checkpointer import TrainState, build_checkpointer
from megatier.checkpoint.commit.reader import RemoteReader
from megatier.checkpoint.commit.records import list_units
from megatier.checkpoint.format.payload import decode_base, decode_diff_batch
from megatier.checkpoint.format.units import PayloadId
from megatier.checkpoint.tiers.base import TIER1, TIER2
from megatier.checkpoint.tiers.node_memory import NodeMemory
from megatier.checkpoint.tiers.remote import open_remote_store
from megatier.config import (
    Config,
)
from megatier.ops.records import CompressedRecord
from megatier.training.trainer import Trainer
from tests.checkpoint_fakes import FlakyStore
from tests.conftest import REPO
from tests.distributed.configs import tiny_job
from tests.distributed.world import run_world

pytestmark = pytest.mark.timeout(180)
JOB = "savejob"
WORLD, PER_NODE = 4, 2


def _config(tmp: str, prefix: str, *, iters: int, tp: int = 2, compression: str = "fp32", base_interval: int = 10,
            remote_url: str | None = None, endpoint: str | None = None) -> Config:
    return tiny_job(tmp, JOB, prefix, iters=iters, tp=tp, optim={"decay_iters": None},
                    train={"global_batch_size": 8 // tp, "micro_batch_size": 2 // tp, "seed": 3},
                    checkpoint={"base_interval": base_interval,
                                "diff": {"batch": 5, "compression": compression, "small_threshold": 200},
                                "remote": {"url": remote_url or os.path.join(tmp, "remote"), "endpoint_url": endpoint,
                                           "keep_bases": 2}})


def _as_node(rank: int) -> None:
    os.environ["MEGATIER_NODE_NAME"] = f"node{rank // PER_NODE}"
    os.environ["LOCAL_RANK"] = str(rank % PER_NODE)
    os.environ["LOCAL_WORLD_SIZE"] = str(PER_NODE)


class _Watched:
    """The tiered checkpointer, recording each step's metrics, the state it saw and how much each area held."""

    def __init__(self, manager, optimizer, rank: int, watch_every: int):
        self.manager, self.optimizer, self.rank, self.watch_every = manager, optimizer, rank, watch_every
        tiers = {t.label: t for t in manager.ctx.tiers}
        self.memory: NodeMemory = tiers[TIER1].memory
        self.owner = tiers[TIER2].replicator.owner if TIER2 in tiers else None
        self.held_max = {"own": 0, "replica": 0}
        self.records, self.captured = [], {}

    def restore(self):
        return self.manager.restore()

    def after_step(self, step: int) -> dict:
        out = self.manager.after_step(step)
        self.records.append(out)
        self.captured[step] = (self.optimizer.master.clone(), self.optimizer.last_grad.clone())
        if step % self.watch_every == 0:
            # Reclamation runs on the save thread after the units submitted before it: count once it caught up.
            self.manager.worker.flush(60.0)
            self.held_max["own"] = max(self.held_max["own"], len(self.memory.entries(owner_rank=self.rank)))
            if self.owner is not None:
                self.held_max["replica"] = max(self.held_max["replica"], len(self.memory.entries(
                    replica=True, owner_rank=self.owner)))
        return out

    def close(self, *, failed: bool = False) -> None:
        self.manager.close(failed=failed)


def _train_and_inspect(rank: int, cfg: Config, watch_every: int, flaky_writes: int = 0) -> dict:
    _as_node(rank)

    def factory(state: TrainState) -> _Watched:
        store = None
        if flaky_writes:
            r = cfg.checkpoint.remote
            store = FlakyStore(open_remote_store(r.url, cfg.checkpoint.job_id, endpoint_url=r.endpoint_url),
                               flaky_writes)
        manager = build_checkpointer(cfg.checkpoint, state, timeout_s=cfg.parallel.timeout_s, remote_store=store)
        return _Watched(manager, state.optimizer, rank, watch_every)

    trainer = Trainer(cfg, checkpointer=factory)
    watched = trainer.checkpointer
    manager, ctx = watched.manager, watched.manager.ctx
    trainer.train()
    memory, owner, layout = watched.memory, watched.owner, ctx.layout
    records, captured = watched.records, watched.captured
    trainer.close()
    out = {"records": records, "held_max": watched.held_max, "owner": owner, "node": ctx.node,
           "own": [s.pid for s in memory.list(owner_rank=rank)],
           "replicas": [s.pid for s in memory.list(replica=True, owner_rank=owner)],
           "segments": manager.shard.segments}
    # Every own unit decodes to the shard it claims (lossless: bit for bit) or its compressed image.
    for pid in out["own"]:
        payload = memory.load(rank, pid)
        if pid.kind == "base":
            if pid.version in captured:
                base = decode_base(payload, job_id=JOB, layout=layout, source="t1")
                out.setdefault("base_ok", []).append(torch.equal(base.master, captured[pid.version][0]))
        else:
            for s in decode_diff_batch(payload, job_id=JOB, layout=layout, source="t1"):
                dense = ops.decompress_segments(CompressedRecord(s.header, s.tensors))
                expect = _expected_image(captured, s.step, cfg, manager.shard.segments)
                out.setdefault("diff_ok", []).append(torch.equal(dense, expect))
    # The replicas this node holds are byte-identical to what the owner saved (checked by the owner's stamp).
    out["replica_stamps"] = {pid: memory.load(owner, pid, replica=True).stamp.xxh64 for pid in out["replicas"]}
    out["own_stamps"] = {pid: memory.load(rank, pid).stamp.xxh64 for pid in out["own"]}
    return out


def _expected_image(captured: dict, step: int, cfg: Config, segments) -> torch.Tensor:
    """The gradient image step ``step``'s record must hold: the gradient itself (fp32), or, lossy, the
    compressed gradient plus the error-feedback residual carried from the last base before ``step``."""
    d = cfg.checkpoint.diff
    if d.compression == "fp32":
        return captured[step][1]
    base = (step - 1) // cfg.checkpoint.base_interval * cfg.checkpoint.base_interval
    residual = torch.zeros_like(captured[step][1])
    for t in range(base + 1, step + 1):
        wanted = captured[t][1] + residual
        image = ops.decompress_segments(ops.compress_segments(wanted, segments, d.compression, d.topk_ratio,
                                                              d.small_threshold, seed=t))
        residual = wanted - image
    return image


def _run(tmp_path, corpus_prefix, watch_every: int = 5, flaky_writes: int = 0, **kw) -> list[dict]:
    cfg = _config(str(tmp_path), corpus_prefix, **kw)
    return run_world(_train_and_inspect, WORLD, tmp_path, cfg, watch_every, flaky_writes, timeout_s=120)


@pytest.mark.parametrize("compression", ["fp32", "adaptive"])
def test_tiers_hold_bases_diffs_and_ring_replicas(tmp_path, corpus_prefix, compression):
    results = _run(tmp_path, corpus_prefix, iters=20, compression=compression)
    for rank, r in enumerate(results):
        assert r["base_ok"] and all(r["base_ok"]), (rank, r["base_ok"])
        assert r["diff_ok"] and all(r["diff_ok"]), rank
        # The newest base and the diffs after the watermark are on Tier-1 ...
        assert PayloadId.base(20) in r["own"] and PayloadId.diff(16, 20) in r["own"], (rank, r["own"])
        # ... and the ring predecessor's (same local rank on the other node) replicas are here, byte-identical.
        assert r["owner"] == (rank + PER_NODE) % WORLD
        owner = results[r["owner"]]
        assert r["replicas"] and set(r["replicas"]) <= set(owner["own"]) | {PayloadId.base(0)}, r["replicas"]
        for pid, digest in r["replica_stamps"].items():
            if pid in owner["own_stamps"]:
                assert owner["own_stamps"][pid] == digest, pid
    last = results[0]["records"][-1]
    # Recovery points: everything reached Tier-1 and Tier-2 by the end; Tier-3 lags by at most a batch or two.
    # The watermark sync of a batch end is read at the next one (it never holds the loop), so the figures of the
    # last step may be those of the sync after step 15.
    assert last["rpo_software"] is not None and last["rpo_software"] >= 14, last
    assert last["watermark"] is not None, last  # base 0 at least; base 10's commit may be newer than that sync
    store = open_remote_store(str(tmp_path / "remote"), JOB)
    committed = RemoteReader(store, JOB).committed()
    assert PayloadId.base(20) in {c.pid for c in committed}
    for pid, unit in list_units(store).items():
        if unit.committed:
            assert len(unit.markers) == WORLD, pid


def test_s3_remote_behaves_like_the_directory(tmp_path, corpus_prefix, s3_url):
    url, endpoint = s3_url
    _run(tmp_path, corpus_prefix, iters=10, remote_url=url, endpoint=endpoint)
    store = open_remote_store(url, JOB, endpoint_url=endpoint)
    assert {PayloadId.base(0), PayloadId.base(10), PayloadId.diff(6, 10)} <= {
        c.pid for c in RemoteReader(store, JOB).committed()}


def test_remote_failing_its_first_writes_is_retried_and_commits(tmp_path, corpus_prefix):
    _run(tmp_path, corpus_prefix, iters=10, flaky_writes=3)
    store = open_remote_store(str(tmp_path / "remote"), JOB)
    # The bases are retried until they commit. Diff batches 1-5 and 6-10 commit too unless base 10 reached the
    # uploader while it was still backing off: then it supersedes them (the backlog of an outage stays one
    # interval), so they are not required here.
    assert {PayloadId.base(0), PayloadId.base(10)} <= {c.pid for c in RemoteReader(store, JOB).committed()}


@pytest.mark.slow
def test_reclamation_bounds_tier1_and_tier2_over_300_steps(tmp_path, corpus_prefix):
    results = _run(tmp_path, corpus_prefix, watch_every=5, iters=300, tp=1, base_interval=25)
    batches_per_interval = 25 // 5
    bound = 2 + 2 * batches_per_interval  # two bases plus two intervals of diff batches
    for rank, r in enumerate(results):
        assert 0 < r["held_max"]["own"] <= bound, (rank, r["held_max"])
        assert 0 < r["held_max"]["replica"] <= bound, (rank, r["held_max"])
    watermarks = [rec["watermark"] for rec in results[0]["records"] if rec["watermark"] is not None]
    assert watermarks == sorted(watermarks) and watermarks[-1] >= 250
    store = open_remote_store(str(tmp_path / "remote"), JOB)
    bases = sorted(p.version for p, u in list_units(store).items() if p.kind == "base" and u.committed)
    assert len(bases) <= 3, bases  # keep_bases=2 at or below W, plus at most one newer


def _launch(tmp_path, corpus_prefix, *overrides: str, env_extra: dict) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", **env_extra)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MEGATIER_NODE_NAME"):
        env.pop(var, None)
    cmd = [sys.executable, str(REPO / "scripts" / "launch_local_cluster.py"), "--nodes", "2", "--procs-per-node", "1",
           "--fail-grace-s", "10", "--", "pretrain_gpt.py", "model=tiny", f"data.prefix={corpus_prefix}",
           "data.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=2", "train.iters=20",
           "logging.progress=false", f"logging.run_dir={tmp_path}/run", "checkpoint=tiered",
           f"checkpoint.local.root={tmp_path}/shm", f"checkpoint.remote.url={tmp_path}/remote",
           f"checkpoint.job_id={JOB}", "checkpoint.base_interval=10", "parallel.timeout_s=30", *overrides]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=150)


def test_crash_between_object_and_marker_leaves_the_version_uncommitted(tmp_path, corpus_prefix):
    proc = _launch(tmp_path, corpus_prefix, env_extra={"MEGATIER_CRASH_AT": "t3.before_marker:10:1"})
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "crashing at t3.before_marker" in proc.stderr
    store = open_remote_store(str(tmp_path / "remote"), JOB)
    units = list_units(store)
    # after_step(10) submits the diff batch 6-10 before base 10, so rank 1 dies between that
    # batch's object and its marker; nothing of version 10 may be committed.
    unit = units[PayloadId.diff(6, 10)]
    assert not unit.committed and 1 not in unit.markers
    assert any(k.startswith("diff/v00000006-00000010/rank00001.") and k.endswith(".safetensors")
               for k in unit.objects)
    assert units[PayloadId.base(0)].committed
    assert all(not u.committed for p, u in units.items() if p.version >= 10)
