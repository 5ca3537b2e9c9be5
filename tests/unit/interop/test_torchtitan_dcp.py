"""torchtitan DCP checkpoints <-> a MegaTier job state: torchtitan's own CheckpointManager writes and reads them."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatier.config import ModelConfig, OptimConfig
from megatier.interop.job_state import JobFormatError, split_init_from
from megatier.interop.torchtitan_dcp import export_torchtitan, load_torchtitan, read_dcp, to_halves, to_pairs
from tests.torchtitan_llama import build_job, import_torchtitan, train_step

import_torchtitan()

VOCAB = 64
MODEL = ModelConfig(name="tt", arch="llama", num_layers=2, hidden_size=32, num_heads=4, num_query_groups=2,
                    max_position_embeddings=32)
OPTIM = OptimConfig(lr=1e-3, warmup_iters=0, decay_style="constant", weight_decay=0.1, clip_grad=0.0)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, 16), generator=g), torch.randint(0, VOCAB, (2, 16), generator=g)


@pytest.fixture(scope="module")
def titan_ckpt(tmp_path_factory) -> str:
    """A torchtitan job after two steps, saved by its CheckpointManager at step-2."""
    folder = str(tmp_path_factory.mktemp("titan"))
    job = build_job(MODEL, VOCAB, OPTIM, folder)
    for seed in (1, 2):
        train_step(job, *_batch(seed))
    job.checkpointer.save(curr_step=2)
    return os.path.join(folder, "ckpt")


def test_init_from_names_a_format_by_its_prefix():
    assert split_init_from("torchtitan:/a/b") == ("torchtitan", "/a/b")
    assert split_init_from("/a/hf") == (None, "/a/hf")
    assert split_init_from("hub:/x") == (None, "hub:/x")


def test_rotary_row_order_is_a_permutation_and_its_inverse():
    w = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)
    assert torch.equal(to_pairs(to_halves(w, 2), 2), w)
    assert sorted(to_halves(w, 2)[:, 0].tolist()) == w[:, 0].tolist()


def test_import_reads_step_moments_and_data_position(titan_ckpt):
    job = load_torchtitan(titan_ckpt, MODEL, VOCAB, OPTIM)
    assert (job.iteration, job.adam_steps, job.consumed_tokens) == (2, 2, 2 * 2 * 16)
    assert job.next_lr == pytest.approx(OPTIM.lr)
    kv = job.canonical["layers.0.attn.kv.weight"]
    assert kv["master"].shape == (32, 32) and kv["exp_avg_sq"].min() >= 0 and kv["exp_avg"].abs().sum() > 0
    assert any("dataloader" in line for line in job.notes)


def test_round_trip_through_megatier_is_bitwise(titan_ckpt, tmp_path):
    job = load_torchtitan(titan_ckpt, MODEL, VOCAB, OPTIM)
    where = export_torchtitan(job, MODEL, OPTIM, str(tmp_path), lr=OPTIM.lr)
    src, out = read_dcp(os.path.join(titan_ckpt, "step-2")), read_dcp(where)
    tensors = [k for k, v in src.items() if isinstance(v, torch.Tensor)]
    assert len(tensors) == 21 + 17 * 3  # model keys split q, k, v; the optimizer keeps them fused
    for key in tensors:
        assert out[key].dtype == src[key].dtype and torch.equal(out[key], src[key]), key
    for key in ("train_state.step", "train_state.ntokens_seen", "lr_scheduler.last_epoch"):
        assert out[key] == src[key], key


def test_torchtitan_loads_the_export_and_takes_the_same_step(titan_ckpt, tmp_path):
    """The export, loaded by torchtitan's CheckpointManager, continues exactly as the source job does."""
    where = export_torchtitan(load_torchtitan(titan_ckpt, MODEL, VOCAB, OPTIM), MODEL, OPTIM,
                              str(tmp_path / "out"), lr=OPTIM.lr)
    src = build_job(MODEL, VOCAB, OPTIM, os.path.dirname(titan_ckpt), seed=7)
    assert src.checkpointer.load(step=2)
    dst = build_job(MODEL, VOCAB, OPTIM, str(tmp_path / "out"), seed=8)
    dst.checkpointer.folder = os.path.dirname(where)
    dst.checkpointer.exclude_from_loading = ["dataloader"]  # the export has no torchtitan data loader state
    assert dst.checkpointer.load(step=2)
    assert dst.train_state.step == 2 and dst.schedulers.schedulers[0].last_epoch == 2
    losses = [train_step(job, *_batch(3)) for job in (src, dst)]
    assert losses[0] == losses[1]
    for (name, a), b in zip(src.model.named_parameters(), dst.model.parameters()):
        assert torch.equal(a, b), name
    sa, sb = src.optimizers.state_dict(), dst.optimizers.state_dict()
    assert sa.keys() == sb.keys()
    for key, value in sa.items():
        if key.endswith((".fused", ".foreach")):  # the kernel choice: an export leaves it to the loader (None)
            continue
        assert (torch.equal(value, sb[key]) if isinstance(value, torch.Tensor) else value == sb[key]), key


def test_a_block_megatier_lacks_is_refused_naming_its_key(titan_ckpt):
    wider = ModelConfig(**{**MODEL.__dict__, "num_layers": 1})
    with pytest.raises(JobFormatError, match=r"layers\.1\.attention"):
        load_torchtitan(titan_ckpt, wider, VOCAB, OPTIM)
    with pytest.raises(JobFormatError, match="model.arch=gpt2"):
        load_torchtitan(titan_ckpt, ModelConfig(name="g"), VOCAB, OPTIM)
    with pytest.raises(JobFormatError, match="step-N"):
        load_torchtitan(os.path.dirname(titan_ckpt), MODEL, VOCAB, OPTIM)


def test_the_schedule_position_and_base_rate_are_checked_and_the_dataloader_named(titan_ckpt, tmp_path):
    job = load_torchtitan(titan_ckpt, MODEL, VOCAB, OPTIM)
    assert not any(line.startswith("learning rate") for line in job.notes)
    assert any("no dataloader state saved" in line for line in job.notes)
    other = load_torchtitan(titan_ckpt, MODEL, VOCAB, OptimConfig(**{**OPTIM.__dict__, "lr": 2e-3}))
    assert any("optimizer.param_groups." in line and ".initial_lr=0.001" in line for line in other.notes)

    flat = read_dcp(os.path.join(titan_ckpt, "step-2"))
    flat["lr_scheduler.last_epoch"], flat["dataloader.dp_rank_0"] = 5, b"loader"
    moved = tmp_path / "moved"
    dcp.save(flat, checkpoint_id=str(moved), no_dist=True)
    notes = load_torchtitan(str(moved), MODEL, VOCAB, OPTIM).notes
    assert any("lr_scheduler.last_epoch=5 is not train_state.step=2" in line for line in notes)
    assert any(line.startswith("not carried: dataloader.dp_rank_0") for line in notes)

    key = "optimizer.param_groups.norm.weight.initial_lr"
    flat[key] = 5e-4
    dcp.save(flat, checkpoint_id=str(tmp_path / "groups"), no_dist=True)
    with pytest.raises(JobFormatError, match=r"norm\.weight\.initial_lr=0\.0005 but .*one optim\.lr"):
        load_torchtitan(str(tmp_path / "groups"), MODEL, VOCAB, OPTIM)
