"""CheckFree's decisions: which stages are lost, when they may be rebuilt, the survivors' recovery point, the
rebuild plan and the mix of the neighbours' weights."""
from __future__ import annotations

import functools

import pytest
import torch

from megatier.checkpoint.recover.checkfree import layers_of, mix, plan, stage_sumsq
from megatier.checkpoint.recover.consensus import ConfigCheck, checkfree_refusal, decide, lost_stages
from megatier.checkpoint.recover.inventory import RecoveryError
from megatier.config import ModelConfig
from megatier.model.params import canonical_name, stage_parameters, stage_spec
from megatier.parallel.interleaved import chunk_layers
from tests.unit.checkpoint.recover.test_consensus import B, D, copies

pytestmark = pytest.mark.timeout(60)

PP4 = (1, 4, 2)  # tp, pp, dp: stage s holds ranks 2s and 2s+1


def _decide(cs, last_resort: str, degrees=PP4):
    return decide(cs, job_id="job", degrees=degrees, traces=True, allow_fresh_start=False, looked="Tier-1",
                  last_resort=last_resort)


def _all_but(stage: int, degrees=PP4, diffs=(D(7, 8), D(9, 10))) -> list:
    ranks = [r for r in range(8) if r // 2 != stage]
    return copies(ranks, [B(6), *diffs], degrees=degrees)


def test_a_stage_is_lost_only_when_every_one_of_its_ranks_has_no_base():
    bases = [{6}, {6}, set(), set(), {6}, {6}, {6}, {6}]
    assert lost_stages(bases, PP4) == [1]
    assert lost_stages([{6}, {6}, set(), {6}, {6}, {6}, {6}, {6}], PP4) == []  # half a stage: not lost
    assert lost_stages([set()] * 8, PP4) == []  # nothing anywhere is not a lost stage


def test_refusals_name_the_stages():
    assert checkfree_refusal([1], 4) is None
    assert checkfree_refusal([1, 3], 5) is None  # two stages, each with both neighbours
    assert checkfree_refusal([0], 4) is None  # an end stage: plan() decides, knowing whether stand-ins exist
    assert "stages 1 and 2 are consecutive" in checkfree_refusal([1, 2], 4)


def test_stop_names_the_lost_stage_and_the_option():
    with pytest.raises(RecoveryError, match=r"stage\(s\) \[2\] lost every copy: checkpoint.last_resort=checkfree"):
        _decide(_all_but(2), "stop")


def test_checkfree_agrees_among_the_other_stages():
    c = _decide(_all_but(2), "checkfree")
    assert (c.version, c.end, c.lost_stages) == (6, 10, (2,))
    assert sorted(c.chains) == [0, 1, 2, 3, 6, 7]  # the lost stage's ranks fetch nothing
    assert c.chains[0] == [B(6), D(7, 8), D(9, 10)]


def test_checkfree_refuses_consecutive_stages():
    cs = [c for c in _all_but(1) if c.owner not in (4, 5)]
    with pytest.raises(RecoveryError, match="stages 1 and 2 are consecutive"):
        _decide(cs, "checkfree")


def test_checkfree_does_not_cover_a_partly_lost_stage():
    cs = [c for c in copies(range(8), [B(6), D(7, 8)], degrees=PP4) if c.owner != 4]  # rank 5 of stage 2 kept
    with pytest.raises(RecoveryError, match="ranks \\[4\\] have no base"):
        _decide(cs, "checkfree")


def _names(layers_per_stage: int = 1, pp: int = 4, plus: bool = False) -> list[set[str]]:
    """Parameter names per stage of a GPT on ``pp`` stages (one per layer part), with CheckFree+'s replicas."""
    out = []
    for s in range(pp):
        names = {f"layers.{s * layers_per_stage + k}.attn.qkv.weight" for k in range(layers_per_stage)}
        names |= {"word.weight", "pos.weight"} if s == 0 else set()
        names |= {"head_weight", "final_norm.weight", "final_norm.bias"} if s == pp - 1 else set()
        names |= {"pos_replica.weight"} if plus and s == 1 else set()
        names |= {"final_norm_replica.weight", "final_norm_replica.bias"} if plus and s == pp - 2 else set()
        out.append(names)
    return out


def test_weights_are_each_stages_squared_gradient_norm():
    parts = [1.0, 2.0, 0.5, 0.25, 3.0, None, 4.0, 4.0]
    assert stage_sumsq(parts, PP4) == [3.0, 0.75, None, 8.0]
    sumsq = [3.0, 0.75, None, 8.0]
    (rb,) = plan([2], _names(), sumsq, 10, "weighted")
    assert rb.sources == ((1, 0.75), (3, 8.0)) and rb.renames == ({1: 2}, {3: 2}) and rb.extras == {}
    (rb,) = plan([2], _names(), sumsq, 10, "copy")
    assert rb.sources == ((1, 1.0),)
    (rb,) = plan([2], _names(), sumsq, 10, "random")
    assert rb.sources == ()


def test_plan_refuses_unequal_stages_unknown_norms_and_ends_without_stand_ins():
    names = _names(2)
    names[2] = {"layers.4.attn.qkv.weight"}
    with pytest.raises(RecoveryError, match="stage 2: it holds 1 transformer layers and stage 1 2"):
        plan([2], names, [1.0, 1.0, None, 1.0], 10, "weighted")
    with pytest.raises(RecoveryError, match="neighbour stage 3 is not recorded at step 10"):
        plan([2], _names(), [1.0, 1.0, None, None], 10, "weighted")
    for end in (0, 3):
        with pytest.raises(RecoveryError, match=f"stage {end}: it holds the embedding or the output head.*"
                                                f"checkfree_plus"):
            plan([end], _names(), [1.0] * 4, 10, "weighted")


@pytest.mark.parametrize("pp,lost", [(4, 1), (4, 2), (3, 1)])
def test_with_model_chunks_each_chunk_comes_from_the_neighbours_same_chunk(pp, lost):
    """v=2, two layers a chunk: chunk c of stage i (virtual stage c * pp + i) is rebuilt from chunk c of i-1 and i+1."""
    cfg, v = ModelConfig(num_layers=pp * 2 * 2, hidden_size=32, num_heads=4, max_position_embeddings=16), 2
    names = [{p.name for p in stage_parameters(cfg, 257, stage_spec(cfg, tp=1, pp=pp, tp_rank=0, pp_rank=s,
                                                                   virtual_stages=v))} for s in range(pp)]
    (rb,) = plan([lost], names, [1.0, 2.0, 3.0, 4.0][:pp], 10, "weighted")
    assert [s for s, _ in rb.sources] == [lost - 1, lost + 1] and rb.extras == {}
    mine = chunk_layers(num_layers=cfg.num_layers, pp=pp, virtual_stages=v, rank=lost)
    for (source, _), rename in zip(rb.sources, rb.renames):
        theirs = chunk_layers(num_layers=cfg.num_layers, pp=pp, virtual_stages=v, rank=source)
        assert rename == {a: b for ours, own in zip(theirs, mine) for a, b in zip(ours, own)}
    if (pp, lost) == (4, 1):  # spelled out: stage 0 holds 0-1 and 8-9, stage 1 2-3 and 10-11, stage 2 4-5, 12-13
        assert rb.renames == ({0: 2, 1: 3, 8: 10, 9: 11}, {4: 2, 5: 3, 12: 10, 13: 11})
    for end in (0, pp - 1):  # the embedding's and the head's stage stay refused
        with pytest.raises(RecoveryError, match=f"stage {end}: it holds the embedding or the output head"):
            plan([end], names, [1.0] * pp, 10, "weighted")


def test_checkfree_rebuilds_only_from_copies_of_the_jobs_own_model_chunks():
    """Copies at the job's degrees written with other virtual_stages gave each stage other layers: no rebuild."""
    cs = _all_but(2)  # written without a config record: parallel.virtual_stages=1
    chunked = ConfigCheck("", current={"parallel.virtual_stages": "2"})
    assert decide(cs, job_id="job", degrees=PP4, traces=True, allow_fresh_start=False, looked="Tier-1",
                  config=ConfigCheck("", current={}), last_resort="checkfree").lost_stages == (2,)
    with pytest.raises(RecoveryError, match=r"no base version is available for every rank.*stage\(s\) \[2\] lost "
                                            r"every copy: CheckFree .* parallel.virtual_stages=2, but they were "
                                            r"written with virtual_stages=\[1\]: relaunch with that value"):
        decide(cs, job_id="job", degrees=PP4, traces=True, allow_fresh_start=False, looked="Tier-1",
               config=chunked, last_resort="checkfree")


def test_checkfree_plus_rebuilds_an_end_stage_from_its_stand_in_and_exact_copies():
    names = _names(plus=True)
    (rb,) = plan([0], names, [None, 1.0, 1.0, 1.0], 10, "weighted")
    assert rb.stand_in and rb.sources == ((1, 1.0),) and rb.renames == ({1: 0},)
    assert rb.extras == {"word.weight": 3, "pos.weight": 1}  # the tied head; stage 1's replica
    (rb,) = plan([3], names, [1.0, 1.0, 1.0, None], 10, "weighted")
    assert rb.sources == ((2, 1.0),) and rb.extras == {"word.weight": 0, "final_norm.weight": 2,
                                                       "final_norm.bias": 2}
    (rb,) = plan([1], names, [2.0, None, 3.0, 1.0], 10, "weighted")  # an intermediate stage: its replica too
    assert rb.sources == ((0, 2.0), (2, 3.0)) and rb.extras == {"pos.weight": 0}
    with pytest.raises(RecoveryError, match="no surviving stage holds word.weight"):
        plan([0, 4], _names(pp=5, plus=True), [None, 1.0, 1.0, 1.0, None], 10, "weighted")


def test_checkfree_plus_rebuilds_a_llama_end_stage_from_its_replicas():
    """Llama: the head is not the word embedding, so each end comes back from stage 1's or P-2's replicas."""
    cfg = ModelConfig(arch="llama", pipeline_order="checkfree_plus")
    names = [{"word.weight", "layers.0.attn.q.weight"}, {"layers.1.attn.q.weight", "word_replica.weight"},
             {"layers.2.attn.q.weight", "final_norm_replica.weight", "head_replica.weight"},
             {"layers.3.attn.q.weight", "final_norm.weight", "head_weight"}]
    canonical = functools.partial(canonical_name, cfg=cfg)
    (rb,) = plan([0], names, [None, 1.0, 1.0, 1.0], 10, "weighted", canonical)
    assert rb.stand_in and rb.sources == ((1, 1.0),) and rb.extras == {"word.weight": 1}
    (rb,) = plan([3], names, [1.0, 1.0, 1.0, None], 10, "weighted", canonical)
    assert rb.sources == ((2, 1.0),) and rb.extras == {"final_norm.weight": 2, "head_weight": 2}
    # GPT-2's reading (the head is the tied word embedding) would copy the embedding into the head.
    assert plan([3], names, [1.0] * 4, 10, "weighted")[0].extras == {"final_norm.weight": 2, "word.weight": 1}


def test_mix_is_the_weighted_average_in_float64():
    a, b = torch.randn(1000), torch.randn(1000)
    want = ((0.3 * a.double() + 1.7 * b.double()) / 2.0).float()
    assert torch.equal(mix([a, b], [0.3, 1.7]), want)
    assert torch.equal(mix([a], [1.0]), a)
    assert torch.equal(mix([a, b], [0.0, 0.0]), ((a.double() + b.double()) / 2).float())


def test_layers_of_reads_global_layer_indices():
    assert layers_of(["word.weight", "layers.4.ln1.weight", "layers.5.mlp.fc.bias", "layers.4.attn.qkv.weight",
                      "final_norm.weight"]) == [4, 5]
