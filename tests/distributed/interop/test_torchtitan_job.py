"""A torchtitan job continued by MegaTier at tp=2 (model.init_from=torchtitan:<folder>): MegaTier's next step is
the step torchtitan's model and AdamW take on the same batch, and its state exports back to torchtitan."""
from __future__ import annotations

import os

import pytest
import torch

from megatier.config import ModelConfig, OptimConfig
from megatier.interop.job_state import JobState
from megatier.interop.torchtitan_dcp import export_torchtitan, load_torchtitan
from megatier.optim.canonical import ShardState, assemble, shard_pieces
from megatier.training.trainer import Trainer
from tests.distributed.configs import tiny_job
from tests.distributed.world import run_world
from tests.torchtitan_llama import build_job, import_torchtitan, train_step

import_torchtitan()

VOCAB = 257  # the byte corpus
FIELDS = dict(name="tt2", arch="llama", num_layers=2, hidden_size=32, num_heads=4, num_query_groups=2,
              max_position_embeddings=32, make_vocab_size_divisible_by=128)
OPTIM = dict(lr=1e-3, warmup_iters=0, decay_style="constant", weight_decay=0.1, clip_grad=0.0)


def _worker(rank: int, tmp: str, prefix: str, ckpt: str) -> dict:
    model = ModelConfig(**FIELDS, init_from=f"torchtitan:{ckpt}")
    cfg = tiny_job(tmp, "tt-import", prefix, iters=3, tp=2, model=model, optim=OPTIM, checkpoint={},
                   train={"global_batch_size": 4})
    trainer = Trainer(cfg)
    trainer.train()
    o, ps = trainer.optimizer, trainer.ps
    out = {"step": trainer.step, "loss": trainer.last_record["loss"], "batches": trainer.batches.train_microbatches(3),
           "shard": ShardState(ps.tp_rank, ps.tp, o.shard_segments,
                               {k: getattr(o, k).detach().clone() for k in ("master", "exp_avg", "exp_avg_sq")}),
           "adam_steps": o.adam_steps}
    trainer.close()
    return out


def _titan_source(folder: str, m: ModelConfig, o: OptimConfig) -> str:
    job = build_job(m, VOCAB, o, folder)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        tokens = torch.randint(0, VOCAB, (4, 33), generator=g)
        train_step(job, tokens[:, :-1], tokens[:, 1:])
    job.checkpointer.save(curr_step=2)
    return os.path.join(folder, "ckpt")


@pytest.mark.timeout(240)
def test_tp2_continues_a_torchtitan_job_with_its_next_step(corpus_prefix, tmp_path):
    m, o = ModelConfig(**FIELDS), OptimConfig(**OPTIM)
    ckpt = _titan_source(str(tmp_path / "titan"), m, o)
    results = run_world(_worker, 2, tmp_path, str(tmp_path), corpus_prefix, ckpt, timeout_s=180)
    assert [r["step"] for r in results] == [3, 3] and results[0]["adam_steps"] == 3
    ours = assemble([p for r in results for p in shard_pieces(r["shard"])])

    # torchtitan's own step 3 on MegaTier's batch, from the same checkpoint.
    ref = build_job(m, VOCAB, o, str(tmp_path / "titan"), seed=9)
    assert ref.checkpointer.load(step=2)
    tokens = torch.cat([x for x, _ in results[0]["batches"]])
    labels = torch.cat([y for _, y in results[0]["batches"]])
    loss = train_step(ref, tokens, labels)
    assert results[0]["loss"] == pytest.approx(loss, rel=0, abs=1e-5)
    ref.checkpointer.save(curr_step=3)
    theirs = load_torchtitan(os.path.join(str(tmp_path / "titan"), "ckpt"), m, VOCAB, o).canonical
    for name, kinds in theirs.items():
        for kind, value in kinds.items():
            diff = (ours[name][kind] - value).abs().max().item()
            assert diff <= 1e-5 * max(1.0, value.abs().max().item()), (name, kind, diff)

    # MegaTier's state at step 3 exported: torchtitan's CheckpointManager loads it bitwise.
    job = JobState(ours, 3, 3, consumed_tokens=3 * 4 * 32)
    where = export_torchtitan(job, m, o, str(tmp_path / "export"), lr=o.lr)
    back = build_job(m, VOCAB, o, str(tmp_path / "export"), seed=11)
    back.checkpointer.folder, back.checkpointer.exclude_from_loading = os.path.dirname(where), ["dataloader"]
    assert back.checkpointer.load(step=3)
    again = load_torchtitan(os.path.dirname(where), m, VOCAB, o).canonical
    for name, kinds in again.items():
        for kind, value in kinds.items():
            assert torch.equal(value, ours[name][kind]), (name, kind)
    qkv = back.model.layers["0"].attention.qkv_linear.wqkv.weight
    state = back.optimizers.optimizers[0].state[qkv]
    assert int(state["step"]) == 3 and state["exp_avg"].abs().sum() > 0
