"""The replica check (``reliability.replica_check_interval``): data-parallel replicas hold the same parameters.

After the optimizer step's all-gather, every rank of a data-parallel group holds the same bytes of the
parameters of its (tensor, pipeline) slice; silent data corruption (a flipped bit in a rank's memory or on the
wire of the all-gather) breaks that without any error. Every ``replica_check_interval`` steps the checkpoint
manager compares a digest of those bytes (xxh64, :meth:`..shard.ShardAccess.replica_digests`) across each
group. A mismatch is named, ranks and step, in a warning and in the step's metrics (``replica_mismatch``),
and the base of that interval, the next base taken at or after the step, is kept from Tier-3 (node memory
still holds it): a state the check found in doubt is never committed. The parameters are then gathered again
from the optimizer's shards at once, which heals a corrupted copy before the next step uses it, and compared
again; the warning says whether they agree now. A check that keeps failing keeps every base from Tier-3.

The decision here is pure: which ranks of each group hold bytes the others do not.
"""
from __future__ import annotations

import collections
from typing import Sequence


def odd_replicas(digests: Sequence[tuple[int, int]]) -> list[int]:
    """The global ranks whose digest differs from their group's majority; every rank of the group when no
    digest has a majority (two replicas that differ cannot say which one is wrong). ``digests``: (global
    rank, digest) for each replica of one group."""
    counts = collections.Counter(d for _, d in digests)
    if len(counts) <= 1:
        return []
    digest, count = counts.most_common(1)[0]
    if 2 * count <= len(digests):
        return sorted(r for r, _ in digests)
    return sorted(r for r, d in digests if d != digest)


def due(step: int, interval: int) -> bool:
    """Whether the check runs after optimizer step ``step`` (never with ``interval`` 0)."""
    return interval > 0 and step % interval == 0
