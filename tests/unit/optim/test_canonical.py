"""The canonical description of optimizer shards: every layout places the same state the same way.

Shards are built here the way the trainer builds them (each parameter's tp slice of its padded full tensor via
``shard_of_full``, flattened by ``FlatLayout``, cut into dp shards), from one random full state; the canonical
module must recover that state from any layout's shards and cut any layout's shards from it.
"""
from __future__ import annotations

import itertools
import json

import pytest
import torch
from torch import nn

from megatier.model.params import padded_vocab_size, stage_layers
from megatier.optim.canonical import (
    STATE_KINDS,
    ReshardError,
    ShardState,
    assemble,
    canonical_digest,
    cut_shard,
    reshard,
    shard_pieces,
)
from megatier.optim.flat import FlatLayout, ShardSegment
from megatier.parallel.layers import mark_partition
from megatier.slicing import shard_of_full

VOCAB, HIDDEN, LAYERS, POSITIONS = 259, 8, 3, 16


def _params(layer: int) -> list[tuple[str, tuple[int, ...], int | None, int]]:
    """(name, full shape, tp dim, stride) of one block, as the model cuts it."""
    p = f"layers.{layer}"
    h = HIDDEN
    return [(f"{p}.ln1.weight", (h,), None, 1), (f"{p}.attn.qkv.weight", (3 * h, h), 0, 3),
            (f"{p}.attn.qkv.bias", (3 * h,), 0, 3), (f"{p}.attn.proj.weight", (h, h), 1, 1),
            (f"{p}.attn.proj.bias", (h,), None, 1), (f"{p}.mlp.fc.weight", (4 * h, h), 0, 1)]


def _stage_params(tp: int, pp: int, pp_rank: int):
    out = []
    if pp_rank == 0:
        out += [("word.weight", (VOCAB, HIDDEN), 0, 1), ("pos.weight", (POSITIONS, HIDDEN), None, 1)]
    for i in stage_layers(LAYERS, pp, pp_rank):
        out += _params(i)
    if pp_rank == pp - 1:
        out.append(("final_norm.weight", (HIDDEN,), None, 1))
        if pp > 1:
            out.append(("head_weight", (VOCAB, HIDDEN), 0, 1))
    return out


def _full_state(seed: int) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    names = _stage_params(1, 1, 0)
    return {name: {k: torch.randn(shape, generator=g) for k in STATE_KINDS} for name, shape, _, _ in names}


class _Stage(nn.Module):
    """Parameters named like a GPT stage (dots replaced: a module path is not needed for the segment table)."""

    def __init__(self, params, tp: int, tp_rank: int, values: dict[str, torch.Tensor]):
        super().__init__()
        self.names = []
        for name, full_shape, dim, stride in params:
            full = values["word.weight" if name == "head_weight" else name]
            if dim == 0 and full_shape[0] == VOCAB:  # pad the vocabulary with zero rows
                rows = padded_vocab_size(VOCAB, 8, tp)
                full = torch.cat([full, full.new_zeros(rows - VOCAB, *full.shape[1:])])
            p = mark_partition(nn.Parameter(shard_of_full(full, dim, stride, tp_rank, tp).clone()), dim, stride)
            p.full_shape = full_shape
            p.copy_of = "word.weight" if name == "head_weight" else ""  # the tied head: a copy, as GPTStage says
            self.register_parameter(name.replace(".", "__"), p)

    def named_parameters(self, *args, **kwargs):
        for name, p in super().named_parameters(*args, **kwargs):
            yield name.replace("__", "."), p


def _shards(state, tp: int, pp: int, dp: int) -> list[ShardState]:
    """Every rank's shard (rank order: tp fastest, then dp, then pp) of ``state`` under (tp, pp, dp)."""
    out = []
    for pp_rank, dp_rank, tp_rank in itertools.product(range(pp), range(dp), range(tp)):
        params = _stage_params(tp, pp, pp_rank)
        kinds = {}
        for k in STATE_KINDS:
            stage = _Stage(params, tp, tp_rank, {n: v[k] for n, v in state.items()})
            layout = FlatLayout.from_module(stage, dp, tp_rank=tp_rank)
            flat = torch.zeros(layout.numel)
            for s in layout.segments:
                flat[s.offset:s.end] = dict(stage.named_parameters())[s.name].detach().reshape(-1)
            lo, hi = layout.shard_range(dp_rank)
            kinds[k] = flat[lo:hi]
        out.append(ShardState(tp_rank, tp, layout.shard_segments(dp_rank), kinds))
    return out


LAYOUTS = [(1, 1, 1), (2, 2, 1), (1, 2, 2), (2, 1, 1), (1, 1, 4), (2, 1, 2), (1, 3, 1)]


@pytest.mark.parametrize("tp,pp,dp", LAYOUTS)
def test_any_layout_assembles_the_full_unpadded_state(tp, pp, dp):
    state = _full_state(1)
    canonical = assemble([p for s in _shards(state, tp, pp, dp) for p in shard_pieces(s)])
    assert set(canonical) == set(state)
    for name in state:
        for k in STATE_KINDS:
            assert torch.equal(canonical[name][k], state[name][k]), (name, k)
    assert canonical_digest(canonical) == canonical_digest(state)


@pytest.mark.parametrize("old,new", [((2, 2, 1), (1, 1, 4)), ((1, 2, 2), (2, 1, 1)), ((2, 1, 1), (1, 2, 2)),
                                     ((1, 3, 1), (2, 2, 2))])
def test_reshard_gives_the_shards_the_new_layout_would_have_built(old, new):
    state = _full_state(2)
    want = _shards(state, *new)
    got = reshard(_shards(state, *old), [(s.tp_rank, s.tp, s.segments, s.tensors["master"].numel()) for s in want])
    for w, g in zip(want, got):
        for k in STATE_KINDS:
            assert torch.equal(g[k], w.tensors[k])


def test_digest_sees_every_element_and_kind():
    state = _full_state(3)
    base = canonical_digest(state)
    state["layers.1.attn.qkv.weight"]["exp_avg_sq"][5, 3] += 1e-6
    assert canonical_digest(state) != base


def test_a_missing_shard_is_named():
    shards = _shards(_full_state(4), 1, 1, 2)
    with pytest.raises(ReshardError, match="missing"):
        assemble(shard_pieces(shards[0]))


def test_another_model_shape_is_refused():
    state = _full_state(5)
    canonical = assemble([p for s in _shards(state, 1, 1, 1) for p in shard_pieces(s)])
    seg = _shards(state, 1, 1, 1)[0].segments[0]
    wider = ShardSegment(seg.name, 0, 0, 10, (VOCAB + 5, HIDDEN), True, True, 0, 1, (VOCAB, HIDDEN + 1))
    with pytest.raises(ReshardError):
        cut_shard(canonical, [wider], 0, 1, 10)


def test_segments_without_full_shape_are_refused_with_the_fix():
    old = ShardSegment("word.weight", 0, 0, 4, (2, 2), True, True)
    shard = ShardState(0, 1, [old], {k: torch.zeros(4) for k in STATE_KINDS})
    with pytest.raises(ReshardError, match="layout that wrote it"):
        shard_pieces(shard)


def test_segment_table_round_trips_through_json():
    seg = _shards(_full_state(6), 2, 1, 1)[0].segments[2]
    assert ShardSegment.from_dict(json.loads(json.dumps(seg.to_dict()))) == seg
