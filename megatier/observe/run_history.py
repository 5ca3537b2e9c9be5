"""A run directory's metrics across launches: what ``megatier-plot`` and the reports read.

Rank 0's metrics logger (:mod:`megatier.observe.metrics`) writes ``<run_dir>/metrics.jsonl``; when the run
directory is launched again (the relaunch after a failure, or a rerun) it first renames the earlier file to
``metrics.<k>.jsonl`` with the smallest free k. So launch order is ``metrics.1.jsonl``, ``metrics.2.jsonl``,
..., and ``metrics.jsonl`` last. A launch's records are step records (no ``"event"`` key), a
``"event": "recovery"`` record before its first step when it recovered, and a ``"event": "summary"`` record
when it finished.

A launch that recovered to step E trains E+1, E+2, ... again: steps between E and the failure appear in two
launches (the work the failure lost). Values are kept per launch, so a figure can draw each launch as its own
line and mark where each failure struck and where training resumed.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

METRICS = "metrics.jsonl"
_ROTATED = re.compile(r"^metrics\.(\d+)\.jsonl$")


class MetricsMissing(Exception):
    """The directory holds no metrics a training run wrote (or none that parse)."""


def number(value: Any) -> Optional[float]:
    """``value`` as a float when it is a number (the logger writes inf and nan as strings), else None."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.lower() in ("nan", "inf", "-inf", "infinity", "-infinity"):
        return float(value)
    return None


@dataclass(frozen=True)
class Recovery:
    """One restart that recovered: the failure struck after step ``failed_at``; training resumed from the state of
    step ``resumed_at`` (E), so steps ``resumed_at + 1 .. failed_at`` were trained twice."""

    launch: int  # index of the launch that recovered (its predecessor failed)
    failed_at: Optional[int]  # the record's last_step, else the failed launch's last logged step
    resumed_at: int
    failure_class: str
    steps_lost: Optional[int]
    restore_s: float  # consensus + rollback (loading the base) + replay


@dataclass
class Launch:
    """One launch's records, in the order it wrote them."""

    path: str
    steps: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)

    @property
    def last_step(self) -> Optional[int]:
        return self.steps[-1]["step"] if self.steps else None


def metrics_files(run_dir: str) -> list[str]:
    """Every launch's metrics file in ``run_dir``, oldest first (see the module docstring)."""
    names = os.listdir(run_dir) if os.path.isdir(run_dir) else []
    rotated = sorted((int(m.group(1)), n) for n in names if (m := _ROTATED.match(n)))
    ordered = [n for _, n in rotated] + ([METRICS] if METRICS in names else [])
    return [os.path.join(run_dir, n) for n in ordered]


def _read_launch(path: str) -> tuple[Launch, int]:
    """The launch in ``path`` and how many lines did not parse (a process killed mid-line leaves a partial one)."""
    launch, bad = Launch(path), 0
    with open(path, errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                bad += 1
            elif record.get("event") is None:
                launch.steps.append(record)
            else:
                launch.events.append(record)
    return launch, bad


@dataclass
class RunHistory:
    """Every launch of one run directory, oldest first; ``unparsed``: lines that were not records."""

    run_dir: str
    launches: list[Launch]
    unparsed: int = 0

    @classmethod
    def read(cls, run_dir: str) -> "RunHistory":
        """Read ``run_dir``; MetricsMissing (one line: what is wrong and what to do) when it has no step records."""
        if not os.path.isdir(run_dir):
            raise MetricsMissing(f"{run_dir} is not a directory; give the run directory a training run wrote "
                                 f"(logging.run_dir, default runs/<logging.name>)")
        paths = metrics_files(run_dir)
        if not paths:
            raise MetricsMissing(f"{run_dir} has no {METRICS} (nor metrics.<n>.jsonl of earlier launches); give the "
                                 f"run directory a training run wrote (logging.run_dir, default runs/<logging.name>)")
        launches, unparsed = [], 0
        for path in paths:
            launch, bad = _read_launch(path)
            launches.append(launch)
            unparsed += bad
        history = cls(run_dir, launches, unparsed)
        if not history.steps:
            raise MetricsMissing(f"{', '.join(paths)} hold no step records (the run stopped before its first step "
                                 f"was logged); train at least one step, then plot")
        return history

    @property
    def steps(self) -> list[dict]:
        """Every launch's step records, launch after launch."""
        return [r for launch in self.launches for r in launch.steps]

    @property
    def summary(self) -> Optional[dict]:
        """The newest launch's summary record, if it finished."""
        found = [e for e in self.launches[-1].events if e.get("event") == "summary"]
        return found[-1] if found else None

    def keys(self, *, prefix: str = "", suffix: str = "") -> list[str]:
        """Numeric keys of the step records that start with ``prefix`` and end with ``suffix``, first seen first."""
        seen: dict[str, None] = {}
        for r in self.steps:
            for k, v in r.items():
                if k.startswith(prefix) and k.endswith(suffix) and k != "step" and number(v) is not None:
                    seen.setdefault(k)
        return list(seen)

    def series(self, key: str) -> list[tuple[list[int], list[float]]]:
        """Per launch, the (steps, values) of the step records where ``key`` is a finite number (inf and nan
        would spoil an axis); launches without any are left out."""
        out = []
        for launch in self.launches:
            pairs = [(r["step"], v) for r in launch.steps if (v := number(r.get(key))) is not None and math.isfinite(v)]
            if pairs:
                out.append(([s for s, _ in pairs], [v for _, v in pairs]))
        return out

    def last_with(self, keys: Iterable[str]) -> Optional[dict]:
        """The newest record (summary included) that has a number under one of ``keys``."""
        keys = list(keys)
        records = [r for launch in self.launches for r in launch.steps + launch.events]
        for record in reversed(records):
            if any(number(record.get(k)) is not None for k in keys):
                return record
        return None

    @property
    def trained_launches(self) -> list[Launch]:
        """The launches that trained or recovered (a launch refused before its restore wrote nothing)."""
        return [launch for launch in self.launches if launch.steps or launch.events]

    @property
    def recoveries(self) -> list[Recovery]:
        """Every restart that recovered from a failure, in launch order. A launch continuing a job whose previous
        launch ended cleanly (``failure_class`` none: to train longer, or a job already finished) is no failure,
        and a refused launch (no records) is no launch."""
        out = []
        launches = self.trained_launches
        for i, launch in enumerate(launches):
            for e in launch.events:
                if e.get("event") != "recovery" or e.get("failure_class") == "none":
                    continue
                failed = e.get("last_step")
                if not isinstance(failed, int) and i > 0:
                    failed = launches[i - 1].last_step  # node memory that knew it was lost (a rack failure)
                restore = sum(number(e.get(k)) or 0.0 for k in ("t_consensus_s", "t_rollback_s", "t_replay_s"))
                out.append(Recovery(i, failed if isinstance(failed, int) else None, e["step"],
                                    str(e.get("failure_class", "unknown")), e.get("steps_lost"), restore))
        return out

