"""Writing Megatron's indexed format (layout in :mod:`megatier.data.megatron_indexed`), byte for byte as
megatron-core's ``IndexedDatasetBuilder`` writes it for a GPT corpus: one sequence per document, a document with
no tokens recorded as a document of no sequences (as ``add_document`` with no lengths records it).

The index arrays grow in compact typed arrays (8 bytes a document, not a Python int object), so a corpus of a
billion documents is indexed in a few GiB; the files appear under their names only when complete.
"""
from __future__ import annotations

import os
import struct
from array import array

import numpy as np

from megatier.data.megatron_indexed import DTYPES, MEGATRON_MAGIC, VERSION

DTYPE_CODES = {np.dtype(dtype): code for code, dtype in DTYPES.items()}
# megatron-core's DType.optimal_dtype: uint16 below this vocabulary size, int32 from it on.
UINT16_VOCAB_LIMIT = 65500


def megatron_token_dtype(vocab_size: int) -> np.dtype:
    """The token dtype Megatron's preprocess_data.py picks for a vocabulary of ``vocab_size``."""
    return np.dtype(np.uint16 if vocab_size < UINT16_VOCAB_LIMIT else np.int32)


class MegatronCorpusWriter:
    """Streams documents into ``<prefix>.bin`` and writes ``<prefix>.idx`` on ``close``."""

    def __init__(self, prefix: str, dtype: np.dtype):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"Megatron's format has no code for {self.dtype.name} tokens")
        self._tmp = f".tmp{os.getpid()}"
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._bin = open(prefix + ".bin" + self._tmp, "wb")
        self._sequence_lengths = array("i")
        self._document_indices = array("q", [0])

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Documents laid end to end in ``tokens`` (already in this corpus's dtype), ``lengths`` tokens each."""
        self._bin.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        for length in lengths.tolist():
            if length:
                self._sequence_lengths.append(length)
            self._document_indices.append(len(self._sequence_lengths))

    def close(self) -> None:
        self._bin.close()
        with open(self.prefix + ".idx" + self._tmp, "wb") as f:
            f.write(self.index_bytes())
        os.replace(self.prefix + ".bin" + self._tmp, self.prefix + ".bin")
        os.replace(self.prefix + ".idx" + self._tmp, self.prefix + ".idx")

    def abort(self) -> None:
        """Drop the partial files (an input error or Ctrl-C leaves no half-written corpus)."""
        self._bin.close()
        for suffix in (".bin", ".idx"):
            if os.path.exists(self.prefix + suffix + self._tmp):
                os.remove(self.prefix + suffix + self._tmp)

    def index_bytes(self) -> bytes:
        lengths = np.frombuffer(self._sequence_lengths, dtype=np.int32) if self._sequence_lengths else \
            np.zeros(0, np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths):
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        documents = np.frombuffer(self._document_indices, dtype=np.int64)
        header = MEGATRON_MAGIC + struct.pack("<QBQQ", VERSION, DTYPE_CODES[self.dtype], len(lengths),
                                              len(documents))
        return header + lengths.tobytes() + pointers.tobytes() + documents.tobytes()
