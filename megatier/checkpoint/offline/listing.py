"""What every tier holds for a job, each payload verified: the rows ``megatier-inspect`` prints.

Tier-1/Tier-2: one row per payload in every node directory under ``<local.root>/<job_id>/`` (own payloads and
the replicas a node holds for its ring predecessor). Tier-3: one row per unit under ``<remote.url>/<job_id>/``,
committed or not, with every rank's object checked against its record or done marker, and one per unit set
aside (quarantined or superseded), which no restore ever loads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatier.checkpoint.commit.reader import RemoteReader
from megatier.checkpoint.commit.records import QUARANTINE, SUPERSEDED, CommitError, DoneMarker, list_units, marker_key
from megatier.checkpoint.format.payload import PayloadError, verify_payload
from megatier.checkpoint.format.units import PayloadId
from megatier.checkpoint.storage.store import ObjectStore, StoreError
from megatier.checkpoint.tiers.node_memory import NodeMemory


@dataclass
class Row:
    """One line of the report; ``ok`` False means a verification failure."""

    tier: str
    where: str
    rank: str
    unit: str
    size: int
    xxh64: str
    status: str
    ok: bool = True


def inspect_local(root: str, job_id: str) -> list[Row]:
    """Rows for every Tier-1 payload (own and replica areas) of every node directory."""
    rows = []
    for node in NodeMemory.nodes(root, job_id):
        tier = NodeMemory(root, job_id, node)
        for replica in (False, True):
            label = "Tier-2" if replica else "Tier-1"
            where = f"{node}/{'replica' if replica else 'own'}"
            for e in tier.entries(replica=replica):
                row = Row(label, where, str(e.owner_rank), str(e.pid), e.data_size or 0, "-", "ok")
                if not e.complete:
                    row.status = "incomplete (crashed write; never loaded)"
                else:
                    try:
                        row.xxh64 = tier.load(e.owner_rank, e.pid, replica=replica).stamp.xxh64
                    except (PayloadError, StoreError) as err:
                        row.status, row.ok = f"FAILED: {err}", False
                rows.append(row)
    return rows


def _verify_uncommitted(store: ObjectStore, pid, ranks: list[int]) -> Optional[str]:
    """None if every marked object matches its marker, else the first problem."""
    for r in ranks:
        key = marker_key(pid, r)
        try:
            marker = DoneMarker.from_json(store.get(key), store.describe(key))
            verify_payload(store.get(marker.key), marker.stamp, store.describe(marker.key))
        except (PayloadError, CommitError, StoreError) as err:
            return str(err)
    return None


def inspect_remote(store: ObjectStore, job_id: str) -> list[Row]:
    """Rows for every Tier-3 unit: committed ones verified rank by rank, uncommitted ones by marker."""
    reader = RemoteReader(store, job_id)
    rows = []
    for pid, unit in sorted(list_units(store).items(), key=lambda kv: (kv[0].last, kv[0].kind)):
        row = Row("Tier-3", store.url, "-", str(pid), sum(unit.objects.values()), "-", "")
        if unit.committed:
            try:
                record = reader.record(pid)
                for r in range(record.world_size):
                    reader.load(pid, r)
                row.rank, row.status = f"0-{record.world_size - 1}", f"committed, {record.world_size} verified"
            except (PayloadError, StoreError) as err:
                row.status, row.ok = f"FAILED: {err}", False
        else:
            problem = _verify_uncommitted(store, pid, sorted(unit.markers))
            row.rank = ",".join(map(str, sorted(unit.markers))) or "-"
            row.status = f"uncommitted ({len(unit.markers)} done markers)"
            if problem is not None:
                row.status, row.ok = f"FAILED: {problem}", False
        rows.append(row)
    return rows + inspect_quarantine(store)


def inspect_quarantine(store: ObjectStore) -> list[Row]:
    """Rows for every unit set aside: ``_quarantine/`` (corrupt when a restore read it) and ``_superseded/``
    (committed beyond a later launch's recovery point); neither is ever loaded."""
    rows = []
    for area, label in ((QUARANTINE, "quarantined"), (SUPERSEDED, "superseded")):
        groups: dict[str, dict[str, int]] = {}
        for key, size in store.list(area).items():
            head, _, name = key[len(area):].rpartition("/")
            groups.setdefault(head, {})[name] = size
        for head, objects in sorted(groups.items()):
            dirname, _, when = head.rpartition("/")
            pid = PayloadId.from_dirname(dirname)
            try:
                reason = store.get(f"{area}{head}/REASON").decode(errors="replace")
            except StoreError:
                reason = "no reason recorded"
            rows.append(Row("Tier-3", f"{store.url} {label}", "-", str(pid) if pid else dirname,
                            sum(objects.values()), "-", f"{label} {when}: {reason} (never loaded)"))
    return rows
