"""Tensor-parallel regions, layers and loss on tp=2 against their single-process definitions.

One spawned world computes every case; each test checks one family. Every rank
draws all ranks' inputs from fixed seeds, so it can evaluate the definition
(sum, concatenation, dense layer) locally and compare with what the
distributed code produced.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatier.parallel.cross_entropy import mask_padded_vocab, vocab_parallel_cross_entropy
from megatier.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from megatier.parallel.mappings import copy_to_region, gather_from_region, reduce_from_region, scatter_to_region
from megatier.parallel.state import build_parallel_state
from megatier.slicing import full_from_shards, shard_of_full
from tests.distributed.world import run_world

TP = 2
pytestmark = pytest.mark.timeout(120)


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_(True)


def _regions(group, r: int) -> dict:
    xs = [_rand(2, 3, 4, seed=10 + i) for i in range(TP)]  # rank i's input
    gs = [_rand(2, 3, 4, seed=20 + i) for i in range(TP)]  # rank i's upstream gradient
    halves = [_rand(2, 3, 4 // TP, seed=30 + i) for i in range(TP)]  # per-rank (.., 4/tp) tensors
    out = {}

    x = _leaf(xs[r])
    y = copy_to_region(x, group)
    y.backward(gs[r])
    out["copy.forward"], out["copy.backward"] = (y, xs[r]), (x.grad, sum(gs))

    x = _leaf(xs[r])
    y = reduce_from_region(x, group)
    y.backward(gs[r])
    out["reduce.forward"], out["reduce.backward"] = (y, sum(xs)), (x.grad, gs[r])

    x = _leaf(xs[0])  # replicated input
    y = scatter_to_region(x, group)
    y.backward(halves[r])
    out["scatter.forward"], out["scatter.backward"] = (y, xs[0].chunk(TP, -1)[r]), (x.grad, torch.cat(halves, -1))

    x = _leaf(halves[r])
    y = gather_from_region(x, group)
    y.backward(gs[r])
    out["gather.forward"], out["gather.backward"] = (y, torch.cat(halves, -1)), (x.grad, gs[r].chunk(TP, -1)[r])
    return out


def _column(group, r: int, *, stride: int, gather: bool) -> dict:
    w, b, x = _rand(12, 8, seed=1), _rand(12, seed=2), _rand(2, 5, 8, seed=3)
    if gather:
        gy = gy_full = _rand(2, 5, 12, seed=4)
    else:
        # Each rank's output slice gets its own gradient; the dense layer sees them reassembled.
        parts = [_rand(2, 5, 12 // TP, seed=40 + k) for k in range(TP)]
        gy, gy_full = parts[r], full_from_shards(parts, 2, stride)
    layer = ColumnParallelLinear(8, 12, group=group, stride=stride, gather_output=gather)
    with torch.no_grad():
        layer.weight.copy_(shard_of_full(w, 0, stride, r, TP))
        layer.bias.copy_(shard_of_full(b, 0, stride, r, TP))
    xi = _leaf(x)
    y = layer(xi)
    y.backward(gy)
    wf, bf, xf = _leaf(w), _leaf(b), _leaf(x)
    yf = F.linear(xf, wf, bf)
    yf.backward(gy_full)
    tag = f"column.stride{stride}"
    return {
        f"{tag}.forward": (y, yf if gather else shard_of_full(yf, 2, stride, r, TP)),
        f"{tag}.dx": (xi.grad, xf.grad),
        f"{tag}.dw": (layer.weight.grad, shard_of_full(wf.grad, 0, stride, r, TP)),
        f"{tag}.db": (layer.bias.grad, shard_of_full(bf.grad, 0, stride, r, TP)),
    }


def _row(group, r: int) -> dict:
    w, b, x, gy = _rand(6, 8, seed=5), _rand(6, seed=6), _rand(2, 5, 8, seed=7), _rand(2, 5, 6, seed=8)
    layer = RowParallelLinear(8, 6, group=group)
    with torch.no_grad():
        layer.weight.copy_(shard_of_full(w, 1, 1, r, TP))
        layer.bias.copy_(b)
    xi = _leaf(x.chunk(TP, -1)[r])
    y = layer(xi)
    y.backward(gy)
    wf, bf, xf = _leaf(w), _leaf(b), _leaf(x)
    F.linear(xf, wf, bf).backward(gy)
    return {"row.forward": (y, F.linear(x, w, b)), "row.dx": (xi.grad, xf.grad.chunk(TP, -1)[r]),
            "row.dw": (layer.weight.grad, shard_of_full(wf.grad, 1, 1, r, TP)), "row.db": (layer.bias.grad, bf.grad)}


def _embedding(group, r: int) -> dict:
    table, gy = _rand(16, 4, seed=9), _rand(2, 5, 4, seed=10)
    ids = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(11))
    layer = VocabParallelEmbedding(16, 4, group=group)
    with torch.no_grad():
        layer.weight.copy_(shard_of_full(table, 0, 1, r, TP))
    y = layer(ids)
    y.backward(gy)
    tf = _leaf(table)
    F.embedding(ids, tf).backward(gy)
    return {"embedding.forward": (y, F.embedding(ids, table)),
            "embedding.dw": (layer.weight.grad, shard_of_full(tf.grad, 0, 1, r, TP))}


def _cross_entropy(group, r: int) -> dict:
    logits, gl = _rand(2, 5, 16, seed=12) * 3, _rand(2, 5, seed=13)
    target = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(14))
    local = _leaf(logits.chunk(TP, -1)[r])
    loss = vocab_parallel_cross_entropy(local, target, vocab_start=r * 16 // TP, group=group)
    loss.backward(gl)
    full = _leaf(logits)
    ref = F.cross_entropy(full.flatten(0, 1), target.flatten(), reduction="none").view(2, 5)
    ref.backward(gl)
    return {"cross_entropy.forward": (loss, ref.detach()),
            "cross_entropy.dlogits": (local.grad, full.grad.chunk(TP, -1)[r])}


def _cross_entropy_padded(group, r: int) -> dict:
    """True vocabulary 6 of 16 padded ids: rank 1's whole slice is padding (-inf logits)."""
    true_vocab, gl = 6, _rand(2, 5, seed=16)
    logits = _rand(2, 5, 16, seed=15) * 3
    target = torch.randint(0, true_vocab, (2, 5), generator=torch.Generator().manual_seed(17))
    local = _leaf(logits.chunk(TP, -1)[r])
    masked = mask_padded_vocab(local, vocab_start=r * 16 // TP, vocab_size=true_vocab)
    loss = vocab_parallel_cross_entropy(masked, target, vocab_start=r * 16 // TP, group=group)
    loss.backward(gl)
    real = _leaf(logits[..., :true_vocab])
    ref = F.cross_entropy(real.flatten(0, 1), target.flatten(), reduction="none").view(2, 5)
    ref.backward(gl)
    ref_grad = torch.cat([real.grad, torch.zeros(2, 5, 16 - true_vocab)], -1)  # padded ids: zero gradient
    return {"cross_entropy_padded.forward": (loss, ref.detach()),
            "cross_entropy_padded.dlogits": (local.grad, ref_grad.chunk(TP, -1)[r])}


def _tp_worker(rank: int) -> dict:
    ps = build_parallel_state(TP, 1, 60.0, torch.device("cpu"))
    g, r = ps.tp_group, ps.tp_rank
    out = {**_regions(g, r), **_row(g, r), **_embedding(g, r), **_cross_entropy(g, r),
           **_cross_entropy_padded(g, r)}
    out.update(_column(g, r, stride=1, gather=True))
    out.update(_column(g, r, stride=3, gather=False))
    out = {k: (a.detach(), b.detach()) for k, (a, b) in out.items()}
    try:
        ColumnParallelLinear(8, 12, group=g, stride=3, gather_output=True)
        out["column.strided_gather_refused"] = False
    except ValueError:
        out["column.strided_gather_refused"] = True
    return out


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory) -> list[dict]:
    return run_world(_tp_worker, TP, tmp_path_factory.mktemp("tp"))


def _check(results: list[dict], prefix: str) -> None:
    keys = [k for k in results[0] if k.startswith(prefix) and isinstance(results[0][k], tuple)]
    assert keys, prefix
    for rank, res in enumerate(results):
        for k in keys:
            actual, expected = res[k]
            torch.testing.assert_close(actual, expected, msg=lambda m: f"rank {rank} {k}: {m}")


@pytest.mark.parametrize("region", ["copy", "reduce", "scatter", "gather"])
def test_region_forward_and_backward_match_definition(tp_results, region):
    _check(tp_results, f"{region}.")


@pytest.mark.parametrize("layer", ["column.stride1", "column.stride3", "row", "embedding", "cross_entropy",
                                   "cross_entropy_padded"])
def test_parallel_layer_matches_dense(tp_results, layer):
    _check(tp_results, f"{layer}.")


def test_column_parallel_refuses_to_gather_a_strided_output(tp_results):
    assert all(res["column.strided_gather_refused"] for res in tp_results)
