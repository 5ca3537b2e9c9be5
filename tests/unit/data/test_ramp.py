"""The batch-size ramp-up equals Megatron-core's RampupBatchsizeNumMicroBatchesCalculator, step for step."""
from __future__ import annotations

import pytest

from megatier.data.ramp import BatchRamp

calc = pytest.importorskip("megatron.core.num_microbatches_calculator",
                           reason="megatron-core (a test dependency: make install) is not importable")


def megatron_batches(gbs: int, mbs: int, dp: int, rampup: list[int], iters: int) -> list[int]:
    """The global batch of each iteration as Megatron's loop sets it (update before the step, then consume)."""
    c = calc.RampupBatchsizeNumMicroBatchesCalculator(gbs, mbs, dp, False, 0, *rampup)
    consumed, out = 0, []
    for _ in range(iters):
        c.update(consumed, consistency_check=True)
        out.append(c.get_current_global_batch_size())
        consumed += out[-1]
    return out


@pytest.mark.parametrize("gbs, mbs, dp, rampup", [(32, 2, 2, [8, 8, 200]), (24, 1, 4, [4, 4, 97]),
                                                  (16, 2, 1, [2, 2, 30]), (12, 1, 1, [3, 3, 1])])
def test_the_ramp_equals_megatron_core_step_for_step(gbs, mbs, dp, rampup):
    ramp = BatchRamp.of(gbs, rampup)
    expected = megatron_batches(gbs, mbs, dp, rampup, 40)
    assert [ramp.batch(s) for s in range(1, 41)] == expected
    assert [ramp.consumed_before(s) for s in range(1, 42)] == [sum(expected[:s - 1]) for s in range(1, 42)]
    assert expected[0] == rampup[0] and expected[-1] == gbs


def test_no_ramp_is_the_global_batch_every_step():
    ramp = BatchRamp.of(8, None)
    assert [ramp.batch(s) for s in (1, 2, 50)] == [8, 8, 8] and ramp.consumed_before(11) == 80
