"""A step as operations: the events module hooks emit, the profile they give, and scheduled copies."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from megatier.checkpoint.save.schedule import CaptureSchedule, Chunk
from megatier.checkpoint.save.step_ops import Copier, Profiler, ScheduledCopy, StepOps, copy_bandwidth, leaf_modules
from tests.unit.checkpoint.memory import step, tiny_shard

pytestmark = pytest.mark.timeout(60)


class _Recorder:
    def __init__(self):
        self.events, self.updates = [], 0

    def on_event(self, index, name, delta_bytes):
        self.events.append((index, name, delta_bytes))

    def on_update(self):
        self.updates += 1


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.0), nn.Linear(64, 8))


def _forward_backward(model: nn.Module) -> None:
    model(torch.randn(16, 64)).square().sum().backward()


def test_events_are_each_leaf_forward_then_each_backward_numbered_from_zero_every_step():
    model, (opt, _) = _model(), tiny_shard()
    ops = StepOps(model, opt)
    assert [name for name, _ in leaf_modules(model)] == ["0", "1", "2", "3"]
    ops.listener = recorder = _Recorder()
    for s in (1, 2):
        _forward_backward(model)
        step(opt, s)  # the update closes the step
    names = [n for _, n, _ in recorder.events]
    # Dropout(0) hands back its input: no op of its own. Backward starts at the last module.
    assert names == ["fwd 0", "fwd 1", "fwd 3", "bwd 3", "bwd 1", "bwd 0"] * 2
    assert [i for i, _, _ in recorder.events] == list(range(6)) * 2 and recorder.updates == 2
    # Bytes come back: every output counted at its forward is returned at its backward.
    assert sum(d for _, _, d in recorder.events[:6]) == 0 and recorder.events[0][2] == 16 * 64 * 4
    with torch.no_grad():  # evaluation: no events
        model(torch.randn(4, 64))
    model.eval()
    _forward_backward(model)
    assert len(recorder.events) == 12
    ops.close()


def test_the_profiler_gives_one_op_per_event_with_its_duration_and_live_bytes():
    model, (opt, _) = _model(), tiny_shard()
    ops = StepOps(model, opt)
    ops.listener = profiler = Profiler(torch.device("cpu"))
    _forward_backward(model)
    step(opt, 1)
    p = profiler.profile
    assert p is not None and len(p.names) == 6 and all(s > 0 for s in p.seconds)
    assert p.live_bytes[2] == p.peak_bytes == 16 * 64 * 4 * 2 + 16 * 8 * 4  # the end of the forward
    assert p.live_bytes[-1] < p.peak_bytes


def _schedule(numel: int, ops: list[int]) -> CaptureSchedule:
    bounds = [(numel * j // len(ops), numel * (j + 1) // len(ops)) for j in range(len(ops))]
    return CaptureSchedule(tuple(Chunk(a, b) for a, b in bounds), tuple(ops), 0, 0, 0, 0.0)


@pytest.mark.parametrize("ops", [[0, 3], [4, 99]], ids=["at-their-ops", "one-op-never-comes"])
def test_scheduled_copies_hold_the_state_before_the_update(ops):
    model, (opt, _) = _model(), tiny_shard()
    step(opt, 1)
    before = {k: getattr(opt, k).clone() for k in ("master", "exp_avg", "exp_avg_sq")}
    steps_ops, copier = StepOps(model, opt), Copier(torch.device("cpu"))
    lo, hi = 5, 30
    copy = ScheduledCopy({k: getattr(opt, k)[lo:hi] for k in before}, _schedule(hi - lo, ops), copier)
    steps_ops.listener = copy
    _forward_backward(model)
    assert not copy.done
    step(opt, 2)  # the update waits for every chunk, whether its op came or not
    assert copy.done
    for kind, want in before.items():
        assert torch.equal(copy.destination[kind], want[lo:hi]), kind
        assert not torch.equal(getattr(opt, kind)[lo:hi], want[lo:hi])  # and the state did move on
    copier.close()


def test_copy_bandwidth_is_measured():
    copier = Copier(torch.device("cpu"))
    assert copier.call(lambda: copy_bandwidth(copier, nbytes=1 << 20)).result() > 1e7  # 10 MB/s: any machine does more
    copier.close()


def test_a_held_copier_starts_nothing_until_released():
    copier, ran = Copier(torch.device("cpu")), []
    copier.hold()
    first = copier.call(lambda: ran.append(1) or "first")
    src, dst = torch.arange(8.0), torch.zeros(8)
    copier.submit([(src, dst)])
    failing = copier.call(lambda: 1 / 0)
    assert not first.done() and ran == [] and not torch.equal(dst, src)
    copier.release()
    assert first.result(timeout=10) == "first" and ran == [1]
    with pytest.raises(ZeroDivisionError):
        failing.result(timeout=10)
    with pytest.raises(ZeroDivisionError):  # as from a call given unheld
        copier.wait()
    assert torch.equal(dst, src)
    copier.hold()  # wait() starts what is held before waiting for it
    late = copier.call(lambda: "late")
    copier.wait()
    assert late.result(timeout=0) == "late"
    copier.close()
