"""The batched compression on a GPU: no host sync until the record's one copy, and bitwise the CPU's records
and residual. Needs CUDA, not the extension (the batched path is torch ops). Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from megatier import ops
from megatier.ops import batched
from megatier.ops.compression import _codecs, _record_header

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

SIZES = [1000, 150_000, 3, 120_001, 0, 777, 2_000_000]


def _layout():
    segments, pos = [], 0
    for s in SIZES:
        segments.append((pos, s))
        pos += s
    return segments, pos


def _gradient(n: int, seed: int) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    x[150_000:170_000] = x[150_000:170_000].round(decimals=1)  # ties
    x[2_000_000:] = torch.linspace(0.0, 1.0, n - 2_000_000)  # a ramp
    return x


@pytest.mark.parametrize("mode", ["adaptive", "topk", "int8"])
def test_compressing_a_shard_never_waits_for_the_gpu(mode):
    segments, n = _layout()
    offsets, numels = [o for o, _ in segments], [k for _, k in segments]
    h = _record_header("test", n, mode, 0.01, 100_000, 256, 16384, 5, 2**31 - 1)
    flat = _gradient(n, 1).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pools, counts, plan = batched.compress_pools(flat, offsets, numels, _codecs(mode, numels, 100_000), h,
                                                     True)
        pending = batched.PendingRecord(pools, counts, plan)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    host, _ = pending.wait()
    assert all(t.device.type == "cpu" for t in host.values())


@pytest.mark.parametrize("mode", ops.MODES)
@pytest.mark.parametrize("sample_size", [1, 16384])  # 1: every sampled threshold fails and is made exact
def test_gpu_records_and_residual_equal_the_cpu(mode, sample_size):
    segments, n = _layout()
    x = _gradient(n, 2)
    addend = torch.randn(n, generator=torch.Generator().manual_seed(3))
    kw = dict(sample_size=sample_size, seed=9, feedback=True)
    cpu_x, gpu_x = x.clone(), x.cuda()
    cpu = ops.compress_segments(cpu_x, segments, mode, 0.01, 100_000, addend=addend, **kw)
    gpu = ops.compress_segments(gpu_x, segments, mode, 0.01, 100_000, addend=addend.cuda(), **kw)
    assert gpu.header == cpu.header
    assert gpu.tensors.keys() == cpu.tensors.keys()
    for name, t in gpu.tensors.items():
        assert torch.equal(t.cpu().view(torch.uint8), cpu.tensors[name].view(torch.uint8)), name
    assert torch.equal(gpu_x.cpu().view(torch.int32), cpu_x.view(torch.int32))
