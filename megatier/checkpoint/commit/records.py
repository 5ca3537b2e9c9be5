"""Tier-3 object layout and the two-phase commit that makes a unit a recovery source.

Keys inside the job's store (``<remote.url>/<job_id>/``)::

    base/v00000050/rank00003.<xxh64>.safetensors            rank 3's payload (content-addressed)
    base/v00000050/rank00003.done.json                      rank 3's done marker
    base/v00000050/_COMMITTED                               the commit record of the unit (its header)
    base/v00000050/_ranks.000000-000256.<xxh64>.json        its markers of ranks 0..255 (:mod:`.commit_record`)
    diff/v00000046-00000050/rank00003.<xxh64>.safetensors   diff batches: the same kinds
    diff/v00000046-00000050/rank00003.done.json
    diff/v00000046-00000050/_COMMITTED

Protocol (phase 1 by every rank's uploader, phase 2 by the coordinator):
1. A rank uploads its payload, then writes its done marker: the payload's key
   and stamp (size, xxh64, job id, layout) and the uploader's incarnation.
2. The coordinator (global rank 0) writes ``_COMMITTED`` with a conditional
   create only once it has seen a marker from every rank, all from one
   incarnation, whose objects are listed with the stamped sizes. The record
   names every object, its size and checksum, and the layout, in parts a
   node's leader can read for its own ranks (:mod:`.commit_record`).

Why payload keys carry their checksum: an object is never overwritten with
different bytes. A relaunched job that saves a unit again writes new keys, so a
commit built from older markers still names objects that hold exactly the
bytes it records. Why one incarnation: shards from two runs of the same version
(possible after a lossy replay) are never mixed in one commit.

Nothing without ``_COMMITTED`` is ever returned by
:class:`~megatier.checkpoint.commit.reader.RemoteReader`. Phase 2 lives in
:mod:`.committer`, the read side in :mod:`.reader`, phase 1 in :mod:`.uploader`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from megatier.checkpoint.format.payload import FORMAT, JsonRecord, PayloadError, Stamp
from megatier.checkpoint.format.units import BASE, DIFF, PayloadId, rank_name
from megatier.checkpoint.storage.store import ObjectStore

COMMITTED = "_COMMITTED"
_MARKER = re.compile(r"^rank(\d{5})\.done\.json$")


class CommitError(Exception):
    """Markers that can never form a valid commit (another job, inconsistent layouts, corrupt JSON)."""


def object_key(stamp: Stamp) -> str:
    """Key of a rank's payload object: content-addressed by its xxh64, so it is never overwritten."""
    return f"{stamp.pid.dirname}/{rank_name(stamp.rank)}.{stamp.xxh64}.safetensors"


def marker_key(pid: PayloadId, rank: int) -> str:
    """Key of a rank's done marker for a unit."""
    return f"{pid.dirname}/{rank_name(rank)}.done.json"


def commit_key(pid: PayloadId) -> str:
    """Key of a unit's commit record."""
    return f"{pid.dirname}/{COMMITTED}"


@dataclass(frozen=True)
class DoneMarker(JsonRecord):
    """Phase 1: one rank's statement that ``key`` holds its payload for the unit."""

    key: str
    stamp: Stamp
    incarnation: str
    json_errors = ("done marker", CommitError, "delete it so the rank's uploader can write it again")

    def to_dict(self) -> dict:
        return {"format": FORMAT, "key": self.key, "stamp": self.stamp.to_dict(), "incarnation": self.incarnation}

    @classmethod
    def from_dict(cls, d: dict, source: str) -> "DoneMarker":
        try:
            return cls(str(d["key"]), Stamp.from_dict(d["stamp"], source), str(d["incarnation"]))
        except (KeyError, TypeError, PayloadError) as e:
            raise CommitError(f"{source}: malformed done marker ({type(e).__name__}: {e}); delete it so the "
                              f"rank's uploader can write it again") from e



@dataclass
class UnitListing:
    """The objects of one unit directory on Tier-3."""

    committed: bool = False
    markers: list[int] = field(default_factory=list)
    objects: dict[str, int] = field(default_factory=dict)  # every key of the unit -> size


def _group_units(listing: dict[str, int]) -> dict[PayloadId, UnitListing]:
    """Keys and sizes grouped by the unit directory holding them; keys outside the layout are ignored."""
    units: dict[PayloadId, UnitListing] = {}
    for key, size in listing.items():
        head, _, name = key.rpartition("/")
        pid = PayloadId.from_dirname(head)
        if pid is None:
            continue
        unit = units.setdefault(pid, UnitListing())
        unit.objects[key] = size
        if name == COMMITTED:
            unit.committed = True
        elif (m := _MARKER.match(name)) is not None:
            unit.markers.append(int(m.group(1)))
    return units


def list_units(store: ObjectStore) -> dict[PayloadId, UnitListing]:
    """Group the job's Tier-3 keys by unit (one listing of the whole job)."""
    return _group_units(store.list(""))


def unit_ids(store: ObjectStore) -> set[PayloadId]:
    """The units with a directory on Tier-3 (complete or not), from a listing of the two unit folders alone."""
    return {pid for kind in (BASE, DIFF) for name in store.children(f"{kind}/")
            if (pid := PayloadId.from_dirname(f"{kind}/{name}")) is not None}


def list_unit(store: ObjectStore, pid: PayloadId) -> UnitListing:
    """One unit's objects (an empty listing if it has none)."""
    return _group_units(store.list(f"{pid.dirname}/")).get(pid, UnitListing())


def _deletion_order(key: str) -> tuple[int, str]:
    name = key.rpartition("/")[2]
    return (0 if name == COMMITTED else 1 if name.endswith(".done.json") else 2), key


def delete_unit(store: ObjectStore, keys: list[str]) -> None:
    """Delete one unit's objects so it stops being a source first: ``_COMMITTED``, then done markers,
    then payloads (a crash in between leaves an uncommitted unit, never a commit naming missing bytes)."""
    for key in sorted(keys, key=_deletion_order):
        store.delete(key)


QUARANTINE = "_quarantine/"  # units that failed their checksum
SUPERSEDED = "_superseded/"  # committed units a resumed launch left behind (beyond its recovery point)


def set_aside_units(store: ObjectStore) -> dict[PayloadId, list[str]]:
    """Every unit in the set-aside areas (quarantined or superseded, any number of times) -> its keys."""
    out: dict[PayloadId, list[str]] = {}
    for area in (QUARANTINE, SUPERSEDED):
        for key in store.list(area):
            pid = PayloadId.from_dirname("/".join(key[len(area):].split("/")[:2]))
            if pid is not None:
                out.setdefault(pid, []).append(key)
    return out


def set_aside(store: ObjectStore, pid: PayloadId, keys: list[str], reason: str, when: str,
              area: str = QUARANTINE) -> str:
    """Move one unit's objects aside to ``<area><unit>/<when>/`` (``_COMMITTED`` first, so it stops being a
    recovery source before anything else moves) with a ``REASON`` note; returns that prefix."""
    dest = f"{area}{pid.dirname}/{when}/"
    store.put(f"{dest}REASON", reason.encode())
    for key in sorted(keys, key=_deletion_order):
        store.put(dest + key.rpartition("/")[2], store.get(key))
        store.delete(key)
    return dest
