"""ParallelState's groups in objects built on it: in-process recovery clears every reference to the old groups
(so gloo closes their connections at once) and points the same objects at the re-formed world's."""
from __future__ import annotations

import torch

from megatier.parallel.layers import ColumnParallelLinear
from megatier.parallel.state import attach_groups, build_parallel_state, detach_groups


class _Holder:
    def __init__(self, ps):
        self.dp_group, self.norm_group, self.other = ps.dp_group, ps.world_group, "kept"


def test_the_groups_are_detached_from_their_holders_and_attached_to_the_new_world(process_group):
    ps = process_group
    layer, holder = ColumnParallelLinear(4, 4, group=ps.tp_group), _Holder(ps)
    detached = detach_groups([*layer.modules(), holder], ps)
    assert layer.group is None and holder.dp_group is None and holder.norm_group is None and holder.other == "kept"
    assert sorted(role for _, _, role in detached) == ["dp_group", "tp_group", "world_group"]
    new = build_parallel_state(1, 1, 60.0, torch.device("cpu"))  # the re-formed world's groups
    attach_groups(detached, new)
    assert layer.group is new.tp_group and holder.dp_group is new.dp_group and holder.norm_group is new.world_group
    assert layer(torch.ones(2, 4)).shape == (2, 4)

