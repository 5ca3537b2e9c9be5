"""A store on a local or shared file system directory (Tier-1 under /dev/shm, Tier-3 as a directory).

Atomicity comes from the file system, not from locks:
- ``put`` writes ``<key>.tmp-<random>`` in the key's directory, fsyncs it, and
  ``os.replace``-s it onto the key (atomic on POSIX), then fsyncs the directory
  so the rename itself survives a power loss on a real disk.
- ``put_if_absent`` writes a fsynced temp file the same way and ``os.link``-s it
  to the key: link fails with EEXIST when the key exists, so the object appears
  complete or not at all and exactly one concurrent caller wins. The file
  system must support hard links (every POSIX local FS, NFS and Lustre do).
- Temp names contain ``.tmp-`` and are never listed; a crash leaves at most a
  temp file, which :meth:`DirectoryStore.sweep_temp` removes.
"""
from __future__ import annotations

import errno
import mmap
import os
import secrets
from typing import BinaryIO, Iterable, Optional

from megatier.checkpoint.storage.store import (
    Buffer,
    ObjectNotFound,
    ObjectStore,
    StoreError,
    StoreUnavailable,
    check_key,
)

_TMP = ".tmp-"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class PartialFile:
    """A temp file next to its final path, written in pieces; never listed, never visible as the key.

    ``reuse``: an existing file nobody reads any more (a spare, :mod:`.spare`) to write over instead of a
    new one; it is renamed to the temp name first and cut to the written size when sealed.
    """

    def __init__(self, path: str, *, fsync: bool = True, reuse: Optional[str] = None):
        self.fsync = fsync
        self.size = 0
        self.reused = False
        directory = os.path.dirname(path)
        for attempt in range(4):  # a concurrent delete may prune a parent directory while we create ours
            self.tmp = f"{path}{_TMP}{secrets.token_hex(6)}"
            try:
                if attempt:  # the directory is missing (the first try assumes it exists: three syscalls less)
                    os.makedirs(directory, exist_ok=True)
                self._file = self._open_reused(reuse) if reuse is not None else None
                self._file = self._file or open(self.tmp, "xb")
                return
            except (FileNotFoundError, FileExistsError):
                # makedirs raises FileExistsError too when the directory vanishes between its mkdir and
                # its isdir check: the same race, so the same retry.
                continue
        raise StoreError(f"cannot create a file in {directory}: the directory keeps disappearing")

    def _open_reused(self, spare: str) -> Optional[BinaryIO]:
        """``spare`` renamed to the temp name and opened for writing over from its start; None if it is gone."""
        try:
            os.rename(spare, self.tmp)
        except FileNotFoundError:
            return None
        self.reused = True
        return open(self.tmp, "r+b")

    def append(self, data: Buffer) -> None:
        self._file.write(data)
        self.size += memoryview(data).nbytes

    def fill_from(self, fd: int, size: int) -> None:
        """Copy ``size`` bytes of the file ``fd`` (from its start) in the kernel."""
        self._file.flush()
        sent = 0
        while sent < size:
            n = os.sendfile(self._file.fileno(), fd, sent, size - sent)
            if n == 0:
                raise OSError(errno.EIO, f"source file ended after {sent} of {size} bytes")
            sent += n
        self.size += size

    def seal(self) -> str:
        """Flush, fsync and close; returns the temp path, ready to be renamed or linked."""
        if not self._file.closed:
            self._file.flush()
            if self.reused:  # drop what the old content had beyond this file's end
                os.ftruncate(self._file.fileno(), self.size)
            if self.fsync:
                os.fsync(self._file.fileno())
            self._file.close()
        return self.tmp

    def discard(self) -> None:
        """Close and remove the temp file (idempotent)."""
        self._file.close()
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass


