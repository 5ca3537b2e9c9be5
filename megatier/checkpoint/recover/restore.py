"""Recovery path: ``restore()`` before the training loop (DESIGN.md section 4, 000_*.txt section 3.3).

Collective over every rank, in four phases:

1. Inventory: every rank lists its node's whole Tier-1 area (:func:`inventory.list_node`);
   rank 0 lists Tier-3's committed units. One ``all_gather_object`` on the
   control group gives every rank every report. A node is represented by the
   report of its *server*, its lowest global rank, because global ranks may land
   on other nodes than in the previous launch: holdings belong to nodes.
2. Consensus: :func:`inventory.decide` on the identical gathered data, so every
   rank derives the same V, E, chains and candidate copies without messages.
3. Cascade, one *round* per position in the chains (round 0: base V, then one
   diff batch per round), so at most one unit per rank is held in memory:

   - local attempt: each rank tries the copies on its own node (own area, then
     replica area), verifying checksum and identity (decode with this job and
     layout); then one status gather tells everyone who is done and which
     candidate each other rank tries next;
   - remote attempts, repeated until everyone is done: for every pending rank
     r, in rank order, the next candidate copy is served by the server rank of
     the node holding it (Tier-2, another node's memory), or for a Tier-3 copy
     by the *leader* of r's node (its server rank again), which reads the
     object (only the files its local ranks need) and sends it on. Transfers
     are point-to-point over ``peer_group``: an int64 header (size, or -1 when
     the server's copy is missing or fails its checksum) then the bytes. Every
     rank walks the same global list in the same order, so sends and receives
     pair up and cannot deadlock (the lowest unfinished transfer always has
     both ends ready). The receiver verifies the bytes against the inventory's
     stamp, then decodes. A status gather follows; a failed copy moves that
     rank to its next candidate. When a rank runs out of candidates, the
     consensus is taken again without every copy found bad (an older base or
     a shorter chain may still be complete everywhere), and the rounds start
     over from the new base; if none is left, every rank raises RecoveryError.
   Sending to the rank instead of writing into the node's Tier-1 area keeps
   recovered copies out of the areas whose only writers are the save path.
4. Replay: ``load_base``, one fused ``replay`` per diff batch (the
   ``replay.mid_batch`` fault point between batches), then ``publish`` once.

Then cleanup, so later saves never mix with stale units: each node's server
sweeps incomplete leftovers in every area of its node and deletes units that
end after E (nothing at or below E) and the stale progress keys; rank 0 deletes
uncommitted Tier-3 units after E. A last gather makes sure no rank resumes
(and starts writing) before every node is clean, and carries the per-rank
timings for the record.

Every failure inside a phase travels in the next status gather, so a problem
on one rank becomes the same RecoveryError on all ranks; every collective and
transfer uses the context's groups and waits at most the job timeout.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatier.checkpoint.commit.records import RemoteReader, list_units
from megatier.checkpoint.context import CheckpointContext
from megatier.checkpoint.recover.inventory import (TIER1, TIER2, TIER3, PROGRESS_PREFIX, Consensus, Copy, RecoveryError,
                                           cascade, collect_copies, decide, has_traces, list_node, list_remote,
                                           recovery_record)
from megatier.checkpoint.format.units import BASE, PayloadId, parse_rank_name
from megatier.checkpoint.format.payload import (EncodedPayload, PayloadError, decode_base, decode_diff_batch,
                                         verify_payload)
from megatier.checkpoint.shard import ShardAccess
from megatier.checkpoint.tiers.store import StoreError

log = logging.getLogger(__name__)

REPLAY_MID_BATCH = "replay.mid_batch"
_TAG_HDR, _TAG_DATA = 0x7301, 0x7302
_LOAD_ERRORS = (PayloadError, StoreError, ValueError)


@dataclass
class RecoveryResult:
    """The state is now version ``end`` (replayed from base ``version``); training resumes at end + 1."""

    version: int
    end: int
    record: dict


def _gather(ctx: CheckpointContext, item: Any) -> list:
    out: list = [None] * ctx.world_size
    dist.all_gather_object(out, item, group=ctx.control_group)
    return out


def _raise_fatal(statuses: list[dict], what: str) -> None:
    fatal = [f"rank {r}: {s['fatal']}" for r, s in enumerate(statuses) if s.get("fatal")]
    if fatal:
        raise RecoveryError(f"recovery failed during {what}: " + "; ".join(fatal))


class _Exhausted(RecoveryError):
    """A rank ran out of copies of a unit; recovery retries the consensus without the copies found bad."""


@dataclass
class _Ledger:
    """What every rank knows after each status gather: who got which unit from which tier, and fallbacks."""

    served: dict[tuple[int, PayloadId], tuple[str, int]] = field(default_factory=dict)  # -> (tier, bytes)
    fallbacks: list[str] = field(default_factory=list)
    bad: set[Copy] = field(default_factory=set)
    moved: dict[str, int] = field(default_factory=lambda: {TIER1: 0, TIER2: 0, TIER3: 0})  # every pass


class _Fetcher:
    """Runs the cascade of one round (one unit per rank) with the protocol described in the module docstring."""

    def __init__(self, ctx: CheckpointContext, consensus: Consensus, rank_nodes: list[str], servers: dict[str, int]):
        self.ctx = ctx
        self.consensus = consensus
        self.rank_nodes = rank_nodes
        self.servers = servers
        self.ledger = _Ledger()
        self.timeout = timedelta(seconds=ctx.timeout_s)
        self._remote = RemoteReader(ctx.remote, ctx.job_id) if ctx.remote is not None else None

    # ---- reading and checking one copy --------------------------------------------------------

    def _read(self, copy: Copy) -> EncodedPayload:
        """The copy's bytes from a tier this rank can read directly, checksum-verified by the tier loader."""
        if copy.node is None:
            if self._remote is None:
                raise StoreError("Tier-3 is not configured on this rank")
            return self._remote.load(copy.pid, copy.owner)
        if self.ctx.local is None or copy.node != self.ctx.node_name:
            raise StoreError(f"{copy.describe()} is not readable from {self.ctx.node_name}")
        return self.ctx.local.load(copy.owner, copy.pid, replica=copy.replica)

    def _decode(self, data: bytes, copy: Copy, source: str) -> Any:
        """Verify ``data`` against the inventory's stamp, then decode with this job and this rank's layout."""
        verify_payload(data, copy.stamp, source)
        payload = EncodedPayload(data, copy.stamp)
        ctx = self.ctx
        if copy.pid.kind == BASE:
            return decode_base(payload, job_id=ctx.job_id, layout=ctx.layout, source=source)
        return decode_diff_batch(payload, job_id=ctx.job_id, layout=ctx.layout, source=source)

    def _note(self, copy: Copy, error: Exception) -> tuple[Copy, str]:
        """A bad copy and a short why for the record (every rank learns both); the full error goes to the log."""
        log.warning("skipping rank %d's %s from %s: %s", copy.owner, copy.pid, copy.describe(), error)
        reason = str(error).split("; ")[0].rsplit(": ", 1)[-1]
        return copy, f"rank {copy.owner} {copy.pid} from {copy.describe()}: {reason}"

    # ---- one round ----------------------------------------------------------------------------

    def round(self, k: int, carried_fatal: Optional[str]) -> tuple[Optional[PayloadId], Any]:
        """Fetch unit ``k`` of every rank's chain; returns this rank's (unit, decoded object) or (None, None)."""
        ctx, me = self.ctx, self.ctx.rank
        need = {r: chain[k] for r, chain in self.consensus.chains.items() if k < len(chain)}
        cands = {r: cascade(self.consensus.copies[(r, pid)], self.rank_nodes[r]) for r, pid in need.items()}
        result, got, notes, nxt = None, None, [], 0
        for i, copy in enumerate(cands.get(me, [])):
            if copy.node != ctx.node_name:
                break
            nxt = i + 1
            try:
                payload = self._read(copy)
                result = self._decode(payload.data, copy, copy.describe())
                got = (copy.tier_for(ctx.node_name), copy.stamp.size)
                break
            except _LOAD_ERRORS as e:
                notes.append(self._note(copy, e))
        statuses = _gather(ctx, {"got": got, "next": nxt, "notes": notes, "fatal": carried_fatal})
        _raise_fatal(statuses, f"round {k} (local copies)")
        pending, idx = self._absorb(statuses, need)
        attempt = 0
        while pending:
            for r in pending:
                if idx[r] >= len(cands[r]):
                    tried = ", ".join(c.describe() for c in cands[r]) or "no copy in any tier"
                    raise _Exhausted(f"rank {r} cannot get {need[r]} from any tier (tried: {tried})")
            got, notes, fatal, mine = None, [], None, None
            for r in sorted(pending):
                copy = cands[r][idx[r]]
                server = self.servers[self.rank_nodes[r] if copy.node is None else copy.node]
                if me not in (r, server) or fatal is not None:
                    continue
                try:
                    if me == server == r:
                        try:
                            payload = self._read(copy)
                            mine = self._decode(payload.data, copy, copy.describe())
                            got = (copy.tier_for(ctx.node_name), copy.stamp.size)
                        except _LOAD_ERRORS as e:
                            notes.append(self._note(copy, e))
                    elif me == server:
                        notes.extend(self._serve(copy, r))
                    else:
                        mine, got = self._receive(copy, server, notes)
                except Exception as e:  # a broken link or a timeout: the pairing is lost, stop transferring
                    fatal = f"transfer of {copy.pid} of rank {r} ({copy.describe()}, served by rank {server}): {e}"
            statuses = _gather(ctx, {"got": got, "next": None, "notes": notes, "fatal": fatal})
            _raise_fatal(statuses, f"round {k} (remote attempt {attempt})")
            if mine is not None:
                result = mine
            pending, _ = self._absorb(statuses, need, pending, idx)
            attempt += 1
        return need.get(me), result

    def _absorb(self, statuses: list[dict], need: dict[int, PayloadId], pending: Optional[set] = None,
                idx: Optional[dict[int, int]] = None) -> tuple[set, dict[int, int]]:
        """Fold a status gather into the ledger; returns the ranks still pending and their next candidate."""
        for s in statuses:
            self.ledger.fallbacks.extend(message for _, message in s["notes"])
            self.ledger.bad.update(copy for copy, _ in s["notes"])
        if idx is None:
            idx = {r: statuses[r]["next"] for r in need}
            pending = set(need)
        still = set()
        for r in pending:
            got = statuses[r]["got"]
            if got is not None:
                self.ledger.served[(r, need[r])] = tuple(got)
                self.ledger.moved[got[0]] += got[1]
            else:
                if statuses[r]["next"] is None:
                    idx[r] += 1
                still.add(r)
        return still, idx

    def _serve(self, copy: Copy, dst: int) -> list[tuple[Copy, str]]:
        """Send ``copy`` to ``dst``: header with its size (-1 if this rank's copy is bad), then the bytes."""
        try:
            data, notes = self._read(copy).data, []
        except _LOAD_ERRORS as e:
            data, notes = None, [self._note(copy, e)]
        header = torch.tensor([len(data) if data is not None else -1], dtype=torch.int64)
        self._wait(dist.isend(header, dst=dst, group=self.ctx.peer_group, tag=_TAG_HDR))
        if data is not None:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            self._wait(dist.isend(buf, dst=dst, group=self.ctx.peer_group, tag=_TAG_DATA))
        return notes

    def _receive(self, copy: Copy, server: int, notes: list) -> tuple[Any, Optional[tuple[str, int]]]:
        header = torch.zeros(1, dtype=torch.int64)
        self._wait(dist.irecv(header, src=server, group=self.ctx.peer_group, tag=_TAG_HDR))
        size = int(header.item())
        if size < 0:
            return None, None  # the server reported why in its own notes
        buf = torch.empty(size, dtype=torch.uint8)
        if size:
            self._wait(dist.irecv(buf, src=server, group=self.ctx.peer_group, tag=_TAG_DATA))
        source = f"{copy.describe()} (served by rank {server})"
        try:
            return self._decode(buf.numpy().tobytes(), copy, source), (copy.tier_for(self.ctx.node_name), size)
        except _LOAD_ERRORS as e:
            notes.append(self._note(copy, e))
            return None, None

    def _wait(self, work) -> None:
        if work.wait(self.timeout) is False:
            raise TimeoutError(f"no completion within {self.ctx.timeout_s:g} s; the peer may have died")


