"""The capture schedule: during which operation of a step each chunk of a base part is copied (Checkflow).

Checkflow (IEEE CAL 2025, section III; docs/references.md) places each checkpoint copy inside the
training computation: a copy may run during an operation when it fits the
operation's duration at the copy bandwidth (its Eq. 9), and the memory held
for checkpointing must never push the step above its peak (Eqs. 10-12). It
solves this as an integer program and splits checkpoints that do not fit
(its Algorithm 1).

MegaTier's version, for one part of a spread base (:mod:`.capture`):

* the step is profiled into operations t = 0..T-1 (module forward and
  backward, in execution order; op t runs from event t to event t + 1, the
  last one up to the optimizer's update): ``seconds[t]`` and ``live_bytes[t]``,
  the memory the step holds during op t without checkpointing;
* the optimizer state does not change between two updates, so a chunk can be
  read straight from the live shard during any operation of the step before
  the update (Checkflow's snapshot-before-update, its Eq. 8, always holds, and
  no separate snapshot copy is needed: creation and offload are one copy);
* x[i, t] = 1 when chunk i is copied during op t. Each chunk is copied once;
  the bytes copied during op t fit bandwidth * seconds[t]; a copied chunk is
  held from its op to the end of the step, so where the copy lands in the
  step's own memory (``held_on_device``: on CPU the host is the device), for
  every t: live_bytes[t] + bytes copied during ops 0..t <= peak, with peak at
  most the profiled no-checkpoint peak (``memory_limit``); minimise peak.

:func:`plan` is Algorithm 1: solve; when the bandwidth constraint alone
makes it infeasible, split every chunk larger than the chunk limit into equal
pieces and halve the limit, up to ``max_splits`` times; when memory does, or
the total exceeds what the whole step can move, there is no schedule (None)
and the capture falls back to copying each part at the end of its step.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

# The solver's time limit per program; the demo model's programs solve in milliseconds.
SOLVE_LIMIT_S = 2.0


@dataclass(frozen=True)
class OpProfile:
    """One profiled training step: op t's name, duration and the memory the step holds during it."""

    names: tuple[str, ...]
    seconds: tuple[float, ...]
    live_bytes: tuple[int, ...]

    def __post_init__(self):
        if not (len(self.names) == len(self.seconds) == len(self.live_bytes)) or not self.names:
            raise ValueError("an operation profile needs one name, duration and live-bytes figure per operation")

    @property
    def peak_bytes(self) -> int:
        return max(self.live_bytes)

    @property
    def step_seconds(self) -> float:
        return sum(self.seconds)


@dataclass(frozen=True)
class Chunk:
    """Elements [lo, hi) of a part (relative to its start), copied as one piece."""

    lo: int
    hi: int


@dataclass(frozen=True)
class CaptureSchedule:
    """Which op copies which chunk of a part; the modeled peak memory with and without checkpointing."""

    chunks: tuple[Chunk, ...]
    ops: tuple[int, ...]  # ops[i]: the op during which chunks[i] is copied
    peak_bytes: int  # modeled peak of the step with the copies
    base_peak_bytes: int  # the profiled peak without them
    splits: int  # how many times Algorithm 1 split the chunks
    solve_s: float  # solver time, all rounds

    def at(self, op: int) -> list[Chunk]:
        return [c for c, t in zip(self.chunks, self.ops) if t == op]

    def describe(self, profile: OpProfile, bytes_per_element: int) -> str:
        """One line per op that copies something: what the log prints once per run."""
        lines = [f"capture schedule: {len(self.chunks)} chunks over {len(set(self.ops))} of {len(profile.names)} ops"
                 f" (step {profile.step_seconds * 1e3:.1f} ms), modeled peak {self.peak_bytes / 2**20:.1f} MiB"
                 f" (without checkpointing {self.base_peak_bytes / 2**20:.1f} MiB), {self.splits} splits,"
                 f" solved in {self.solve_s * 1e3:.0f} ms"]
        for t in sorted(set(self.ops)):
            size = sum(c.hi - c.lo for c in self.at(t)) * bytes_per_element
            lines.append(f"  op {t:3d} {profile.names[t]:<28s} {profile.seconds[t] * 1e3:7.2f} ms"
                         f"  copies {size / 2**20:6.2f} MiB")
        return "\n".join(lines)


