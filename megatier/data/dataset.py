"""Fixed-length GPT samples, the train/validation split, and a resumable sampler.

Sample i is tokens[i*L : i*L + L + 1] of the concatenated stream (L = seq_len):
inputs are its first L tokens, labels its last L. The last ``val_fraction`` of
samples is the validation split, so the two never overlap.

The sampler has no state: the sample read at any point is a pure function of
the number of samples consumed before it. Epoch e visits the training samples
in a permutation seeded by (seed, e). Resuming at step s therefore reads exactly
what an uninterrupted run reads.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional, Sequence

import numpy as np
import torch

from megatier.data.indexed import IndexedDataset
from megatier.data.ramp import BatchRamp


class GPTSamples:
    def __init__(self, dataset: IndexedDataset, seq_len: int, val_fraction: float):
        self.dataset = dataset
        self.seq_len = seq_len
        total = max(0, (dataset.num_tokens - 1) // seq_len)
        n_val = int(round(total * val_fraction)) if val_fraction > 0 else 0
        if val_fraction > 0 and total >= 2:
            n_val = max(1, n_val)
        self.num_train = total - n_val
        self.num_val = n_val
        if self.num_train < 1:
            raise ValueError(f"dataset has {dataset.num_tokens} tokens: too few for one training sample of "
                             f"seq_len={seq_len}; use more data or a shorter data.seq_len")

    def sample(self, index: int) -> np.ndarray:
        """Global sample ``index`` as int64 (seq_len + 1,)."""
        start = index * self.seq_len
        return np.asarray(self.dataset.tokens[start:start + self.seq_len + 1], dtype=np.int64)

    def stack(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and labels, each (len(indices), seq_len)."""
        rows = torch.from_numpy(np.stack([self.sample(i) for i in indices]))
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


class ResumableSampler:
    """Maps consumed-sample counts to training sample indices (see module docstring)."""

    def __init__(self, num_train: int, seed: int):
        self.num_train = num_train
        self.seed = seed
        # The current and the previous epoch's order (a window may straddle an epoch boundary).
        self._permutation = lru_cache(maxsize=2)(self._make_permutation)

    def _make_permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_train)

    def index(self, consumed: int) -> int:
        epoch, pos = divmod(consumed, self.num_train)
        return int(self._permutation(epoch)[pos])

    def indices(self, start: int, count: int) -> list[int]:
        return [self.index(c) for c in range(start, start + count)]


class BatchSource:
    """The micro-batches of one dp rank for a training step or a validation pass.

    Global batch of step s (1-based) = the G samples after those consumed
    before s ((s-1)*G; G = global_batch_size, or the ramp's batch of step s
    during a ramp-up, megatier.data.ramp). dp rank r takes the r-th contiguous
    G/dp of them, cut into micro-batches of ``micro_batch_size``.
    """

    def __init__(self, samples: GPTSamples, sampler: ResumableSampler, *, global_batch_size: int,
                 micro_batch_size: int, dp: int, dp_rank: int, rampup: Optional[Sequence[int]] = None):
        self.samples = samples
        self.sampler = sampler
        self.global_batch_size = global_batch_size
        self.ramp = BatchRamp.of(global_batch_size, rampup)
        self.micro_batch_size = micro_batch_size
        self.dp, self.dp_rank = dp, dp_rank
        self.per_rank = global_batch_size // dp
        self.num_microbatches = self.per_rank // micro_batch_size

    def consumed_before(self, step: int) -> int:
        return self.ramp.consumed_before(step)

    def train_indices(self, step: int) -> list[int]:
        """The global sample indices of this dp rank's share of step ``step``."""
        per_rank = self.ramp.batch(step) // self.dp
        return self.sampler.indices(self.consumed_before(step) + self.dp_rank * per_rank, per_rank)

    def train_microbatches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        indices, mb = self.train_indices(step), self.micro_batch_size
        return [self.samples.stack(indices[i:i + mb]) for i in range(0, len(indices), mb)]

    def val_microbatches(self, num_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A fixed slice of the validation split: the same samples at every evaluation."""
        if self.samples.num_val == 0:
            return []
        base = self.samples.num_train
        out = []
        for b in range(num_batches):
            first = (b * self.dp + self.dp_rank) * self.micro_batch_size
            indices = [base + (first + j) % self.samples.num_val for j in range(self.micro_batch_size)]
            out.append(self.samples.stack(indices))
        return out
