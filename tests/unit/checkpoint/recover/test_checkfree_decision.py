"""CheckFree's decisions: which stages are lost, when they may be rebuilt, the survivors' recovery point, the
rebuild plan and the mix of the neighbours' weights."""
from __future__ import annotations

import pytest
import torch

from megatier.checkpoint.recover.checkfree import layers_of, mix, plan, stage_sumsq
from megatier.checkpoint.recover.consensus import checkfree_refusal, decide, lost_stages
from megatier.checkpoint.recover.inventory import RecoveryError
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
    for lost, pp in (([0], 4), ([3], 4)):
        assert "only intermediate stages" in checkfree_refusal(lost, pp)
    assert "stages 1 and 2 are consecutive" in checkfree_refusal([1, 2], 4)


def test_stop_names_the_lost_stage_and_the_option():
    with pytest.raises(RecoveryError, match=r"stage\(s\) \[2\] lost every copy: checkpoint.last_resort=checkfree"):
        _decide(_all_but(2), "stop")


def test_checkfree_agrees_among_the_other_stages():
    c = _decide(_all_but(2), "checkfree")
    assert (c.version, c.end, c.lost_stages) == (6, 10, (2,))
    assert sorted(c.chains) == [0, 1, 2, 3, 6, 7]  # the lost stage's ranks fetch nothing
    assert c.chains[0] == [B(6), D(7, 8), D(9, 10)]


def test_checkfree_refuses_the_first_stage_and_consecutive_stages():
    with pytest.raises(RecoveryError, match=r"refusing to recover with checkpoint.last_resort=checkfree.*\[0\]"):
        _decide(_all_but(0), "checkfree")
    cs = [c for c in _all_but(1) if c.owner not in (4, 5)]
    with pytest.raises(RecoveryError, match="stages 1 and 2 are consecutive"):
        _decide(cs, "checkfree")


def test_checkfree_does_not_cover_a_partly_lost_stage():
    cs = [c for c in copies(range(8), [B(6), D(7, 8)], degrees=PP4) if c.owner != 4]  # rank 5 of stage 2 kept
    with pytest.raises(RecoveryError, match="ranks \\[4\\] have no base"):
        _decide(cs, "checkfree")


def test_weights_are_each_stages_squared_gradient_norm():
    parts = [1.0, 2.0, 0.5, 0.25, 3.0, None, 4.0, 4.0]
    assert stage_sumsq(parts, PP4) == [3.0, 0.75, None, 8.0]
    layers = [[0], [1], [2], [3]]
    (rb,) = plan([2], layers, [3.0, 0.75, None, 8.0], 10, "weighted")
    assert rb.sources == ((1, 0.75), (3, 8.0)) and rb.renames == ({1: 2}, {3: 2})
    (rb,) = plan([2], layers, [3.0, 0.75, None, 8.0], 10, "copy")
    assert rb.sources == ((1, 1.0),)
    (rb,) = plan([2], layers, [3.0, 0.75, None, 8.0], 10, "random")
    assert rb.sources == ()


def test_plan_refuses_unequal_stages_and_unknown_norms():
    with pytest.raises(RecoveryError, match="holds 1 transformer layers and its neighbour stage 1 2"):
        plan([2], [[0, 1], [2, 3], [4], [5]], [1.0, 1.0, None, 1.0], 10, "weighted")
    with pytest.raises(RecoveryError, match="neighbour stage 3 is not recorded at step 10"):
        plan([2], [[0], [1], [2], [3]], [1.0, 1.0, None, None], 10, "weighted")


def test_mix_is_the_weighted_average_in_float64():
    a, b = torch.randn(1000), torch.randn(1000)
    want = ((0.3 * a.double() + 1.7 * b.double()) / 2.0).float()
    assert torch.equal(mix([a, b], [0.3, 1.7]), want)
    assert torch.equal(mix([a], [1.0]), a)
    assert torch.equal(mix([a, b], [0.0, 0.0]), ((a.double() + b.double()) / 2).float())


def test_layers_of_reads_global_layer_indices():
    assert layers_of(["word.weight", "layers.4.ln1.weight", "layers.5.mlp.fc.bias", "layers.4.attn.qkv.weight",
                      "final_norm.weight"]) == [4, 5]
