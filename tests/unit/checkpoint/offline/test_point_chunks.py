"""The export's recovery point never mixes copies written at the same degrees with other model chunks.

At (tp, pp, dp) = (1, 2, 1) a run with parallel.virtual_stages=1 and one with 2 gave rank 0 other layers
(0-1 against 0 and 2), so their copies make separate layouts. Here the v=1 run's ranks both hold base 0 and
the diffs to 4, and only rank 1 its base 6; the v=2 run left rank 0's base 6 alone. By degrees alone both
ranks would hold base 6 and the point would be (6, 8), each rank's state from another run.
"""
from __future__ import annotations

import dataclasses

import pytest

from megatier.checkpoint.offline.state import choose_point, reachable_points
from megatier.checkpoint.offline.tiers import ExportError, Holdings
from tests.unit.checkpoint.recover.test_consensus import B, D, copies

pytestmark = pytest.mark.timeout(60)

DEG = (1, 2, 1)
FINGERPRINTS = {"fpv1": {"model.num_layers": "4"},  # no parallel.virtual_stages: written as 1
                "fpv2": {"model.num_layers": "4", "parallel.virtual_stages": "2"}}


def _written(fp: str, ranks, pids) -> list:
    return [dataclasses.replace(c, stamp=dataclasses.replace(c.stamp, fingerprint=fp))
            for c in copies(ranks, pids, degrees=DEG)]


def _holdings() -> Holdings:
    cs = (_written("fpv1", [0, 1], [B(0), D(1, 2), D(3, 4)]) + _written("fpv1", [1], [B(6), D(7, 8)])
          + _written("fpv2", [0], [B(6), D(7, 8)]))
    return Holdings(copies=cs, fingerprints=FINGERPRINTS, traces=True, looked=["Tier-1"])


def test_each_virtual_stages_is_a_layout_of_its_own():
    points = reachable_points(_holdings().copies, "job", FINGERPRINTS)
    assert points == {(DEG, 1): {0: set(range(5))}, (DEG, 2): {}}


@pytest.mark.parametrize("step", [None, 4, 2])
def test_the_point_is_read_from_one_virtual_stages_only(step):
    point = choose_point(_holdings(), "job", step)
    assert (point.version, point.end) == (0, step or 4)
    assert {c.stamp.fingerprint for cs in point.copies.values() for c in cs} == {"fpv1"}


def test_a_step_only_mixed_copies_reach_is_no_point():
    with pytest.raises(ExportError, match=r"step 8 is not a recovery point .* reaches steps 0-4 \(.*\)"):
        choose_point(_holdings(), "job", 8)
