"""restore() in a world of 4 ranks on 2 simulated nodes (tp=2 x dp=2): every failure class, bit for bit.

One world (spawned once per test process by the ``world`` fixture) runs every
scenario in turn, each in its own directories; the tests check its results.
In each scenario every rank takes 14 optimizer steps of a tiny
ZeRO-1 shard with fixed pseudo-random gradients (the optimizer's own kernel),
keeping a snapshot of its state after every step, and writes its units with
the save-path mechanism: bases at 0 and 8, lossless (fp32) diff batches of 2
steps up to 12, into its node's Tier-1 own area, a replica into the ring
holder's node area, and Tier-3 (bases and diffs up to 10 committed; 11-12
uploaded but left uncommitted because rank 3's marker is missing). Rank 1 got
one batch further (13-14, Tier-1 only). Then rank 0 simulates the failure on
the files, every rank builds a fresh optimizer and calls restore(), and each
rank compares its restored shard and the published parameters with its own
snapshot at E.
"""
from __future__ import annotations

import os
import shutil
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from filelock import FileLock
from torch import nn

from megatier import ops
from megatier.checkpoint.commit.committer import Committer
from megatier.checkpoint.commit.records import DoneMarker, list_units, marker_key, object_key
from megatier.checkpoint.context import build_context
from megatier.checkpoint.format.payload import DiffStep, encode_base, encode_diff_batch
from megatier.checkpoint.format.units import PayloadId
from megatier.checkpoint.recover.inventory import RecoveryError
from megatier.checkpoint.recover.restore import restore
from megatier.checkpoint.shard import ShardAccess
from megatier.checkpoint.tiers.node_memory import NodeMemory
from megatier.checkpoint.tiers.remote import open_remote_store
from megatier.config import CheckpointConfig, DiffStreamConfig, LocalTierConfig, OptimConfig, RemoteTierConfig
from megatier.optim.adamw import DistributedAdamW
from megatier.optim.flat import FlatLayout, flatten_parameters
from megatier.optim.grad_buffer import GradBuffer
from megatier.optim.schedule import LRSchedule
from megatier.parallel.state import build_parallel_state
from tests.distributed.world import run_world

pytestmark = pytest.mark.timeout(150)

JOB = "recjob"
STEPS, BATCH, BASES = 14, 2, (0, 8)
T3_DIFF_END = 10  # committed diffs on Tier-3 end here
TIMEOUT = 30.0
STATE = ("master", "exp_avg", "exp_avg_sq")


