"""parallel.virtual_stages outside a process group: the stage a rank holds, the config checks, the fingerprint."""
from __future__ import annotations

import pytest

from megatier.checkpoint.offline.plan import shard_segments
from megatier.config import Config, ModelConfig
from megatier.config.fingerprint import state_fingerprint
from megatier.config.schema import ConfigError
from megatier.config.validation import validate
from megatier.model.params import stage_parameters, stage_spec
from megatier.parallel.layout import Layout
from tests.unit.model.test_stage_parameters import VOCAB, _built

CFG = ModelConfig(num_layers=8, hidden_size=32, num_heads=4, max_position_embeddings=16, ffn_hidden_size=48)


@pytest.mark.parametrize("pp_rank,layers,chunks", [(0, (0, 1, 4, 5), (range(0, 2), range(4, 6))),
                                                  (1, (2, 3, 6, 7), (range(2, 4), range(6, 8)))])
def test_a_rank_holds_its_chunks_by_global_layer(pp_rank, layers, chunks):
    spec = stage_spec(CFG, tp=1, pp=2, tp_rank=0, pp_rank=pp_rank, virtual_stages=2)
    assert spec.layers == layers and spec.chunks == chunks and spec.model_chunks() == chunks
    assert (spec.is_first, spec.is_last) == (pp_rank == 0, pp_rank == 1)
    built, model = _built(spec, CFG)
    assert [p[0] for p in built] == [p.name for p in stage_parameters(CFG, VOCAB, spec)]
    assert list(model.layers) == [str(i) for i in layers]


def test_plain_stage_has_one_chunk():
    spec = stage_spec(CFG, tp=1, pp=2, tp_rank=0, pp_rank=1)
    assert spec.layers == range(4, 8) and spec.model_chunks() == (range(4, 8),)


def _cfg(v: int, **parallel) -> Config:
    cfg = Config(model=ModelConfig(num_layers=4))
    cfg.parallel.pp, cfg.parallel.virtual_stages = 2, v
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    cfg.train.global_batch_size, cfg.train.micro_batch_size = 8, 2
    return cfg


def test_validation_names_the_field_and_the_fix():
    validate(_cfg(2), world_size=2)
    with pytest.raises(ConfigError, match="model.num_layers=4 must be a multiple of parallel.pp x"):
        validate(_cfg(4), world_size=2)
    cfg = _cfg(2)
    cfg.train.global_batch_size = 6  # 3 micro-batches: not a multiple of pp
    with pytest.raises(ConfigError, match="multiple of parallel.pp=2"):
        validate(cfg, world_size=2)
    cfg = _cfg(2)
    cfg.train.rampup_batch_size = [4, 2, 64]  # 2, 3 and 4 micro-batches: 3 is no multiple of pp
    with pytest.raises(ConfigError, match=r"micro-batches per step \(3\)"):
        validate(cfg, world_size=2)
    cfg.train.rampup_batch_size = [4, 4, 64]
    validate(cfg, world_size=2)
    cfg = _cfg(2)
    cfg.model.pipeline_order = "checkfree_plus"
    with pytest.raises(ConfigError, match="set model.pipeline_order=standard or parallel.virtual_stages=1"):
        validate(cfg)
    cfg = _cfg(2)
    cfg.checkpoint.last_resort = "checkfree"  # CheckFree rebuilds a lost stage chunk by chunk
    validate(cfg, world_size=2)


def test_fingerprint_records_it_only_when_on():
    assert "parallel.virtual_stages" not in state_fingerprint(_cfg(1), "")
    assert state_fingerprint(_cfg(2), "")["parallel.virtual_stages"] == "2"


def test_the_size_plan_holds_the_chunks_the_trainer_builds():
    segments, _ = shard_segments(_cfg(2), Layout(1, 2, 1, 0, 0, 0), 256)
    assert {int(s.name.split(".")[1]) for s in segments if s.name.startswith("layers.")} == {0, 2}
