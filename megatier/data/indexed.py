"""Memory-mapped token dataset: ``<prefix>.bin`` (tokens) and ``<prefix>.idx`` (index).

.bin: every document's tokens followed by its end-of-document token, as uint16
(vocabularies up to 65535) or uint32, back to back.

.idx: little-endian
    8 bytes   magic b"MTIDX001"
    int64     dtype code (2: uint16, 4: uint32)
    int64     number of documents D
    int64     number of tokens T
    int64     length J of the metadata JSON
    J bytes   metadata JSON (tokenizer spec, vocab_size, eod_id)
    int64[D+1] document start offsets in tokens (last = T)
"""
from __future__ import annotations

import json
import os
import struct
from typing import Iterable

import numpy as np

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
        self._offsets = [0]

    def add_document(self, tokens: Iterable[int]) -> None:
        arr = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(arr.tobytes())
        self._offsets.append(self._offsets[-1] + len(arr))

    def close(self) -> None:
        self._bin.close()
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


class IndexedDataset:
    """Read-only view of a token dataset; ``tokens`` is a memory map, never loaded whole."""

    def __init__(self, prefix: str):
        prefix = os.path.expanduser(prefix)
        idx_path, bin_path = prefix + ".idx", prefix + ".bin"
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path} does not exist; build the dataset with scripts/preprocess_data.py")
        with open(idx_path, "rb") as f:
            magic = f.read(8)
            if magic != MAGIC:
                raise ValueError(f"{idx_path} is not a MegaTier index (magic {magic!r}); rebuild it with "
                                 f"scripts/preprocess_data.py")
            code, docs, num_tokens, meta_len = struct.unpack("<qqqq", f.read(32))
            if code not in DTYPES:
                raise ValueError(f"{idx_path}: unknown token dtype code {code}; the index is corrupt")
            self.metadata = json.loads(f.read(meta_len))
            self.doc_offsets = np.frombuffer(f.read(8 * (docs + 1)), dtype=np.int64)
        self.dtype = DTYPES[code]
        expected = num_tokens * np.dtype(self.dtype).itemsize
        actual = os.path.getsize(bin_path)
        if actual != expected:
            raise ValueError(f"{bin_path} has {actual} bytes but its index promises {expected}; the pair is "
                             f"truncated or mismatched, rebuild it with scripts/preprocess_data.py")
        self.num_tokens = num_tokens
        self.tokens = (np.memmap(bin_path, dtype=self.dtype, mode="r", shape=(num_tokens,)) if num_tokens
                       else np.zeros(0, self.dtype))

    @property
    def num_documents(self) -> int:
        return len(self.doc_offsets) - 1

    def document(self, i: int) -> np.ndarray:
        return np.asarray(self.tokens[self.doc_offsets[i]:self.doc_offsets[i + 1]])
