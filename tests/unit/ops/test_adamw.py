"""Fused AdamW of megatier.ops: native step vs reference, replay == N x step bitwise, bad input."""
from __future__ import annotations

import pytest
import torch

from megatier import ops
from megatier.ops import _native, reference

native_only = pytest.mark.skipif(not ops.native_available(), reason="megatier._C not built")
HP = dict(beta1=0.9, beta2=0.95, eps=1e-8)


def _state(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g)
    m = torch.randn(n, generator=g) * 0.01
    v = torch.rand(n, generator=g) * 1e-4
    return p, m, v


def _grads(n, count, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) * (0.1 + i) for i in range(count)]


def _decay(n):
    # ranges crossing the kernel's 2048-element tiles, adjacent ranges, an empty one, unsorted
    raw = [[5000, min(n, 9000)], [10, 2050], [2050, 2100], [3000, 3000], [min(n, 9500), n]]
    return torch.tensor([r for r in raw if r[0] <= r[1] <= n], dtype=torch.int64)


def _bits(t):
    return t.view(torch.int32)


def _assert_bitwise(a, b):
    for x, y in zip(a, b):
        assert torch.equal(_bits(x), _bits(y)), f"max diff {(x - y).abs().max().item()}"


@native_only
@pytest.mark.parametrize("n", [1, 1000, 100_003])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_step_matches_reference(n, wd):
    p, m, v = _state(n)
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    decay = _decay(n)
    for step, g in enumerate(_grads(n, 3), start=1):
        ops.adamw_step(p, m, v, g, step, 1e-3 * step, weight_decay=wd, decay_segments=decay, **HP)
        reference.adamw_step(rp, rm, rv, g, step, 1e-3 * step, weight_decay=wd, decay_segments=decay, **HP)
    # the reference is torch's vectorized kernels (which may fuse multiply-adds): equal to rounding
    torch.testing.assert_close(m, rm, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(v, rv, rtol=1e-5, atol=1e-10)
    torch.testing.assert_close(p, rp, rtol=1e-5, atol=1e-6)


def test_step_decays_only_decay_ranges():
    p = torch.ones(3000)
    z = torch.zeros(3000)
    ops.adamw_step(p, z.clone(), z.clone(), z.clone(), 1, 0.5, weight_decay=0.1,
                   decay_segments=torch.tensor([[2, 5], [2040, 2060]]), **HP)
    decayed = torch.zeros(3000, dtype=torch.bool)
    decayed[2:5] = decayed[2040:2060] = True
    assert torch.equal(p[decayed], torch.full((23,), 0.95))
    assert torch.equal(p[~decayed], torch.ones(3000 - 23))


@native_only
@pytest.mark.parametrize("N", [1, 5, 20])
@pytest.mark.parametrize("n", [3000, 100_003])
@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_replay_equals_sequential_steps_bitwise(N, n, wd):
    p, m, v = _state(n, seed=N)
    seq = [t.clone() for t in (p, m, v)]
    grads = _grads(n, N, seed=n)
    steps = [10 + i for i in range(N)]
    lrs = [1e-3 * (1 + 0.1 * i) for i in range(N)]
    skipped = [i % 4 == 2 for i in range(N)]
    decay = _decay(n)
    adam_step = 9
    for i in range(N):
        if skipped[i]:
            continue  # an overflow step applies nothing and does not advance
        adam_step += 1
        steps[i] = adam_step
        ops.adamw_step(*seq, grads[i], adam_step, lrs[i], weight_decay=wd, decay_segments=decay, **HP)
    replay_grads = [None if s else g for g, s in zip(grads, skipped)]
    ops.adamw_replay(p, m, v, replay_grads, steps, lrs, weight_decay=wd, decay_segments=decay, skipped=skipped, **HP)
    _assert_bitwise((p, m, v), seq)


def test_replay_reference_backend_equals_steps(monkeypatch):
    monkeypatch.setattr(_native, "_C", None)
    monkeypatch.setattr(_native, "_warned", True)
    n, N = 5000, 4
    p, m, v = _state(n)
    seq = [t.clone() for t in (p, m, v)]
    grads = _grads(n, N)
    decay = _decay(n)
    for i, g in enumerate(grads):
        reference.adamw_step(*seq, g, i + 1, 1e-3, weight_decay=0.1, decay_segments=decay, **HP)
    rec = ops.compress_segments(grads[1], None, "fp32")
    ops.adamw_replay(p, m, v, [grads[0], rec, grads[2], grads[3]], [1, 2, 3, 4], [1e-3] * 4,
                     weight_decay=0.1, decay_segments=decay, **HP)
    _assert_bitwise((p, m, v), seq)


@pytest.mark.parametrize("mode", ["adaptive", "int8", "topk", "bf16", "fp32"])
def test_replay_records_equal_replay_of_their_dense_gradients(mode):
    sizes = [1000, 150_000, 7, 30_000]
    segs, pos = [], 0
    for s in sizes:
        segs.append((pos, s))
        pos += s
    n, N = pos, 5
    grads = _grads(n, N, seed=3)
    records = [ops.compress_segments(g, segs, mode, 0.01, 100_000, seed=i, chunk_size=40_000)
               for i, g in enumerate(grads)]
    dense = [ops.decompress_segments(r) for r in records]
    a = _state(n, seed=4)
    b = [t.clone() for t in a]
    steps, lrs = [3, 4, 5, 6, 7], [1e-3, 2e-3, 3e-3, 2e-3, 1e-3]
    decay = _decay(n)
    ops.adamw_replay(*a, records, steps, lrs, weight_decay=0.1, decay_segments=decay, **HP)
    ops.adamw_replay(*b, dense, steps, lrs, weight_decay=0.1, decay_segments=decay, **HP)
    _assert_bitwise(a, b)
    if mode == "fp32":  # lossless: identical to replaying the original gradients
        c = _state(n, seed=4)
        ops.adamw_replay(*c, grads, steps, lrs, weight_decay=0.1, decay_segments=decay, **HP)
        _assert_bitwise(a, c)


def test_replay_mixed_records_and_tensors():
    n = 4096
    grads = _grads(n, 3)
    recs = [grads[0], ops.compress_segments(grads[1], None, "int8"), ops.compress_segments(grads[2], None, "topk", 0.1)]
    a = _state(n)
    b = [t.clone() for t in a]
    no_decay = torch.empty(0, 2, dtype=torch.int64)
    ops.adamw_replay(*a, recs, [1, 2, 3], [1e-3] * 3, weight_decay=0.0, decay_segments=no_decay, **HP)
    for i, r in enumerate(recs):
        g = r if isinstance(r, torch.Tensor) else ops.decompress_segments(r)
        ops.adamw_step(*b, g, i + 1, 1e-3, weight_decay=0.0, decay_segments=torch.empty(0, 2, dtype=torch.int64), **HP)
    _assert_bitwise(a, b)


# ---------------------------------------------------------------------------
# bad input: a clear error, never a crash


def _ok_args(n=100):
    p, m, v = _state(n)
    return p, m, v, torch.randn(n)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda a: (a[0].double(), *a[1:]), "param must be torch.float32"),
        (lambda a: (a[0], a[1][:50], *a[2:]), "same number of elements"),
        (lambda a: (a[0], a[1], a[2], torch.randn(200)[::2]), "grad must be contiguous"),
        (lambda a: (a[0], a[1], a[2], torch.randn(99)), "grad has 99 elements"),
        (lambda a: (a[0].view(10, 10), *a[1:]), "param must be 1-D"),
        (lambda a: (a[0], a[1], a[2], a[3].half()), "grad must be torch.float32"),
    ],
)
def test_step_bad_input(mutate, match):
    args = mutate(_ok_args())
    with pytest.raises(ValueError, match=match):
        ops.adamw_step(*args, 1, 1e-3, weight_decay=0.1, decay_segments=torch.tensor([[0, 10]]), **HP)


