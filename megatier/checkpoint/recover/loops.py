"""The restart-loop guard: a job that keeps failing right after it restores a point takes an older one.

A checksum proves that a copy's bytes are the bytes that were written, not that the state they hold is good.
A state that is faithfully saved and faithfully wrong (a corruption that turns into a NaN a few steps later, a
step that crashes every time it is reached) makes a job fail, restore, fail again a few steps on, and loop for
as long as its launcher relaunches it (Megatron-LM issue 5281: 44 restarts of one checkpoint).

So every tier the job writes keeps a short history of its restores (``restores.json`` in node memory,
``_restores.json`` on Tier-3): the point
restored (base V, end E), the fallback level it was taken at, and the step the launch after it reached before
it failed (filled in by the next restore, from the tiers' progress keys and units) or that it ended cleanly. A
restore *looped* when its launch failed within ``reliability.loop_window`` steps of its E, or for a fallback,
no further than the failure it fell back from. The job is in a loop while the newest restores each
looped and none got further than the newest failure: a flaky machine that fails every few steps but moves on
is not a loop. :func:`plan` reads that run of loops:

- level 0, the newest point every rank reaches (the normal restore), until it looped
  ``reliability.loop_limit`` times;
- level 1, the previous base: the newest base older than every point the looping restores took, restored on
  its own (no diffs: the diffs after it were written by the run that is suspected);
- level 2, the newest base on Tier-3 (committed) older than level 1's, on its own;
- then the job stops (:class:`RestoreLoop`, exit 6) with one line naming the step, the points tried and the
  units suspected, instead of looping. A level with no such base stops it too (node memory and Tier-3 keep
  ``keep_bases`` bases each; a restore's own base at E counts among them).

A launch that ends without a failure (trained to the end, or stopped on request) marks its entry clean.
``loop_limit=0`` turns the guard off (the history is kept).
The functions here are pure; :mod:`.restore` reads and writes the history through the tiers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatier.checkpoint.format.units import BASE
from megatier.checkpoint.recover.inventory import RecoveryError
from megatier.checkpoint.tiers.base import TIER3, Copy

HISTORY_LENGTH = 16  # entries kept: more than any loop the guard acts on
LEVELS = ("the newest point", "the previous base", "the newest committed Tier-3 base")


class RestoreLoop(RecoveryError):
    """The job failed right after each point it could restore: it stops instead of looping (exit 6)."""


@dataclass(frozen=True)
class Fallback:
    """Which copies a restore may use: all of them (level 0), or only bases older than ``below`` (on Tier-3
    only with ``tier3_only``), each restored without diffs."""

    level: int = 0
    below: Optional[int] = None
    tier3_only: bool = False

    def usable(self, copies: list[Copy]) -> list[Copy]:
        if self.level == 0:
            return copies
        return [c for c in copies if c.pid.kind == BASE and c.pid.version < self.below
                and (c.tier == TIER3 or not self.tier3_only)]

    def describe(self) -> str:
        return LEVELS[self.level] if self.level == 0 else f"{LEVELS[self.level]} (older than v{self.below})"


def with_failure(history: list[dict], reached: Optional[int]) -> list[dict]:
    """The history with its last entry's launch failing at ``reached`` (the newest step any rank reached), unless
    that launch ended cleanly or already says where it failed."""
    history = [dict(e) for e in history]
    if history and not history[-1].get("clean") and history[-1].get("reached") is None and reached is not None:
        history[-1]["reached"] = reached
    return history


def looped(entry: dict, window: int) -> bool:
    """Whether the launch after this restore failed before getting anywhere: within ``window`` steps of the point
    it restored, or for a fallback, no further than the failure it fell back from."""
    reached = entry.get("reached")
    if entry.get("clean") or reached is None:
        return False
    if entry.get("level", 0) > 0:
        return reached <= entry["mark"]
    return reached - entry["end"] <= window


def trailing_loops(history: list[dict], window: int) -> list[dict]:
    """The newest entries that each looped and failed no earlier than the newest failure, oldest first (empty when
    the last launch got past its window)."""
    run: list[dict] = []
    for entry in reversed(history):
        if not looped(entry, window) or entry["reached"] < history[-1]["reached"]:
            break
        run.insert(0, entry)
    return run


def plan(history: list[dict], window: int, limit: int) -> Fallback:
    """The fallback the next restore takes, or RestoreLoop when every level has looped ``limit`` times."""
    loops = trailing_loops(history, window)
    if limit <= 0 or not loops:
        return Fallback()
    level = loops[-1].get("level", 0)
    if sum(1 for e in loops if e.get("level", 0) == level) >= limit:
        level += 1
    if level == 0:
        return Fallback()
    if level >= len(LEVELS):
        raise RestoreLoop(stop_line(loops, window, limit, f"no older point is left after {LEVELS[-1]}"))
    # Level 1 goes below the looping points themselves (each E: a restore re-bases there, so its newest base
    # holds the same state), level 2 below the bases level 1 took.
    points = [e["end"] if level == 1 else e["version"] for e in loops if e.get("level", 0) == level - 1]
    if not points:  # a history cut short (or written by hand): start counting again
        return Fallback()
    return Fallback(level, min(points), tier3_only=level == 2)


def stop_line(loops: list[dict], window: int, limit: int, why: str) -> str:
    """The one line of a job stopped by the guard: the step, the points tried, the units suspected."""
    tried = ", ".join(f"v{e['version']}->E={e['end']} (failed after step {e['reached']})" for e in loops)
    oldest, failing = min(e["version"] for e in loops), max(e["reached"] for e in loops) + 1
    return (f"restore loop: the job failed within reliability.loop_window={window} steps of every point it "
            f"restored, up to reliability.loop_limit={limit} times each ({tried}); {why}. Suspected: step {failing} "
            f"itself (its batch, or the code it runs), or if the state is at fault, base v{oldest} and every unit "
            f"after it. Relaunching repeats this: find the failure in those launches' logs, and once it is fixed "
            f"relaunch once with reliability.loop_limit=0 (the guard counts afresh after a launch that gets on)")


def appended(history: list[dict], *, version: int, end: int, level: int) -> list[dict]:
    """The history with this restore's entry added, cut to the last :data:`HISTORY_LENGTH`. A fallback's launch
    has to get past the failure it falls back from, not past its own (older) end."""
    n = history[-1].get("n", 0) + 1 if history else 1
    mark = max(end, history[-1]["reached"]) if level > 0 else end
    entry = {"n": n, "version": version, "end": end, "mark": mark, "level": level, "reached": None,
             "clean": False}
    return (history + [entry])[-HISTORY_LENGTH:]


def closed(history: list[dict]) -> list[dict]:
    """The history with its last entry's launch marked as ended without a failure."""
    history = [dict(e) for e in history]
    if history:
        history[-1]["clean"] = True
    return history


def newest(histories: list[list[dict]]) -> list[dict]:
    """Of the histories the tiers hold (one per lister; a replaced node's memory holds none), the newest: the one
    whose last restore has the highest count; a clean mark breaks a tie."""
    return max(histories, key=lambda h: (h[-1].get("n", 0), bool(h[-1].get("clean"))) if h else (-1, False),
               default=[])