def solve(profile: OpProfile, sizes: list[int], bandwidth: float, *, memory_limit: Optional[float],
          held_on_device: bool) -> Optional[tuple[list[int], float]]:
    """The integer program above for chunks of ``sizes`` bytes: (op of each chunk, modeled peak), or None
    when it has no solution. ``bandwidth`` in bytes per second; ``memory_limit`` None: unbounded.

    Columns: x[i, t] (binary) at i * T + t, then held[t] (bytes copied during ops 0..t, continuous), then
    the peak; held is carried by one equality per op, which keeps the matrix sparse (O(n T) entries)."""
    n, ops = len(sizes), len(profile.names)
    nx, held, peak = n * ops, n * ops, n * ops + ops
    rows, cols, vals, lower, upper = [], [], [], [], []

    def constraint(entries: list[tuple[int, float]], lo: float, hi: float) -> None:
        row = len(lower)
        for col, val in entries:
            rows.append(row), cols.append(col), vals.append(val)
        lower.append(lo), upper.append(hi)

    for i in range(n):  # each chunk copied exactly once
        constraint([(i * ops + t, 1.0) for t in range(ops)], 1.0, 1.0)
    for t in range(ops):
        copied = [(i * ops + t, float(sizes[i])) for i in range(n)]
        # What op t copies fits its duration at the bandwidth (Checkflow's Eq. 9).
        constraint(copied, -np.inf, bandwidth * profile.seconds[t])
        # held[t] = held[t - 1] + what op t copies (nothing is held where the copies land elsewhere).
        carried = [(held + t - 1, 1.0)] if t > 0 else []
        constraint([(held + t, 1.0)] + [(c, -v) for c, v in copied] + [(c, -v) for c, v in carried]
                   if held_on_device else [(held + t, 1.0)], 0.0, 0.0)
        # live + held <= peak (Eq. 10).
        constraint([(held + t, 1.0), (peak, -1.0)], -np.inf, -float(profile.live_bytes[t]))
    width = nx + ops + 1
    a = coo_matrix((vals, (rows, cols)), shape=(len(lower), width))
    cost = np.zeros(width)
    cost[peak] = 1.0  # minimise the peak (Eq. 12)
    integrality = np.concatenate([np.ones(nx), np.zeros(ops + 1)])
    top = np.concatenate([np.ones(nx), np.full(ops, np.inf), [memory_limit if memory_limit is not None else np.inf]])
    res = milp(cost, constraints=LinearConstraint(a.tocsr(), lower, upper), integrality=integrality,
               bounds=Bounds(np.zeros(width), top), options={"time_limit": SOLVE_LIMIT_S})
    if res.x is None:
        return None
    x = np.round(res.x[:nx]).reshape(n, ops)
    return [int(np.argmax(x[i])) for i in range(n)], float(res.x[peak])


def split(chunks: list[Chunk], limit_elements: int) -> list[Chunk]:
    """Algorithm 1's SPLITCHECKPOINTS: every chunk longer than the limit cut into ceil(len / limit) equal ones."""
    out = []
    for c in chunks:
        pieces = max(1, math.ceil((c.hi - c.lo) / max(1, limit_elements)))
        out += [Chunk(c.lo + (c.hi - c.lo) * j // pieces, c.lo + (c.hi - c.lo) * (j + 1) // pieces)
                for j in range(pieces)]
    return [c for c in out if c.hi > c.lo]


def plan(profile: OpProfile, numel: int, bytes_per_element: int, bandwidth: float, *,
         held_on_device: bool = True, memory_limit: Optional[float] = None, max_splits: int = 8
         ) -> Optional[CaptureSchedule]:
    """Algorithm 1 for a part of ``numel`` elements: its schedule, or None (copy it at the end of the step).

    ``memory_limit`` defaults to the profiled peak: checkpointing may use only memory the step already
    frees before the update."""
    if numel <= 0 or bandwidth <= 0:
        return None
    limit = profile.peak_bytes if memory_limit is None else memory_limit
    if numel * bytes_per_element > bandwidth * profile.step_seconds:
        return None  # more than the whole step can move: no split helps
    chunks, splits, spent = [Chunk(0, numel)], 0, 0.0
    # Algorithm 1's per_size, in elements: first what the longest op can move, halved on every later split.
    per_chunk = max(1, int(bandwidth * max(profile.seconds)) // bytes_per_element)
    while True:
        sizes = [(c.hi - c.lo) * bytes_per_element for c in chunks]
        start = time.perf_counter()
        found = solve(profile, sizes, bandwidth, memory_limit=limit, held_on_device=held_on_device)
        spent += time.perf_counter() - start
        if found is not None:
            ops, peak = found
            return CaptureSchedule(tuple(chunks), tuple(ops), int(round(peak)), profile.peak_bytes, splits, spent)
        start = time.perf_counter()
        bandwidth_bound = solve(profile, sizes, bandwidth, memory_limit=None, held_on_device=False) is None
        spent += time.perf_counter() - start
        if not bandwidth_bound or splits >= max_splits:
            return None  # memory-bound (splitting does not free memory), or split as far as allowed
        chunks, splits = split(chunks, per_chunk), splits + 1
        per_chunk = max(1, per_chunk // 2)