def _apply(ctx: CheckpointContext, shard: ShardAccess, pid: Optional[PayloadId], obj: Any) -> Optional[str]:
    """Load the base or replay one diff batch; an error is returned (and gathered), not raised."""
    if pid is None:
        return None
    try:
        if pid.kind == BASE:
            shard.load_base(obj)
        else:
            shard.replay(obj)
            ctx.fault.hit(REPLAY_MID_BATCH, pid.last)
    except Exception as e:  # shape mismatch, a kernel error: fatal, reported on every rank
        return f"applying {pid} failed: {type(e).__name__}: {e}"
    return None


def _areas(local, replica: bool) -> list[int]:
    """Owner ranks with an area (directory) of the given kind on this node, including ones with only temp files."""
    path = os.path.join(local.store.root, "replica" if replica else "own")
    names = os.listdir(path) if os.path.isdir(path) else []
    return sorted(r for r in (parse_rank_name(n) for n in names) if r is not None)


def _cleanup(ctx: CheckpointContext, end: int, is_server: bool) -> list[str]:
    """Delete what could mix with the resumed run: units after E and leftovers; nothing at or below E."""
    notes: list[str] = []
    if ctx.local is not None and is_server:
        for replica in (False, True):
            for owner in _areas(ctx.local, replica):
                ctx.local.sweep_incomplete(owner, replica=replica)
                for e in ctx.local.entries(replica=replica, owner_rank=owner):
                    if e.pid.last > end:
                        ctx.local.delete(owner, e.pid, replica=replica)
                        notes.append(f"{ctx.node_name} {'replica' if replica else 'own'} rank {owner} {e.pid}")
        for key in ctx.local.store.list(PROGRESS_PREFIX):  # the resumed run rewrites them every step
            ctx.local.store.delete(key)
    if ctx.rank == 0 and ctx.remote is not None:
        for pid, unit in sorted(list_units(ctx.remote).items(), key=lambda kv: (kv[0].last, kv[0].kind)):
            if pid.last <= end:
                continue
            if unit.committed:
                log.warning("Tier-3 %s is committed but lies beyond the recovery point E=%d; kept", pid, end)
                continue
            for key in sorted(unit.objects, key=lambda k: (0 if k.endswith(".done.json") else 1, k)):
                ctx.remote.delete(key)
            notes.append(f"Tier-3 {pid}")
    return notes


