"""Every 3D layout trains the same model as one process, and ZeRO-1 exposes what it consumed.

Each layout (tp, pp, dp) runs the real Trainer for a few steps of a tiny GPT in
a spawned gloo world and is compared with the single-process run (1, 1, 1):
per-step and validation losses, the gathered final parameters, and the
gradient the optimizer consumed in step 1, reassembled by global parameter
name from every rank's shard segment table. Within each run every step must
replay bit for bit from the exposed gradient shard, and the dp shards must
tile each stage's flat buffer exactly once.

The model has 3 layers, so pp=2 also exercises the uneven split (2 + 1).
The vocabulary is padded to the same size (512) for tp=1 and tp=2 only so the
reassembled tensors have one shape (padding never enters the softmax); the
canonical digest of the initial state, unpadded, must be the same everywhere.
"""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from megatier import ops
from megatier.config import (
    Config,
)
from megatier.optim.adamw import DistributedAdamW
from megatier.slicing import full_from_shards
from megatier.training.trainer import Trainer
from tests.distributed.configs import tiny_job
from tests.distributed.world import run_world

STEPS = 5
LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 1, 2), (1, 2, 2), (2, 2, 2)]
LR = 3e-3
LOSS_RTOL = 1e-5
# Adam divides each gradient element by its own running magnitude, so elements whose true
# gradient is ~0 (the key bias: softmax ignores it) move by up to ~lr per step in a direction
# set by rounding noise. Parameters therefore agree to a fraction of one step's lr, not to 1e-7.
PARAM_ATOL = 0.005 * LR


