"""Megatron-core's BlendedDataset: samples drawn from several corpora in proportion to their weights.

Megatron interleaves the corpora of a blend greedily (helpers.cpp's
build_blending_indices): sample n comes from the corpus that is furthest
behind its share, weight * max(n, 1) - samples taken so far (the first such
corpus on a tie), and is that corpus's next sample. Reproducing the float
arithmetic exactly is what makes MegaTier's blended order Megatron's, so the
loop below keeps Megatron's operations and their order (IEEE doubles both).
"""
from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np


class Samples(Protocol):
    """A sequence of fixed-length token samples (one corpus's split, megatier.data.megatron_gpt.GPTSplit)."""

    def __len__(self) -> int: ...

    def sample(self, i: int) -> np.ndarray: ...


def normalize(weights: Sequence[float]) -> list[float]:
    """Weights over their sum, in float64 as Megatron divides them (its ``utils.normalize``)."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(corpus of each blended sample as int16, that sample's index within its corpus as int64)."""
    corpus_of = np.zeros(size, dtype=np.int16)
    if len(weights) == 1:  # every sample is the one corpus's next
        return corpus_of, np.arange(size, dtype=np.int64)
    index_in = np.zeros(size, dtype=np.int64)
    taken = [0] * len(weights)
    order = range(1, len(weights))
    for n in range(size):
        at = max(float(n), 1.0)
        best, best_error = 0, weights[0] * at - float(taken[0])
        for c in order:
            error = weights[c] * at - float(taken[c])
            if error > best_error:
                best, best_error = c, error
        corpus_of[n] = best
        index_in[n] = taken[best]
        taken[best] += 1
    return corpus_of, index_in


class BlendedSamples:
    """``size`` samples blending ``parts`` by ``weights`` (normalized here, as BlendedDataset does)."""

    def __init__(self, parts: Sequence[Samples], weights: Sequence[float], size: int,
                 names: Sequence[str], split: str):
        if any(w <= 0 for w in weights):
            raise ValueError(f"the {split} blend's weights {list(weights)} must all be positive")
        self.parts = list(parts)
        self.weights = normalize(weights)
        self.corpus_of, self.index_in = blending_indices(self.weights, size)
        self._check_counts(names, split)

    def _check_counts(self, names: Sequence[str], split: str) -> None:
        """No corpus is asked for more samples than its split was built with (Megatron's oversampling error)."""
        asked = np.bincount(self.corpus_of, minlength=len(self.parts))
        for name, part, count in zip(names, self.parts, asked):
            if count > len(part):
                raise ValueError(f"the {split} blend asks {name} for {int(count)} samples but its split holds "
                                 f"{len(part)}; raise data.mid_level_dataset_surplus (e.g. ten-fold)")

    def __len__(self) -> int:
        return len(self.corpus_of)

    def sample(self, i: int) -> np.ndarray:
        return self.parts[int(self.corpus_of[i])].sample(int(self.index_in[i]))
