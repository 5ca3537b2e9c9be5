"""Fast versus durable frequencies: which bases Tier-3 gets (``checkpoint.remote.base_every`` = n).

Node memory (Tier-1) and the ring peer (Tier-2) take every base: the anchor (the base a launch writes at
its start, at step 0 or at the recovery point E) and one every ``base_interval`` steps after it. Tier-3
takes the anchor and every n-th base after it (versions anchor + k * n * base_interval), and every diff
batch, as with n = 1. The rest of the system needs no other change, for these reasons:

- A chain is a base plus units whose steps tile version+1..e without a gap (:mod:`.format.chain`); the
  bases that lie inside those steps play no part in it. From Tier-3's newest committed base D, the
  committed diff batches after D therefore reach the newest committed batch, through the bases Tier-3
  skipped: the rack recovery point keeps moving every diff batch, as with n = 1, and a rack failure
  still loses at most the batches not yet committed. What n costs a rack failure is the replay: up to
  n base intervals of diffs (plus the batches since) instead of one.
- The watermark W (the newest base committed on Tier-3) moves in steps of n base intervals, and
  reclamation against it stays correct as it is (:mod:`.reclaim.policy`): Tier-3 keeps every base at or
  above W and every diff batch ending after the committed base before W (W - n * base_interval), so the
  chain from W to the rack point is whole; node memory drops only units at or before max(W, its own
  ``local.keep_bases``-th newest base), never its newest base and the chain after it, which the software
  and node recovery points need. With W lagging, node memory's own retention floor is the one that acts.
- Tier-3 holds fewer bases and more diffs: ``remote.keep_bases`` committed bases span
  (keep_bases - 1) * n intervals, and the diffs of up to 2 n intervals (:mod:`.plan`). While Tier-3 is
  down, the uploader drops queued units only when a base it gets supersedes them, so the backlog can reach
  n intervals.
- Lossy diffs: error feedback starts afresh at every base (``ShardAccess.base_of``), Tier-3's or not, so a
  replay from D through skipped bases sums the true gradients up to one residual per base crossed (at most
  n) instead of one. Lossless diffs (fp32) replay bit-exactly from any base.

The decision is :func:`uploads_base` (pure); :class:`~megatier.checkpoint.tiers.durable.DurableCadence`
applies it where the save thread puts units into Tier-3, so the tier itself (the commit protocol, or a test's
in-memory tier) is unchanged.
"""
from __future__ import annotations


def uploads_base(version: int, anchor: int, base_interval: int, base_every: int) -> bool:
    """Whether Tier-3 gets the base of ``version``: the anchor and every ``base_every``-th base after it."""
    if base_interval < 1 or base_every < 1:
        raise ValueError(f"base_interval={base_interval} and base_every={base_every} must be >= 1")
    return version >= anchor and (version - anchor) % (base_interval * base_every) == 0
