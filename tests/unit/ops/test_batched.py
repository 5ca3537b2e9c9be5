"""The batched, sync-free compression (the CUDA path, and the CPU path without the extension): bitwise the
records of the segment-by-segment definition and of the compiled CPU kernel, feedback and addend included."""
from __future__ import annotations

import pytest
import torch

from megatier import ops
from megatier.ops import batched, reference
from megatier.ops.compression import _codecs, _record_header

native_only = pytest.mark.skipif(not ops.native_available(), reason="megatier._C not built")


def _layout(sizes):
    offsets, pos = [], 0
    for s in sizes:
        offsets.append(pos)
        pos += s
    return offsets, list(sizes), pos


def _gradient(kind: str, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g)
    if kind == "ties":  # many equal magnitudes: the exact path's lowest-index rule decides
        return x.round(decimals=1)
    if kind == "sparse":  # fewer nonzeros than k in most chunks
        return x * (torch.rand(n, generator=g) < 0.003)
    if kind == "ramp":  # a sample of one run misjudges it: the count falls outside [k/2, 2k]
        return torch.linspace(0.0, 1.0, n)
    if kind == "special":
        x[:256] = 0.0
        x[300], x[400], x[401] = float("nan"), float("inf"), -float("inf")
        x[1024:1280] *= 1e30
        x[2000:2100] = 1.0
    return x


def _batched(x, offsets, numels, mode, h, feedback):
    pools, counts, plan = batched.compress_pools(x, offsets, numels, _codecs(mode, numels, h["small_threshold"]),
                                                 h, feedback)
    chunk_counts = [] if counts is None else counts.tolist()
    return {k: v for k, v in batched.trim(pools, chunk_counts, plan).items() if v.numel()}, chunk_counts


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


SIZES = {"mixed": [1000, 150_000, 3, 120_001, 0, 777], "one": [200_000], "chunked": [5, 130_000, 70_000, 0]}


@pytest.mark.parametrize("layout", sorted(SIZES))
@pytest.mark.parametrize("kind", ["randn", "ties", "sparse", "ramp", "special"])
@pytest.mark.parametrize("mode", ["adaptive", "topk", "int8"])
def test_batched_pools_equal_the_definition(layout, kind, mode):
    offsets, numels, n = _layout(SIZES[layout])
    h = _record_header("test", n, mode, 0.01, 100_000, 256, 4096, 7, 60_000)  # small chunks: exact
    x = _gradient(kind, n)
    pools, counts = _batched(x.clone(), offsets, numels, mode, h, False)
    want, want_counts = reference.compress_pools(x, offsets, numels, _codecs(mode, numels, 100_000), h)
    assert counts == want_counts
    assert pools.keys() == {k for k, v in want.items() if v.numel()}
    for name, t in pools.items():
        assert torch.equal(_bits(t), _bits(want[name])), name


@native_only
@pytest.mark.parametrize("layout", sorted(SIZES))
@pytest.mark.parametrize("kind", ["randn", "ties", "sparse", "ramp", "special"])
@pytest.mark.parametrize("mode", ops.MODES)
def test_batched_records_and_feedback_equal_the_compiled_kernel(layout, kind, mode):
    offsets, numels, n = _layout(SIZES[layout])
    x = _gradient(kind, n)
    if mode == "bf16":  # NaN payloads differ between the kernels' bf16 conversions; not part of the contract
        x = x.nan_to_num(0.0)
    addend = torch.randn(n, generator=torch.Generator().manual_seed(3))
    compiled_x = x.clone()
    compiled = ops.compress_segments(compiled_x, list(zip(offsets, numels)), mode, 0.01, 100_000, sample_size=4096,
                                     seed=11, chunk_size=60_000, feedback=True, addend=addend)
    h = _record_header("test", n, mode, 0.01, 100_000, 256, 4096, 11, 60_000)
    batched_x = x + addend  # the compiled kernel adds it inside its pass: bitwise the same sum
    pools, counts, plan = batched.compress_pools(batched_x, offsets, numels, _codecs(mode, numels, 100_000), h,
                                                 True)
    host, host_counts = batched.PendingRecord(pools, counts, plan).wait()
    assert host_counts == [c[3] for seg in compiled.header["segments"] for c in seg.get("chunks", [])]
    assert {k for k, v in host.items() if v.numel()} == compiled.tensors.keys()
    for name, t in compiled.tensors.items():
        assert torch.equal(_bits(host[name]), _bits(t)), name
    assert torch.equal(_bits(batched_x), _bits(compiled_x))  # the residual error feedback leaves


def test_a_failed_sample_falls_back_to_the_exact_top_k_with_lowest_index_ties():
    n = 200_000
    k = reference.topk_target(n, 0.01)
    h = _record_header("test", 2 * n, "topk", 0.01, 0, 256, 1, 0, n)
    ramp_and_ties = torch.cat([torch.linspace(0.0, 1.0, n), torch.ones(n)])  # two chunks, both refined
    pools, counts = _batched(ramp_and_ties, [0], [2 * n], "topk", h, False)
    assert counts == [k, k]
    assert torch.equal(pools["topk_indices"][:k].long(), torch.arange(n - k, n))  # the ramp's largest
    assert torch.equal(pools["topk_indices"][k:].long(), torch.arange(k))  # all ties: the lowest indices
