"""Tier-3 as the save thread sees it: every unit, except the bases ``checkpoint.remote.base_every`` skips
(the decision: :func:`megatier.checkpoint.policy.cadence.uploads_base`) and those the replica check withheld
(:mod:`megatier.checkpoint.policy.replicas`)."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from megatier.checkpoint.format.payload import EncodedPayload
from megatier.checkpoint.format.units import BASE, PayloadId
from megatier.checkpoint.policy.cadence import uploads_base
from megatier.checkpoint.tiers.base import TIER3, Copy, Listing, Tier


class DurableCadence(Tier):
    """Tier-3 as the save thread sees it: every unit it is given except the bases :func:`uploads_base`
    skips. Only the save thread holds it (restore, reclamation and the watermark use the tier itself).

    ``anchor`` returns the launch's anchor when a base is put: the manager sets it before it submits the
    anchor base, the first unit of a launch, and never changes it afterwards.
    """

    def __init__(self, tier: Tier, *, base_interval: int, base_every: int, anchor: Callable[[], int]):
        self.tier = tier
        self.label, self.scope, self.lockstep, self.takes_steps = tier.label, tier.scope, False, tier.takes_steps
        self.base_interval, self.base_every, self.anchor = base_interval, base_every, anchor
        self.skipped: list[int] = []  # versions of the bases kept from Tier-3 (Tier-1/Tier-2 have them)
        self._always: set[int] = set()  # versions uploaded whatever the cadence says (the final base)
        self.withheld: set[int] = set()  # versions kept from Tier-3 whatever the cadence says (replica check)

    def upload_always(self, version: int) -> None:
        self._always.add(version)

    def withhold(self, version: int) -> None:
        self.withheld.add(version)

    def put(self, payload: EncodedPayload) -> None:
        pid = payload.stamp.pid
        if pid.kind == BASE and pid.version in self.withheld:
            return
        if (pid.kind == BASE and pid.version not in self._always
                and not uploads_base(pid.version, self.anchor(), self.base_interval, self.base_every)):
            self.skipped.append(pid.version)
            return
        self.tier.put(payload)

    def set_base_interval(self, steps: int) -> None:
        self.base_interval = steps  # base_interval=auto: decided before any base after the anchor

    def list(self) -> Listing:
        return self.tier.list()

    def read(self, copy: Copy) -> EncodedPayload:
        return self.tier.read(copy)

    def delete(self, pid: PayloadId, owner: Optional[int] = None) -> None:
        self.tier.delete(pid, owner)

    def where(self) -> str:
        return self.tier.where()


def save_thread_tiers(tiers: Sequence[Tier], *, base_interval: int, base_every: int,
                      anchor: Callable[[], int], withholds: bool = False) -> list[Tier]:
    """``tiers`` as the save thread puts into them: Tier-3 behind a :class:`DurableCadence` when
    ``base_every`` > 1 or bases may be ``withheld`` (the replica check), every tier as it is otherwise (n = 1:
    Tier-3 gets every base)."""
    if base_every == 1 and not withholds:
        return list(tiers)
    return [DurableCadence(t, base_interval=base_interval, base_every=base_every, anchor=anchor)
            if t.label == TIER3 else t for t in tiers]
