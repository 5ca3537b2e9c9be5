"""What every checkpoint tier holds for a job, with every payload's checksum verified.

    megatier-inspect --job-id run42
    megatier-inspect --job-id run42 --local-root /dev/shm/megatier \\
        --remote-url s3://bucket/runs --endpoint-url http://127.0.0.1:9000

Tier-1/Tier-2: one row per payload in every node directory under
``<local-root>/<job-id>/`` (own payloads and the replicas a node holds for its
ring predecessor). Tier-3: one row per unit under ``<remote-url>/<job-id>/``,
committed or not, with every rank's object verified against its record.

Exit status: 0 all found payloads verify; 1 nothing was found for the job;
2 a payload failed verification or a tier could not be read.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Optional

from megatier.checkpoint.commit.reader import RemoteReader
from megatier.checkpoint.commit.records import QUARANTINE, SUPERSEDED, CommitError, DoneMarker, list_units, marker_key
from megatier.checkpoint.format.payload import PayloadError, verify_payload
from megatier.checkpoint.format.units import PayloadId
from megatier.checkpoint.tiers.node_memory import NodeMemory
from megatier.checkpoint.tiers.remote import open_remote_store
from megatier.checkpoint.tiers.store import ObjectStore, RetryPolicy, StoreError
from megatier.config import CheckpointConfig, ConfigError

_DEFAULTS = CheckpointConfig()


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


def human(n: int) -> str:
    """Bytes in B, KiB, MiB or GiB."""
    value, unit = float(n), "B"
    for larger in ("KiB", "MiB", "GiB"):
        if value < 1024:
            break
        value, unit = value / 1024, larger
    return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"


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


def render(rows: list[Row]) -> str:
    """Aligned columns; the status column last and unpadded (it may be long)."""
    header = ("tier", "where", "rank", "unit", "size", "xxh64", "status")
    cells = [header] + [(r.tier, r.where, r.rank, r.unit, human(r.size), r.xxh64, r.status) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header) - 1)]
    return "\n".join("  ".join(c[i].ljust(widths[i]) for i in range(len(widths))) + "  " + c[-1] for c in cells)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--job-id", required=True, help="checkpoint.job_id of the run")
    p.add_argument("--local-root", default=_DEFAULTS.local.root, help="checkpoint.local.root (Tier-1/Tier-2)")
    p.add_argument("--remote-url", default=_DEFAULTS.remote.url, help="checkpoint.remote.url (Tier-3)")
    p.add_argument("--endpoint-url", default=None, help="checkpoint.remote.endpoint_url for S3-compatible services")
    p.add_argument("--no-local", action="store_true", help="skip Tier-1/Tier-2")
    p.add_argument("--no-remote", action="store_true", help="skip Tier-3")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    rows: list[Row] = []
    unreadable = []
    if not args.no_local:
        rows += inspect_local(args.local_root, args.job_id)
    if not args.no_remote:
        try:
            store = open_remote_store(args.remote_url, args.job_id, endpoint_url=args.endpoint_url,
                                      retry=RetryPolicy(attempts=3, base_delay_s=0.2, max_delay_s=1.0))
            rows += inspect_remote(store, args.job_id)
        except (ConfigError, StoreError) as err:
            unreadable.append(f"Tier-3 at {args.remote_url}: {err}")
    if rows:
        print(f"checkpoints of job {args.job_id!r}")
        print(render(rows))
    for message in unreadable:
        print(f"error: {message}", file=sys.stderr)
    failed = [r for r in rows if not r.ok]
    if failed:
        print(f"error: {len(failed)} payload(s) failed verification (see FAILED rows); recovery will skip them",
              file=sys.stderr)
        return 2
    if unreadable:
        return 2
    if not rows:
        print(f"error: no checkpoints of job {args.job_id!r} in Tier-1 ({os.path.join(args.local_root, args.job_id)})"
              f" or Tier-3 ({args.remote_url.rstrip('/')}/{args.job_id}); check --job-id, --local-root and "
              f"--remote-url", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
