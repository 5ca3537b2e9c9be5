"""The cascade: getting every rank the units of its chain, one *round* per position in the chains.

Round 0 fetches base V for every rank, then one diff batch per round, so at
most one unit per rank is held in memory. A round (:meth:`Fetcher.round`):

- local attempt: each rank tries the copies in its own node's memory (own
  area, then replica area), verifying checksum and identity (decoding with
  this job and layout); then one status gather tells everyone who is done, and
  for each rank that is not, which rank serves the copy it tries next. Only
  the rank itself knows its candidates (its plan: :mod:`.plan`);
- remote attempts, repeated until everyone is done: for every pending rank r,
  in rank order, its next copy is served by the server rank of the node
  holding it (another node's memory), or for a Tier-3 copy by the *leader* of
  r's node (its server rank again), which reads only the objects its local
  ranks need and sends them on. Transfers are point-to-point
  (:meth:`CheckpointComm.send`): r sends the copy it asks for (its stamp), the
  server answers with the size, or "nothing" when its copy is missing or fails
  its check, then the bytes. Every rank walks the same list of pending ranks
  in the same order, so sends and receives pair up and cannot deadlock (the
  lowest unfinished transfer always has both ends ready). The receiver
  verifies the bytes against the stamp, then decodes. A status gather
  follows, with the next ask of each rank whose copy failed.

Sending to the rank instead of writing into the node's memory keeps recovered
copies out of the areas whose only writers are the save path. When a rank runs
out of candidates, :class:`Exhausted` tells restore to take the consensus
again without the copies found bad.
"""
from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass, field
from typing import Any, Optional

from megatier.checkpoint.comm import CheckpointComm
from megatier.checkpoint.format.payload import (
    EncodedPayload,
    PayloadError,
    decode_base,
    decode_diff_batch,
    verify_payload,
)
from megatier.checkpoint.format.units import BASE, PayloadId
from megatier.checkpoint.recover.consensus import Consensus, cascade
from megatier.checkpoint.recover.inventory import RecoveryError, node_servers, raise_fatal
from megatier.checkpoint.recover.record import Sources
from megatier.checkpoint.storage.store import StoreError
from megatier.checkpoint.tiers.base import TIER_ORDER, Copy, Tier
from megatier.parallel.layout import Layout, coordinates_of

log = logging.getLogger(__name__)

LOAD_ERRORS = (PayloadError, StoreError, ValueError)


class Exhausted(RecoveryError):
    """A rank ran out of copies of a unit; recovery retries the consensus without the copies found bad."""


@dataclass
class Ledger:
    """What every rank knows after each status gather: who got which unit from which tier, and fallbacks."""

    served: Sources = field(default_factory=Sources)  # where each rank's units came from (the record's)
    fallbacks: list[str] = field(default_factory=list)
    bad: set[Copy] = field(default_factory=set)
    corrupt: set[Copy] = field(default_factory=set)  # bad copies whose bytes failed their check (not a read error)
    moved: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIER_ORDER, 0))  # every pass


@dataclass
class Reader:
    """Who this rank is, for reading and checking copies: its node, job and tiers by label, and the layout
    (degrees) the units were written with (the job's own, or an old one that restore reshards)."""

    node: str
    job_id: str
    degrees: tuple[int, int, int]
    tiers: dict[str, Tier]

    def layout_of(self, owner: int) -> Layout:
        """The layout a unit of rank ``owner`` must be stamped with."""
        tp, pp, dp = self.degrees
        tp_rank, dp_rank, pp_rank = coordinates_of(owner, tp=tp, dp=dp)
        return Layout(tp, pp, dp, tp_rank, pp_rank, dp_rank)

    def read(self, copy: Copy) -> EncodedPayload:
        """The copy's bytes from the tier holding it, checksum-verified; it must be reachable from here."""
        if copy.source_node(self.node) != self.node:
            raise StoreError(f"{copy.describe()} is not readable from {self.node}")
        if copy.tier not in self.tiers:
            raise StoreError(f"{copy.describe()}: {copy.tier} is not configured on this rank")
        return self.tiers[copy.tier].read(copy)

    def decode(self, data: bytes, copy: Copy, source: str) -> Any:
        """Verify ``data`` against the inventory's stamp, then decode with this job and its owner's layout."""
        verify_payload(data, copy.stamp, source)
        payload = EncodedPayload(data, copy.stamp)
        decoder = decode_base if copy.pid.kind == BASE else decode_diff_batch
        return decoder(payload, job_id=self.job_id, layout=self.layout_of(copy.owner), source=source)

    def load(self, copy: Copy) -> Any:
        return self.decode(self.read(copy).data, copy, copy.describe())


