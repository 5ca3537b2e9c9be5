"""The goodput ledger: where a job's wall time went, across every launch and restart.

Goodput is the share of the time a job holds its machines that produced training progress it kept:
``goodput = productive / wall``. The ledger splits the wall time into parts (:data:`PARTS`):

    productive  the measured time of steps whose work is kept (``iter_time_s``)
    ckpt_stall  the loop waiting on checkpointing (``ckpt_stall_ms``) and the final drain at exit
    restore     each recovery's consensus + rollback + replay (the recovery record's ``t_*_s``)
    lost        steps computed before a failure and computed again after it: the steps past the
                recovered end E, at the times they took; moved out of ``productive`` at the restore
    restart     from the last ledger update before a failure (or a launch's start) to the first step
                after it, less ``restore`` and that step: starting processes, imports, process groups,
                data, model, the rest of restore; also the time a launch died in before its next update
    eval        validation (``eval_time_s``)
    other       the loop's bookkeeping between steps (metrics, logging) and the end of a launch

Global rank 0 keeps it (:meth:`GoodputLedger.open`) in ``<run_dir>/goodput.json`` beside the metrics
and rewrites it (a temporary file, then ``os.replace``) after every step, before the step's record is
logged, and at exit. A process killed at any moment leaves the previous version whole; the time since
it was written becomes ``restart`` at the next launch, so nothing is counted twice or dropped.
Invariants, after every update: ``sum(parts) == wall_s`` (to float rounding); ``wall_s`` is the wall
clock from the first launch's start (``started``: the Trainer's construction) to the last update, less
the gaps between a clean exit and the next launch (nothing is held then); ``parts["productive"]``
equals the recorded times of the kept steps (``window`` plus ``folded``). No fsync: the file must
survive the process, which the page cache outlives.

Lost work needs the time of each step a restore may give up. Steps at or below the durable recovery
point (``rpo_rack``: committed to Tier-3, which a restore never goes behind) cannot be lost, so they are
folded into one total; the rest stay in ``window`` one by one, at most :data:`MAX_WINDOW` (older ones
are folded too). A restore behind the folded steps (a fresh start, a wiped Tier-3) counts them at
their mean time.

A launch that restores after a failure also times that recovery, from the failure (the failed launch's last
update: its last completed step) to the end of the first step after the restore, in four parts that add up
(:class:`RecoveryTimeline`); its first step record carries them as ``recovery_*_s``.

One launch, as the Trainer drives it:

    ledger = GoodputLedger.open(run_dir, job_id, fingerprint, started=t0)   # in the Trainer's constructor
    ledger.resume(start_step, recovery_record)   # after restore: continue or start afresh, reconcile
    record.update(ledger.step(record))            # every step: the goodput fields go to the metrics
    summary.update(ledger.close(drain_s))         # at exit
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field, fields
from typing import Callable, Optional

log = logging.getLogger(__name__)

PARTS = ("productive", "ckpt_stall", "restore", "lost", "restart", "eval", "other")
FILENAME = "goodput.json"
FORMAT = 1
MAX_WINDOW = 2048  # per-step times kept beyond the durable point (~25 KiB of JSON)
_NUMBER = (int, float)
# The file's fields and their JSON types, in LedgerState's order.
_FIELDS = (("job_id", str), ("fingerprint", str), ("mark", _NUMBER), ("wall_s", _NUMBER), ("parts", dict),
           ("last_step", int), ("closed", bool), ("launches", int), ("restarts", int), ("steps_lost", int),
           ("window", list), ("folded_through", int), ("folded_steps", int), ("folded_s", _NUMBER))


class LedgerError(ValueError):
    """A ledger file that cannot be read as one."""


@dataclass
class LedgerState:
    """What ``goodput.json`` holds: the totals so far and what a later restore needs to reconcile them."""

    job_id: str
    fingerprint: str
    mark: float  # unix time up to which wall_s accounts
    wall_s: float = 0.0
    parts: dict = field(default_factory=lambda: {p: 0.0 for p in PARTS})
    last_step: int = 0  # the newest step recorded
    closed: bool = False  # the last launch exited cleanly (its summary was written)
    launches: int = 0
    restarts: int = 0  # launches that continued after a launch that did not exit cleanly
    steps_lost: int = 0
    window: list = field(default_factory=list)  # [step, productive seconds] of kept steps past the fold
    folded_through: int = 0  # every kept step <= this is folded into folded_s
    folded_steps: int = 0
    folded_s: float = 0.0

    def to_json(self) -> dict:
        # Shallow (the fields are plain numbers, strings, a dict of floats and a list of pairs): written every
        # step, where asdict's deep copy of the window cost milliseconds.
        return {"format": FORMAT, **{f.name: getattr(self, f.name) for f in fields(self)}}

    @classmethod
    def from_json(cls, doc) -> LedgerState:
        """The state in ``doc``; a :class:`LedgerError` naming what is wrong otherwise."""
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise LedgerError(f"not a goodput ledger of format {FORMAT}")
        fields = {k: v for k, v in doc.items() if k != "format"}
        for key, kind in _FIELDS:
            value = fields.get(key)
            if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
                raise LedgerError(f"{key} is missing or not a {getattr(kind, '__name__', 'number')}")
        parts = fields["parts"]
        if set(parts) != set(PARTS) or not all(isinstance(v, _NUMBER) for v in parts.values()):
            raise LedgerError(f"parts must be numbers for exactly {', '.join(PARTS)}")
        if not all(isinstance(w, list) and len(w) == 2 and isinstance(w[0], int) and isinstance(w[1], _NUMBER)
                   for w in fields["window"]):
            raise LedgerError("window must hold [step, seconds] pairs")
        return cls(**{key: fields[key] for key, _ in _FIELDS})


def _recovery_seconds(record: Optional[dict]) -> float:
    """Consensus + rollback + replay of a recovery record (the slowest rank's each), 0 without one."""
    if record is None:
        return 0.0
    return sum(float(record.get(k) or 0.0) for k in ("t_consensus_s", "t_rollback_s", "t_replay_s"))


def process_started() -> Optional[float]:
    """The wall-clock time this process started (Linux: its start in ``/proc/self/stat`` against the boot
    clock, to the kernel's clock tick), or None where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces; field 22 is starttime
        since_boot = int(after_name[19]) / os.sysconf("SC_CLK_TCK")
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


@dataclass
class RecoveryTimeline:
    """One recovery, from the failure to the first step after it (wall-clock times), by relaunch or in place.

    detection  the failure -> it was acted on: by relaunch, this process started (the launcher saw the
               failure, stopped the other processes and started this one); in place, a surviving process
               saw a collective fail (or, on a spare taking a lost rank, the round assigned it)
    reform     -> the restore began: by relaunch, interpreter, imports, rendezvous, process groups, data,
               model, checkpointer and tiers; in place, stopping the checkpoint threads, the membership
               round, the new process groups and checkpointer
    restore    the recovery record's consensus + rollback + replay (the slowest rank's each)
    rerun      the restore's end -> the end of the first step after it (``steps_rerun`` steps lay between
               the recovered end E and the failure, and are computed again)"""

    failed_at: float
    detected_at: float
    restored_at: float
    restore_s: float
    steps_rerun: int
    mode: str = "relaunch"  # or inprocess

    def fields(self, now: float) -> dict:
        detection = max(0.0, self.detected_at - self.failed_at)
        reform = max(0.0, self.restored_at - self.restore_s - max(self.detected_at, self.failed_at))
        return {"recovery_mode": self.mode, "recovery_detection_s": detection, "recovery_reform_s": reform,
                "recovery_restore_s": self.restore_s, "recovery_rerun_s": max(0.0, now - self.restored_at),
                "recovery_total_s": max(0.0, now - self.failed_at), "recovery_steps_rerun": self.steps_rerun}


def _set_aside(path: str) -> None:
    try:
        os.replace(path, path + ".corrupt")
    except OSError:
        pass  # the next write replaces it anyway


class GoodputLedger:
    """The job's goodput ledger, kept by the metrics writer (global rank 0); see the module docstring."""

    def __init__(self, path: str, job_id: str, fingerprint: str, *, started: float, prior: Optional[LedgerState],
                 clock: Callable[[], float] = time.time, process_started: Optional[float] = None):
        self.path = path
        self.job_id, self.fingerprint = job_id, fingerprint
        self.started = started  # when this launch began to hold its machines
        self.process_started = started if process_started is None else process_started
        self.timeline: Optional[RecoveryTimeline] = None  # this launch's recovery, until its first step
        self.prior = prior  # the file as this launch found it (None: no usable ledger)
        self.clock = clock
        self.state: Optional[LedgerState] = None  # set by resume()
        self._pending_restore = 0.0  # this launch's restore time, accounted at its first step
        self._first_update = True
        self._write_failed = False

    @classmethod
    def open(cls, run_dir: str, job_id: str, fingerprint: str, *, started: float,
             clock: Callable[[], float] = time.time, process_started: Optional[float] = None) -> GoodputLedger:
        """Load ``<run_dir>/goodput.json`` if there is one. A file that is not a ledger gets one warning, is kept
        as ``goodput.json.corrupt`` and the ledger starts afresh: it only feeds metrics, the training state does
        not depend on it, so carrying on is safe (the time before this launch is then not counted)."""
        path = os.path.join(run_dir, FILENAME)
        prior = None
        if os.path.exists(path):
            try:
                with open(path) as f:
                    prior = LedgerState.from_json(json.load(f))
            except (OSError, ValueError) as e:  # LedgerError and json's decode error are ValueErrors
                _set_aside(path)
                log.warning("goodput: %s is not a readable ledger (%s); kept as %s.corrupt, counting goodput afresh "
                            "from this launch", path, e, path)
        return cls(path, job_id, fingerprint, started=started, prior=prior, clock=clock,
                   process_started=process_started)

    @property
    def continues_clean_exit(self) -> bool:
        """Whether the job's previous launch ended cleanly: a launch restoring after it continues the job (to
        train longer, or a job already finished), no failure is behind it."""
        p = self.prior
        return p is not None and p.closed and p.job_id == self.job_id

    # ---- a launch ------------------------------------------------------------------------------

    def resume(self, start_step: int, recovery: Optional[dict] = None, *,
               detected_at: Optional[float] = None) -> None:
        """This launch trains on from ``start_step`` (E after a restore, 0 on a fresh start): continue the
        ledger it found, or start a new one when there is none, it belongs to another job id, or this is a new
        run (step 0 after a clean exit, or step 0 with another config). Steps past E become lost work. A second
        call in the same launch (an in-place recovery, or another restore) reconciles and adds its restore time.
        ``detected_at``: the recovery is in place, and the failure was acted on then (its timeline's mode)."""
        if self.state is not None:
            s = self.state
            if recovery is not None and detected_at is not None:  # the gap since the last update is restart
                s.restarts += 1
                self.timeline = RecoveryTimeline(s.mark, detected_at, self.clock(), _recovery_seconds(recovery),
                                                 max(0, s.last_step - start_step), mode="inprocess")
                self._first_update, self._pending_restore = True, 0.0
            self._reconcile(start_step)
            self._pending_restore += _recovery_seconds(recovery)
            return
        p = self.prior
        if p is not None and p.job_id != self.job_id:
            log.warning("goodput: %s belongs to job %r; starting a new ledger for %r", self.path, p.job_id,
                        self.job_id)
            p = None
        if p is not None and start_step == 0 and (p.closed or p.fingerprint != self.fingerprint):
            p = None  # a new run of this job from scratch
        inplace = False  # a spare that took rank 0's place in the same launch
        if p is None:
            self.state = LedgerState(self.job_id, self.fingerprint, mark=self.started)
        else:
            self.state = p
            if p.closed:
                p.mark = self.started  # nothing was held between a clean exit and this launch
            else:
                p.restarts += 1  # the gap since its last update is restart, accounted at the first step
                if recovery is not None:
                    inplace = detected_at is not None
                    self.timeline = RecoveryTimeline(p.mark, detected_at if inplace else self.process_started,
                                                     self.clock(), _recovery_seconds(recovery),
                                                     max(0, p.last_step - start_step),
                                                     mode="inprocess" if inplace else "relaunch")
            p.fingerprint, p.closed = self.fingerprint, False
        if not inplace:
            self.state.launches += 1
        self._reconcile(start_step)
        self._pending_restore = _recovery_seconds(recovery)

    def _reconcile(self, end: int) -> None:
        """Reclassify the recorded steps past ``end`` from productive to lost."""
        s = self.state
        lost = [w for w in s.window if w[0] > end]
        lost_s, count = sum(w[1] for w in lost), len(lost)
        s.window = [w for w in s.window if w[0] <= end]
        if s.folded_through > end:
            # Behind the durable point (a fresh start, a wiped Tier-3): per-step times are folded, use their mean.
            k = min(s.folded_steps, s.folded_through - end)
            share = s.folded_s * k / s.folded_steps if k else 0.0
            s.folded_s, s.folded_steps, s.folded_through = s.folded_s - share, s.folded_steps - k, end
            lost_s, count = lost_s + share, count + k
        s.parts["productive"] = max(0.0, s.parts["productive"] - lost_s)
        s.parts["lost"] += lost_s
        s.steps_lost += count
        s.last_step = min(s.last_step, end)

    def step(self, record: dict) -> dict:
        """Account the time since the last update to step ``record["step"]`` (``iter_time_s``, ``ckpt_stall_ms``,
        ``eval_time_s``; ``rpo_rack`` lets older steps fold), persist, and return the goodput fields."""
        step = int(record["step"])
        if self.state is None:
            self.resume(step - 1)
        known = {"productive": float(record["iter_time_s"]),
                 "ckpt_stall": float(record.get("ckpt_stall_ms") or 0.0) / 1000.0,
                 "eval": float(record.get("eval_time_s") or 0.0)}
        self._account(known)
        s = self.state
        s.window.append([step, known["productive"]])
        s.last_step = step
        self._fold(record.get("rpo_rack"))
        self._persist()
        out = self.fields()
        if self.timeline is not None:
            out.update(self.timeline.fields(s.mark))
            self.timeline = None
        return out

    def close(self, drain_s: float = 0.0) -> dict:
        """The launch ends cleanly: the final checkpoint drain is stall, the rest other (restart if the launch
        trained no step); persist, return fields."""
        if self.state is None:
            self.resume(0)
        self._account({"ckpt_stall": drain_s})
        self.state.closed = True
        self._persist()
        return self.fields()

    def fields(self) -> dict:
        """``goodput`` and its parts in seconds, as they go to the metrics."""
        s = self.state
        out = {"goodput": s.parts["productive"] / s.wall_s if s.wall_s > 0 else 0.0, "goodput_wall_s": s.wall_s}
        out.update({f"goodput_{p}_s": s.parts[p] for p in PARTS})
        out.update(goodput_steps_lost=s.steps_lost, goodput_restarts=s.restarts)
        return out

    # ---- accounting ----------------------------------------------------------------------------

    def _account(self, known: dict) -> None:
        """Split the wall time since ``mark`` into the ``known`` parts and the rest: restart up to this launch's
        first update (which also takes the launch's restore), other after it. The rest is never negative (a wall
        clock stepped back: wall_s then runs ahead of the clock, and still equals the parts)."""
        s = self.state
        rest = "restart" if self._first_update else "other"
        if self._first_update:
            known = {**known, "restore": self._pending_restore}
            self._first_update = False
        now = self.clock()
        remainder = max(0.0, (now - s.mark) - sum(known.values()))
        for part, seconds in known.items():
            s.parts[part] += seconds
        s.parts[rest] += remainder
        s.wall_s += sum(known.values()) + remainder
        s.mark = now

    def _fold(self, durable: Optional[int]) -> None:
        """Fold the per-step times no restore can give up (at or below ``durable``), and the oldest beyond
        :data:`MAX_WINDOW`, into one total."""
        s = self.state
        keep_from = 0
        while keep_from < len(s.window) and (
                (isinstance(durable, int) and s.window[keep_from][0] <= durable)
                or len(s.window) - keep_from > MAX_WINDOW):
            step, seconds = s.window[keep_from]
            s.folded_through, s.folded_steps, s.folded_s = max(s.folded_through, step), s.folded_steps + 1, \
                s.folded_s + seconds
            keep_from += 1
        del s.window[:keep_from]

    def _persist(self) -> None:
        """Write the ledger atomically; a write that fails is warned about once and training goes on."""
        tmp = f"{self.path}.tmp"
        try:
            text = json.dumps(self.state.to_json(), separators=(",", ":"))  # one pass of the C encoder
            os.makedirs(os.path.dirname(tmp) or ".", exist_ok=True)  # the run directory waits for the first record
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, self.path)
        except OSError as e:
            if not self._write_failed:
                log.warning("goodput: cannot write %s (%s); the goodput metrics go on but a restart will not "
                            "see them", self.path, e)
            self._write_failed = True


class NullLedger:
    """What ranks other than the metrics writer hold: every call is a no-op."""

    continues_clean_exit = False

    def resume(self, start_step: int, recovery: Optional[dict] = None, *, detected_at: Optional[float] = None) -> None:
        pass

    def step(self, record: dict) -> dict:
        return {}

    def close(self, drain_s: float = 0.0) -> dict:
        return {}
