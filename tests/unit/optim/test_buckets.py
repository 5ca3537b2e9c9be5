"""The bucket plan: buckets tile each region at parameter ends, their owners' pieces tile every owner's range,
and the pieces placed at their shard offsets tile the rank's optimizer shard exactly once; config checks."""
from __future__ import annotations

import pytest

from megatier.config import Config, ConfigError, ModelConfig, ParallelConfig, validate
from megatier.optim.buckets import bucket_numel, plan_buckets
from megatier.optim.flat import FlatLayout, ParamSpec


def _params(experts: int) -> list[ParamSpec]:
    """An embedding, two layers of a dense matrix and a norm (and routed experts), of sizes nothing divides."""
    out = [ParamSpec("word.weight", (11, 3), 0, 1, (11, 3))]
    for layer in range(2):
        out += [ParamSpec(f"layers.{layer}.fc.weight", (7, 5), 0, 1, (7, 5)),
                ParamSpec(f"layers.{layer}.norm.weight", (5,), None, 1, (5,))]
        out += [ParamSpec(f"layers.{layer}.experts.{e}.weight", (3, 7), 0, 1, (3, 7), "", e) for e in range(experts)]
    return out


@pytest.mark.parametrize("dp,ep,experts,numel", [(2, 1, 0, 1), (3, 1, 0, 20), (4, 1, 0, 40), (4, 2, 2, 16),
                                                 (4, 1, 0, 10**6)])
def test_buckets_tile_regions_owners_and_shards(dp, ep, experts, numel):
    layout = FlatLayout.from_params(_params(experts), dp, tp_rank=0, ep=ep)
    for dp_rank in range(dp):
        buckets = plan_buckets(layout, dp_rank, numel)
        ends = [0, layout.dense_numel, layout.numel][:2 + bool(layout.expert_shard_size)]
        for region, (start, end) in enumerate(zip(ends, ends[1:])):
            mine = [b for b in buckets if b.region == region]
            assert [b.lo for b in mine] == [start] + [b.hi for b in mine[:-1]] and mine[-1].hi == end
            owners = len(mine[0].pieces)
            size = (end - start) // owners
            for b in mine:
                full = [(lo, hi) for lo, hi in b.pieces if hi > lo]
                assert full[0][0] == b.lo and full[-1][1] == b.hi and all(
                    x[1] == y[0] for x, y in zip(full, full[1:]))
                assert all(hi == lo or start + q * size <= lo < hi <= start + (q + 1) * size
                           for q, (lo, hi) in enumerate(b.pieces))
        covered = sorted((b.shard_offset, b.shard_offset + b.piece_numel) for b in buckets if b.piece_numel)
        assert covered[0][0] == 0 and covered[-1][1] == layout.shard_size
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
        named = [n for b in buckets for n in b.names]
        assert sorted(named) == sorted(s.name for s in layout.segments)


def test_bucket_size_and_one_bucket_per_parameter_at_the_smallest():
    assert bucket_numel(1.0) == 1 << 18 and bucket_numel(0.0) == 40 * (1 << 18)
    layout = FlatLayout.from_params(_params(0), 2, tp_rank=0)
    assert len(plan_buckets(layout, 0, 1)) == len(layout.segments)


@pytest.mark.parametrize("fields,model,says", [
    ({"bucket_mb": -1.0}, {}, "parallel.bucket_mb=-1.0 must be >= 0"),
    ({"overlap_param_gather": True}, {"compile": True}, "set model.compile=false or parallel.overlap_param_gather"),
    ({"overlap_grad_reduce": True}, {"pipeline_order": "checkfree_plus"}, "model.pipeline_order=standard"),
])
def test_config_errors_name_the_field_and_the_fix(fields, model, says):
    cfg = Config(parallel=ParallelConfig(**fields), model=ModelConfig(**model))
    with pytest.raises(ConfigError, match=says.replace(".", r"\.").replace("+", r"\+")):
        validate(cfg)