def _note(copy: Copy, error: Exception) -> tuple[Copy, str, bool]:
    """A bad copy, a short why for the record (every rank learns both) and whether its bytes are corrupt (rather
    than unreadable just now); the full error goes to the log."""
    log.warning("skipping rank %d's %s from %s: %s", copy.owner, copy.pid, copy.describe(), error)
    reason = str(error).split("; ")[0].rsplit(": ", 1)[-1]
    return copy, f"rank {copy.owner} {copy.pid} from {copy.describe()}: {reason}", isinstance(error, PayloadError)


class Fetcher:
    """Runs the cascade of one round (one unit per rank) with the protocol in the module docstring.

    ``owner`` is the rank whose chain this rank fetches (None: nothing): itself when the units were written
    by this layout; when restore reshards, one old rank of its plan per pass (restore sets it pass by pass).
    The consensus holds only the chains and copies of this rank's owners (:mod:`.plan`); what the others
    fetch, and from whom, comes in the status gathers.
    """

    def __init__(self, comm: CheckpointComm, reader: Reader, consensus: Consensus, rank_nodes: list[str]):
        self.comm = comm
        self.reader = reader
        self.consensus = consensus
        self.owner: Optional[int] = None
        self.rank_nodes = rank_nodes
        self.servers = node_servers(rank_nodes)
        self.ledger = Ledger()
        self.in_place: set[int] = set()  # ranks whose memory is already at the end: they fetch nothing

    def chain(self) -> list[PayloadId]:
        return self.consensus.chains[self.owner] if self.owner is not None else []

    def plan(self, k: int) -> tuple[Optional[PayloadId], list[Copy]]:
        """This rank's unit of round ``k`` and its candidate copies, cheapest first."""
        chain = self.chain()
        if k >= len(chain):
            return None, []
        return chain[k], cascade(self.consensus.copies[(self.owner, chain[k])], self.reader.node)

    def round(self, k: int, carried_fatal: Optional[str]) -> tuple[Optional[PayloadId], Any]:
        """Fetch unit ``k`` of every owner's chain; returns this rank's (unit, decoded object) or (None, None)."""
        need, cands = self.plan(k)
        result, got, notes, idx = self._local_attempt(cands)
        status = {"got": got, "notes": notes, "fatal": carried_fatal}
        if need is not None and got is None:
            status.update(self._ask(need, cands, idx))
        statuses = self.comm.gather(status, what=f"recovery round {k} (local copies)")
        raise_fatal(statuses, f"round {k} (local copies)")
        pending = self._absorb(statuses)
        attempt = 0
        while pending:
            out = [s["exhausted"] for s in statuses if s.get("exhausted")]
            if out:
                raise Exhausted(out[0])
            mine, status = self._remote_attempt(sorted(pending.items()), cands[idx] if idx < len(cands) else None)
            if mine is not None:
                result = mine
            elif self.comm.rank in pending:
                idx += 1
                status.update(self._ask(need, cands, idx))
            statuses = self.comm.gather(status, what=f"recovery round {k} (remote attempt {attempt})")
            raise_fatal(statuses, f"round {k} (remote attempt {attempt})")
            pending = self._absorb(statuses)
            attempt += 1
        return need, result

    def _ask(self, need: PayloadId, cands: list[Copy], idx: int) -> dict:
        """What this rank's status says it tries next for ``need``: the rank serving candidate ``idx`` (the
        server of the node holding it; for a Tier-3 copy the leader of this rank's node), or that none is left.
        Only the server: the copy itself goes to it point to point (a gather pads every status to the
        largest)."""
        if idx < len(cands):
            return {"ask": self.servers[cands[idx].source_node(self.reader.node)]}
        tried = ", ".join(c.describe() for c in cands) or "no copy in any tier"
        me = self.comm.rank
        whose = f"rank {me}" if self.owner == me else f"rank {me} (for old rank {self.owner})"
        return {"ask": -1, "exhausted": f"{whose} cannot get {need} from any tier (tried: {tried})"}

    def _got(self, copy: Copy, size: int) -> tuple[str, int, Optional[int], bool]:
        """A status's ``got``: the tier as this rank reaches it, the bytes, whose unit, whether it is a base."""
        return copy.reach(self.reader.node), size, self.owner, copy.pid.kind == BASE

    def _local_attempt(self, mine: list[Copy]) -> tuple[Any, Optional[tuple], list, int]:
        """Try this rank's candidates on its own node, in order; returns (object, got, notes, next index)."""
        notes, nxt = [], 0
        for i, copy in enumerate(mine):
            if copy.node != self.reader.node:
                break
            nxt = i + 1
            try:
                return self.reader.load(copy), self._got(copy, copy.stamp.size), notes, nxt
            except LOAD_ERRORS as e:
                notes.append(_note(copy, e))
        return None, None, notes, nxt

    def _remote_attempt(self, pending: list[tuple[int, int]], asked: Optional[Copy]) -> tuple[Any, dict]:
        """Serve and receive the asked copy of every pending rank (rank, its server), in rank order; ``asked``
        is this rank's. Returns (my object, my status)."""
        me = self.comm.rank
        got, notes, fatal, mine = None, [], None, None
        for r, server in pending:
            if me not in (r, server) or fatal is not None:
                continue
            try:
                if me == server == r:
                    try:
                        mine, got = self.reader.load(asked), self._got(asked, asked.stamp.size)
                    except LOAD_ERRORS as e:
                        notes.append(_note(asked, e))
                elif me == server:
                    notes.extend(self._serve(pickle.loads(self.comm.recv(r)), r))
                else:
                    self.comm.send(pickle.dumps(asked), server)
                    mine, got = self._receive(asked, server, notes)
            except Exception as e:  # a broken link or a timeout: the pairing is lost, stop transferring
                what = f"{asked.pid} of rank {r} ({asked.describe()})" if me == r else f"the copy rank {r} asked for"
                fatal = f"transfer of {what}, served by rank {server}: {e}"
        return mine, {"got": got, "notes": notes, "fatal": fatal}

    def _absorb(self, statuses: list[dict]) -> dict[int, int]:
        """Fold a status gather into the ledger; returns the ranks still pending and the rank serving each."""
        pending = {}
        for r, s in enumerate(statuses):
            self.ledger.fallbacks.extend(message for _, message, _ in s["notes"])
            self.ledger.bad.update(copy for copy, _, _ in s["notes"])
            self.ledger.corrupt.update(copy for copy, _, corrupt in s["notes"] if corrupt)
            if s["got"] is not None:
                tier, size, owner, base = s["got"]
                self.ledger.served.add(owner, base, tier)
                self.ledger.moved[tier] += size
            elif s.get("ask") is not None:
                pending[r] = s["ask"]
        return pending

    def _serve(self, copy: Copy, dst: int) -> list[tuple[Copy, str, bool]]:
        """Send ``copy`` to ``dst`` ("nothing" if this rank's copy is bad, with the reason in the notes)."""
        try:
            data, notes = self.reader.read(copy).data, []
        except LOAD_ERRORS as e:
            data, notes = None, [_note(copy, e)]
        self.comm.send(data, dst)
        return notes

    def _receive(self, copy: Copy, server: int, notes: list) -> tuple[Any, Optional[tuple[str, int]]]:
        data = self.comm.recv(server)
        if data is None:
            return None, None  # the server reported why in its own notes
        source = f"{copy.describe()} (served by rank {server})"
        try:
            return self.reader.decode(data, copy, source), self._got(copy, len(data))
        except LOAD_ERRORS as e:
            notes.append(_note(copy, e))
            return None, None