class DirectoryStore(ObjectStore):
    """Objects as files under ``root``; a key's '/' parts are subdirectories."""

    def __init__(self, root: str, *, fsync: bool = True):
        self.root = os.path.abspath(os.path.expanduser(root))
        self.url = self.root
        self.fsync = fsync

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *check_key(key).split("/"))

    def path(self, key: str) -> str:
        """The file that holds ``key`` (for moving it elsewhere on the same file system)."""
        return self._path(key)

    def _write_temp(self, path: str, data: bytes) -> str:
        """Write ``data`` to a fresh, fsynced temp file next to ``path``; returns the temp path."""
        partial = PartialFile(path, fsync=self.fsync)
        try:
            partial.append(data)
            return partial.seal()
        except BaseException:
            partial.discard()
            raise

    def begin(self, key: str, reuse: Optional[str] = None) -> PartialFile:
        """Start writing ``key`` piece by piece (over the spare file ``reuse`` if given); nothing is visible
        until :meth:`publish`."""
        try:
            return PartialFile(self._path(key), fsync=self.fsync, reuse=reuse)
        except OSError as e:
            raise self._wrap(e, "writing", key) from e

    def publish(self, partial: PartialFile, key: str) -> None:
        """Atomically make a finished PartialFile the object ``key`` (replacing any old one)."""
        path = self._path(key)
        try:
            os.replace(partial.seal(), path)
            if self.fsync:
                _fsync_dir(os.path.dirname(path))
        except OSError as e:
            partial.discard()
            raise self._wrap(e, "writing", key) from e

    def _wrap(self, e: OSError, what: str, key: str) -> StoreError:
        hint = "check free space, permissions and that the file system is mounted"
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            hint = "the file system is full (or a file-size limit is reached); free space or lower retention"
        return StoreUnavailable(f"{what} {self.describe(key)} failed: {e.strerror or e}; {hint}",
                                transient=e.errno in (errno.EIO, errno.EAGAIN, errno.EINTR, errno.ESTALE))

    def put(self, key: str, data: Buffer) -> None:
        self.put_pieces(key, (data,))

    def put_pieces(self, key: str, pieces: Iterable[Buffer], reuse: Optional[str] = None) -> None:
        """:meth:`put` of the concatenation of ``pieces``, written one after another (no joined copy), over the
        spare file ``reuse`` if given."""
        partial = self.begin(key, reuse)
        try:
            for piece in pieces:
                partial.append(piece)
        except OSError as e:
            partial.discard()
            raise self._wrap(e, "writing", key) from e
        self.publish(partial, key)

    def open_mapped(self, key: str) -> tuple[BinaryIO, mmap.mmap]:
        """``key``'s file opened for reading and a read-only map of it: its bytes without a copy
        (on tmpfs, the very memory of the file). Both stay valid if the key is deleted or replaced."""
        path = self._path(key)
        try:
            f = open(path, "rb")
        except FileNotFoundError as e:
            raise ObjectNotFound(f"{self.describe(key)} does not exist") from e
        except OSError as e:
            raise self._wrap(e, "reading", key) from e
        try:
            return f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:  # ValueError: an empty file cannot be mapped
            f.close()
            raise StoreError(f"mapping {self.describe(key)} failed: {e}") from e

    def put_from(self, key: str, data: Buffer, source: Optional[BinaryIO]) -> None:
        """:meth:`put`, copying from the open file ``source`` (holding exactly ``data``) in the kernel.

        A Tier-1 payload lives in a tmpfs file; sendfile moves it into this
        store's file without touching user memory, which costs a third of the
        CPU of writing the mapped bytes (and does not grow under writeback).
        """
        if source is None:
            return self.put(key, data)
        partial = self.begin(key)
        try:
            partial.fill_from(source.fileno(), len(data))
        except OSError as e:
            partial.discard()
            raise self._wrap(e, "writing", key) from e
        self.publish(partial, key)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        try:
            if os.path.exists(path):
                return False
            tmp = self._write_temp(path, data)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
            if self.fsync:
                _fsync_dir(os.path.dirname(path))
            return True
        except OSError as e:
            if e.errno in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise StoreUnavailable(f"creating {self.describe(key)} exclusively failed: {e.strerror}; the file "
                                       f"system must support hard links for conditional creates") from e
            raise self._wrap(e, "creating", key) from e

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError as e:
            raise ObjectNotFound(f"{self.describe(key)} does not exist") from e
        except OSError as e:
            raise self._wrap(e, "reading", key) from e

    def exists(self, key: str) -> bool:
        return os.path.isfile(self._path(key))

    def list(self, prefix: str = "") -> dict[str, int]:
        # Walk only the deepest directory the prefix names, then filter by the full prefix. One scandir pass
        # per directory, sizes from its entries: no join and stat per file as os.walk needs; node memory and
        # the Tier-3 coordinator list often.
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        out: dict[str, int] = {}
        self._list_into(self._path(base) if base else self.root, f"{base}/" if base else "", prefix, out)
        return out

    def children(self, prefix: str) -> set[str]:
        """Subdirectories of ``prefix``'s directory: one scandir, not a walk of everything below."""
        try:
            with os.scandir(self._path(prefix.rstrip("/"))) as entries:
                return {e.name for e in entries if e.is_dir(follow_symlinks=False)}
        except OSError:  # no such directory (nothing stored under it) or not a directory
            return set()

    def _list_into(self, directory: str, rel: str, prefix: str, out: dict[str, int]) -> None:
        try:
            entries = os.scandir(directory)
        except OSError:  # gone (deleted while listing) or not a directory
            return
        with entries:
            for entry in entries:
                key = rel + entry.name
                try:
                    if entry.is_dir():
                        if not entry.is_symlink():
                            self._list_into(entry.path, key + "/", prefix, out)
                    elif _TMP not in entry.name and key.startswith(prefix):
                        out[key] = entry.stat().st_size
                except FileNotFoundError:  # deleted while listing
                    continue

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        except OSError as e:
            raise self._wrap(e, "deleting", key) from e
        self._prune(os.path.dirname(path))

    def prune(self, key: str) -> None:
        """Remove the directories that held ``key``, now moved away, if they are empty."""
        self._prune(os.path.dirname(self._path(key)))

    def _prune(self, directory: str) -> None:
        """Remove now-empty parent directories up to the root (rmdir refuses non-empty ones)."""
        while directory != self.root and directory.startswith(self.root + os.sep):
            try:
                os.rmdir(directory)
            except OSError:
                return
            directory = os.path.dirname(directory)

    def sweep_temp(self, prefix: str = "") -> int:
        """Delete temp files left by crashed writers under ``prefix`` (a directory key); returns the count.

        Only safe when no writer is active under ``prefix``.
        """
        start = self._path(prefix.rstrip("/")) if prefix.strip("/") else self.root
        removed = 0
        for dirpath, _, files in os.walk(start):
            for name in files:
                if _TMP in name:
                    os.unlink(os.path.join(dirpath, name))
                    removed += 1
        return removed

    def check(self) -> None:
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise StoreUnavailable(f"cannot create checkpoint directory {self.root}: {e.strerror}; check the "
                                   f"path and its permissions") from e
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise StoreUnavailable(f"checkpoint directory {self.root} is not writable; fix its permissions or "
                                   f"choose another path")