@pytest.mark.parametrize(
    "decay,match",
    [
        (torch.tensor([[0, 10]], dtype=torch.int32), "int64"),
        (torch.tensor([0, 10]), r"shape \(k, 2\)"),
        (torch.tensor([[0, 101]]), "0 <= start <= end <= 100"),
        (torch.tensor([[5, 3]]), "0 <= start <= end"),
        (torch.tensor([[0, 10], [5, 20]]), "overlap"),
    ],
)
def test_step_bad_decay_segments(decay, match):
    with pytest.raises(ValueError, match=match):
        ops.adamw_step(*_ok_args(), 1, 1e-3, weight_decay=0.1, decay_segments=decay, **HP)


def test_step_bad_scalars():
    with pytest.raises(ValueError, match="step must be >= 1"):
        ops.adamw_step(*_ok_args(), 0, 1e-3, weight_decay=0.1, decay_segments=torch.tensor([[0, 10]]), **HP)
    with pytest.raises(ValueError, match="beta1"):
        ops.adamw_step(*_ok_args(), 1, 1e-3, 1.5, 0.95, 1e-8, 0.1, torch.tensor([[0, 10]]))


def test_replay_bad_input():
    p, m, v, g = _ok_args()
    no_decay = torch.empty(0, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="one of each"):
        ops.adamw_replay(p, m, v, [g, g], [1], [1e-3, 1e-3], weight_decay=0.0, decay_segments=no_decay, **HP)
    with pytest.raises(ValueError, match="not marked skipped"):
        ops.adamw_replay(p, m, v, [None], [1], [1e-3], weight_decay=0.0, decay_segments=no_decay, **HP)
    with pytest.raises(ValueError, match="record of 50 elements"):
        rec = ops.compress_segments(torch.randn(50), None, "int8")
        ops.adamw_replay(p, m, v, [rec], [1], [1e-3], weight_decay=0.0, decay_segments=no_decay, **HP)
    with pytest.raises(ValueError, match=r"grads\[0\] has 10 elements"):
        ops.adamw_replay(p, m, v, [torch.randn(10)], [1], [1e-3], weight_decay=0.0, decay_segments=no_decay, **HP)
    before = p.clone()
    ops.adamw_replay(p, m, v, [None], [1], [1e-3], weight_decay=0.0, decay_segments=no_decay, skipped=[True], **HP)
    assert torch.equal(p, before)


