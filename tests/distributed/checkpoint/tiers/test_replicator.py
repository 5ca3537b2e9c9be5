"""Tier-2 replication (megatier/checkpoint/tiers/replicator.py) between spawned gloo processes on simulated nodes.

Most worlds are 2 nodes x 2 ranks: ranks 0,1 on node0 and 2,3 on node1, so 0<->2
and 1<->3 replicate to each other; one world is a ring of 3 nodes (holder !=
owner). Every rank writes its node's Tier-1 area under one shared root and
derives every rank's payloads from fixed seeds, so a receiver can check that its
replica is byte-identical to what the owner sent.
"""
from __future__ import annotations

import os
import random
import time
import uuid
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatier.checkpoint.format.payload import EncodedPayload, Stamp, checksum
from megatier.checkpoint.format.units import PayloadId
from megatier.checkpoint.storage.store import ObjectNotFound
from megatier.checkpoint.tiers.node_memory import NodeMemory
from megatier.checkpoint.tiers.replicator import PeerReplicator
from megatier.faults import Armed, CrashPoint, FaultInjector, no_faults
from megatier.parallel.layout import Layout
from tests.distributed.world import _worker, run_world

pytestmark = pytest.mark.timeout(90)
JOB = "t2test"


def _ring(rank: int, nodes: int, per_node: int) -> tuple[str, int, int]:
    """(node name, holder rank, owner rank) of ``rank`` in a ring of ``nodes`` x ``per_node``."""
    node, local = divmod(rank, per_node)
    return f"node{node}", ((node + 1) % nodes) * per_node + local, ((node - 1) % nodes) * per_node + local


def _payload(rank: int, world: int, pid: PayloadId, size: int) -> EncodedPayload:
    data = random.Random(f"{rank}/{pid}/{size}").randbytes(size)
    return EncodedPayload(data, Stamp(pid, size, checksum(data), JOB, Layout(1, 1, world, 0, 0, rank)))


class _Plan:
    """Which units every rank hands in at which step (the same on every rank), and their sizes."""

    def __init__(self, steps: int, bases: dict[int, int], diff_every: int = 0, diff_size: int = 3000):
        self.steps, self.bases, self.diff_every, self.diff_size = steps, bases, diff_every, diff_size

    def units(self, rank: int, world: int, step: int) -> dict:
        out = {}
        if self.diff_every and step % self.diff_every == self.diff_every - 1:
            pid = PayloadId.diff(step - self.diff_every + 1, step)
            out["diff"] = _payload(rank, world, pid, self.diff_size + 7 * rank)
        if step in self.bases:
            out["base"] = _payload(rank, world, PayloadId.base(step), self.bases[step] + 1000 * rank)
        return out


