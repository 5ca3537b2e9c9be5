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
