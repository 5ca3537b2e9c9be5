"""reliability.on_nonfinite and max_consecutive_skips: what a skipped step does to the run (world of one)."""
from __future__ import annotations

import pytest
import torch

from megatier.config import ReliabilityConfig
from megatier.optim.flat import ShardSegment
from megatier.training.nonfinite import NonFiniteGuard, NonFiniteStep, first_nonfinite

SEGMENTS = [ShardSegment("word.weight", 0, 0, 6, (6,), True, True),
            ShardSegment("layers.0.mlp.fc.weight", 6, 0, 4, (4,), True, True)]


def _grad(bad_at=None, value=float("nan")) -> torch.Tensor:
    g = torch.ones(10)
    if bad_at is not None:
        g[bad_at] = value
    return g


def test_the_first_nonfinite_tensor_is_named():
    assert first_nonfinite(_grad(), SEGMENTS) is None
    assert first_nonfinite(_grad(7), SEGMENTS) == "layers.0.mlp.fc.weight"
    assert first_nonfinite(_grad(2, float("-inf")), SEGMENTS) == "word.weight"
    assert first_nonfinite(_grad(8, 2e19), SEGMENTS) == "layers.0.mlp.fc.weight"  # its square overflows fp32


def test_stop_names_the_step_the_rank_and_the_tensor():
    guard = NonFiniteGuard(ReliabilityConfig(), loss_scaled=False, rank=0)
    guard.check(1, False, 2.5, _grad(), SEGMENTS)
    with pytest.raises(NonFiniteStep) as err:
        guard.check(2, True, float("nan"), _grad(7), SEGMENTS)
    line = str(err.value)
    assert "\n" not in line and line.startswith("step 2: the gradient is not finite")
    assert "rank 0: layers.0.mlp.fc.weight" in line and "loss nan" in line
    assert "reliability.on_nonfinite=skip_step" in line


def test_skip_step_skips_until_too_many_in_a_row():
    guard = NonFiniteGuard(ReliabilityConfig(on_nonfinite="skip_step", max_consecutive_skips=3), False, 0)
    for step in (1, 2, 3):
        guard.check(step, True, float("nan"), _grad(0), SEGMENTS)
    guard.check(4, False, 1.0, _grad(), SEGMENTS)  # a good step resets the count
    for step in (5, 6, 7):
        guard.check(step, True, float("nan"), _grad(0), SEGMENTS)
    assert guard.nonfinite_steps == 6
    with pytest.raises(NonFiniteStep, match=r"^step 8: 4 steps with a non-finite loss or gradient in a row, more "
                                            r"than reliability.max_consecutive_skips=3: the run diverged after "
                                            r"step 4"):
        guard.check(8, True, float("nan"), _grad(0), SEGMENTS)


def test_fp16_overflows_are_the_loss_scalers_until_too_many_in_a_row():
    guard = NonFiniteGuard(ReliabilityConfig(max_consecutive_skips=2), loss_scaled=True, rank=0)
    guard.check(1, True, 3.0, _grad(0, float("inf")), SEGMENTS)  # stop does not apply to a scaler's overflow
    guard.check(2, True, 3.0, _grad(0, float("inf")), SEGMENTS)
    assert guard.nonfinite_steps == 0
    with pytest.raises(NonFiniteStep, match=r"3 fp16 overflows .* in a row"):
        guard.check(3, True, 3.0, _grad(0, float("inf")), SEGMENTS)
