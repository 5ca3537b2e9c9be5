"""The prefetching loader: the same batches as reading in the loop, whatever step is asked for, and its thread
stopped at close."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from megatier.data.dataset import BatchSource, GPTSamples, ResumableSampler
from megatier.data.prefetch import PrefetchingBatches

CPU = torch.device("cpu")


class Recording:
    """A source whose batch for step s holds s, recording which thread read which step."""

    def __init__(self, fail_at: int = -1):
        self.reads: list[tuple[int, str]] = []
        self.fail_at = fail_at
        self.micro_batch_size = 4

    def train_microbatches(self, step: int):
        self.reads.append((step, threading.current_thread().name))
        if step == self.fail_at:
            raise IndexError(f"no step {step}")
        return [(torch.full((2, 3), step), torch.full((2, 3), step + 1))]


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("megatier-prefetch")]


def test_reads_the_next_step_on_its_thread_and_hands_it_over():
    source = Recording()
    loader = PrefetchingBatches(source, CPU)
    try:
        for step in range(1, 5):
            (x, y), = loader.train_microbatches(step)
            assert int(x[0, 0]) == step and int(y[0, 0]) == step + 1
            assert loader.take_wait_ms() >= 0.0
        loader._ahead[1].result()
        on_thread = [s for s, name in source.reads if name.startswith("megatier-prefetch")]
        assert on_thread == [2, 3, 4, 5]  # step 1 in the loop, every later step read ahead
        assert loader.micro_batch_size == 4  # everything else is the source's
    finally:
        loader.close()


def test_another_step_than_the_guess_reads_that_step():
    source = Recording()
    loader = PrefetchingBatches(source, CPU)
    try:
        loader.train_microbatches(5)  # reads 6 ahead
        (x, _), = loader.train_microbatches(3)  # a rollback: 3, not the 6 read ahead
        assert int(x[0, 0]) == 3
        (x, _), = loader.train_microbatches(3)  # a rerun of the same step
        assert int(x[0, 0]) == 3
        (x, _), = loader.train_microbatches(4)
        assert int(x[0, 0]) == 4
    finally:
        loader.close()


def test_no_read_past_the_last_step_and_a_failed_read_ahead_raises_when_asked():
    source = Recording(fail_at=3)
    loader = PrefetchingBatches(source, CPU, last_step=3)
    try:
        loader.train_microbatches(2)  # reads 3 ahead, which fails on the thread
        with pytest.raises(IndexError, match="no step 3"):
            loader.train_microbatches(3)
        assert loader._ahead is None and max(s for s, _ in source.reads) == 3  # nothing past step 3
    finally:
        loader.close()


def test_close_stops_the_thread_and_a_later_request_starts_it_again():
    loader = PrefetchingBatches(Recording(), CPU)
    loader.train_microbatches(1)
    assert _prefetch_threads()
    loader.close()
    assert not _prefetch_threads()
    (x, _), = loader.train_microbatches(2)
    assert int(x[0, 0]) == 2 and _prefetch_threads()
    loader.close()
    assert not _prefetch_threads()


def test_off_reads_in_the_loop_and_still_times_it():
    source = Recording()
    loader = PrefetchingBatches(source, CPU, enabled=False)
    for step in (1, 2, 3):
        loader.train_microbatches(step)
    assert [s for s, _ in source.reads] == [1, 2, 3]
    assert all(name == threading.current_thread().name for _, name in source.reads)
    assert loader.take_wait_ms() > 0.0 and loader.take_wait_ms() == 0.0
    assert not _prefetch_threads()


class _Tokens:
    def __init__(self, n: int):
        self.tokens = np.arange(n, dtype=np.uint16)
        self.num_tokens = n


def test_a_real_batch_source_gives_bitwise_the_same_batches_with_and_without():
    samples = GPTSamples(_Tokens(5000), seq_len=16, val_fraction=0.05)

    def source():
        return BatchSource(samples, ResumableSampler(samples.num_train, 7), global_batch_size=8,
                           micro_batch_size=2, dp=2, dp_rank=1)

    plain, ahead = source(), PrefetchingBatches(source(), CPU, last_step=40)
    try:
        order = list(range(1, 30)) + list(range(12, 41))  # a rollback to step 12 midway
        for step in order:
            for (a, b), (c, d) in zip(plain.train_microbatches(step), ahead.train_microbatches(step)):
                assert torch.equal(a, c) and torch.equal(b, d)
        assert ahead.consumed_before(41) == plain.consumed_before(41)
    finally:
        ahead.close()
