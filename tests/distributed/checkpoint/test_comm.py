"""A checkpoint collective that a rank never reaches names that rank and the operation, on every other rank."""
from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from megatier.checkpoint.comm import CheckpointTimeout, GroupComm
from tests.distributed.world import run_world

pytestmark = pytest.mark.timeout(90)


def _stalled(rank: int) -> str:
    group = dist.new_group([0, 1, 2], timeout=timedelta(seconds=3), backend="gloo")
    comm = GroupComm(group, group, timeout_s=3)
    comm.gather(rank, what="a first round")  # every rank answers
    if rank == 2:
        time.sleep(8)  # as a SIGSTOPped process would: it never shows up in time
        return "slept"
    try:
        comm.gather(rank, what="the watermark sync after step 15")
    except CheckpointTimeout as e:
        return str(e)
    return "no error"


def test_a_stalled_rank_is_named_with_the_operation(tmp_path):
    results = run_world(_stalled, 3, tmp_path, timeout_s=30)
    for message in results[:2]:
        assert "the watermark sync after step 15" in message and "ranks [2] never reached it" in message, message


def _async(rank: int) -> dict:
    group = dist.new_group([0, 1, 2], timeout=timedelta(seconds=3), backend="gloo")
    comm = GroupComm(group, group, timeout_s=3)
    comm.gather(rank, what="a first round")
    if rank == 1:
        time.sleep(1.0)  # arrives late: the others must not wait for it when they start the gather
    t0 = time.perf_counter()
    pending = comm.gather_ints_async([rank, 10 * rank], what="the watermark sync after step 5")
    started_s = time.perf_counter() - t0
    rows = pending.wait()
    out = {"started_s": started_s, "rows": rows, "done": pending.done()}
    if rank == 2:
        time.sleep(8)  # never starts the next one in time
        return out
    pending = comm.gather_ints_async([rank], what="the watermark sync after step 10")
    try:
        pending.wait()
        out["error"] = "no error"
    except CheckpointTimeout as e:
        out["error"] = str(e)
    return out


def test_an_async_gather_does_not_wait_for_late_ranks_and_names_absent_ones(tmp_path):
    results = run_world(_async, 3, tmp_path, timeout_s=30)
    for res in results:
        assert res["rows"] == [[0, 0], [1, 10], [2, 20]] and res["done"]
    assert results[0]["started_s"] < 0.5 and results[2]["started_s"] < 0.5, results
    for res in results[:2]:
        assert "the watermark sync after step 10" in res["error"] and "ranks [2] never reached it" in res["error"]


def _to_and_from_rank0(rank: int) -> dict:
    group = dist.new_group([0, 1, 2], timeout=timedelta(seconds=10), backend="gloo")
    comm = GroupComm(group, group, timeout_s=10)
    collected = comm.collect({"rank": rank, "pad": "x" * (100 * rank)}, what="the recovery inventory")
    plans = [f"plan of rank {r}" for r in range(3)] if rank == 0 else None
    return {"collected": collected, "plan": comm.scatter(plans, what="the recovery plan")}


def test_rank0_collects_every_item_and_each_rank_receives_only_its_own(tmp_path):
    results = run_world(_to_and_from_rank0, 3, tmp_path, timeout_s=30)
    assert [item["rank"] for item in results[0]["collected"]] == [0, 1, 2]
    assert results[1]["collected"] is None and results[2]["collected"] is None
    assert [res["plan"] for res in results] == ["plan of rank 0", "plan of rank 1", "plan of rank 2"]


def _exchanged(rank: int) -> dict:
    group = dist.new_group([0, 1, 2], timeout=timedelta(seconds=10), backend="gloo")
    comm = GroupComm(group, group, timeout_s=10)
    # Every rank sends to both others at once (each pair both ways: a blocking send first would wait on the
    # other's blocking send); rank 2 sends rank 0 nothing (an empty message still arrives).
    outgoing = {peer: (b"" if (rank, peer) == (2, 0) else bytes([rank]) * (1000 * (rank + 1) + peer))
                for peer in range(3) if peer != rank}
    return comm.exchange(outgoing, [peer for peer in range(3) if peer != rank])


def test_an_exchange_sends_and_receives_at_once_without_waiting_on_each_other(tmp_path):
    results = run_world(_exchanged, 3, tmp_path, timeout_s=30)
    for rank, got in enumerate(results):
        want = {src: (b"" if (src, rank) == (2, 0) else bytes([src]) * (1000 * (src + 1) + rank))
                for src in range(3) if src != rank}
        assert got == want, (rank, {s: len(b) for s, b in got.items()})
