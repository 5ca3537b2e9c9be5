"""Re-forming a gloo world in the surviving processes: one process of a 2 x 2 world dies, the survivors see
their next collective fail, a spare on its node takes its rank through a membership round, and the new
world's collectives work, all without starting a process."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megatier.parallel.assignment import Member
from megatier.parallel.membership import MembershipRound

pytestmark = pytest.mark.timeout(180)

WORLD = [Member(f"node{n}/{i}", f"node{n}") for n in range(2) for i in range(2)]
SPARE = Member("node0/spare0", "node0")
VICTIM = 1
_SPARE_WAITING = "test/spare_waiting"  # a spare started with the job is idle in the next round before any failure


def _client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))


def _form(rnd: MembershipRound, rank: int, world_size: int) -> None:
    dist.init_process_group("gloo", store=rnd.process_group_store(), rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=10))


def _rank_process(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    store = _client(port)
    _form(MembershipRound(store, 0), rank, len(WORLD))
    x = torch.ones(4)
    dist.all_reduce(x)
    if rank == VICTIM:
        store.wait([_SPARE_WAITING], timedelta(seconds=60))  # a launcher's spares wait in the round ahead
        os._exit(1)  # a crashed process
    failed = time.monotonic()
    try:
        while True:  # the survivors' training goes on until a collective fails
            dist.all_reduce(torch.ones(4))
    except RuntimeError:
        detected = time.monotonic() - failed
    dist.destroy_process_group()
    me = WORLD[rank]
    rnd = MembershipRound(store, 1)
    if rnd.join(me, survivor=True):
        rnd.decide((2, 1, 2), WORLD, deadline_s=30, shrink=False)
    outcome = rnd.outcome(timeout_s=60)
    _finish(rnd, outcome.assignment.rank_of(me.id), outcome, out, me, x, detected)


def _spare_process(port: int, out: str) -> None:
    torch.set_num_threads(1)
    rnd = MembershipRound(_client(port), 1)
    rnd.join(SPARE, survivor=False)
    rnd.store.set(_SPARE_WAITING, "1")
    outcome = rnd.outcome(timeout_s=60)
    _finish(rnd, outcome.assignment.rank_of(SPARE.id), outcome, out, SPARE, None, None)


def _finish(rnd, new_rank, outcome, out, me, before, detected) -> None:
    _form(rnd, new_rank, outcome.assignment.world_size)
    y = torch.full((4,), float(new_rank + 1))
    dist.all_reduce(y)
    dist.destroy_process_group()
    with open(os.path.join(out, me.id.replace("/", "_") + ".json"), "w") as f:
        json.dump({"rank": new_rank, "holders": list(outcome.assignment.holders), "sum": y.tolist(),
                   "before": None if before is None else before.tolist(), "detected_s": detected}, f)


def test_survivors_and_a_spare_reform_the_world_in_process(tmp_path):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    ctx = mp.get_context("spawn")
    ranks = [ctx.Process(target=_rank_process, args=(r, server.port, str(tmp_path))) for r in range(len(WORLD))]
    spare = ctx.Process(target=_spare_process, args=(server.port, str(tmp_path)))
    for p in [*ranks, spare]:
        p.start()
    ranks[VICTIM].join(60)
    assert ranks[VICTIM].exitcode == 1
    MembershipRound(server, 1).report_dead(WORLD[VICTIM].id)  # what the launcher's agent does
    for p in [*ranks, spare]:
        p.join(120)
    assert [p.exitcode for p in ranks] == [0, 1, 0, 0] and spare.exitcode == 0
    results = {m.id: json.loads((tmp_path / (m.id.replace("/", "_") + ".json")).read_text())
               for m in [*WORLD, SPARE] if m is not WORLD[VICTIM]}
    assert {r["rank"] for r in results.values()} == {0, 1, 2, 3} and results[SPARE.id]["rank"] == VICTIM
    assert all(r["holders"] == ["node0/0", "node0/spare0", "node1/0", "node1/1"] for r in results.values())
    assert all(r["sum"] == [10.0] * 4 for r in results.values())  # 1 + 2 + 3 + 4 over the new world
    survivors = [r for m, r in results.items() if m != SPARE.id]
    assert all(r["before"] == [4.0] * 4 and r["detected_s"] < 10 for r in survivors)
