"""Compression codecs of megatier.ops: compiled kernels against the pure-torch reference."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from megatier import ops
from megatier.ops import _native, reference

native_only = pytest.mark.skipif(not ops.native_available(), reason="megatier._C not built")


@pytest.fixture
def reference_backend(monkeypatch):
    """Route megatier.ops through the pure-torch reference (as without the extension), silently."""
    monkeypatch.setattr(_native, "_C", None)
    monkeypatch.setattr(_native, "_warned", True)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _special_values(n: int) -> torch.Tensor:
    x = torch.randn(n, generator=_gen(1))
    x[:256] = 0.0                                        # an all-zero block
    x[256:512] *= 1e-40                                  # denormals
    x[512:768] = (torch.arange(256, dtype=torch.float32) % 254) - 126.5  # exact halves after scaling
    x[512] = 127.0  # block scale exactly 1
    x[1024:1280] *= 1e30
    return x


# ---------------------------------------------------------------------------
# INT8


@native_only
@pytest.mark.parametrize("n,block", [(1, 256), (1000, 256), (100_003, 256), (70_000, 1000), (5000, 7)])
def test_int8_matches_reference_exactly(n, block):
    x = torch.randn(n, generator=_gen(n)) * 3
    codes, scales = ops.quantize_int8(x, block)
    rc, rs = reference.quantize_int8(x, block)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32
    assert scales.numel() == (n + block - 1) // block
    assert torch.equal(codes, rc) and torch.equal(scales, rs)
    deq = ops.dequantize_int8(codes, scales, block)
    assert torch.equal(deq, reference.dequantize_int8(rc, rs, block))
    # round to nearest: error at most half a step of its block
    step = scales.repeat_interleave(block)[:n]
    assert bool(((deq - x).abs() <= step / 2 + 1e-6 * x.abs()).all())


@native_only
def test_int8_special_values_and_rounding():
    x = _special_values(4096)
    codes, scales = ops.quantize_int8(x, 256)
    rc, rs = reference.quantize_int8(x, 256)
    assert torch.equal(codes, rc) and torch.equal(scales, rs)
    assert int(codes[:256].abs().sum()) == 0 and float(scales[0]) == 0.0
    # block 2: scale 1, values k + 0.5 round half to even
    assert float(scales[2]) == 1.0
    assert torch.equal(codes[512:768].float(), torch.round(x[512:768]))
    # non-finite blocks are deterministic and never crash
    y = x.clone()
    y[5] = float("nan")
    y[300] = float("inf")
    c1, s1 = ops.quantize_int8(y, 256)
    c2, s2 = reference.quantize_int8(y, 256)
    assert torch.equal(c1, c2)
    assert torch.equal(s1.isnan(), s2.isnan()) and torch.equal(s1.nan_to_num(), s2.nan_to_num())


@native_only
def test_int8_nan_block_scale_is_the_canonical_nan():
    """Whatever NaN a block holds, its scale is 0x7fc00000 from the kernel and the reference alike (a GPU's
    arithmetic turns every NaN into 0x7fffffff, so the bits must not come from a division)."""
    x = torch.randn(512, generator=torch.Generator().manual_seed(3))
    x[7] = torch.tensor(0x7FC00001, dtype=torch.int32).view(torch.float32)  # a NaN with a payload
    x[300] = torch.tensor(-0x00400000, dtype=torch.int32).view(torch.float32)  # a negative NaN
    for codes, scales in (ops.quantize_int8(x, 256), reference.quantize_int8(x, 256)):
        assert scales.view(torch.int32)[:2].tolist() == [0x7FC00000] * 2
        assert codes.eq(0).all()


def test_int8_reference_backend_roundtrip(reference_backend):
    x = torch.randn(3000, generator=_gen())
    codes, scales = ops.quantize_int8(x, 128)
    assert not ops.native_available()
    assert (ops.dequantize_int8(codes, scales, 128) - x).abs().max() <= scales.max() / 2 + 1e-7


# ---------------------------------------------------------------------------
# top-k


def _check_topk(x: torch.Tensor, res, ratio: float):
    values, indices, counts = res
    n = x.numel()
    k = reference.topk_target(n, ratio)
    c = values.numel()
    nonzero = int((x != 0).sum())
    assert values.dtype == torch.float16 and indices.dtype == torch.int32 and counts.dtype == torch.int64
    assert int(counts.sum()) == c == indices.numel()
    assert k / 2 <= c <= 2 * k or c == nonzero  # (c == nonzero: fewer than k/2 nonzeros exist)
    idx = indices.long()
    assert bool((idx[1:] > idx[:-1]).all()) and (c == 0 or (int(idx[0]) >= 0 and int(idx[-1]) < n))
    assert torch.equal(values, x[idx].half())
    kept = torch.zeros(n, dtype=torch.bool)
    kept[idx] = True
    if 0 < c < n:
        assert float(x[kept].abs().min()) >= float(x[~kept].abs().max())
    dense = ops.densify(values, indices, n)
    expect = torch.where(kept, x.half().float(), torch.zeros(()))
    assert torch.equal(dense, expect)
    assert torch.equal(dense, reference.densify(values, indices, n))


@pytest.mark.parametrize("n", [1, 10, 5000, 100_003, 1_000_000])
@pytest.mark.parametrize("ratio", [0.01, 0.1])
def test_topk_properties(n, ratio):
    x = torch.randn(n, generator=_gen(n))
    res = ops.sparsify_topk(x, ratio, 32768, seed=3)
    _check_topk(x, res, ratio)
    again = ops.sparsify_topk(x, ratio, 32768, seed=3)
    assert torch.equal(res.values, again.values) and torch.equal(res.indices, again.indices)  # deterministic


@pytest.mark.parametrize("n", [5000, 200_000])
def test_topk_reference_properties(n):
    x = torch.randn(n, generator=_gen(n))
    _check_topk(x, reference_topk(x, 0.01, 4096, 1), 0.01)


def reference_topk(x, ratio, sample, seed):
    v, i = reference.sparsify_topk(x, ratio, sample, seed)
    return ops.TopK(v, i, torch.tensor([v.numel()]))


@native_only
@pytest.mark.parametrize("n", [1000, 30_000])
def test_topk_exact_path_matches_reference(n):
    # n <= sample_size: both compute the exact top-k (ties to lowest index)
    x = torch.randn(n, generator=_gen(n)).round(decimals=1)  # many ties
    a = ops.sparsify_topk(x, 0.05, 32768, seed=0)
    v, i = reference.sparsify_topk(x, 0.05, 32768, 0)
    assert torch.equal(a.values, v) and torch.equal(a.indices, i)
    assert a.values.numel() == reference.topk_target(n, 0.05)


@pytest.mark.parametrize("backend", ["native", "reference"])
def test_topk_refinement(backend, monkeypatch):
    if backend == "reference":
        monkeypatch.setattr(_native, "_C", None)
        monkeypatch.setattr(_native, "_warned", True)
    elif not ops.native_available():
        pytest.skip("megatier._C not built")
    n = 200_000
    k = reference.topk_target(n, 0.01)
    # a one-element sample of a ramp misjudges the threshold: the count must be refined to exactly k
    ramp = torch.linspace(0.0, 1.0, n)
    r = ops.sparsify_topk(ramp, 0.01, 1, seed=5)
    assert r.values.numel() == k and torch.equal(r.indices.long(), torch.arange(n - k, n))
    # all ties: exactly k kept, lowest indices first
    r = ops.sparsify_topk(torch.ones(n), 0.01, 1024, seed=0)
    assert r.values.numel() == k and torch.equal(r.indices.long(), torch.arange(k))
    # fewer nonzeros than k: all of them, no zeros
    x = torch.zeros(n)
    x[torch.tensor([3, 77, 190_000])] = torch.tensor([1.0, -2.0, 3.0])
    r = ops.sparsify_topk(x, 0.01, 1024, seed=0)
    assert r.indices.tolist() == [3, 77, 190_000]
    r = ops.sparsify_topk(torch.zeros(n), 0.01, 1024, seed=0)
    assert r.values.numel() == 0
    # heavy tail
    y = torch.randn(n, generator=_gen()) ** 9
    _check_topk(y, ops.sparsify_topk(y, 0.01, 1024, seed=1), 0.01)


@pytest.mark.parametrize("chunk", [3000, 4096, 10_000])
def test_topk_chunk_rebasing(chunk):
    n = 10_000
    x = torch.randn(n, generator=_gen(7))
    res = ops.sparsify_topk(x, 0.05, 512, seed=2, chunk_size=chunk)
    nchunks = (n + chunk - 1) // chunk
    assert res.chunk_counts.numel() == nchunks
    dense = ops.densify(res.values, res.indices, n, chunk_counts=res.chunk_counts, chunk_size=chunk)
    expect = torch.zeros(n)
    off = 0
    for c in range(nchunks):
        cnt = int(res.chunk_counts[c])
        idx = res.indices[off : off + cnt].long()
        assert cnt == 0 or int(idx.max()) < min(chunk, n - c * chunk)  # chunk-local int32 indices
        expect[c * chunk + idx] = res.values[off : off + cnt].float()
        # each chunk is the top-k of its own elements
        part = x[c * chunk : (c + 1) * chunk]
        sub = ops.sparsify_topk(part.contiguous(), 0.05, 512, seed=reference.chunk_seed(2, 0, c))
        assert torch.equal(sub.indices, res.indices[off : off + cnt])
        off += cnt
    assert torch.equal(dense, expect)
    assert torch.equal(dense, reference.densify(res.values, res.indices, n, res.chunk_counts, chunk))
    nz = dense != 0
    assert torch.equal(dense[nz], x[nz].half().float())


def test_topk_rejects_bad_input():
    x = torch.randn(100)
    with pytest.raises(ValueError, match="float32"):
        ops.sparsify_topk(x.double(), 0.1)
    with pytest.raises(ValueError, match="contiguous"):
        ops.sparsify_topk(torch.randn(200)[::2], 0.1)
    with pytest.raises(ValueError, match="1-D"):
        ops.sparsify_topk(torch.randn(10, 10), 0.1)
    with pytest.raises(ValueError, match="ratio"):
        ops.sparsify_topk(x, 0.0)
    with pytest.raises(ValueError, match="sample_size"):
        ops.sparsify_topk(x, 0.1, 0)
    with pytest.raises(TypeError, match="torch.Tensor"):
        ops.sparsify_topk([1.0, 2.0], 0.1)
    v, i, _ = ops.sparsify_topk(x, 0.1)
    with pytest.raises(ValueError, match="elements"):
        ops.densify(v, i[:-1], 100)
    with pytest.raises(ValueError, match="int32"):
        ops.densify(v, i.long(), 100)
    with pytest.raises(ValueError, match="chunk_counts"):
        ops.densify(v, i, 100, chunk_counts=torch.tensor([1, 2]), chunk_size=60)
    with pytest.raises((ValueError, RuntimeError), match="indices|outside"):
        ops.densify(v, i, 10)  # indices past n


# ---------------------------------------------------------------------------
# records


def _segments(n_small=1000):
    # (offset, numel): small, large, small, large, empty, tail
    sizes = [n_small, 150_000, 3, 120_001, 0, 777]
    out, pos = [], 0
    for s in sizes:
        out.append((pos, s))
        pos += s
    return out, pos


@pytest.mark.parametrize("mode", ops.MODES)
def test_compress_roundtrip(mode):
    segs, n = _segments()
    x = torch.randn(n, generator=_gen(11))
    rec = ops.compress_segments(x, segs, mode, 0.01, 100_000)
    json.dumps(rec.header)  # JSON-able
    assert rec.n == n and rec.mode == mode
    dense = ops.decompress_segments(rec)
    assert dense.shape == (n,) and dense.dtype == torch.float32
    codecs = [s["codec"] for s in rec.header["segments"]]
    if mode == "adaptive":
        assert codecs == ["int8", "topk", "int8", "topk", "int8", "int8"]
    else:
        assert codecs == [mode] * len(segs)
    for (off, num), codec in zip(segs, codecs):
        got, seg = dense[off : off + num], x[off : off + num]
        if codec == "fp32":
            assert torch.equal(got, seg)
        elif codec == "bf16":
            assert torch.equal(got, seg.to(torch.bfloat16).float())
        elif codec == "int8":
            c, s = reference.quantize_int8(seg, 256)
            assert torch.equal(got, reference.dequantize_int8(c, s, 256))
        else:
            nz = got != 0
            k = reference.topk_target(num, 0.01)
            assert k / 2 <= int(nz.sum()) <= 2 * k
            assert torch.equal(got[nz], seg[nz].half().float())
    assert rec.nbytes == sum(t.numel() * t.element_size() for t in rec.tensors.values())
    if mode == "fp32":
        assert rec.nbytes == 4 * n
    if mode in ("adaptive", "topk"):
        assert rec.nbytes < n  # well under 1 byte per element
    # serialization round trips
    back = ops.CompressedRecord.from_bytes(rec.to_bytes())
    assert back.header == rec.header
    assert torch.equal(ops.decompress_segments(back), dense)
    recs, meta = ops.unpack_records(ops.pack_records([rec, back], {"step": "7"}))
    assert meta["step"] == "7" and len(recs) == 2
    assert all(torch.equal(ops.decompress_segments(r), dense) for r in recs)
    out = torch.full((n,), 9.0)
    assert ops.decompress_segments(rec, out=out) is out and torch.equal(out, dense)


@native_only
@pytest.mark.parametrize("mode", ops.MODES)
def test_compress_native_matches_reference_backend(mode, monkeypatch):
    segs, n = _segments()
    x = _special_values(n) if mode in ("bf16", "fp32", "int8") else torch.randn(n, generator=_gen(5))
    rec = ops.compress_segments(x, segs, mode, seed=9)
    monkeypatch.setattr(_native, "_C", None)
    monkeypatch.setattr(_native, "_warned", True)
    ref = ops.compress_segments(x, segs, mode, seed=9)
    dense_ref = ops.decompress_segments(rec)  # reference decoder on the native record
    monkeypatch.undo()
    assert rec.header == ref.header
    assert rec.tensors.keys() == ref.tensors.keys()
    for k in rec.tensors:
        assert torch.equal(rec.tensors[k].view(torch.uint8), ref.tensors[k].view(torch.uint8)), k
    assert torch.equal(ops.decompress_segments(rec), dense_ref)


def _use_backend(backend: str, monkeypatch) -> None:
    """Route megatier.ops through ``backend``: the native extension (skip the test without it) or the reference."""
    if backend == "native" and not ops.native_available():
        pytest.skip("megatier._C not built")
    if backend == "reference":
        monkeypatch.setattr(_native, "_C", None)
        monkeypatch.setattr(_native, "_warned", True)


@pytest.mark.parametrize("backend", ["native", "reference"])
@pytest.mark.parametrize("mode", ops.MODES)
def test_compress_feedback_leaves_the_residual(mode, backend, monkeypatch):
    # feedback=True: the same record, and flat - decompress(record) left in flat, bit for bit (NaN, inf, zero and
    # denormal blocks included)
    _use_backend(backend, monkeypatch)
    segs, n = _segments()
    x = _special_values(n)
    x[2000] = float("nan")
    x[3000] = float("inf")
    rec = ops.compress_segments(x, segs, mode, 0.01, 100_000, seed=4)
    residual = x.clone()
    fed = ops.compress_segments(residual, segs, mode, 0.01, 100_000, seed=4, feedback=True)
    assert fed.header == rec.header
    for k in rec.tensors:
        assert torch.equal(fed.tensors[k].view(torch.uint8), rec.tensors[k].view(torch.uint8)), k
    dense = ops.decompress_segments(rec)
    assert torch.equal(residual.view(torch.int32), (x - dense).view(torch.int32))


def _addend_cases(n: int):
    """(x, addend) pairs: special values in both; and a constant sum in the second segment, whose sampled
    threshold keeps every element, so the pass stops compacting early and the exact selection runs on the sum."""
    x = _special_values(n)
    x[2000], x[3000] = float("nan"), float("inf")
    add = torch.randn(n, generator=_gen(5))
    add[100:300] = -x[100:300]  # sums of exactly zero
    add[4000:4256] = -0.0
    yield x, add
    flat, tie = x.clone(), torch.zeros(n)
    flat[1000:151_000], tie[1000:151_000] = 0.25, 0.75
    yield flat, tie


@pytest.mark.parametrize("backend", ["native", "reference"])
@pytest.mark.parametrize("threads", [1, 0])
@pytest.mark.parametrize("mode,ratio", [(m, 0.01) for m in ops.MODES] + [("topk", 1.0)])
def test_an_addend_is_compressed_as_if_added_first(mode, ratio, threads, backend, monkeypatch):
    # addend=g: the record of flat + g and the residual left in flat are bitwise those of flat.add_(g) first, with
    # feedback or without, in chunks or whole, on one thread or the team (the native pass folds the add in)
    _use_backend(backend, monkeypatch)
    segs, n = _segments()
    for x, add in _addend_cases(n):
        for feedback, chunk in ((True, 50_000), (False, ops.TOPK_CHUNK_ELEMS)):
            with ops.thread_parallelism(threads):
                first = x.clone().add_(add)
                rec = ops.compress_segments(first, segs, mode, ratio, 100_000, seed=8, chunk_size=chunk,
                                            feedback=feedback)
                folded = x.clone()
                got = ops.compress_segments(folded, segs, mode, ratio, 100_000, seed=8, chunk_size=chunk,
                                            feedback=feedback, addend=add)
            assert got.header == rec.header
            assert got.tensors.keys() == rec.tensors.keys()
            for k in rec.tensors:
                assert torch.equal(got.tensors[k].view(torch.uint8), rec.tensors[k].view(torch.uint8)), k
            assert torch.equal(folded.view(torch.int32), first.view(torch.int32))


def test_an_addend_must_be_another_tensor_of_the_same_shape():
    segs, n = _segments()
    x = torch.randn(n, generator=_gen(3))
    with pytest.raises(ValueError, match="addend must be another fp32 tensor"):
        ops.compress_segments(x, segs, "adaptive", addend=torch.zeros(n - 1))
    with pytest.raises(ValueError, match="addend must be another fp32 tensor"):
        ops.compress_segments(x, segs, "adaptive", addend=x)
    with pytest.raises(ValueError, match="addend must be"):
        ops.compress_segments(x, segs, "adaptive", addend=torch.zeros(n, dtype=torch.float64))


@native_only
@pytest.mark.parametrize("mode", ["adaptive", "int8", "bf16"])
def test_one_thread_compresses_exactly_as_the_team(mode):
    # checkpoint.diff.threads: the record and the error feedback do not depend on how many threads made them,
    # and the calling thread's team size is back to what it was afterwards
    segs, n = _segments()
    x = torch.randn(n, generator=_gen(21))
    team = torch.get_num_threads()
    with ops.thread_parallelism(1):
        assert torch.get_num_threads() == 1
        alone = x.clone()
        rec1 = ops.compress_segments(alone, segs, mode, 0.01, 100_000, seed=3, feedback=True)
    assert torch.get_num_threads() == team
    together = x.clone()
    rec = ops.compress_segments(together, segs, mode, 0.01, 100_000, seed=3, feedback=True)
    assert rec1.header == rec.header
    for k in rec.tensors:
        assert torch.equal(rec1.tensors[k].view(torch.uint8), rec.tensors[k].view(torch.uint8)), k
    assert torch.equal(alone.view(torch.int32), together.view(torch.int32))
    with ops.thread_parallelism(0):  # 0: left as it is
        assert torch.get_num_threads() == team


@native_only
def test_compress_segments_uses_per_segment_kernels():
    # the fused C++ compressor == the per-op kernels applied segment by segment
    segs, n = _segments()
    x = torch.randn(n, generator=_gen(2))
    rec = ops.compress_segments(x, segs, "adaptive", 0.01, 100_000, seed=4, chunk_size=50_000)
    t = rec.tensors
    for s, seg in enumerate(rec.header["segments"]):
        part = x[seg["offset"] : seg["offset"] + seg["numel"]]
        if seg["codec"] == "int8":
            c, sc = ops.quantize_int8(part, 256)
            cs, ss = seg["codes_start"], seg["scales_start"]
            assert torch.equal(t["int8_codes"][cs : cs + seg["numel"]], c)
            assert torch.equal(t["int8_scales"][ss : ss + sc.numel()], sc)
        else:
            assert len(seg["chunks"]) == (seg["numel"] + 49_999) // 50_000
            for ci, (rel, length, start, count) in enumerate(seg["chunks"]):
                v, i, _ = ops.sparsify_topk(part[rel : rel + length].contiguous(), 0.01,
                                            seed=reference.chunk_seed(4, s, ci))
                assert torch.equal(t["topk_indices"][start : start + count], i)
                assert torch.equal(t["topk_values"][start : start + count], v)


def test_compress_chunked_topk_segment():
    n = 25_000
    x = torch.randn(n, generator=_gen(8))
    rec = ops.compress_segments(x, [(0, n)], "topk", 0.02, chunk_size=7000)
    chunks = rec.header["segments"][0]["chunks"]
    assert [c[:2] for c in chunks] == [[0, 7000], [7000, 7000], [14000, 7000], [21000, 4000]]
    dense = ops.decompress_segments(rec)
    res = ops.sparsify_topk(x, 0.02, seed=0, chunk_size=7000)
    assert torch.equal(dense, ops.densify(res.values, res.indices, n, chunk_counts=res.chunk_counts, chunk_size=7000))


def test_compress_segment_forms():
    x = torch.randn(300, generator=_gen())
    a = ops.compress_segments(x, [(0, 100), (100, 200)], "fp32")
    b = ops.compress_segments(x, [SimpleNamespace(offset=0, numel=100), SimpleNamespace(offset=100, numel=200)], "fp32")
    c = ops.compress_segments(x, torch.tensor([[0, 100], [100, 200]]), "fp32")
    d = ops.compress_segments(x, None, "fp32")
    assert a.header == b.header == c.header
    assert len(d.header["segments"]) == 1
    with pytest.raises(ValueError, match="tile"):
        ops.compress_segments(x, [(0, 100), (150, 150)])
    with pytest.raises(ValueError, match="cover"):
        ops.compress_segments(x, [(0, 100)])
    with pytest.raises(ValueError, match="mode"):
        ops.compress_segments(x, None, "zstd")
    with pytest.raises(ValueError, match="float32"):
        ops.compress_segments(x.half(), None)


def test_corrupt_record_is_rejected():
    x = torch.randn(2000, generator=_gen())
    rec = ops.compress_segments(x, [(0, 1000), (1000, 1000)], "topk", 0.05)
    bad = ops.CompressedRecord(json.loads(json.dumps(rec.header)), dict(rec.tensors))
    bad.header["segments"][1]["offset"] = 999
    with pytest.raises(ValueError, match="segment"):
        ops.decompress_segments(bad)
    bad = ops.CompressedRecord(rec.header, dict(rec.tensors, topk_values=rec.tensors["topk_values"][:-1]))
    with pytest.raises(ValueError, match="topk_values"):
        ops.decompress_segments(bad)
    idx = rec.tensors["topk_indices"].clone()
    idx[3] = 5000  # outside its chunk
    bad = ops.CompressedRecord(rec.header, dict(rec.tensors, topk_indices=idx))
    with pytest.raises((ValueError, RuntimeError), match="indices|index"):
        ops.decompress_segments(bad)
    with pytest.raises(ValueError, match="format"):
        ops.decompress_segments(ops.CompressedRecord({"format": "other"}, {}))


# ---------------------------------------------------------------------------
# property-based: random sizes, block sizes and magnitudes

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@native_only
@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 3000), block=st.integers(1, 300), exp=st.integers(-40, 30), seed=st.integers(0, 2**31))
def test_int8_property(n, block, exp, seed):
    x = torch.randn(n, generator=_gen(seed)) * (2.0**exp)
    c, s = ops.quantize_int8(x, block)
    rc, rs = reference.quantize_int8(x, block)
    assert torch.equal(c, rc) and torch.equal(s, rs)
    assert torch.equal(ops.dequantize_int8(c, s, block), reference.dequantize_int8(rc, rs, block))


@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 50_000), ratio=st.floats(0.001, 1.0), sample=st.integers(1, 4096), seed=st.integers(0, 2**40),
       zeros=st.floats(0.0, 1.0))
def test_topk_property(n, ratio, sample, seed, zeros):
    x = torch.randn(n, generator=_gen(seed % 2**31))
    x[torch.rand(n, generator=_gen(seed % 2**31 + 1)) < zeros] = 0.0
    _check_topk(x, ops.sparsify_topk(x, ratio, sample, seed=seed), ratio)


def test_out_arguments():
    x = torch.randn(5000, generator=_gen(4))
    codes, scales = torch.empty(5000, dtype=torch.int8), torch.empty(20)
    c, s = ops.quantize_int8(x, 250, out=(codes, scales))
    assert c is codes and s is scales
    rc, rs = ops.quantize_int8(x, 250)
    assert torch.equal(codes, rc) and torch.equal(scales, rs)
    buf = torch.full((5000,), 7.0)
    assert ops.dequantize_int8(codes, scales, 250, out=buf) is buf
    assert torch.equal(buf, ops.dequantize_int8(codes, scales, 250))
    v, i, _ = ops.sparsify_topk(x, 0.1)
    assert ops.densify(v, i, 5000, out=buf) is buf and torch.equal(buf, ops.densify(v, i, 5000))
    with pytest.raises(ValueError, match="out"):
        ops.quantize_int8(x, 250, out=(codes[:10], scales))
    with pytest.raises(ValueError, match="out has"):
        ops.densify(v, i, 5000, out=torch.empty(10))
