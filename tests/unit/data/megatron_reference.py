"""Megatron-core as the reference: corpora written by its own IndexedDatasetBuilder, and its GPTDataset and
BlendedDataset built with no cache directory and no process group (megatron-core is a test dependency only)."""
from __future__ import annotations

import os
from typing import Optional, Sequence

import numpy as np
import torch

# Megatron-core's splits loop forever over a split with no tokens: every corpus below has enough documents, all
# of at least one token past the few chosen to be empty or one token long.
EMPTY_DOCUMENT, ONE_TOKEN_DOCUMENT = 3, 5


class TokenizerStub:
    """What GPTDatasetConfig reads of a tokenizer: the end-of-document id, no vocabulary (the .idx names the
    dtype), no pad token (Megatron then pads with -1, which no corpus holds), and an identity for its hash."""

    eod = 0
    vocab_size = None
    unique_identifiers = {"class": "TokenizerStub"}


def write_corpus(prefix: str, documents: Sequence[Sequence[int]], dtype: type) -> None:
    """``documents`` as a Megatron corpus, one sequence per document, written by megatron-core itself."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for document in documents:
        builder.add_item(torch.tensor(list(document), dtype=torch.int64))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def random_documents(rng: np.random.Generator, count: int, high: int, max_len: int = 30) -> list[list[int]]:
    """``count`` documents of 2..max_len tokens below ``high``, one of them empty and one a single token."""
    documents = [rng.integers(0, high, size=int(rng.integers(2, max_len))).tolist() for _ in range(count)]
    documents[EMPTY_DOCUMENT] = []
    documents[ONE_TOKEN_DOCUMENT] = [int(rng.integers(0, high))]
    return documents


def write_corpora(root: str, seed: int = 0) -> list[str]:
    """Three corpora of different sizes: uint16, int32 and uint16 tokens."""
    rng = np.random.default_rng(seed)
    prefixes = []
    for i, (count, dtype, high) in enumerate([(60, np.uint16, 65535), (40, np.int32, 2**31 - 1),
                                              (25, np.uint16, 50257)]):
        prefix = os.path.join(root, f"corpus{i}")
        write_corpus(prefix, random_documents(rng, count, high), dtype)
        prefixes.append(prefix)
    return prefixes


def megatron_splits(blend: Optional[tuple], split: Optional[str], sizes: list[int], seq_len: int, seed: int,
                    per_split: Optional[list] = None) -> list:
    """Megatron-core's train, valid and test datasets for these settings."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config = GPTDatasetConfig(random_seed=seed, sequence_length=seq_len, blend=blend, blend_per_split=per_split,
                              split=split, path_to_cache=None, tokenizer=TokenizerStub(), reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False)
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()


def megatron_sample(dataset, i: int) -> np.ndarray:
    """Megatron's sample ``i`` as the seq_len + 1 tokens its inputs and labels are cut from."""
    item = dataset[i]
    return torch.cat([item["tokens"], item["labels"][-1:]]).numpy()
