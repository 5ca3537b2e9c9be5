"""AdamW against torch.optim.AdamW, the LR schedule, the loss scaler, the flat layout."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from megatier import ops
from megatier.config import OptimConfig
from megatier.optim.adamw import DistributedAdamW
from megatier.optim.flat import FlatLayout, flatten_parameters, ranges_tensor
from megatier.optim.grad_buffer import GradBuffer
from megatier.optim.loss_scaler import DynamicLossScaler
from megatier.optim.schedule import LRSchedule
from megatier.parallel.layers import mark_partition


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_step_matches_torch(weight_decay):
    gen = torch.Generator().manual_seed(0)
    n = 1000
    ours = torch.randn(n, generator=gen)
    theirs = nn.Parameter(ours.clone())
    m, v = torch.zeros(n), torch.zeros(n)
    ref = torch.optim.AdamW([theirs], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    decay = torch.tensor([[0, n]], dtype=torch.int64)
    for step in range(1, 31):
        grad = torch.randn(n, generator=gen)
        theirs.grad = grad.clone()
        ref.step()
        ops.adamw_step(ours, m, v, grad, step, 1e-2, 0.9, 0.95, 1e-8, weight_decay, decay)
    torch.testing.assert_close(ours, theirs.detach(), rtol=1e-5, atol=1e-6)


def test_adamw_decays_only_decay_ranges():
    p = torch.ones(10)
    zeros = torch.zeros(10)
    ops.adamw_step(p, zeros.clone(), zeros.clone(), zeros.clone(), 1, 0.5, 0.9, 0.95, 1e-8, 0.1,
                   torch.tensor([[2, 5]], dtype=torch.int64))
    assert torch.equal(p[2:5], torch.full((3,), 0.95))
    assert torch.equal(p[:2], torch.ones(2)) and torch.equal(p[5:], torch.ones(5))


def _toy_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    for p in model.parameters():
        mark_partition(p, None)
    return model


def test_distributed_adamw_matches_torch_with_groups_and_clipping(process_group):
    cfg = OptimConfig(lr=1e-2, min_lr=1e-2, warmup_iters=0, weight_decay=0.1, clip_grad=0.5)
    ours, theirs = _toy_model(), _toy_model()
    layout = FlatLayout.from_module(ours, dp=1, tp_rank=0)
    flat = flatten_parameters(ours, layout, torch.float32, torch.device("cpu"))
    grads = GradBuffer(ours, layout, torch.device("cpu"), dp_group=process_group.dp_group)
    opt = DistributedAdamW(cfg, layout, flat, grads, dp_rank=0, dp_group=process_group.dp_group,
                           norm_group=process_group.world_group, schedule=LRSchedule(1e-2, 1e-2, 0, 100))
    decay = [p for p in theirs.parameters() if p.dim() >= 2]
    no_decay = [p for p in theirs.parameters() if p.dim() < 2]
    ref = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-2, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 11):
        x = torch.randn(32, 8, generator=gen)
        grads.zero()
        ours(x).pow(2).mean().backward()
        stats = opt.step(step)
        ref.zero_grad()
        theirs(x).pow(2).mean().backward()
        norm = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5)
        ref.step()
        assert stats.grad_norm == pytest.approx(float(norm), rel=1e-5)
        # the exposed gradient is exactly what the step consumed: clipped to norm 0.5
        assert float(opt.last_grad.norm()) == pytest.approx(min(0.5, float(norm)), rel=1e-4)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_flat_layout_shards_tile_the_buffer():
    model = _toy_model()
    for dp in (1, 2, 3, 4):
        layout = FlatLayout.from_module(model, dp=dp, tp_rank=0)
        covered = []
        for r in range(dp):
            lo, _ = layout.shard_range(r)
            covered += [lo + s.shard_offset + i for s in layout.shard_segments(r) for i in range(s.numel)]
        assert covered == list(range(layout.segments[-1].end))
        assert layout.numel % dp == 0


def test_ranges_tensor_merges_adjacent():
    model = _toy_model()
    layout = FlatLayout.from_module(model, dp=1, tp_rank=0)
    segs = layout.shard_segments(0)
    assert ranges_tensor(segs, "in_norm").tolist() == [[0, layout.segments[-1].end]]
    assert ranges_tensor(segs, "decay").shape == (2, 2)  # two weight matrices, biases/norm excluded


def test_warmup_cosine_schedule():
    s = LRSchedule(lr=1.0, min_lr=0.1, warmup_iters=10, decay_iters=110)
    assert s(1) == pytest.approx(0.1) and s(10) == pytest.approx(1.0)
    assert s(60) == pytest.approx(0.1 + 0.5 * 0.9)
    assert s(110) == pytest.approx(0.1) and s(500) == pytest.approx(0.1)
    values = [s(i) for i in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    with pytest.raises(ValueError):
        s(0)


def test_loss_scaler_backs_off_and_grows():
    scaler = DynamicLossScaler(initial_scale=1024, min_scale=1, window=3, hysteresis=2)
    scaler.update(True)
    assert scaler.scale == 1024  # hysteresis absorbs the first overflow
    scaler.update(True)
    assert scaler.scale == 512
    for _ in range(3):
        scaler.update(False)
    assert scaler.scale == 1024
    restored = DynamicLossScaler(1, 1, 3, 2)
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()


def test_overflow_skips_step(process_group):
    model = _toy_model()
    layout = FlatLayout.from_module(model, dp=1, tp_rank=0)
    flat = flatten_parameters(model, layout, torch.float32, torch.device("cpu"))
    grads = GradBuffer(model, layout, torch.device("cpu"), dp_group=process_group.dp_group)
    scaler = DynamicLossScaler(8.0, 1.0, 100, 1)
    opt = DistributedAdamW(OptimConfig(), layout, flat, grads, dp_rank=0, dp_group=process_group.dp_group,
                           norm_group=process_group.world_group, schedule=LRSchedule(1e-3, 1e-4, 0, 10),
                           scaler=scaler)
    before = opt.master.clone()
    grads.flat[0] = math.inf
    stats = opt.step(1)
    assert stats.skipped and opt.adam_steps == 0 and scaler.scale == 4.0
    assert torch.equal(opt.master, before)


def test_a_gradient_whose_square_overflows_fp32_skips_the_step(process_group):
    """The norm is summed in float64 and stays finite, but g * g in fp32 would make exp_avg_sq inf."""
    model = _toy_model()
    layout = FlatLayout.from_module(model, dp=1, tp_rank=0)
    flat = flatten_parameters(model, layout, torch.float32, torch.device("cpu"))
    grads = GradBuffer(model, layout, torch.device("cpu"), dp_group=process_group.dp_group)
    opt = DistributedAdamW(OptimConfig(clip_grad=0.0), layout, flat, grads, dp_rank=0,
                           dp_group=process_group.dp_group, norm_group=process_group.world_group,
                           schedule=LRSchedule(1e-3, 1e-4, 0, 10))
    before = opt.master.clone()
    grads.flat[3] = 3e19  # finite, 9e38 squared
    stats = opt.step(1)
    assert stats.skipped and opt.adam_steps == 0 and torch.equal(opt.master, before)
    grads.flat[3] = 1e19  # 1e38 squared: still an fp32 number, so the step is taken
    stats = opt.step(2)
    assert not stats.skipped and bool(torch.isfinite(opt.exp_avg_sq).all())
