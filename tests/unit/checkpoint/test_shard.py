"""ShardAccess.compress: the error feedback of a lossy diff stream, restarted at each base."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatier import ops
from megatier.config import DiffStreamConfig
from tests.unit.checkpoint.memory import tiny_shard


def _gradient(n: int, seed: int) -> torch.Tensor:
    g = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    g[::7] = -0.0  # 0.0 + -0.0 is +0.0: a residual restarted at a base must give the same signed zeros
    g[3] = float("nan")
    return g


@pytest.mark.parametrize("threads", [1, 0])
def test_the_residual_restarts_at_a_base_as_if_cleared(threads):
    """Records and residual, step by step across two bases (one right after another), equal those of a
    residual cleared to zeros at each base and added to, bit for bit; on one thread or on the team."""
    opt, shard = tiny_shard()
    cfg = dataclasses.replace(DiffStreamConfig(), compression="topk", topk_ratio=0.2, threads=threads)
    n = opt.master.numel()
    reference = torch.zeros(n)
    for step in range(1, 9):
        if step in (3, 4):  # a base after steps 2 and 3
            shard.capture_base(step - 1)
            reference.zero_()
        grad = _gradient(n, step)
        record, _ = shard.compress(step, grad, 1e-3, step, False, cfg)
        reference.add_(grad)
        expected = ops.compress_segments(reference, shard.segments, "topk", 0.2, cfg.small_threshold, seed=step,
                                         feedback=True)
        assert record.header == expected.header
        for k, t in expected.tensors.items():
            assert torch.equal(record.tensors[k].view(torch.uint8), t.view(torch.uint8)), (step, k)
        assert torch.equal(shard.residual.view(torch.int32), reference.view(torch.int32)), step


def test_a_skipped_step_keeps_the_restart_for_the_next_record():
    opt, shard = tiny_shard()
    cfg = dataclasses.replace(DiffStreamConfig(), compression="int8")
    n = opt.master.numel()
    shard.compress(1, _gradient(n, 1), 1e-3, 1, False, cfg)
    shard.capture_base(1)
    record, nbytes = shard.compress(2, None, 1e-3, 1, True, cfg)  # an fp16 overflow: nothing applied
    assert record.skipped and nbytes == 0
    grad = _gradient(n, 3)
    shard.compress(3, grad, 1e-3, 2, False, cfg)
    expected = grad + 0.0
    ops.compress_segments(expected, shard.segments, "int8", cfg.topk_ratio, cfg.small_threshold, seed=3,
                          feedback=True)
    assert torch.equal(shard.residual.view(torch.int32), expected.view(torch.int32))
