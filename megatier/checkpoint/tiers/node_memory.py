"""NodeMemory: one node's checkpoint area in memory that outlives the training process.

It is the storage under two tiers: Tier-1 (:mod:`.local`, a rank's own units)
and Tier-2 (:mod:`.peer`, the replicas a node keeps for its ring predecessor).

Layout under ``<local.root>/<job_id>/<node>/`` (files on /dev/shm by default)::

    own/rank00003/base/v00000050.safetensors            rank 3's base at version 50
    own/rank00003/base/v00000050.json                   its stamp (size, xxh64, job, layout)
    own/rank00003/diff/v00000046-00000050.safetensors   rank 3's diff batch of steps 46..50
    own/rank00003/diff/v00000046-00000050.json
    own/rank00003/step/v00000052.safetensors            step 52's record while batch 51..55 is open
    own/rank00003/step/v00000052.json
    replica/rank00001/base/v00000050.safetensors        rank 1's replica, held here (Tier-2)
    replica/rank00001/base/v00000050.json
    progress/rank00003                                  the newest step rank 3 reached (steps lost)
    spare/own/rank00003/<hex>.spare                     a deleted unit's file, to be written over (:mod:`.spare`)
    fingerprints/<id>.json                              a config fingerprint the units' stamps name
    restores.json                                       the job's restore history (the restart-loop guard)

Invariants:
- A payload is complete exactly when its stamp exists. The data file is written
  (atomically) first, the stamp last; a re-save removes the old stamp before
  touching the data. A crash anywhere leaves the payload either complete and
  valid, or without a stamp and therefore invisible.
- A diff batch, once complete, makes the step units it covers redundant: the
  save removes them (a crash in between leaves both; the chain walk prefers
  the batch and reclamation removes the rest).
- Each area (``own/rankR``, ``replica/rankO``) has one writer: rank R, or the
  holder of O's replica. So a rank may sweep its own areas' leftovers without
  racing other processes on the node.
- Nothing is fsynced. The area must outlive the process, and a written file
  does once it is in the page cache; what fsync adds is surviving the node's
  own crash, which the failure classes count as losing this area anyway. (With
  ``local.root`` on a disk, an fsync per step unit and per replica held the
  loop up for up to a second on a loaded box; on /dev/shm fsync is a no-op.)
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import weakref
from dataclasses import dataclass
from typing import Optional

import xxhash

from megatier.checkpoint.format.payload import EncodedPayload, PayloadDraft, PayloadError, Stamp, verify_payload
from megatier.checkpoint.format.units import DIFF, PayloadId, check_path_component, parse_rank_name, rank_name
from megatier.checkpoint.storage.directory import DirectoryStore, PartialFile
from megatier.checkpoint.storage.spare import SPARE_ROOT, SparePool
from megatier.checkpoint.storage.store import ObjectNotFound, StoreError
from megatier.faults import CrashPoint, FaultHook, no_faults

log = logging.getLogger(__name__)


def read_fingerprints(store, prefix: str) -> dict[str, dict]:
    """``<prefix><id>.json`` objects of ``store`` as id -> fingerprint; unreadable ones are logged and skipped."""
    out = {}
    for key in store.list(prefix):
        name = key[len(prefix):]
        try:
            out[name.removesuffix(".json")] = json.loads(store.get(key))
        except (StoreError, ValueError) as e:
            log.warning("ignoring config fingerprint %s: %s", store.describe(key), e)
    return out

def read_history(store, key: str) -> list[dict]:
    """The job's restore history (megatier.checkpoint.recover.loops) kept at ``key``; [] if there is none or it
    cannot be read (logged: the guard then counts from the next restore)."""
    try:
        history = json.loads(store.get(key))
    except ObjectNotFound:
        return []
    except (StoreError, ValueError) as e:
        log.warning("ignoring the restore history %s: %s", store.describe(key), e)
        return []
    return history if isinstance(history, list) else []


def write_history(store, key: str, history: list[dict]) -> None:
    store.put(key, json.dumps(history, sort_keys=True).encode())


_DATA, _STAMP = ".safetensors", ".json"
_PROGRESS = "progress/"
_FINGERPRINTS = "fingerprints/"
_RESTORES = "restores.json"


def _area(owner_rank: int, replica: bool) -> str:
    return f"{'replica' if replica else 'own'}/{rank_name(owner_rank)}"


@dataclass(frozen=True)
class LocalEntry:
    """One unit found in an area: which files of it exist (a complete one has both)."""

    owner_rank: int
    replica: bool
    pid: PayloadId
    data_size: Optional[int]
    has_stamp: bool

    @property
    def complete(self) -> bool:
        return self.data_size is not None and self.has_stamp


@dataclass(frozen=True)
class CaptureArea:
    """Where a spread base capture's finished parts wait, with the spare files of parts already read back:
    each capture writes over the pages of the one before."""

    directory: str
    spares: SparePool


class NodeMemory:
    """The checkpoint area of node ``node`` for job ``job_id`` under ``root``."""

    def __init__(self, root: str, job_id: str, node: str, *, fault_hook: FaultHook = no_faults):
        check_path_component(job_id, "checkpoint.job_id")
        check_path_component(node, "node name")
        self.node = node
        self.store = DirectoryStore(os.path.join(root, job_id, node), fsync=False)  # see the module docstring
        self.fault_hook = fault_hook
        self._spares: dict[str, SparePool] = {}  # area -> its pool, for the areas this process wrote to
        self._mapped: dict[str, weakref.ref] = {}  # data key -> the map save_draft returned (alive: not a spare)
        self._keep_spares = True  # False once released for good (closing): deleted files are deleted

    @staticmethod
    def nodes(root: str, job_id: str) -> list[str]:
        """Node directories present for ``job_id`` under ``root`` (sorted)."""
        job_dir = os.path.join(os.path.abspath(os.path.expanduser(root)), job_id)
        if not os.path.isdir(job_dir):
            return []
        return sorted(n for n in os.listdir(job_dir) if os.path.isdir(os.path.join(job_dir, n)))

    def _keys(self, owner_rank: int, pid: PayloadId, replica: bool) -> tuple[str, str]:
        base = f"{_area(owner_rank, replica)}/{pid.dirname}"
        return base + _DATA, base + _STAMP

    def describe(self, owner_rank: int, pid: PayloadId, replica: bool = False) -> str:
        return self.store.describe(self._keys(owner_rank, pid, replica)[0])

    def save(self, payload: EncodedPayload, *, replica: bool = False) -> None:
        """Write a payload whole (own area of its rank, or the replica area); atomic as described above."""
        stamp = payload.stamp
        data_key, stamp_key = self._keys(stamp.rank, stamp.pid, replica)
        self.store.delete(stamp_key)
        spare = self._pool(stamp.rank, replica).take(stamp.size)
        self.store.put_pieces(data_key, (payload.data,), spare)
        self.fault_hook(CrashPoint.T1_MID_WRITE, stamp.pid.version)
        self.store.put(stamp_key, stamp.to_json())
        self._drop_covered_steps(stamp.rank, stamp.pid, replica)

    def save_draft(self, draft: PayloadDraft) -> EncodedPayload:
        """Serialize ``draft`` straight into its rank's own area; atomic as :meth:`save`.

        Returns the payload with ``data`` a read-only map of the written file, so
        Tier-2 and Tier-3 send this very memory and the tensors are copied once.
        """
        data_key, stamp_key = self._keys(draft.layout.rank, draft.pid, False)
        self.store.delete(stamp_key)
        pieces = draft.pieces()
        stamp = draft.stamp_of_pieces(pieces)  # what is written, hashed from memory (verified when read back)
        spare = self._pool(draft.layout.rank, False).take(stamp.size)
        self.store.put_pieces(data_key, pieces, spare)
        source, data = self.store.open_mapped(data_key)
        self._mapped[data_key] = weakref.ref(data)
        payload = EncodedPayload(data, stamp, source)
        self.fault_hook(CrashPoint.T1_MID_WRITE, draft.pid.version)
        self.store.put(stamp_key, payload.stamp.to_json())
        self._drop_covered_steps(draft.layout.rank, draft.pid, False)
        return payload

    def _drop_covered_steps(self, owner_rank: int, pid: PayloadId, replica: bool) -> None:
        """After diff batch ``pid`` is complete: remove the step units of its steps (see the invariants)."""
        if pid.kind == DIFF:
            for step in range(pid.first, pid.last + 1):
                self.delete(owner_rank, PayloadId.step(step), replica=replica)

    def begin_replica(self, stamp: Stamp) -> "ReplicaWriter":
        """Receive the replica that ``stamp`` describes chunk by chunk (Tier-2 paced transfer)."""
        data_key, stamp_key = self._keys(stamp.rank, stamp.pid, True)
        self.store.delete(stamp_key)
        spare = self._pool(stamp.rank, True).take(stamp.size)
        return ReplicaWriter(self.store, stamp, data_key, stamp_key, spare)

    def load(self, owner_rank: int, pid: PayloadId, *, replica: bool = False) -> EncodedPayload:
        """The complete payload, checksum-verified; ObjectNotFound if absent, PayloadError if bad."""
        data_key, stamp_key = self._keys(owner_rank, pid, replica)
        source = self.store.describe(data_key)
        try:
            stamp = Stamp.from_json(self.store.get(stamp_key), self.store.describe(stamp_key))
        except ObjectNotFound as e:
            raise ObjectNotFound(f"{source}: no complete payload (its stamp is missing)") from e
        if stamp.pid != pid or stamp.rank != owner_rank:
            raise PayloadError(f"{source}: stamp describes {stamp.pid} of rank {stamp.rank}, expected {pid} "
                               f"of rank {owner_rank}")
        data = self.store.get(data_key)
        verify_payload(data, stamp, source)
        return EncodedPayload(data, stamp)

    def entries(self, *, replica: bool = False, owner_rank: Optional[int] = None) -> list[LocalEntry]:
        """Every unit with any file in the area(s), complete or not, sorted by (owner, unit)."""
        prefix = f"{_area(owner_rank, replica)}/" if owner_rank is not None else f"{'replica' if replica else 'own'}/"
        found: dict[tuple[int, PayloadId], dict] = {}
        for key, size in self.store.list(prefix).items():
            parts = key.split("/")
            if len(parts) != 4:
                continue
            owner = parse_rank_name(parts[1])
            stem, ext = os.path.splitext(parts[3])
            pid = PayloadId.from_dirname(f"{parts[2]}/{stem}")
            if owner is None or pid is None or ext not in (_DATA, _STAMP):
                continue
            slot = found.setdefault((owner, pid), {"data": None, "stamp": False})
            if ext == _DATA:
                slot["data"] = size
            else:
                slot["stamp"] = True
        return [LocalEntry(owner, replica, pid, s["data"], s["stamp"]) for (owner, pid), s in sorted(found.items())]

    def list(self, *, replica: bool = False, owner_rank: Optional[int] = None) -> list[Stamp]:
        """Stamps of the complete payloads in the area(s); unreadable stamps are logged and left out."""
        out = []
        for e in self.entries(replica=replica, owner_rank=owner_rank):
            if not e.complete:
                continue
            stamp_key = self._keys(e.owner_rank, e.pid, replica)[1]
            try:
                out.append(Stamp.from_json(self.store.get(stamp_key), self.store.describe(stamp_key)))
            except (PayloadError, ObjectNotFound) as err:
                log.warning("ignoring Tier-1 entry: %s", err)
        return out

    def delete(self, owner_rank: int, pid: PayloadId, *, replica: bool = False) -> None:
        """Remove a unit: stamp first, so it stops being complete before its data goes (into the area's spare
        pool if this process writes the area and nothing here still maps the file)."""
        data_key, stamp_key = self._keys(owner_rank, pid, replica)
        self.store.delete(stamp_key)
        mapped = self._mapped.pop(data_key, None)
        holder = mapped() if mapped is not None else None  # once: another thread may drop the last reference
        pool = self._spares.get(_area(owner_rank, replica))
        in_use = holder is not None and not holder.closed
        if pool is None or in_use:
            self.store.delete(data_key)
        elif pool.give(self.store.path(data_key)):
            self.store.prune(data_key)
        else:
            self.store.delete(data_key)

    def _pool(self, owner_rank: int, replica: bool) -> SparePool:
        """The spare pool of an area this process writes (created at its first write)."""
        area = _area(owner_rank, replica)
        pool = self._spares.get(area)
        if pool is None:
            pool = self._spares.setdefault(area, self._new_pool(area))
        return pool

    def _new_pool(self, area: str, max_files: int = 32) -> SparePool:
        pool = SparePool(self.store.root, area, max_files=max_files)
        pool.closed = not self._keep_spares
        return pool

    def release_spares(self, *, for_good: bool = False) -> int:
        """Delete every spare file this process keeps (over a budget; ``for_good``: closing, keep none from now
        on); returns the bytes freed."""
        if for_good:
            self._keep_spares = False
        return sum(pool.release(close=for_good) for pool in list(self._spares.values()))

    def sweep_incomplete(self, owner_rank: int, *, replica: bool = False) -> list[PayloadId]:
        """Remove crashed writers' leftovers in one area (only its single writer may call this)."""
        self.store.sweep_temp(_area(owner_rank, replica))
        pool = self._spares.pop(_area(owner_rank, replica), None)
        if pool is not None:
            pool.release()
        shutil.rmtree(os.path.join(self.store.root, SPARE_ROOT, _area(owner_rank, replica)), ignore_errors=True)
        removed = [e.pid for e in self.entries(replica=replica, owner_rank=owner_rank) if not e.complete]
        for pid in removed:
            self.delete(owner_rank, pid, replica=replica)
        return removed

    def owners(self, *, replica: bool) -> list[int]:
        """Owner ranks with an area of the given kind here, including areas holding only temp files."""
        path = os.path.join(self.store.root, "replica" if replica else "own")
        names = os.listdir(path) if os.path.isdir(path) else []
        return sorted(r for r in (parse_rank_name(n) for n in names) if r is not None)

    def capture_area(self, rank: int) -> CaptureArea:
        """An empty folder where rank ``rank``'s spread base capture keeps finished parts until the base is whole
        (:mod:`megatier.checkpoint.save.capture`; not units: listings skip it, ``bytes_held`` counts it), with
        a spare pool for the parts' files once read back. What a crashed launch left there is removed: a
        capture never outlives its launch."""
        area = f"capture/{rank_name(rank)}"
        path = os.path.join(self.store.root, *area.split("/"))
        for leftover in (path, os.path.join(self.store.root, SPARE_ROOT, *area.split("/"))):
            shutil.rmtree(leftover, ignore_errors=True)
        os.makedirs(path, exist_ok=True)
        old = self._spares.pop(area, None)
        if old is not None:
            old.release()
        pool = self._spares.setdefault(area, self._new_pool(area, max_files=8))
        return CaptureArea(path, pool)

    def write_progress(self, rank: int, step: int) -> None:
        """Record that ``rank`` reached ``step`` (one tiny atomic file, rewritten every step)."""
        self.store.put(f"{_PROGRESS}{rank_name(rank)}", str(step).encode())

    def read_progress(self) -> dict[int, int]:
        """rank -> newest step reached, for every rank that recorded progress here; unreadable keys are skipped."""
        out = {}
        for key in self.store.list(_PROGRESS):
            owner = parse_rank_name(key[len(_PROGRESS):])
            try:
                step = int(self.store.get(key).decode())
            except (StoreError, ValueError, UnicodeDecodeError) as e:
                log.warning("ignoring progress key %s: %s", self.store.describe(key), e)
                continue
            if owner is not None:
                out[owner] = step
        return out

    def clear_progress(self) -> None:
        """Drop every progress key (a resumed run rewrites them every step)."""
        for key in self.store.list(_PROGRESS):
            self.store.delete(key)

    def write_fingerprint(self, fingerprint_id: str, fingerprint: dict) -> None:
        self.store.put(f"{_FINGERPRINTS}{fingerprint_id}.json", json.dumps(fingerprint, sort_keys=True).encode())

    def read_fingerprints(self) -> dict[str, dict]:
        """Fingerprint id -> fingerprint, for every one recorded here (unreadable ones are skipped)."""
        return read_fingerprints(self.store, _FINGERPRINTS)

    def write_restores(self, history: list[dict]) -> None:
        write_history(self.store, _RESTORES, history)

    def read_restores(self) -> list[dict]:
        return read_history(self.store, _RESTORES)

    def bytes_held(self) -> int:
        """Bytes of every file in this node's area (own and replicas, complete or not, and spare files)."""
        return sum(self.store.list("").values())


