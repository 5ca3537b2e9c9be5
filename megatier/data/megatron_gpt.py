"""Megatron-core's GPTDataset: one corpus's documents of one split, cut into samples in Megatron's order.

A job moved from Megatron-LM must read the very samples Megatron would have
read, so the three indices of megatron/core/datasets/gpt_dataset.py are
rebuilt here with the same random draws:

- document index: the split's documents repeated for as many epochs as the
  requested samples need, shuffled by ``RandomState(seed)`` (the last epoch
  shuffled apart when it contributes under 80% of an epoch's samples);
- sample index: where sample k starts, (position in the document index, token
  offset); sample k is the tokens [k*L, k*L + L + 1) of the documents laid end to
  end in document-index order (helpers.cpp's build_sample_idx; a partial last
  sample is dropped);
- shuffle index: a permutation of the samples, drawn from the same RandomState
  right after the document index.

Megatron splits and samples by *sequence* (one per document in a GPT corpus);
so does this module. Sample i is a pure function of the corpus, the documents,
the seed, the sequence length and the requested count.
"""
from __future__ import annotations

from typing import Optional, Protocol

import numpy as np

# Megatron draws one token past each sample (add_extra_token_to_sequence): inputs and labels both hold L tokens.
EXTRA_TOKEN = 1
# The last epoch is shuffled apart when it contributes under this share of an epoch's samples.
SEPARATE_FINAL_EPOCH_BELOW = 0.80


class TokenCorpus(Protocol):
    """What a GPT split reads: Megatron's and MegaTier's indexed datasets both provide it."""

    sequence_lengths: np.ndarray
    dtype: type

    def get(self, sequence: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray: ...


def num_epochs(tokens_per_epoch: int, num_samples: Optional[int], seq_len: int) -> int:
    """Epochs of the split that hold ``num_samples`` samples (one epoch when no count is asked)."""
    if num_samples is None:
        return 1
    requested = num_samples * seq_len + EXTRA_TOKEN
    return max(1, -(-requested // tokens_per_epoch))


def samples_in(num_tokens: int, seq_len: int) -> int:
    """Whole samples in ``num_tokens`` laid end to end (each reads one token past its end)."""
    return (num_tokens - EXTRA_TOKEN) // seq_len


def separate_final_epoch(tokens_per_epoch: int, epochs: int, num_samples: Optional[int], seq_len: int) -> bool:
    """Whether the last epoch is shuffled apart: it adds under 80% of an epoch's samples."""
    if epochs == 1 or num_samples is None:
        return False
    before_final = samples_in((epochs - 1) * tokens_per_epoch, seq_len)
    per_epoch = samples_in(tokens_per_epoch, seq_len)
    return num_samples - before_final < int(SEPARATE_FINAL_EPOCH_BELOW * per_epoch)


def document_index(documents: np.ndarray, epochs: int, rng: np.random.RandomState, separate: bool) -> np.ndarray:
    """The documents of ``epochs`` epochs, shuffled (the last epoch on its own when ``separate``)."""
    if separate and epochs > 1:
        first = document_index(documents, epochs - 1, rng, False)
        return np.concatenate((first, document_index(documents, 1, rng, False)))
    index = np.tile(np.asarray(documents, dtype=np.int32), epochs)
    rng.shuffle(index)
    return index


def sample_index(lengths: np.ndarray, documents: np.ndarray, seq_len: int, num_samples: int) -> np.ndarray:
    """(num_samples + 1, 2): for the start of each sample and the end of the last, the position in
    ``documents`` of the document holding that token and the token's offset in it."""
    doc_lengths = lengths[documents].astype(np.int64)
    ends = np.cumsum(doc_lengths)
    starts = np.arange(1, num_samples + 1, dtype=np.int64) * seq_len
    where = np.searchsorted(ends, starts, side="right")
    index = np.zeros((num_samples + 1, 2), dtype=np.int64)  # sample 0 starts at document 0, offset 0
    index[1:, 0] = where
    index[1:, 1] = starts - (ends[where] - doc_lengths[where])
    return index


def shuffle_index(num_samples: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of [0, num_samples) followed by one of [num_samples, total)."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total:
        return first
    last = np.arange(num_samples, total, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


class GPTSplit:
    """Megatron's GPTDataset over ``documents`` of ``corpus``: ``len`` samples of ``seq_len + 1`` tokens."""

    def __init__(self, corpus: TokenCorpus, documents: np.ndarray, num_samples: Optional[int], seq_len: int,
                 seed: int, name: str = "corpus"):
        self.corpus, self.seq_len = corpus, seq_len
        if np.dtype(corpus.dtype).kind == "f":
            raise ValueError(f"{name} holds {np.dtype(corpus.dtype).name} values, not token ids; train on a "
                             f"corpus of integer tokens")
        lengths = corpus.sequence_lengths
        tokens_per_epoch = int(np.sum(lengths[documents], dtype=np.int64))
        if tokens_per_epoch < 1:
            raise ValueError(f"{name} has no tokens in its {len(documents)} documents; give the split more "
                             f"documents (data.split) or leave the corpus out of it")
        epochs = num_epochs(tokens_per_epoch, num_samples, seq_len)
        separate = separate_final_epoch(tokens_per_epoch, epochs, num_samples, seq_len)
        rng = np.random.RandomState(seed)
        self.document_index = document_index(documents, epochs, rng, separate)
        total = samples_in(epochs * tokens_per_epoch, seq_len)
        self.sample_index = sample_index(lengths, self.document_index, seq_len, total)
        shuffled = samples_in((epochs - 1) * tokens_per_epoch, seq_len) if separate else total
        self.shuffle_index = shuffle_index(shuffled, total, rng)
        self.epochs = epochs

    def __len__(self) -> int:
        return len(self.sample_index) - 1

    def sample(self, i: int) -> np.ndarray:
        """Sample ``i`` as int64 (seq_len + 1,): inputs are its first seq_len tokens, labels its last."""
        k = int(self.shuffle_index[i])
        (first, offset), (last, end) = self.sample_index[k], self.sample_index[k + 1]
        docs = self.document_index
        if first == last:
            return self.corpus.get(int(docs[first]), int(offset), int(end - offset) + EXTRA_TOKEN).astype(np.int64)
        parts = [self.corpus.get(int(docs[first]), int(offset))]
        parts += [self.corpus.get(int(docs[d])) for d in range(first + 1, last)]
        parts.append(self.corpus.get(int(docs[last]), 0, int(end) + EXTRA_TOKEN))
        return np.concatenate(parts).astype(np.int64)

