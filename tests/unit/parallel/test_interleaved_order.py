"""The interleaved 1F1B order against orders written out by hand (Megatron-core's rule)."""
from types import SimpleNamespace

import pytest

from megatier.config.schema import ConfigError
from megatier.config.validation import check_interleaving
from megatier.parallel.interleaved import Op, chunk_layers, interleaved_order


def _ops(text: str) -> list[Op]:
    """'F0.1 B1.0' -> [Op('F', 0, 1), Op('B', 1, 0)]: kind, chunk.micro-batch."""
    return [Op(t[0], int(t[1:].split(".")[0]), int(t.split(".")[1])) for t in text.split()]


def test_pp2_v2_m4_first_rank_warms_up_four():
    expected = _ops("F0.0 F0.1 F1.0 F1.1  F0.2 B1.0 F0.3 B1.1 F1.2 B0.0 F1.3 B0.1  B1.2 B1.3 B0.2 B0.3")
    assert interleaved_order(pp=2, rank=0, virtual_stages=2, num_microbatches=4) == expected


def test_pp2_v2_m4_last_rank_warms_up_two():
    expected = _ops("F0.0 F0.1  F1.0 B1.0 F1.1 B1.1 F0.2 B0.0 F0.3 B0.1 F1.2 B1.2 F1.3 B1.3  B0.2 B0.3")
    assert interleaved_order(pp=2, rank=1, virtual_stages=2, num_microbatches=4) == expected


def test_as_many_microbatches_as_stages():
    assert interleaved_order(pp=2, rank=0, virtual_stages=2, num_microbatches=2) == \
        _ops("F0.0 F0.1 F1.0 F1.1 B1.0 B1.1 B0.0 B0.1")
    assert interleaved_order(pp=2, rank=1, virtual_stages=2, num_microbatches=2) == \
        _ops("F0.0 F0.1 F1.0 B1.0 F1.1 B1.1 B0.0 B0.1")


@pytest.mark.parametrize("pp,v,m", [(2, 2, 4), (2, 2, 2), (2, 3, 6), (4, 2, 8), (3, 2, 9), (4, 3, 4)])
def test_matches_megatron_core(pp, v, m):
    """megatron-core's own warmup count and schedule table (a test dependency) give the same order."""
    schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    table = schedules.get_schedule_table(m, v, pp)
    for rank in range(pp):
        comm = SimpleNamespace(pp_group=SimpleNamespace(size=lambda: pp, rank=lambda r=rank: r),
                               virtual_pipeline_model_parallel_size=v)
        total, _, warmup, _ = schedules.get_pp_rank_microbatches(m, v, pp, p2p_communicator=comm)

        def op(kind, k):
            mb, chunk = table[k]
            return Op(kind, chunk if kind == "F" else v - 1 - chunk, mb)
        expected = [op("F", k) for k in range(warmup)]
        for k in range(total - warmup):
            expected += [op("F", k + warmup), op("B", k)]
        expected += [op("B", k) for k in range(total - warmup, total)]
        assert interleaved_order(pp=pp, rank=rank, virtual_stages=v, num_microbatches=m) == expected


@pytest.mark.parametrize("pp,v,m", [(2, 2, 4), (2, 3, 6), (4, 2, 8), (3, 2, 9)])
def test_every_chunk_runs_each_microbatch_once_each_way(pp, v, m):
    for rank in range(pp):
        ops = interleaved_order(pp=pp, rank=rank, virtual_stages=v, num_microbatches=m)
        for kind in "FB":
            assert sorted((o.chunk, o.microbatch) for o in ops if o.kind == kind) == \
                [(c, b) for c in range(v) for b in range(m)]
        for o in ops:  # a backward follows its own forward
            if o.kind == "B":
                assert ops.index(Op("F", o.chunk, o.microbatch)) < ops.index(o)


def test_chunks_are_virtual_stages_round_robin():
    assert chunk_layers(num_layers=8, pp=2, virtual_stages=2, rank=0) == [range(0, 2), range(4, 6)]
    assert chunk_layers(num_layers=8, pp=2, virtual_stages=2, rank=1) == [range(2, 4), range(6, 8)]


@pytest.mark.parametrize("kwargs,field", [
    (dict(pp=2, virtual_stages=2, num_microbatches=3, num_layers=4), "train.global_batch_size"),
    (dict(pp=2, virtual_stages=2, num_microbatches=4, num_layers=6), "model.num_layers"),
    (dict(pp=1, virtual_stages=2, num_microbatches=4, num_layers=4), "parallel.pp"),
    (dict(pp=2, virtual_stages=0, num_microbatches=4, num_layers=4), "parallel.virtual_stages"),
])
def test_refusals_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        check_interleaving(**kwargs)


def test_plain_pipeline_needs_nothing():
    check_interleaving(pp=2, virtual_stages=1, num_microbatches=3, num_layers=3)
