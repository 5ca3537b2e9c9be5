"""The one deletion executor every reclaiming caller uses.

Callers decide *what* goes (:mod:`.policy`: the manager's watermark for Tier-1
and Tier-2, the coordinator's for Tier-3, restore's recovery point for
leftovers); this module deletes it the same way for all of them: oldest unit
first (a base before the diff batch ending at the same step), one unit at a
time through the tier's own ``delete`` (which makes a unit stop being a source
before its bytes go), with a crash point after each unit for the drills.
"""
from __future__ import annotations

from typing import Callable, Iterable

from megatier.checkpoint.format.units import PayloadId
from megatier.faults import CrashPoint, FaultHook, no_faults


def oldest_first(units: Iterable[PayloadId]) -> list[PayloadId]:
    return sorted(units, key=lambda p: (p.last, p.kind))


def delete_units(doomed: Iterable[PayloadId], delete: Callable[[PayloadId], None], *,
                 fault: FaultHook = no_faults) -> list[PayloadId]:
    """Delete every unit of ``doomed`` with ``delete``, oldest first; returns them in that order."""
    order = oldest_first(doomed)
    for pid in order:
        delete(pid)
        fault(CrashPoint.GC_MID_DELETE, pid.version)
    return order
