"""Megatron's indexed token format, read in place: ``<prefix>.bin`` (tokens) and ``<prefix>.idx`` (index).

Megatron-LM's preprocessing (and NeMo, GPT-NeoX forks) write it; users keep
terabytes of it, so MegaTier reads it as it is, memory-mapped, with no
conversion step.

.idx: little-endian
    9 bytes   magic b"MMIDIDX\\x00\\x00"
    uint64    version (1)
    uint8     dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16)
    uint64    number of sequences S
    uint64    number of document indices D
    int32[S]  sequence lengths in tokens
    int64[S]  sequence pointers: byte offsets of the sequences in the .bin
    int64[D]  document indices: document i is sequences [d[i], d[i+1])
    (multimodal files append int8[S] sequence modes, which GPT training does not read)

A GPT corpus has one sequence per document (preprocessing without sentence
splitting), and Megatron's GPTDataset splits and samples by sequence, so
:mod:`megatier.data.megatron_gpt` does the same; ``document`` gives the
multi-sequence documents as Megatron defines them.

The format records no checksum and no vocabulary. The checksum that enters a
job's fingerprint is the xxh64 of the .bin and the .idx, computed once per file
version and remembered like MegaTier's own (:func:`megatier.data.indexed.remembered_checksum`);
the vocabulary comes from ``model.vocab_size``.
"""
from __future__ import annotations

import os
import struct
from typing import Optional, Union

import numpy as np
import xxhash

from megatier.data.indexed import MAGIC as MEGATIER_MAGIC
from megatier.data.indexed import IndexedDataset, corpus_files, remembered_checksum

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}
_HEADER = struct.Struct("<QBQQ")  # version, dtype code, sequences, document indices


def index_format(idx_path: str) -> str:
    """``"megatron"`` or ``"megatier"``, by the .idx's magic; ValueError naming the file if it is neither."""
    with open(idx_path, "rb") as f:
        head = f.read(len(MEGATRON_MAGIC))
    if head == MEGATRON_MAGIC:
        return "megatron"
    if head[:len(MEGATIER_MAGIC)] == MEGATIER_MAGIC:
        return "megatier"
    raise ValueError(f"{idx_path} is neither a Megatron (MMIDIDX) nor a MegaTier (MTIDX001) index (magic "
                     f"{head!r}); point at a .bin/.idx pair from Megatron's preprocess_data.py or megatier-preprocess")


class MegatronIndex:
    """The arrays of a Megatron .idx, memory-mapped (a file of billions of sequences is not loaded)."""

    def __init__(self, idx_path: str):
        with open(idx_path, "rb") as f:
            magic = f.read(len(MEGATRON_MAGIC))
            header = f.read(_HEADER.size)
        if magic != MEGATRON_MAGIC or len(header) != _HEADER.size:
            raise ValueError(f"{idx_path} is not a Megatron index (magic {magic!r})")
        version, code, sequences, documents = _HEADER.unpack(header)
        if version != VERSION:
            raise ValueError(f"{idx_path}: Megatron index version {version}; only version {VERSION} exists")
        if code not in DTYPES:
            raise ValueError(f"{idx_path}: unknown token dtype code {code}; the index is corrupt")
        self.dtype = np.dtype(DTYPES[code])
        offset = len(MEGATRON_MAGIC) + _HEADER.size
        needed = offset + sequences * (4 + 8) + documents * 8
        if os.path.getsize(idx_path) < needed:
            raise ValueError(f"{idx_path} is truncated: its header promises {sequences} sequences and "
                             f"{documents} document indices; rebuild it")
        self.sequence_lengths = _array(idx_path, np.int32, offset, sequences)
        offset += sequences * 4
        self.sequence_pointers = _array(idx_path, np.int64, offset, sequences)
        offset += sequences * 8
        self.document_indices = _array(idx_path, np.int64, offset, documents)


def _array(path: str, dtype: type, offset: int, count: int) -> np.ndarray:
    if count == 0:
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))


class MegatronIndexedDataset:
    """Read-only view of a Megatron corpus; ``tokens`` is the whole .bin as a memory map, never loaded whole."""

    def __init__(self, prefix: str, cache_dir: Optional[str] = None):
        prefix, idx_path, bin_path = corpus_files(prefix, "name a Megatron corpus by its path without .bin or .idx")
        self.prefix = prefix
        self.index = MegatronIndex(idx_path)
        self.dtype = self.index.dtype
        self._check_extent(bin_path)
        size = os.path.getsize(bin_path) // self.dtype.itemsize
        self.num_tokens = int(np.sum(self.sequence_lengths, dtype=np.int64))
        self.tokens = (np.memmap(bin_path, dtype=self.dtype, mode="r", shape=(size,)) if size
                       else np.zeros(0, self.dtype))
        self.checksum = xxhash.xxh64(f"{remembered_checksum(bin_path, cache_dir)}:"
                                     f"{remembered_checksum(idx_path, cache_dir)}".encode()).hexdigest()
        self.metadata = {"format": "megatron", "dtype": self.dtype.name, "sequences": self.num_sequences,
                         "documents": self.num_documents}

    def _check_extent(self, bin_path: str) -> None:
        """Every sequence lies inside the .bin at a whole token (one pass over the index, not the tokens)."""
        pointers, lengths = self.index.sequence_pointers, self.index.sequence_lengths
        if not len(pointers):
            return
        itemsize = self.dtype.itemsize
        end = int(np.max(pointers + lengths.astype(np.int64) * itemsize))
        actual = os.path.getsize(bin_path)
        if end > actual or np.any(pointers % itemsize) or np.any(lengths < 0):
            raise ValueError(f"{bin_path} has {actual} bytes but its index places sequences up to byte {end} "
                             f"(or off a {self.dtype.name} boundary); the pair is truncated or mismatched")

    @property
    def sequence_lengths(self) -> np.ndarray:
        return self.index.sequence_lengths

    @property
    def document_indices(self) -> np.ndarray:
        return self.index.document_indices

    @property
    def num_sequences(self) -> int:
        return len(self.index.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return max(0, len(self.index.document_indices) - 1)

    def get(self, sequence: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens [offset, offset + length) of ``sequence`` (to its end when ``length`` is None), as stored."""
        start = int(self.index.sequence_pointers[sequence]) // self.dtype.itemsize + offset
        if length is None:
            length = int(self.index.sequence_lengths[sequence]) - offset
        return np.asarray(self.tokens[start:start + length])

    def document(self, i: int) -> np.ndarray:
        """Document ``i`` as Megatron defines it: its sequences, back to back."""
        first, last = int(self.document_indices[i]), int(self.document_indices[i + 1])
        parts = [self.get(s) for s in range(first, last)]
        return np.concatenate(parts) if parts else np.zeros(0, self.dtype)


Corpus = Union[IndexedDataset, MegatronIndexedDataset]


def open_corpus(prefix: str, cache_dir: Optional[str] = None) -> Corpus:
    """The corpus at ``prefix`` in whichever format its .idx's magic names."""
    idx_path = os.path.expanduser(prefix) + ".idx"
    if os.path.isfile(idx_path) and index_format(idx_path) == "megatron":
        return MegatronIndexedDataset(prefix, cache_dir)
    return IndexedDataset(prefix, cache_dir)
