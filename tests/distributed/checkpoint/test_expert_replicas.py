"""The replica check under expert parallelism: dp ranks holding other experts are not odd replicas, a corrupted
expert is found (its ep group differs from the other groups), and a corrupted dense parameter names its rank."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatier.checkpoint.policy.replicas import odd_replicas
from megatier.checkpoint.shard import ShardAccess
from tests.distributed.world import run_world

pytestmark = pytest.mark.timeout(60)
DENSE = 6


CASES = [(2, "", []), (4, "", []), (1, "expert", [3]), (2, "dense", [3]),
         (2, "expert", [0, 1, 2, 3])]  # ep=2, a corrupted expert: ep groups {0, 2} and {1, 3} differ, a tie


def _digests(params: torch.Tensor, edp: int) -> list[tuple[int, int]]:
    layout = SimpleNamespace(dense_numel=DENSE, edp=edp)
    optimizer = SimpleNamespace(param_flat=params, layout=layout, dp_group=dist.group.WORLD)
    return ShardAccess.replica_digests(SimpleNamespace(optimizer=optimizer))


def _odd(rank: int) -> list[list[int]]:
    """Each case on 4 dp ranks: rank d holds expert block d // (4 / ep); rank 3's copy corrupted."""
    out = []
    for ep, corrupt, _ in CASES:
        edp = 4 // ep
        params = torch.cat([torch.arange(DENSE, dtype=torch.float32), torch.full((4,), float(rank // edp))])
        if rank == 3 and corrupt:
            params[0 if corrupt == "dense" else DENSE] += 1.0
        out.append(odd_replicas(_digests(params, edp)))
    return out


def test_replica_check_compares_experts_within_their_ep_groups(tmp_path):
    want = [odd for _, _, odd in CASES]
    assert run_world(_odd, 4, tmp_path, timeout_s=30) == [want] * 4