class _Tiny(nn.Module):
    """A few odd-sized parameters; the shard boundary splits one of them."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = nn.Parameter(torch.randn(5, 7, generator=g))
        self.b = nn.Parameter(torch.randn(7, generator=g))
        self.v = nn.Parameter(torch.randn(3, 9, generator=g))
        for p in self.parameters():
            p.tp_partition_dim = 0


def _optimizer(ps) -> tuple[DistributedAdamW, ShardAccess]:
    model = _Tiny(100 + ps.tp_rank)
    layout = FlatLayout.from_module(model, ps.dp, tp_rank=ps.tp_rank)
    flat = flatten_parameters(model, layout, torch.float32, torch.device("cpu"))
    grads = GradBuffer(model, layout, torch.device("cpu"), dp_group=ps.dp_group)
    cfg = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_iters=3, weight_decay=0.1)
    opt = DistributedAdamW(cfg, layout, flat, grads, dp_rank=ps.dp_rank, dp_group=ps.dp_group,
                           norm_group=ps.world_group, schedule=LRSchedule(1e-2, 1e-3, 3, STEPS))
    opt._model = model  # keep the parameters' owner alive with the flat buffer
    return opt, ShardAccess(opt, global_batch_size=4)


def _cfg(root: Path, job: str = JOB) -> CheckpointConfig:
    return CheckpointConfig(enabled=True, base_interval=8, job_id=job,
                            diff=DiffStreamConfig(batch=BATCH, compression="fp32"),
                            local=LocalTierConfig(root=str(root / "t1")), remote=RemoteTierConfig(url=str(root / "t3")))


def _world(rank: int, tp: int = 2, swap: bool = False):
    """Ranks 0-1 on node0 and 2-3 on node1 (or the other way round: a relaunch that maps ranks anew)."""
    node = rank // 2 ^ int(swap)
    os.environ.update(MEGATIER_NODE_NAME=f"node{node}", LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2")
    return build_parallel_state(tp, 1, TIMEOUT, torch.device("cpu"))


def _snapshot(opt: DistributedAdamW) -> dict:
    snap = {name: getattr(opt, name).clone() for name in STATE}
    return {**snap, "adam_steps": opt.adam_steps, "params": opt.param_flat.clone()}


def _generate(ctx, ps, opt: DistributedAdamW, shard: ShardAccess, *, tier3: bool = True) -> dict[int, dict]:
    """Train STEPS steps, write every unit as the save path would; returns the snapshot after each step."""
    rank, holder_node = ctx.rank, f"node{(ctx.rank // 2 + 1) % 2}"
    own = NodeMemory(ctx.cfg.local.root, ctx.job_id, ctx.node)
    held = NodeMemory(ctx.cfg.local.root, ctx.job_id, holder_node)
    store, c = open_remote_store(ctx.cfg.remote.url, ctx.job_id), opt.cfg
    committed = []

    def save(payload, *, upload: bool, local_only: bool = False) -> None:
        own.save(payload)
        if local_only:
            return
        held.save(payload, replica=True)
        if tier3 and upload:
            key = object_key(payload.stamp)
            store.put(key, payload.data)
            if not (payload.stamp.pid.last > T3_DIFF_END and rank == 3):
                store.put(marker_key(payload.stamp.pid, rank), DoneMarker(key, payload.stamp, "crashed").to_json())
            committed.append(payload.stamp.pid)

    snaps, steps = {0: _snapshot(opt)}, []
    save(encode_base(shard.capture_base(0), job_id=ctx.job_id, layout=ctx.layout), upload=True)
    for s in range(1, STEPS + 1):
        grad = torch.randn(opt.master.shape, generator=torch.Generator().manual_seed(1000 * rank + s))
        lr = opt.schedule(s)
        opt.adam_steps += 1
        ops.adamw_step(opt.master, opt.exp_avg, opt.exp_avg_sq, grad, opt.adam_steps, lr, c.beta1, c.beta2, c.eps,
                       c.weight_decay, opt.decay_ranges)
        opt.publish_params()
        snaps[s] = _snapshot(opt)
        record = ops.compress_segments(grad, shard.segments, "fp32", seed=s)
        steps.append(DiffStep(s, lr, opt.adam_steps, False, dict(record.tensors), record.header))
        if s % BATCH == 0:
            batch = encode_diff_batch(steps[-BATCH:], job_id=ctx.job_id, layout=ctx.layout)
            if s <= 12:
                save(batch, upload=True)
            elif rank == 1:
                save(batch, upload=False, local_only=True)  # rank 1 got one batch further before the crash
        if s in BASES:
            save(encode_base(shard.capture_base(s), job_id=ctx.job_id, layout=ctx.layout), upload=True)
        if s < STEPS or rank == 1:  # the progress key: rank 1 reached step 14, the others 13
            own.write_progress(rank, s)
    dist.barrier(group=ps.checkpoint_group)
    if tier3 and rank == 0:
        for pid in dict.fromkeys(committed):
            Committer(store, ctx.job_id).try_commit(pid, ctx.world_size)
    dist.barrier(group=ps.checkpoint_group)
    return snaps


class _Hits:
    """Stands in for the FaultInjector: records the crash points recovery passes."""

    def __init__(self):
        self.hits: list[tuple[str, int]] = []

    def __call__(self, point, step: int) -> None:
        self.hits.append((str(point), step))


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _fail(kind: str, root: Path) -> None:
    t1 = root / "t1" / JOB
    if kind == "node":
        shutil.rmtree(t1 / "node1")
    elif kind == "rack":
        shutil.rmtree(t1)
    elif kind == "corrupt":
        _flip(t1 / "node0" / "own" / "rank00001" / "base" / "v00000008.safetensors")
        _flip(t1 / "node1" / "replica" / "rank00001" / "base" / "v00000008.safetensors")
        _flip(t1 / "node1" / "own" / "rank00002" / "diff" / "v00000009-00000010.safetensors")
        # Every copy of rank 3's last batch (Tier-3 never committed it): E must fall back to 10.
        _flip(t1 / "node1" / "own" / "rank00003" / "diff" / "v00000011-00000012.safetensors")
        _flip(t1 / "node0" / "replica" / "rank00003" / "diff" / "v00000011-00000012.safetensors")
    elif kind == "exhausted":  # every copy of rank 2's newest base, Tier-3's too: rank 0 decides again
        _flip(t1 / "node1" / "own" / "rank00002" / "base" / "v00000008.safetensors")
        _flip(t1 / "node0" / "replica" / "rank00002" / "base" / "v00000008.safetensors")
        for path in (root / "t3" / JOB).glob(f"**/{PayloadId.base(8).dirname}/rank00002.*.safetensors"):
            _flip(path)
    # An interrupted Tier-1 write (data, no stamp) that cleanup must sweep.
    if (t1 / "node0").is_dir():
        (t1 / "node0" / "own" / "rank00000" / "diff").mkdir(parents=True, exist_ok=True)
        (t1 / "node0" / "own" / "rank00000" / "diff" / "v00000013-00000014.safetensors").write_bytes(b"x")


def _scenario(rank: int, root: Path, kind: str, ps) -> dict:
    ctx = build_context(_cfg(root), ps, timeout_s=TIMEOUT)
    opt, shard = _optimizer(ps)
    snaps = _generate(ctx, ps, opt, shard)
    if rank == 0:
        _fail(kind, root)
    dist.barrier(group=ps.checkpoint_group)
    if kind == "remap":  # a relaunch: the first launch is gone (its Tier-3 lease released)
        ctx.close()
        ps = _world(rank, swap=True)
        ctx = build_context(_cfg(root), ps, timeout_s=TIMEOUT)
    fresh, fresh_shard = _optimizer(ps)
    ctx.fault = _Hits()
    result = restore(ctx, fresh_shard, allow_fresh_start=False)
    want = snaps[result.end]
    exact = {name: torch.equal(getattr(fresh, name), want[name]) for name in STATE}
    exact["params"] = torch.equal(fresh.param_flat, want["params"])
    exact["adam_steps"] = fresh.adam_steps == want["adam_steps"]
    dist.barrier(group=ps.checkpoint_group)
    own = []
    if rank % 2 == 0 and kind != "remap":  # one rank per node lists the node's own areas after cleanup
        own = [f"rank{e.owner_rank} {e.pid}" for e in NodeMemory(ctx.cfg.local.root, JOB, ctx.node).entries()]
    t3 = sorted(str(p) for p in list_units(open_remote_store(ctx.cfg.remote.url, JOB))) if rank == 0 else []
    ctx.close()
    return {"version": result.version, "end": result.end, "record": result.record, "exact": exact,
            "entries": own, "t3": t3, "hits": ctx.fault.hits}


def _guarded(fn, *args) -> dict:
    """A failing scenario is reported by its tests, not by every test of the world."""
    try:
        return fn(*args)
    except Exception:
        return {"error": traceback.format_exc()}


def _all(rank: int, root: Path) -> dict:
    """Every scenario, one after another in one world (spawning a world costs more than all of them)."""
    ps = _world(rank)
    kinds = ("software", "node", "rack", "corrupt", "exhausted", "remap")
    out = {kind: _guarded(_scenario, rank, root / kind, kind, ps) for kind in kinds}
    out["missing"] = _guarded(_empty_then_missing, rank, root / "missing", ps)
    out["foreign"] = _guarded(_foreign, rank, root / "foreign", ps)  # last: it builds a second layout
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """world(name) -> that scenario's per-rank results.

    The world runs once per pytest run: under xdist the first worker to get
    here runs it and leaves the results in the session's shared temp directory
    for the others (the pattern the pytest-xdist docs give for one-time fixtures).
    """
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    with FileLock(str(shared / "recovery-world.lock")):
        saved = shared / "recovery-world.pt"
        if saved.exists():
            results = torch.load(saved, weights_only=False)
        else:
            root = tmp_path_factory.mktemp("recovery")
            results = run_world(_all, 4, root, root, timeout_s=150)
            torch.save(results, saved)

    def get(name: str) -> list[dict]:
        got = [res[name] for res in results]
        errors = [res["error"] for res in got if "error" in res]
        assert not errors, errors[0]
        return got

    return get


def _check_common(results: list[dict], version: int, end: int) -> dict:
    for r, res in enumerate(results):
        assert (res["version"], res["end"]) == (version, end), (r, res)
        assert all(res["exact"].values()), (r, res["exact"])
        assert res["record"] == results[0]["record"]  # every rank returns the same record
    record = results[0]["record"]
    assert record["event"] == "recovery" and (record["version"], record["end"]) == (version, end)
    for key in ("t_consensus_s", "t_rollback_s", "t_replay_s"):
        assert record[key] >= 0
    assert 0 < record["t_inventory_s"] <= record["t_consensus_s"]  # the listing is part of agreeing
    return record


TORN = "node0 own area: diff v13-14 of rank 0 is incomplete (its write was cut short), ignored"


def test_software_failure_restores_from_own_tier1(world):
    results = world("software")
    record = _check_common(results, 8, 12)
    assert record["failure_class"] == "software"
    assert record["decided_by"] == "nodes"  # the common case: rank 0 decided from the leaders' summaries
    assert record["source_tiers"] == {"tier1": 4, "tier2": 0, "tier3": 0}
    assert record["bytes_tier1"] > 0 and record["bytes_tier2"] == record["bytes_tier3"] == 0
    assert (record["last_step"], record["steps_lost"]) == (14, 2)
    assert record["fallbacks"] == [TORN], record["fallbacks"]  # reported, never replayed
    # Rank 1's batch 13-14 and the interrupted write are gone; nothing at or below E was touched.
    entries = results[0]["entries"] + results[2]["entries"]
    assert not any("v13-14" in e for e in entries), entries
    assert any("base v8" in e for e in entries)
    assert "diff v11-12" in results[0]["t3"]  # uncommitted but not after E: kept
    # The consensus point is passed first, at the version a survivor keeps in memory (none here: 0).
    assert all(res["hits"] == [("recover.consensus", 0), ("replay.mid_batch", 10), ("replay.mid_batch", 12)]
               for res in results)


def test_node_failure_serves_lost_ranks_from_peer_replicas(world):
    results = world("node")
    record = _check_common(results, 8, 12)
    assert record["failure_class"] == "node"
    assert record["decided_by"] == "nodes"
    assert record["source_tiers"] == {"tier1": 2, "tier2": 2, "tier3": 0}
    assert record["bytes_tier2"] > 0 and record["bytes_tier3"] == 0


def test_rack_failure_restores_from_tier3(world):
    results = world("rack")
    record = _check_common(results, 8, T3_DIFF_END)
    assert record["failure_class"] == "rack"
    assert record["decided_by"] == "nodes"  # Tier-3's holdings summarized by rank 0, routed to each leader
    assert record["source_tiers"] == {"tier1": 0, "tier2": 0, "tier3": 4}
    assert record["bytes_tier1"] == record["bytes_tier2"] == 0 < record["bytes_tier3"]
    assert record["last_step"] is None and record["steps_lost"] is None
    assert "diff v11-12" not in results[0]["t3"] and "diff v9-10" in results[0]["t3"]


def test_corrupt_copies_fall_through_and_are_reported(world):
    results = world("corrupt")
    record = _check_common(results, 8, 10)
    assert record["source_tiers"] == {"tier1": 3, "tier2": 0, "tier3": 1}
    assert record["failure_class"] == "mixed"
    assert record["fallbacks"][0] == TORN
    fallbacks = record["fallbacks"][1:]
    assert len(fallbacks) == 5, fallbacks
    assert sum("rank 1 base v8" in f for f in fallbacks) == 2 and any("rank 2 diff v9-10" in f for f in fallbacks)
    assert sum("rank 3 diff v11-12" in f for f in fallbacks) == 2
    assert "diff v11-12" not in results[0]["t3"]
    assert all("xxh64" in f for f in fallbacks)


def test_a_rank_out_of_copies_has_every_rank_restore_the_older_base_and_its_chain(world):
    # Rank 2 finds every copy of base v8 bad (its node, its ring peer's, Tier-3): rank 0 takes the consensus
    # again without them and sends every rank its new plan; all replay from v0 to the same end, bit for bit.
    results = world("exhausted")
    record = _check_common(results, 0, 12)
    assert record["decided_by"] == "rank 0"  # the retry without bad copies takes the whole inventory
    assert record["source_tiers"] == {"tier1": 4, "tier2": 0, "tier3": 0}
    assert sum("rank 2 base v8" in f and "xxh64" in f for f in record["fallbacks"]) == 3, record["fallbacks"]


def test_ranks_on_other_nodes_find_their_units_by_node(world):
    # The relaunch put ranks 0-1 on node1 and 2-3 on node0: each rank's ring replica is now on its own node.
    results = world("remap")
    record = _check_common(results, 8, 12)
    assert record["decided_by"] == "nodes"
    assert record["source_tiers"] == {"tier1": 4, "tier2": 0, "tier3": 0}
    assert record["bytes_tier2"] == record["bytes_tier3"] == 0


def _empty_then_missing(rank: int, root: Path, ps) -> dict:
    ctx = build_context(_cfg(root), ps, timeout_s=TIMEOUT)
    opt, shard = _optimizer(ps)
    out = {"first_launch": restore(ctx, shard, allow_fresh_start=False)}
    _generate(ctx, ps, opt, shard, tier3=False)
    if rank == 0:  # every base of rank 3, wherever it is
        for area in ("node1/own/rank00003", "node0/replica/rank00003"):
            shutil.rmtree(root / "t1" / JOB / area / "base")
    dist.barrier(group=ps.checkpoint_group)
    try:
        restore(ctx, shard, allow_fresh_start=False)
        out["refusal"] = None
    except RecoveryError as e:
        out["refusal"] = str(e)
    out["allowed"] = restore(ctx, shard, allow_fresh_start=True)
    ctx.close()
    return out


def test_nothing_is_a_fresh_start_and_a_missing_base_fails_every_rank(world):
    results = world("missing")
    for res in results:
        assert res["first_launch"] is None and res["allowed"] is None
        refusal = res["refusal"]
        assert refusal is not None and "ranks [3] have no base" in refusal, refusal
        assert "node0, node1" in refusal and str(Path("missing") / "t3" / JOB) in refusal


def _foreign(rank: int, root: Path, ps) -> dict:
    ctx = build_context(_cfg(root), ps, timeout_s=TIMEOUT)
    opt, shard = _optimizer(ps)
    _generate(ctx, ps, opt, shard)
    ctx.close()
    if rank == 0:
        shutil.copytree(root / "t1" / JOB, root / "t1" / "otherjob")
        shutil.copytree(root / "t3" / JOB, root / "t3" / "otherjob")
    dist.barrier(group=ps.checkpoint_group)
    out = {}
    for name, ctx2 in (("job", build_context(_cfg(root, "otherjob"), ps, timeout_s=TIMEOUT)),
                       ("layout", build_context(_cfg(root), _world(rank, tp=1), timeout_s=TIMEOUT))):
        try:
            restore(ctx2, shard, allow_fresh_start=True)
            out[name] = None
        except RecoveryError as e:
            out[name] = str(e)
        ctx2.close()
    return out


def test_another_job_is_refused_and_an_unreshardable_layout_named(world):
    results = world("foreign")
    for res in results:
        assert res["job"] is not None and f"'{JOB}'" in res["job"] and "'otherjob'" in res["job"], res["job"]
        # These units' segment tables predate resharding (no full shapes): named, with the fix.
        assert res["layout"] is not None, res
        assert "resharding tp=2 pp=1 dp=2 -> tp=1 pp=1 dp=4" in res["layout"], res["layout"]
        assert "the layout that wrote it" in res["layout"], res["layout"]