class ReplicaWriter:
    """A replica arriving in order, chunk by chunk; complete only after :meth:`finish` verifies it."""

    def __init__(self, store: DirectoryStore, stamp: Stamp, data_key: str, stamp_key: str,
                 spare: Optional[str] = None):
        self.stamp = stamp
        self._store = store
        self._keys = (data_key, stamp_key)
        self._partial: PartialFile = store.begin(data_key, spare)
        self._hash = xxhash.xxh64()

    @property
    def received(self) -> int:
        return self._partial.size

    def append(self, chunk: bytes) -> None:
        if self._partial.size + len(chunk) > self.stamp.size:
            self.abort()
            raise PayloadError(f"{self._store.describe(self._keys[0])}: received more than the announced "
                               f"{self.stamp.size} bytes; the transfer is out of order or corrupt")
        self._partial.append(chunk)
        self._hash.update(chunk)

    def finish(self) -> None:
        """Verify size and xxh64, then publish data and stamp; PayloadError (and nothing kept) on mismatch."""
        source = self._store.describe(self._keys[0])
        got_size, got_hash = self._partial.size, self._hash.hexdigest()
        if got_size != self.stamp.size or got_hash != self.stamp.xxh64:
            self.abort()
            raise PayloadError(f"{source}: received {got_size} bytes with xxh64 {got_hash}, expected "
                               f"{self.stamp.size} bytes with {self.stamp.xxh64}; the replica was discarded")
        self._store.publish(self._partial, self._keys[0])
        self._store.put(self._keys[1], self.stamp.to_json())

    def abort(self) -> None:
        """Drop what was received; nothing becomes visible."""
        self._partial.discard()