def _inventory(ctx: CheckpointContext) -> tuple[list[str], dict[str, int], dict, Any]:
    """One gather: every rank's node and node listing, and rank 0's Tier-3 listing."""
    item: dict[str, Any] = {"node": ctx.node_name, "report": None, "remote": None, "fatal": None}
    try:
        item["report"] = list_node(ctx.local, ctx.rank, ctx.node_name)
        if ctx.rank == 0:
            item["remote"] = list_remote(ctx.remote)
    except Exception as e:  # an unreadable area or an unreachable Tier-3 must stop every rank, not only this one
        item["fatal"] = f"inventory on {ctx.node_name} failed: {type(e).__name__}: {e}"
    items = _gather(ctx, item)
    _raise_fatal(items, "the inventory")
    rank_nodes = [it["node"] for it in items]
    servers: dict[str, int] = {}
    for r, node in enumerate(rank_nodes):
        servers.setdefault(node, r)  # ranks are visited in order: the lowest rank of each node serves it
    return rank_nodes, servers, {node: items[r]["report"] for node, r in servers.items()}, items[0]["remote"]


def _fetch_and_replay(ctx: CheckpointContext, shard: ShardAccess, fetcher: _Fetcher, timings: list[float]) -> None:
    """All rounds of the current consensus, applying each unit; adds to ``timings`` = [t_rollback, t_replay]."""
    fatal = None
    for k in range(max(len(c) for c in fetcher.consensus.chains.values())):
        t = time.perf_counter()
        pid, obj = fetcher.round(k, fatal)
        fatal = _apply(ctx, shard, pid, obj)
        timings[min(k, 1)] += time.perf_counter() - t
    t = time.perf_counter()
    _raise_fatal(_gather(ctx, {"fatal": fatal}), "replay")
    shard.publish()
    timings[1] += time.perf_counter() - t


