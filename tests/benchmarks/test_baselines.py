"""The overhead benchmark's baseline checkpointers save what they claim, on a tiny model."""
from __future__ import annotations

import os

import pytest
import torch

from benchmarks.baselines import (
    TRACKER,
    DcpAsyncSave,
    InMemoryEveryStep,
    SnapshotThenPersist,
    SyncTorchSave,
    full_state,
    iter_dir,
    rank_file,
    tensor_bytes,
)
from megatier.training.trainer import Trainer


class Recorder:
    """Wraps a baseline and keeps a clone of the full state at every step the baseline checkpoints."""

    def __init__(self, inner, state):
        self.inner, self.trainer = inner, state
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self.records: list[dict] = []

    def restore(self) -> tuple[int, None]:
        return self.inner.restore()

    def after_step(self, step: int) -> dict:
        out = self.inner.after_step(step)
        self.records.append(out)
        if out["ckpt_bytes"]:
            state = full_state(self.trainer.optimizer, self.trainer.model)
            self.states[step] = {k: v.clone() for k, v in state.items()}
            self.states[step]["adam_steps"] = self.trainer.optimizer.adam_steps
        return out

    def close(self, *, failed: bool = False) -> None:
        self.inner.close(failed=failed)


def _train(tiny_config, make):
    trainer = Trainer(tiny_config("train.iters=10", "train.eval_iters=0"),
                      checkpointer=lambda state: Recorder(make(state), state))
    rec = trainer.checkpointer
    trainer.train()
    return trainer, rec.inner, rec


def _expected_bytes(trainer) -> int:
    o = trainer.optimizer
    params = {p.data_ptr(): p.numel() * p.element_size() for p in trainer.model.parameters()}
    return sum(params.values()) + 3 * o.master.numel() * 4


def _check_torch_file(path: str, step: int, expected: dict) -> None:
    obj = torch.load(path, weights_only=True)
    assert obj["step"] == step and obj["adam_steps"] == expected["adam_steps"]
    for k in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(obj["optimizer"][k], expected[f"optim/{k}"]), k
    model = {k[len("model/"):]: v for k, v in expected.items() if k.startswith("model/")}
    assert obj["model"].keys() == model.keys()
    for k, v in model.items():
        assert torch.equal(obj["model"][k], v), k


def test_sync_torch_save(tiny_config, tmp_path):
    trainer, b, rec = _train(tiny_config, lambda t: SyncTorchSave(t.optimizer, t.model, str(tmp_path / "ckpt"), 4,
                                                                  rank=t.ps.rank, group=t.ps.checkpoint_group))
    trainer.close()
    assert b.checkpoints == [4, 8] and sorted(rec.states) == [4, 8]
    for step in (4, 8):
        _check_torch_file(rank_file(str(tmp_path / "ckpt"), step, 0), step, rec.states[step])
    assert (tmp_path / "ckpt" / TRACKER).read_text() == "8"
    assert not [f for f in os.listdir(iter_dir(str(tmp_path / "ckpt"), 8)) if ".tmp" in f]
    assert b.bytes_per_checkpoint == _expected_bytes(trainer)
    assert b.disk_bytes_per_checkpoint >= b.bytes_per_checkpoint
    assert [r["ckpt_bytes"] for r in rec.records] == [0, 0, 0, b.bytes_per_checkpoint] * 2 + [0, 0]


def test_snapshot_then_persist(tiny_config, tmp_path):
    trainer, b, rec = _train(tiny_config, lambda t: SnapshotThenPersist(t.optimizer, t.model, str(tmp_path / "ckpt"),
                                                                        3, rank=t.ps.rank))
    trainer.close()  # waits for the last persist
    assert b.checkpoints == [3, 6, 9]
    for step in (3, 6, 9):
        # The file holds the snapshot of its step, not the state training moved on to.
        _check_torch_file(rank_file(str(tmp_path / "ckpt"), step, 0), step, rec.states[step])
    assert not torch.equal(rec.states[9]["optim/master"], trainer.optimizer.master)
    assert b.bytes_per_checkpoint == _expected_bytes(trainer)
    assert len(b.disk_bytes) == 3 and b.disk_bytes_per_checkpoint >= b.bytes_per_checkpoint


def test_in_memory_every_step(tiny_config):
    trainer, b, rec = _train(tiny_config, lambda t: InMemoryEveryStep(t.optimizer, t.model))
    assert b.checkpoints == list(range(1, 11)) and b.version == {"step": 10, "adam_steps": trainer.optimizer.adam_steps}
    live = full_state(trainer.optimizer, trainer.model)
    assert b.buffers.keys() == live.keys()
    for k, v in live.items():
        assert torch.equal(b.buffers[k], v), k
        assert b.buffers[k].data_ptr() != v.data_ptr()  # a copy, not a view
    assert b.bytes_per_checkpoint == tensor_bytes(live) == _expected_bytes(trainer)
    assert all(r["ckpt_bytes"] == b.bytes_per_checkpoint for r in rec.records)
    trainer.close()


def test_dcp_async_save(tiny_config, tmp_path):
    import torch.distributed.checkpoint as dcp

    root = str(tmp_path / "dcp")
    trainer, b, rec = _train(tiny_config, lambda t: DcpAsyncSave(
        t.optimizer, t.model, root, 5, rank=t.ps.rank, process_group=t.ps.checkpoint_group,
        coords=(t.ps.pp_rank, t.ps.tp_rank, t.ps.dp_rank)))
    b.close()
    assert b.checkpoints == [5, 10]
    for step in (5, 10):
        expected = rec.states[step]
        target = {k: torch.empty_like(v) for k, v in b.keyed.items()}
        target.update(step=-1, adam_steps=-1)
        dcp.load(target, checkpoint_id=iter_dir(root, step), process_group=trainer.ps.checkpoint_group)
        assert target["step"] == step and target["adam_steps"] == expected["adam_steps"]
        assert torch.equal(target["optim.pp0.tp0.dp0.master"], expected["optim/master"])
        assert torch.equal(target["optim.pp0.tp0.dp0.exp_avg_sq"], expected["optim/exp_avg_sq"])
        for k, v in expected.items():
            if k.startswith("model/"):
                assert torch.equal(target[f"model.pp0.tp0.{k[len('model/'):]}"], v), k
    assert b.bytes_per_checkpoint == _expected_bytes(trainer)
    assert len(b.disk_bytes) == 2 and b.disk_bytes_per_checkpoint >= b.bytes_per_checkpoint
    trainer.close()


def test_interval_must_be_positive(tiny_config, tmp_path):
    trainer = Trainer(tiny_config())
    with pytest.raises(ValueError, match="interval"):
        SyncTorchSave(trainer.optimizer, trainer.model, str(tmp_path), 0)
    trainer.close()
