"""Megatron-core's BlendedMegatronDatasetBuilder: which documents and how many samples each split takes.

``data.blend`` is Megatron's ``--data-path`` (weights and prefixes, or prefixes
only) and ``data.split`` its ``--split``: every corpus's documents are cut into
train, valid and test ranges by the split's normalized weights, and each
split blends its ranges. ``data.train_blend`` / ``valid_blend`` / ``test_blend``
are ``--train-data-path`` etc.: a blend per split, each over whole corpora.

How many samples each corpus's split is built with decides its epochs and so
its shuffle, so the rules below follow Megatron's exactly:
- one corpus without weights (any corpus of a per-split blend): the split is
  that corpus's GPTDataset of the requested count;
- weights: corpus j's split is built with ceil(ceil(count * w_j) * (1 + surplus))
  samples and the blend holds the sum of ceil(count * w_j);
- several corpora without weights: each split is one epoch, weighted by its
  sample count, and the blend holds min(count, their sum).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from megatier.data.blend import BlendedSamples, Samples, normalize
from megatier.data.megatron_gpt import GPTSplit, TokenCorpus

SPLITS = ("train", "valid", "test")
DEFAULT_SPLIT = "969,30,1"  # Megatron's default --split


def parse_blend(blend: Sequence) -> tuple[list[str], Optional[list[float]]]:
    """(prefixes, weights or None) of a ``--data-path``-style list; ValueError saying what is wrong."""
    items = [str(item).strip() for item in blend]
    if not items:
        raise ValueError("the blend is empty: give [prefix, ...] or [weight, prefix, weight, prefix, ...]")
    if len(items) % 2:
        return items, None
    weights = [_number(w) for w in items[0::2]]
    if all(w is None for w in weights):
        return items, None
    if any(w is None for w in weights):
        raise ValueError(f"{list(blend)} mixes weights and prefixes: give a weight before every prefix, or none")
    if any(w <= 0 for w in weights):
        raise ValueError(f"{list(blend)}: every weight must be positive")
    return items[1::2], weights


def _number(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def parse_split(split: str) -> list[float]:
    """The train, valid and test shares of ``split`` ("969,30,1"), normalized as Megatron does."""
    shares = [float(s) for s in re.findall(r"[.0-9]+", str(split))]
    if not 1 <= len(shares) <= len(SPLITS) or sum(shares) <= 0:
        raise ValueError(f"{split!r} must be one to three non-negative weights, not all zero, e.g. 969,30,1")
    return normalize(shares + [0.0] * (len(SPLITS) - len(shares)))


def split_bookends(shares: Sequence[float]) -> list[Optional[tuple[float, float]]]:
    """Each split's [begin, end) fraction of a corpus's documents; None for an empty share."""
    edges = [0.0]
    for share in shares:
        edges.append(edges[-1] + share)
    return [(lo, hi) if hi > lo else None for lo, hi in zip(edges[:-1], edges[1:])]


def split_documents(num_sequences: int, bookend: tuple[float, float]) -> np.ndarray:
    """The documents (sequences) of ``bookend``, rounded as Megatron rounds them."""
    begin = int(round(bookend[0] * float(num_sequences)))
    end = int(round(bookend[1] * float(num_sequences)))
    return np.arange(begin, end, dtype=np.int32)


def samples_per_corpus(weights: Sequence[float], count: int, surplus: float = 0.0) -> list[int]:
    """Samples each corpus of a weighted blend gives a split of ``count`` (plus ``surplus`` to spare)."""
    return [int(math.ceil(math.ceil(count * w) * (1 + surplus))) for w in weights]


@dataclass(frozen=True)
class SplitPlan:
    """What one split reads: its corpora, their weights (None: by size) and the share of each corpus it takes."""

    name: str
    prefixes: list[str]
    weights: Optional[list[float]]
    bookend: tuple[float, float]
    per_split: bool  # a per-split blend, where one corpus is read as it is even when weighted


def split_plans(blend: Optional[Sequence], split: Optional[str],
                per_split: dict[str, Optional[Sequence]]) -> dict[str, Optional[SplitPlan]]:
    """Each split's plan (None where it reads nothing), from one blend and a split or from per-split blends."""
    if blend is not None:
        prefixes, weights = parse_blend(blend)
        bookends = split_bookends(parse_split(split or DEFAULT_SPLIT))
        return {name: SplitPlan(name, prefixes, weights, bookend, False) if bookend else None
                for name, bookend in zip(SPLITS, bookends)}
    plans: dict[str, Optional[SplitPlan]] = {}
    for name in SPLITS:
        given = per_split.get(name)
        plans[name] = None if given is None else SplitPlan(name, *parse_blend(given), (0.0, 1.0), True)
    return plans


class SplitBuilder:
    """Builds the samples of split plans; each corpus is opened once, whichever splits read it."""

    def __init__(self, open_corpus: Callable[[str], TokenCorpus], seq_len: int, seed: int, surplus: float):
        self._open = open_corpus
        self.seq_len, self.seed, self.surplus = seq_len, seed, surplus
        self.corpora: dict[str, TokenCorpus] = {}

    def corpus(self, prefix: str) -> TokenCorpus:
        if prefix not in self.corpora:
            self.corpora[prefix] = self._open(prefix)
        return self.corpora[prefix]

    def _part(self, plan: SplitPlan, prefix: str, count: Optional[int]) -> GPTSplit:
        corpus = self.corpus(prefix)
        documents = split_documents(len(corpus.sequence_lengths), plan.bookend)
        if not len(documents):  # Megatron would loop forever looking for its tokens
            raise ValueError(f"data.split gives the {plan.name} split of {prefix} none of its "
                             f"{len(corpus.sequence_lengths)} documents; give that split a larger share or the "
                             f"corpus more documents")
        return GPTSplit(corpus, documents, count, self.seq_len, self.seed, name=f"the {plan.name} split of {prefix}")

    def build(self, plan: SplitPlan, count: int) -> Samples:
        """The ``plan``'s split of ``count`` requested samples, in Megatron's order."""
        prefixes, weights = plan.prefixes, plan.weights
        if len(prefixes) == 1 and (weights is None or plan.per_split):
            return self._part(plan, prefixes[0], count)
        if weights is not None:
            weights = normalize(weights)
            built = samples_per_corpus(weights, count, self.surplus)
            parts = [self._part(plan, p, n) for p, n in zip(prefixes, built)]
            size = sum(samples_per_corpus(weights, count))
        else:
            parts = [self._part(plan, p, None) for p in prefixes]
            weights = [len(part) for part in parts]
            size = min(count, sum(weights))
        return BlendedSamples(parts, weights, size, prefixes, plan.name)