@native_only
def test_native_entry_points_check_their_input():
    """Calling megatier._C directly with bad input raises RuntimeError instead of crashing."""
    C = _native.lib()
    p, m, v, g = _ok_args()
    no_decay = torch.empty(0, 2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="param must have dtype"):
        C.adamw_step(p.double(), m, v, g, 1e-3, 1.0, 0.9, 0.95, 1e-8, 1.0, False, no_decay)
    with pytest.raises(RuntimeError, match="grad has 10 elements"):
        C.adamw_step(p, m, v, g[:10], 1e-3, 1.0, 0.9, 0.95, 1e-8, 1.0, False, no_decay)
    with pytest.raises(RuntimeError, match="contiguous"):
        C.adamw_step(p, m, v, torch.randn(200)[::2], 1e-3, 1.0, 0.9, 0.95, 1e-8, 1.0, False, no_decay)
    with pytest.raises(RuntimeError, match="distinct"):
        C.adamw_step(p, p, v, g, 1e-3, 1.0, 0.9, 0.95, 1e-8, 1.0, False, no_decay)
    with pytest.raises(RuntimeError, match="overlap"):
        C.adamw_step(p, m, v, g, 1e-3, 1.0, 0.9, 0.95, 1e-8, 1.0, True, torch.tensor([[0, 10], [5, 20]]))
    e = torch.empty(0)
    with pytest.raises(RuntimeError, match="tile the gradient"):
        C.adamw_replay(p, m, v, [[(0, 0, 50, 0, g[:50], e), (0, 60, 40, 0, g[60:], e)]], [1e-3], [1.0], [1.0],
                       [False], 0.9, 0.95, 1e-8, False, no_decay)
    vals, idx = torch.ones(3, dtype=torch.float16), torch.tensor([5, 2, 7], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="ascending"):
        C.adamw_replay(p, m, v, [[(3, 0, 100, 0, vals, idx)]], [1e-3], [1.0], [1.0], [False], 0.9, 0.95, 1e-8,
                       False, no_decay)
    with pytest.raises(RuntimeError, match="scales"):
        C.decompress_into(torch.empty(100), [(2, 0, 100, 16, torch.zeros(100, dtype=torch.int8), torch.ones(3))])
    with pytest.raises(RuntimeError, match="outside its chunk"):
        C.densify(vals, torch.tensor([1, 2, 300], dtype=torch.int32), 100)
    with pytest.raises(RuntimeError, match="ratio"):
        C.sparsify_topk(torch.randn(10), 2.0, 10, 0)
    with pytest.raises(RuntimeError, match="block_size"):
        C.quantize_int8(torch.randn(10), 0)
    with pytest.raises(RuntimeError, match="dtype"):
        C.quantize_int8(torch.randn(10).double(), 4)
    assert torch.equal(p, _ok_args()[0])  # nothing was written by the failed calls