def _config(tp: int, pp: int, dp: int, prefix: str, run_dir: str) -> Config:
    # A high lr and clip 1.0 so the steps move the weights and clipping is active; eval_iters batches per dp
    # rank: 4 // dp keeps the validation samples the same in every layout.
    return tiny_job("", "layout", prefix, iters=STEPS, tp=tp, pp=pp, run=run_dir,
                    model={"make_vocab_size_divisible_by": 256},
                    optim={"lr": LR, "min_lr": LR / 10, "decay_iters": None},
                    train={"seed": 7, "eval_interval": 50, "eval_iters": 4 // dp})

def _replays_exactly(opt: DistributedAdamW, before: dict[str, torch.Tensor]) -> bool:
    """Re-apply the step from the exposed gradient shard, lr and count; must reproduce the state bit for bit."""
    c = opt.cfg
    ops.adamw_step(before["master"], before["exp_avg"], before["exp_avg_sq"], opt.last_grad.clone(), opt.adam_steps,
                   opt.last_lr, c.beta1, c.beta2, c.eps, c.weight_decay, opt.decay_ranges)
    return all(torch.equal(before[k], v) for k, v in opt.state_tensors().items())


def _consumed_by_name(opt: DistributedAdamW) -> list[tuple[str, int, tuple, torch.Tensor]]:
    """The consumed gradient shard cut by the shard's segment table: (name, param_offset, shape, values)."""
    return [(s.name, s.param_offset, s.shape, opt.last_grad[s.shard_offset:s.shard_offset + s.numel].clone())
            for s in opt.shard_segments]


def _reference_clipped_grad(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Single process only: plain autograd over the whole global batch of step 1, clipped by its norm."""
    mbs = trainer.batches.train_microbatches(1)
    tokens, labels = torch.cat([x for x, _ in mbs]), torch.cat([y for _, y in mbs])
    params = dict(trainer.model.named_parameters())
    grads = torch.autograd.grad(trainer.model(tokens, labels).mean(), list(params.values()))
    norm = float(torch.sqrt(sum(g.double().pow(2).sum() for g in grads)))
    factor = min(1.0, trainer.cfg.optim.clip_grad / (norm + 1e-6))
    return {name: g * factor for name, g in zip(params, grads)}


def _train_worker(rank: int, tp: int, pp: int, prefix: str, run_dir: str) -> dict:
    world = torch.distributed.get_world_size()
    trainer = Trainer(_config(tp, pp, world // (tp * pp), prefix, run_dir))
    ps, opt = trainer.ps, trainer.optimizer
    out = {"coords": (ps.tp_rank, ps.dp_rank, ps.pp_rank), "losses": [], "replay_exact": [],
           "digest0": trainer.canonical_digest()}  # initial state: layout-independent by construction
    if world == 1:
        out["reference_grad"] = _reference_clipped_grad(trainer)
    for step in range(1, STEPS + 1):
        before = {k: v.clone() for k, v in opt.state_tensors().items()}
        out["losses"].append(trainer.train_step(step)["loss"])
        trainer.step = step
        out["replay_exact"].append(_replays_exactly(opt, before))
        if step == 1:
            out["consumed"] = _consumed_by_name(opt)
    out["val_loss"] = trainer.evaluate()
    out["layout"] = (trainer.layout.segments, trainer.layout.numel, trainer.layout.shard_range(ps.dp_rank))
    out["params"] = {n: (p.detach().clone(), p.tp_partition_dim, p.tp_partition_stride)
                     for n, p in trainer.model.named_parameters()}
    trainer.close()
    return out


def _run(layout: tuple[int, int, int], prefix: str, tmp_path) -> list[dict]:
    tp, pp, dp = layout
    return run_world(_train_worker, tp * pp * dp, tmp_path, tp, pp, prefix, str(tmp_path / "run"))


@pytest.fixture(scope="module")
def baseline(corpus_prefix, tmp_path_factory) -> list[dict]:
    return _run((1, 1, 1), corpus_prefix, tmp_path_factory.mktemp("layout-1-1-1"))


# ---- reassembly of per-rank pieces into whole-model tensors by global name ------------------------


def _by_stage(results: list[dict]) -> dict[tuple[int, int], list[dict]]:
    """(pp_rank, tp_rank) -> that stage slice's results in dp-rank order."""
    groups = defaultdict(list)
    for res in sorted(results, key=lambda r: r["coords"][1]):
        tp_rank, _, pp_rank = res["coords"]
        groups[(pp_rank, tp_rank)].append(res)
    return groups


def _join_tp(pieces: dict[str, list[torch.Tensor]], partition: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """Whole tensors from tp-rank-ordered slices; replicated tensors must agree across tp."""
    out = {}
    for name, shards in pieces.items():
        dim, stride = partition[name]
        if dim is None:
            for s in shards[1:]:
                torch.testing.assert_close(s, shards[0], rtol=1e-6, atol=1e-8,
                                           msg=lambda m: f"tp copies of {name}: {m}")
        out[name] = full_from_shards(shards, dim, stride)
    return out


def _untie(tensors: dict[str, torch.Tensor], what: str) -> dict[str, torch.Tensor]:
    """The last stage's copy of the tied embedding must equal the first stage's; keep one."""
    if "head_weight" in tensors:
        head = tensors.pop("head_weight")
        torch.testing.assert_close(head, tensors["word.weight"], rtol=0, atol=0, msg=lambda m: f"tied copy {what}: {m}")
    return tensors


def _gather_params(results: list[dict]) -> dict[str, torch.Tensor]:
    pieces, partition = defaultdict(list), {}
    for _, ranks in sorted(_by_stage(results).items()):
        for name, (value, dim, stride) in ranks[0]["params"].items():
            for other in ranks[1:]:  # ZeRO-1 all-gather: every dp replica holds identical parameters
                assert torch.equal(other["params"][name][0], value), f"dp replicas differ in {name}"
            pieces[name].append(value)
            partition[name] = (dim, stride)
    return _untie(_join_tp(pieces, partition), "params")


def _gather_consumed(results: list[dict]) -> dict[str, torch.Tensor]:
    """Step-1 consumed gradient by name; every element must come from exactly one dp shard."""
    pieces, partition = defaultdict(list), {}
    for _, ranks in sorted(_by_stage(results).items()):
        flat, hits = {}, {}
        for res in ranks:
            for name, param_offset, shape, values in res["consumed"]:
                numel = int(torch.Size(shape).numel())
                span = slice(param_offset, param_offset + len(values))
                flat.setdefault(name, torch.zeros(numel))[span] = values
                hits.setdefault(name, torch.zeros(numel, dtype=torch.int64))[span] += 1
                partition[name] = ranks[0]["params"][name][1:]
        for name in flat:
            assert torch.all(hits[name] == 1), f"{name}: dp shards cover some elements {hits[name].max()} times, " \
                                               f"some {hits[name].min()} times"
            pieces[name].append(flat[name].view(ranks[0]["params"][name][0].shape))
    return _untie(_join_tp(pieces, partition), "consumed gradient")


def _check_shards_tile_flat_buffer(results: list[dict]) -> None:
    """dp shard ranges tile [0, numel) and every segment lies inside the used part exactly once."""
    for key, ranks in _by_stage(results).items():
        segments, numel, _ = ranks[0]["layout"]
        ranges = [r["layout"][2] for r in ranks]
        assert ranges[0][0] == 0 and ranges[-1][1] == numel, key
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), (key, ranges)
        ends = [s.offset for s in segments[1:]] + [segments[-1].end]
        assert [s.end for s in segments] == ends and segments[0].offset == 0, key
        assert numel - segments[-1].end < len(ranks), f"{key}: padding {numel - segments[-1].end} >= dp"


# ---- tests ----------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_single_process_consumes_the_clipped_mean_gradient(baseline):
    (res,) = baseline
    consumed = _gather_consumed(baseline)
    assert consumed.keys() == res["reference_grad"].keys()
    for name, ref in res["reference_grad"].items():
        torch.testing.assert_close(consumed[name], ref, rtol=1e-4, atol=1e-7, msg=lambda m: f"{name}: {m}")
    assert all(res["replay_exact"])
    losses = res["losses"]
    assert losses[-1] < losses[0], losses


@pytest.mark.timeout(240)
# Each degree alone and all three together in `make test`; the pairs in `make test-slow`.
@pytest.mark.parametrize("layout", [lay if lay.count(1) != 1 else pytest.param(lay, marks=pytest.mark.slow)
                                    for lay in LAYOUTS],
                         ids=lambda lay: "tp{}-pp{}-dp{}".format(*lay))
def test_layout_matches_single_process(layout, baseline, corpus_prefix, tmp_path):
    results = _run(layout, corpus_prefix, tmp_path)
    (base,) = baseline

    for res in results:  # every rank reports the same global loss
        torch.testing.assert_close(res["losses"], base["losses"], rtol=LOSS_RTOL, atol=0.0)
        torch.testing.assert_close(res["val_loss"], base["val_loss"], rtol=LOSS_RTOL, atol=0.0)
        assert all(res["replay_exact"]), f"rank {res['coords']}: a step did not replay from its exposed gradient"

    _check_shards_tile_flat_buffer(results)
    assert {r["digest0"] for r in results} == {base["digest0"]}, "the initial state's canonical digest differs"
    consumed, base_consumed = _gather_consumed(results), _gather_consumed(baseline)
    assert consumed.keys() == base_consumed.keys()
    for name, ref in base_consumed.items():
        torch.testing.assert_close(consumed[name], ref, rtol=1e-4, atol=1e-8, msg=lambda m: f"grad {name}: {m}")

    params, base_params = _gather_params(results), _gather_params(baseline)
    assert params.keys() == base_params.keys()
    for name, ref in base_params.items():
        torch.testing.assert_close(params[name], ref, rtol=1e-4, atol=PARAM_ATOL, msg=lambda m: f"param {name}: {m}")
