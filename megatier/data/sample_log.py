"""Which samples each rank's steps consumed, for checking that every global sample is trained once and in order.

    MEGATIER_SAMPLE_LOG=<dir>

makes every process append one JSON line per training step it takes the batches of (the step's consumption, not
a read ahead): ``{"t", "step", "dp", "dp_rank", "samples"}`` with the global sample indices of its share, to
``<dir>/samples.<pid>.jsonl``. Each line is one ``write`` on a file opened for appending, so a process killed
mid-run leaves whole lines. Unset, nothing is written and nothing is computed.

:func:`consumed_by_step` reads a directory of such files back into what the job as a whole trained at each
step: where a step was taken more than once (a failure rolled it back, a relaunch replayed it, a survivor of a
re-formed world took it again), the newest take of each data-parallel share counts, as only the last take's
update survives. A test compares that with a fault-free run's (``tests/distributed/data/test_exactly_once.py``).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

ENV = "MEGATIER_SAMPLE_LOG"


class SampleLog:
    """This process's log, or a disabled one (``path`` None)."""

    def __init__(self, path: Optional[Path]):
        self.path = path
        self._fd: Optional[int] = None

    @classmethod
    def from_env(cls, environ: Optional[dict] = None) -> "SampleLog":
        folder = (environ if environ is not None else os.environ).get(ENV)
        return cls(Path(folder) / f"samples.{os.getpid()}.jsonl" if folder else None)

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def consumed(self, step: int, dp: int, dp_rank: int, samples: list[int]) -> None:
        if self.path is None:
            return
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        line = json.dumps({"t": time.time(), "step": step, "dp": dp, "dp_rank": dp_rank, "samples": samples})
        os.write(self._fd, (line + "\n").encode())


def consumed_by_step(folder: Path) -> dict[int, list[int]]:
    """Step -> the global sample indices the job trained it on (sorted), from every log under ``folder``."""
    takes: dict[int, list[dict]] = {}
    for path in sorted(Path(folder).glob("samples.*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                entry = json.loads(line)
                takes.setdefault(entry["step"], []).append(entry)
    return {step: _last_take(entries) for step, entries in sorted(takes.items())}


def _last_take(entries: list[dict]) -> list[int]:
    """The samples of a step's newest take: walking back from the newest line, one line per dp rank of the
    newest take's layout (tensor- and pipeline-parallel ranks log the same share: the first seen counts)."""
    entries = sorted(entries, key=lambda e: e["t"], reverse=True)
    dp, shares = entries[0]["dp"], {}
    for e in entries:
        if e["dp"] == dp and e["dp_rank"] not in shares:
            shares[e["dp_rank"]] = e["samples"]
        if len(shares) == dp:
            break
    return sorted(s for share in shares.values() for s in share)