def _drive(rank: int, world: int, nodes: int, root: str, plan: _Plan, *, base_interval: int, max_chunk: int,
           timeout_s: float = 20.0, fault_hook=no_faults, sleep: float = 0.0, probes: tuple = ()) -> dict:
    """Run ``plan`` through a PeerReplicator; returns stalls, probes (replica complete at step?), status, checks."""
    node, holder, owner = _ring(rank, nodes, world // nodes)
    group = dist.new_group(list(range(world)), backend="gloo", timeout=timedelta(seconds=timeout_s))
    local = NodeMemory(root, JOB, node)
    rep = PeerReplicator(local, rank=rank, holder_rank=holder, owner_rank=owner, group=group,
                         base_interval=base_interval, max_chunk_bytes=max_chunk, timeout_s=timeout_s,
                         fault_hook=fault_hook)
    out: dict = {"stalls": {}, "probes": {}, "error": None}
    try:
        for step in range(plan.steps):
            out["stalls"][step] = rep.on_step(step, **plan.units(rank, world, step))
            for probe_step, version in probes:
                if probe_step == step:
                    out["probes"][step] = [s.pid for s in local.list(replica=True, owner_rank=owner)
                                           if s.pid == PayloadId.base(version)] != []
            time.sleep(sleep)
        rep.flush(timeout_s)
    except RuntimeError as e:
        out["error"] = str(e)
    out["status"] = rep.status()
    rep.close(2.0)
    # Every unit the owner handed in, checked against the replica kept here.
    out["replicas"] = {}
    for step in range(plan.steps):
        for p in plan.units(owner, world, step).values():
            try:
                got = local.load(owner, p.stamp.pid, replica=True)
                out["replicas"][p.stamp.pid] = "ok" if got.data == p.data and got.stamp == p.stamp else "differs"
            except ObjectNotFound:
                out["replicas"][p.stamp.pid] = "missing"
    area = os.path.join(root, JOB, node, "replica", f"rank{owner:05d}")  # only this rank writes there
    out["replica_files"] = sorted(f for _, _, files in os.walk(area) for f in files)
    return out


def _drive_kw(rank, world, nodes, root, plan, kw):
    return _drive(rank, world, nodes, root, plan, **kw)


def _world(tmp_path, plan: _Plan, *, world: int = 4, nodes: int = 2, **kw) -> list[dict]:
    return run_world(_drive_kw, world, tmp_path, world, nodes, str(tmp_path / "shm"), plan, kw, timeout_s=60)


def _all_ok(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert r["error"] is None, f"rank {rank}: {r['error']}"
        assert r["status"].last_error is None, f"rank {rank}: {r['status'].last_error}"
        assert r["replicas"] and set(r["replicas"].values()) == {"ok"}, f"rank {rank}: {r['replicas']}"


def test_diffs_and_bases_arrive_byte_identical(tmp_path):
    plan = _Plan(12, bases={0: 60_000, 4: 60_000, 8: 60_000}, diff_every=2)
    results = _world(tmp_path, plan, base_interval=4, max_chunk=1 << 20)
    _all_ok(results)
    for r in results:
        assert len(r["replicas"]) == 9, r["replicas"]  # 6 diff batches and 3 bases from the owner
        st = r["status"]
        assert st.acked_units == {"diff": PayloadId.diff(10, 11), "base": PayloadId.base(8), "step": None}, st
        assert sorted(st.received) == sorted(r["replicas"]), st.received
        assert st.pending_bytes == 0 and st.sync_flushes == 0
        assert not any(".tmp-" in f for f in r["replica_files"]), r["replica_files"]


def _drive_each(rank, world, nodes, root, scenarios):
    """Several scenarios in one world (each with its own group and Tier-1 root): fewer processes to spawn."""
    return [_drive(rank, world, nodes, f"{root}/{i}", plan, **kw) for i, (plan, kw) in enumerate(scenarios)]


def test_base_chunks_are_paced_and_capped_without_stall(tmp_path):
    # T = 10 - 2 - 2 = 6 steps. Paced: ~800 kB in 6 chunks of ~134 kB (far below the cap), one per step.
    # Capped at 25 kB: 32-33 chunks, so 5-6 fall into each of the 6 steps; it still finishes.
    paced = (_Plan(20, bases={10: 800_000}, diff_every=5),
             {"base_interval": 10, "max_chunk": 1 << 20, "sleep": 0.02, "probes": ((10, 10), (14, 10))})
    capped = (_Plan(10, bases={0: 800_000}), {"base_interval": 10, "max_chunk": 25_000})
    results = run_world(_drive_each, 4, tmp_path, 4, 2, str(tmp_path / "shm"), [paced, capped], timeout_s=60)
    for rank, (p, c) in enumerate(results):
        _all_ok([p, c])
        assert sum(p["stalls"].values()) == 0.0 and sum(c["stalls"].values()) == 0.0, (p["stalls"], c["stalls"])
        assert p["probes"] == {10: False, 14: False}, p["probes"]  # chunks 4..5 are due at steps 15..16
        chunks = [(step, n) for v, step, n in p["status"].base_chunks if v == 10]
        assert chunks == [(step, 1) for step in range(11, 17)], chunks

        chunks = [(step, n) for v, step, n in c["status"].base_chunks if v == 0]
        size = 800_000 + 1000 * rank
        assert sum(n for _, n in chunks) == -(-size // 25_000), chunks  # every chunk at most the cap
        assert {step for step, _ in chunks} == set(range(1, 7)) and max(n for _, n in chunks) >= 5, chunks


def test_new_base_before_previous_finished_flushes_synchronously(tmp_path):
    # Base 0's 8-9 chunks are due at steps 1..6; base 3 arrives first: the rest go at step 3 (stall).
    plan = _Plan(6, bases={0: 400_000, 3: 400_000})
    results = _world(tmp_path, plan, base_interval=10, max_chunk=50_000)
    _all_ok(results)
    for rank, r in enumerate(results):
        st = r["status"]
        assert st.sync_flushes == 1 and r["stalls"][3] > 0, (st, r["stalls"])
        assert [s for s, t in r["stalls"].items() if t > 0] == [3], r["stalls"]
        sent = dict((step, n) for v, step, n in st.base_chunks if v == 0)
        assert sorted(sent) == [1, 2, 3] and sum(sent.values()) == -(-(400_000 + 1000 * rank) // 50_000), sent
        assert sent[3] >= 5, sent  # what was due at steps 3..6 went at step 3
        assert st.acked_units["base"] == PayloadId.base(3)


def _corrupting_drive(rank, world, nodes, root, plan, kw):
    if rank == 0:  # flip one byte of rank 0's second base chunk, after its checksum was taken
        original = PeerReplicator._out_chunk

        def flipped(self, leg, k):
            t = original(self, leg, k)
            if leg.pid.kind == "base" and k == 1:
                t[7] ^= 0xFF
            return t

        PeerReplicator._out_chunk = flipped
    return _drive(rank, world, nodes, root, plan, **kw)


def test_corrupted_chunk_leaves_no_visible_replica(tmp_path):
    plan = _Plan(6, bases={0: 200_000}, diff_every=2)
    results = run_world(_corrupting_drive, 4, tmp_path, 4, 2, str(tmp_path / "shm"), plan,
                        {"base_interval": 5, "max_chunk": 1 << 20}, timeout_s=60)
    bad_base = PayloadId.base(0)
    receiver, sender = results[2], results[0]
    assert receiver["error"] is None and sender["error"] is None
    assert receiver["replicas"][bad_base] == "missing", receiver["replicas"]
    assert {v for pid, v in receiver["replicas"].items() if pid != bad_base} == {"ok"}  # diffs still arrive
    assert "xxh64" in receiver["status"].last_error and "discarded" in receiver["status"].last_error
    assert bad_base not in receiver["status"].received
    assert "rejected base v0 of rank 0" in sender["status"].last_error
    assert sender["status"].acked_units == {"base": None, "diff": PayloadId.diff(4, 5), "step": None}
    assert not any("v00000000.safetensors" in f for f in receiver["replica_files"]), receiver["replica_files"]
    for r in (results[1], results[3]):  # the other pair is unaffected
        assert r["status"].last_error is None and set(r["replicas"].values()) == {"ok"}


def _stopped_hook(point: str, version: int) -> None:
    raise RuntimeError(f"simulated failure at {point} v{version}")


def _crashing_drive(rank, world, nodes, root, plan, kw):
    # Rank 0: the production injector, SIGKILL at its first t2.mid_chunk (after chunk 0 of base 0).
    # Rank 1: its replication thread stops there but the process lives on, silent: rank 3 must time out.
    armed = (Armed(CrashPoint.T2_MID_CHUNK, 0),) if rank == 0 else ()
    hook = _stopped_hook if rank == 1 else FaultInjector(rank, armed)
    out = _drive(rank, world, nodes, root, plan, fault_hook=hook, **kw)
    if rank == 1:
        time.sleep(kw["timeout_s"] + 1.5)
    return out



def _run_with_one_death(run, drive, args) -> list:
    """A world of 4 spawned processes (not run_world: one is meant to die); their exit codes, within 60 s."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, drive, 4, str(run / "store"), str(run), 30.0, args))
             for r in range(4)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 60
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    return codes

def test_sender_dying_mid_chunk_leaves_no_complete_replica(tmp_path):
    plan = _Plan(6, bases={0: 400_000})  # 6 chunks due at steps 1..6
    run = tmp_path / f"world-{uuid.uuid4().hex[:8]}"
    run.mkdir()
    args = (4, 2, str(tmp_path / "shm"), plan, {"base_interval": 10, "max_chunk": 1 << 20, "timeout_s": 2.0,
                                                  "sleep": 0.05})
    codes = _run_with_one_death(run, _crashing_drive, args)
    assert codes == [-9, 0, 0, 0], codes
    results = {r: torch.load(run / f"rank{r}.pt", weights_only=False) for r in (1, 2, 3)}
    assert "simulated failure at t2.mid_chunk v0" in results[1]["error"], results[1]["error"]
    for receiver, sender, detail in ((2, 0, ""), (3, 1, "Timed out")):
        r = results[receiver]
        assert r["error"] is not None and "the peer may have died" in r["error"] and detail in r["error"], r["error"]
        assert f"rank {sender}" in r["error"] and "base v0" in r["error"], r["error"]
        assert r["replicas"][PayloadId.base(0)] == "missing"
        assert r["replica_files"] == [], r["replica_files"]  # the partial file was discarded


def test_ring_of_three_nodes_paces_with_both_neighbours_sizes(tmp_path):
    # holder != owner: rank r sends to r+1 and keeps r-1's replicas; sizes differ per rank.
    plan = _Plan(12, bases={0: 90_000, 5: 90_000, 10: 90_000}, diff_every=3)
    results = _world(tmp_path, plan, world=3, nodes=3, base_interval=5, max_chunk=20_000)
    _all_ok(results)
    for r in results:
        assert len(r["replicas"]) == 7 and r["status"].acked_units["base"] == PayloadId.base(10)
        chunks = [(step, n) for v, step, n in r["status"].base_chunks if v == 0]
        assert {step for step, _ in chunks} <= set(range(1, 3)), chunks  # T = 5 - 2 - 1 = 2 steps


class _StepPlan(_Plan):
    """Base 0, then a step unit every step and a diff batch of steps s-4..s at every fifth step s."""

    def __init__(self, steps: int):
        super().__init__(steps, bases={0: 50_000})

    def units(self, rank: int, world: int, step: int) -> dict:
        if step == 0:
            return super().units(rank, world, step)
        pid = PayloadId.diff(step - 4, step) if step % 5 == 0 else PayloadId.step(step)
        return {"diff": _payload(rank, world, pid, self.diff_size * (5 if pid.kind == "diff" else 1) + 7 * rank)}


def test_step_units_arrive_each_step_and_their_batch_replaces_them(tmp_path):
    results = _world(tmp_path, _StepPlan(13), base_interval=20, max_chunk=1 << 20)
    for r in results:
        assert r["error"] is None and r["status"].last_error is None, r
        st = r["status"]
        assert st.acked_units == {"base": PayloadId.base(0), "diff": PayloadId.diff(6, 10),
                                  "step": PayloadId.step(12)}, st
        covered = {pid: state for pid, state in r["replicas"].items() if pid.kind == "step" and pid.last <= 10}
        assert set(covered.values()) == {"missing"}, covered  # dropped once their batch arrived
        rest = {pid: state for pid, state in r["replicas"].items() if pid not in covered}
        assert set(rest) == {PayloadId.base(0), PayloadId.diff(1, 5), PayloadId.diff(6, 10), PayloadId.step(11),
                             PayloadId.step(12)} and set(rest.values()) == {"ok"}, rest


def _dying_mid_record_drive(rank, world, nodes, root, plan, kw):
    # Rank 0 is SIGKILLed after announcing its step unit 7 to rank 2 and before sending its bytes.
    armed = (Armed(CrashPoint.T2_MID_RECORD, 7),) if rank == 0 else ()
    return _drive(rank, world, nodes, root, plan, fault_hook=FaultInjector(rank, armed), **kw)


def test_a_peer_dying_mid_record_leaves_the_earlier_records_usable(tmp_path):
    from megatier.checkpoint.format.chain import chain_end

    run = tmp_path / f"world-{uuid.uuid4().hex[:8]}"
    run.mkdir()
    args = (4, 2, str(tmp_path / "shm"), _StepPlan(10), {"base_interval": 5, "max_chunk": 1 << 20,
                                                           "timeout_s": 2.0, "sleep": 0.02})
    codes = _run_with_one_death(run, _dying_mid_record_drive, args)
    assert codes == [-9, 0, 0, 0], codes
    receiver = torch.load(run / "rank2.pt", weights_only=False)
    assert "the peer may have died" in receiver["error"] and "rank 0" in receiver["error"], receiver["error"]
    held = {pid for pid, state in receiver["replicas"].items() if state == "ok"}
    assert held == {PayloadId.base(0), PayloadId.diff(1, 5), PayloadId.step(6)}, receiver["replicas"]
    assert not any(".tmp-" in f or "v00000007" in f for f in receiver["replica_files"]), receiver["replica_files"]
    assert chain_end([0], held - {PayloadId.base(0)}) == 6  # a node failure of rank 0 recovers it to step 6
