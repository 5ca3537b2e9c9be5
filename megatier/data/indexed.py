"""Memory-mapped token dataset: ``<prefix>.bin`` (tokens) and ``<prefix>.idx`` (index).

.bin: every document's tokens followed by its end-of-document token, as uint16
(vocabularies up to 65535) or uint32, back to back.

.idx: little-endian
    8 bytes   magic b"MTIDX001"
    int64     dtype code (2: uint16, 4: uint32)
    int64     number of documents D
    int64     number of tokens T
    int64     length J of the metadata JSON
    J bytes   metadata JSON (tokenizer spec, vocab_size, eod_id, bin_xxh64)
    int64[D+1] document start offsets in tokens (last = T)

``bin_xxh64`` is the xxh64 of the whole .bin, computed while writing. Opening
a dataset verifies it (one pass over the file, then remembered in the cache
directory by path, size and modification time, so later opens are free) and
refuses a .bin whose bytes changed; the checksum is part of a run's config
fingerprint, so checkpoints record which data they were trained on.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from typing import Iterable, Optional

import numpy as np
import xxhash

log = logging.getLogger(__name__)

MAGIC = b"MTIDX001"
DTYPES = {2: np.uint16, 4: np.uint32}


def token_dtype(vocab_size: int) -> type:
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32


class IndexedDatasetWriter:
    """Streams documents into a .bin and writes the .idx on ``close``; both appear atomically."""

    def __init__(self, prefix: str, vocab_size: int, metadata: dict):
        self.prefix = prefix
        self.dtype = token_dtype(vocab_size)
        self.metadata = dict(metadata, vocab_size=vocab_size)
        self._tmp = f".tmp{os.getpid()}"
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._bin = open(prefix + ".bin" + self._tmp, "wb")
        self._hash = xxhash.xxh64()
        self._offsets = [0]

    def add_document(self, tokens: Iterable[int]) -> None:
        data = np.asarray(tokens, dtype=self.dtype).tobytes()
        self._bin.write(data)
        self._hash.update(data)
        self._offsets.append(self._offsets[-1] + len(data) // np.dtype(self.dtype).itemsize)

    def abort(self) -> None:
        """Drop the partial .bin (a failed build leaves nothing under the corpus's names)."""
        self._bin.close()
        if os.path.exists(self.prefix + ".bin" + self._tmp):
            os.remove(self.prefix + ".bin" + self._tmp)

    def close(self) -> None:
        self._bin.close()
        self.metadata["bin_xxh64"] = self._hash.hexdigest()
        meta = json.dumps(self.metadata, sort_keys=True).encode()
        offsets = np.asarray(self._offsets, dtype=np.int64)
        code = np.dtype(self.dtype).itemsize
        with open(self.prefix + ".idx" + self._tmp, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<qqqq", code, len(offsets) - 1, int(offsets[-1]), len(meta)))
            f.write(meta)
            f.write(offsets.tobytes())
        os.replace(self.prefix + ".bin" + self._tmp, self.prefix + ".bin")
        os.replace(self.prefix + ".idx" + self._tmp, self.prefix + ".idx")


def read_index(idx_path: str) -> tuple[int, dict, np.ndarray]:
    """(dtype code, metadata, document offsets) of an .idx file; ValueError naming it if it is not one."""
    with open(idx_path, "rb") as f:
        magic = f.read(8)
        if magic != MAGIC:
            raise ValueError(f"{idx_path} is not a MegaTier index (magic {magic!r}); rebuild it with "
                             f"megatier-preprocess")
        code, docs, num_tokens, meta_len = struct.unpack("<qqqq", f.read(32))
        if code not in DTYPES:
            raise ValueError(f"{idx_path}: unknown token dtype code {code}; the index is corrupt")
        metadata = json.loads(f.read(meta_len))
        offsets = np.frombuffer(f.read(8 * (docs + 1)), dtype=np.int64)
    if len(offsets) != docs + 1 or (docs >= 0 and len(offsets) and int(offsets[-1]) != num_tokens):
        raise ValueError(f"{idx_path}: the document table is truncated; rebuild it with megatier-preprocess")
    return code, metadata, offsets


def file_xxh64(path: str, chunk: int = 16 << 20) -> str:
    """xxh64 of a whole file, read in chunks."""
    h = xxhash.xxh64()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class _VerifiedFiles:
    """Which files were verified, by path, size and modification time (a JSON file in the cache directory)."""

    def __init__(self, cache_dir: Optional[str]):
        root = os.path.expanduser(cache_dir or os.environ.get("MEGATIER_CACHE") or "~/.cache/megatier")
        self.path = os.path.join(root, "verified-datasets.json")

    @staticmethod
    def _key(path: str) -> str:
        st = os.stat(path)
        return hashlib.sha1(f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()

    def _load(self) -> dict:
        try:
            with open(self.path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def checksum(self, path: str) -> Optional[str]:
        return self._load().get(self._key(path))

    def remember(self, path: str, checksum: str) -> None:
        entries = self._load()
        entries[self._key(path)] = checksum
        tmp = f"{self.path}.tmp{os.getpid()}"
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(tmp, "w") as f:
                json.dump(entries, f)
            os.replace(tmp, self.path)
        except OSError as e:  # a read-only cache only costs a re-check next time
            log.debug("could not remember the verified dataset %s: %s", path, e)


def remembered_checksum(path: str, cache_dir: Optional[str] = None) -> str:
    """xxh64 of a file that records none of its own (a Megatron corpus): computed once per file version (path,
    size, modification time) and remembered in the cache directory, as verified MegaTier files are."""
    remembered = _VerifiedFiles(cache_dir)
    checksum = remembered.checksum(path)
    if checksum is None:
        checksum = file_xxh64(path)
        remembered.remember(path, checksum)
    return checksum


def corpus_files(prefix: str, fix: str) -> tuple[str, str, str]:
    """``prefix`` (``~`` expanded) and its .idx and .bin paths; FileNotFoundError naming ``fix`` when one is
    missing."""
    prefix = os.path.expanduser(prefix)
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} does not exist; {fix}")
    return prefix, idx_path, bin_path


class IndexedDataset:
    """Read-only view of a token dataset; ``tokens`` is a memory map, never loaded whole."""

    def __init__(self, prefix: str, cache_dir: Optional[str] = None):
        prefix, idx_path, bin_path = corpus_files(prefix, "build the dataset with megatier-preprocess")
        code, self.metadata, self.doc_offsets = read_index(idx_path)
        self.dtype = DTYPES[code]
        num_tokens = int(self.doc_offsets[-1])
        expected = num_tokens * np.dtype(self.dtype).itemsize
        actual = os.path.getsize(bin_path)
        if actual != expected:
            raise ValueError(f"{bin_path} has {actual} bytes but its index promises {expected}; the pair is "
                             f"truncated or mismatched, rebuild it with megatier-preprocess")
        self.num_tokens = num_tokens
        self.checksum = self._verify(bin_path, cache_dir)
        self.tokens = (np.memmap(bin_path, dtype=self.dtype, mode="r", shape=(num_tokens,)) if num_tokens
                       else np.zeros(0, self.dtype))

    def _verify(self, bin_path: str, cache_dir: Optional[str]) -> str:
        """The .bin's xxh64, checked against the one its index records (once per file version)."""
        recorded = self.metadata.get("bin_xxh64")
        verified = _VerifiedFiles(cache_dir)
        if recorded is not None and verified.checksum(bin_path) == recorded:
            return recorded
        actual = file_xxh64(bin_path)
        if recorded is None:
            log.warning("%s has no recorded checksum, so corruption cannot be detected; rebuild it with "
                        "megatier-preprocess", bin_path)
            return actual
        if actual != recorded:
            raise ValueError(f"{bin_path}: xxh64 {actual} does not match {recorded} recorded in its index; the "
                             f"token file was modified or is corrupt, rebuild it with megatier-preprocess")
        verified.remember(bin_path, actual)
        return actual

    @property
    def num_documents(self) -> int:
        return len(self.doc_offsets) - 1

    def document(self, i: int) -> np.ndarray:
        return np.asarray(self.tokens[self.doc_offsets[i]:self.doc_offsets[i + 1]])

    @property
    def sequence_lengths(self) -> np.ndarray:
        """Tokens per document, as Megatron's sequence lengths (its GPT samples cut documents alike)."""
        return np.diff(self.doc_offsets).astype(np.int32)

    def get(self, sequence: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens [offset, offset + length) of document ``sequence`` (to its end when ``length`` is None)."""
        start = int(self.doc_offsets[sequence]) + offset
        end = int(self.doc_offsets[sequence + 1]) if length is None else start + length
        return np.asarray(self.tokens[start:end])
