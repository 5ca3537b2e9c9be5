"""Tier-2 pacing plan of base replicas (the transfers themselves are tested in tests/distributed)."""
from __future__ import annotations

import pytest

from megatier.checkpoint.tiers.ring import chunk_plan


@pytest.mark.parametrize("base_interval", [2, 3, 5, 10, 20, 50, 200])
@pytest.mark.parametrize("size, other", [(1000, 1000), (37, 5000), (10**6, 10), (1, 1)])
def test_paced_base_replica_is_whole_a_margin_before_the_next_base(base_interval, size, other):
    chunk, n, span = chunk_plan(size, other, base_interval, max_chunk_bytes=1 << 30)
    assert chunk * n >= size and chunk * (n - 1) < size
    v = 100  # handed over at v + 1, chunk k due at v + 2 + k * span // n
    last_due = v + 2 + (n - 1) * span // n
    margin = max(1, base_interval // 5)
    assert last_due <= max(v + 2, v + base_interval - 1 - margin)
    # The bigger payload sets the pace: both ends need the same number of steps.
    assert span == chunk_plan(other, size, base_interval, 1 << 30)[2]