def restore(ctx: CheckpointContext, shard: ShardAccess, *, allow_fresh_start: bool) -> Optional[RecoveryResult]:
    """Recover the newest state every rank can reach, or None for a fresh start; collective over all ranks."""
    t0 = time.perf_counter()
    rank_nodes, servers, nodes, remote = _inventory(ctx)
    progress = {owner: step for n in nodes.values() for owner, step in n.progress.items()}
    last_step = max(progress.values()) if progress else None
    looked = f"Tier-1 on nodes {', '.join(sorted(nodes))} (own and replica areas)" + (
        f" and Tier-3 at {remote.url} (committed units only)" if remote.url else " (no Tier-3 configured)")
    copies = collect_copies(nodes.values(), remote)
    traces = has_traces(nodes.values(), remote)

    def agree(bad: set, allow: bool) -> Optional[Consensus]:
        return decide([c for c in copies if c not in bad], job_id=ctx.job_id, degrees=ctx.layout.degrees,
                      world_size=ctx.world_size, traces=traces, allow_fresh_start=allow, looked=looked)

    consensus = agree(set(), allow_fresh_start)
    if consensus is None:
        if ctx.rank == 0:
            log.info("no checkpoint of job %r to recover; starting fresh (looked in %s)", ctx.job_id, looked)
        return None
    t_consensus = time.perf_counter() - t0
    fetcher = _Fetcher(ctx, consensus, rank_nodes, servers)
    fetcher.ledger.fallbacks.extend(remote.notes)
    timings = [0.0, 0.0]
    while True:
        try:
            _fetch_and_replay(ctx, shard, fetcher, timings)
            break
        except _Exhausted as e:
            if ctx.rank == 0:
                log.warning("%s; taking the consensus again without the %d bad copies", e,
                            len(fetcher.ledger.bad))
            try:  # never a fresh start here: the shard is already partly overwritten
                fetcher.consensus = agree(fetcher.ledger.bad, False)
            except RecoveryError as again:
                raise RecoveryError(f"{e}, and without the bad copies: {again}; bad copies: "
                                    f"{fetcher.ledger.fallbacks}") from None
            fetcher.ledger.served.clear()
    consensus = fetcher.consensus

    try:
        deleted, fatal = _cleanup(ctx, consensus.end, servers[ctx.node_name] == ctx.rank), None
    except (StoreError, OSError) as e:
        deleted, fatal = [], f"cleanup after recovery failed: {e}; stale units could mix with the resumed run"
    final = _gather(ctx, {"fatal": fatal, "times": (t_consensus, *timings), "deleted": deleted})
    _raise_fatal(final, "cleanup")
    ledger = fetcher.ledger
    record = recovery_record(consensus, ledger.served, ledger.moved, ledger.fallbacks,
                             times=[f["times"] for f in final], stale_removed=sum(len(f["deleted"]) for f in final),
                             tier1_present=any(n.copies for n in nodes.values()), last_step=last_step,
                             rank_nodes=rank_nodes)
    if ctx.rank == 0:
        log.info("recovered v%d -> E=%d (%s) from %s; %d fallbacks, %d stale units removed", record["version"],
                 record["end"], record["failure_class"], record["source_tiers"], len(record["fallbacks"]),
                 record["stale_units_removed"])
    return RecoveryResult(consensus.version, consensus.end, record)
