"""Spare files: the files of deleted units, kept so the next units are written over their pages.

On tmpfs (node memory's default root) writing into a new file costs the kernel a
fresh, zeroed page for every 4 KiB, and deleting it frees them again; writing over
the pages of an existing file is a plain copy, several times cheaper in CPU
(the unlink of a new file costs again). The units of one base interval are deleted together
(step units once their batch is whole, batches and a base at reclamation) and
replaced by units of the same sizes, so node memory keeps the files it deletes
here, one pool per area, and writes the next unit of about the same size over one.

Invariants:
- A spare is no unit: it lives under ``spare/<area>/`` (outside ``own/`` and
  ``replica/``, so no listing of units sees it) and is taken by renaming it to a
  writer's temp name, so a crash leaves at most a temp file or a spare, both
  swept with the area (:meth:`NodeMemory.sweep_incomplete`).
- A file still mapped by this process (a payload being sent to Tier-2 or Tier-3
  reads its unit's map) is never made a spare: writing over it would change what
  that payload sends. The caller checks that before :meth:`SparePool.give`.
- A pool holds at most ``max_files`` files; its bytes count as node memory held
  (``bytes_held``), so a Tier-1 budget sees them, and :meth:`SparePool.release`
  frees them.
"""
from __future__ import annotations

import os
import secrets
import threading
from typing import Optional

SPARE_ROOT = "spare"


class SparePool:
    """The spare files of one area (``spare/<area>/`` under ``root``), shared by the threads of one process."""

    def __init__(self, root: str, area: str, *, max_files: int = 32):
        self.directory = os.path.join(root, SPARE_ROOT, *area.split("/"))
        self.max_files = max_files
        self._files: dict[str, int] = {}  # path -> size
        self._lock = threading.Lock()
        self.closed = False  # released for good: keeps nothing from then on

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(self._files.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._files)

    def give(self, path: str) -> bool:
        """Move the deleted unit's file ``path`` into the pool; False (and ``path`` untouched) if the pool is
        full or the file is gone, so the caller deletes it as before."""
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            return False
        with self._lock:
            if self.closed or len(self._files) >= self.max_files or size == 0:
                return False
            spare = os.path.join(self.directory, f"{secrets.token_hex(8)}.spare")
            try:
                os.makedirs(self.directory, exist_ok=True)
                os.rename(path, spare)
            except OSError:
                return False
            self._files[spare] = size
            return True

    def take(self, size: int) -> Optional[str]:
        """A spare for a file of ``size`` bytes, removed from the pool (the caller renames it away at once),
        or None. Takes the smallest spare that holds ``size`` bytes, else the largest smaller one, among
        those within a factor two of ``size``: a base's spare is not spent on a step's record."""
        with self._lock:
            fits = [(s, p) for p, s in self._files.items() if size // 2 <= s <= 2 * size]
            if not fits:
                return None
            larger = [f for f in fits if f[0] >= size]
            _, path = min(larger) if larger else max(fits)
            del self._files[path]
            return path

    def release(self, *, close: bool = False) -> int:
        """Delete every spare (``close``: and keep none from now on); returns the bytes freed."""
        with self._lock:
            files, self._files = self._files, {}
            self.closed = self.closed or close
        freed = 0
        for path, size in files.items():
            try:
                os.unlink(path)
                freed += size
            except FileNotFoundError:
                pass
        return freed
