"""Named crash points for failure drills, armed by ``MEGATIER_CRASH_AT``.

    MEGATIER_CRASH_AT=<point>:<step>[:<rank>]

kills this process with SIGKILL (no cleanup, no flush: a real crash) the first
time code reaches ``point`` for a step or version at or after ``step``, on
``rank`` only when given, else on every rank that gets there. Checkpoint code
calls :meth:`FaultInjector.hit` at each point; when nothing is armed that is
one string comparison.

Points (where the crash lands, what it proves):
  t1.mid_write                         a Tier-1 payload written, its stamp not: the unit stays invisible
  t2.mid_chunk                         a paced base replica half sent: the receiver discards it
  t3.before_marker                     a rank's Tier-3 object uploaded, its done marker not: no commit
  t3.before_commit                     every marker in, ``_COMMITTED`` not written: no commit
  t3.after_commit_before_watermark     committed on Tier-3, the watermark not yet advanced
  gc.mid_delete                        reclamation interrupted between two deletions
  replay.mid_batch                     recovery killed while replaying the diff chain
  train.step_end                       the training process dies after step S and its checkpoint hand-off:
                                       how failure_drill.py kills a node's processes at a known step
"""
from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from typing import Optional

ENV = "MEGATIER_CRASH_AT"
CRASH_POINTS = (
    "t1.mid_write",
    "t2.mid_chunk",
    "t3.before_marker",
    "t3.before_commit",
    "t3.after_commit_before_watermark",
    "gc.mid_delete",
    "replay.mid_batch",
    "train.step_end",
)


@dataclass(frozen=True)
class FaultInjector:
    """Crashes this process at an armed point; a disarmed injector (``point is None``) does nothing."""

    rank: int
    point: Optional[str] = None
    step: int = 0
    only_rank: Optional[int] = None

    @classmethod
    def from_env(cls, rank: int, environ: Optional[dict] = None) -> "FaultInjector":
        """Parse ``MEGATIER_CRASH_AT``; a malformed value is an error that shows the expected form."""
        spec = (environ if environ is not None else os.environ).get(ENV, "").strip()
        if not spec:
            return cls(rank)
        parts = spec.split(":")
        usage = (f"{ENV}={spec!r} is not <point>:<step>[:<rank>] with point one of {', '.join(CRASH_POINTS)}; "
                 f"fix or unset it")
        if len(parts) not in (2, 3) or parts[0] not in CRASH_POINTS:
            raise ValueError(usage)
        try:
            step = int(parts[1])
            only_rank = int(parts[2]) if len(parts) == 3 else None
        except ValueError:
            raise ValueError(usage) from None
        return cls(rank, parts[0], step, only_rank)

    @property
    def armed(self) -> bool:
        return self.point is not None and (self.only_rank is None or self.only_rank == self.rank)

    def hit(self, point: str, step: int) -> None:
        """Crash here if ``point`` is armed for ``step`` (at or after the armed step) on this rank."""
        if point != self.point or not self.armed or step < self.step:
            return
        sys.stderr.write(f"[megatier] {ENV}: rank {self.rank} crashing at {point} (step {step})\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    # The checkpoint mechanism takes a plain ``hook(point, version)`` callable.
    __call__ = hit
