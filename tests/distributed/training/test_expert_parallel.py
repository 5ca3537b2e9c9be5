"""Expert parallelism (parallel.ep): a tiny mixture of experts at ep=2 trains bitwise as at ep=1, and its
checkpoints restore across ep by canonical names.

Training: dp=2, one micro-batch per rank per step, fp32. Each expert then sees, per source rank, exactly the rows
it sees at ep=1 (megatier.parallel.expert_dispatch), its weight gradient is the sum of the two ranks' parts
either way (one addition, which commutes), and the halving by dp is exact, so losses and the canonical digest
of the state (master weights and both Adam moments) are equal bit for bit. With two micro-batches per rank the
sums would group differently ((m1 r0 + m1 r1) + (m2 r0 + m2 r1) against (m1 r0 + m2 r0) + (m1 r1 + m2 r1)).

Checkpoints: a rank's shard holds the same canonical elements under every ep that divides dp (FlatLayout), so
an ep=2 job's checkpoint restores at ep=1 on the same world, and at ep=1 on one process through the resharding
restore, and an ep=1 job's at ep=2, each with the digest the writing job had; an ep=4 job of four ranks restores
at ep=2 on two. An ep=2 job's checkpoint exports to a Mixtral whose logits in transformers are the job's own.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatier.cli import convert
from megatier.training.trainer import Trainer
from tests.distributed.configs import tiny_job
from tests.distributed.world import run_world

pytestmark = pytest.mark.timeout(240)
STEPS = 3
MODEL = dict(name="tiny_moe", arch="llama", num_layers=2, hidden_size=32, num_heads=4, num_query_groups=2,
             ffn_hidden_size=64, max_position_embeddings=32,
             moe={"num_experts": 4, "top_k": 2, "moe_ffn_hidden_size": 32, "aux_loss_coeff": 0.02})


def _config(tmp: str, prefix: str, run: str, *, ep: int, tp: int = 1, recompute: str = "none",
            iters: int = STEPS, micro: int = 2, checkpoint: dict | None = None):
    cfg = tiny_job(tmp, "epjob", prefix, iters=iters, tp=tp, sequence_parallel=tp > 1, run=run,
                   model={**MODEL, "recompute": recompute}, train={"global_batch_size": 4, "micro_batch_size": micro},
                   checkpoint=checkpoint)
    cfg.parallel.ep = ep
    return cfg


def _train(rank: int, tmp: str, prefix: str, ep: int, tp: int, recompute: str) -> dict:
    trainer = Trainer(_config(tmp, prefix, f"run-ep{ep}", ep=ep, tp=tp, recompute=recompute))
    experts = sorted({int(n.split(".")[4]) for n, _ in trainer.model.named_parameters() if ".experts." in n})
    losses = []
    for step in range(1, STEPS + 1):
        losses.append(trainer.train_step(step)["loss"])
        trainer.step = step
    out = {"losses": losses, "digest": trainer.canonical_digest(), "experts": experts}
    trainer.close()
    return out


@pytest.mark.parametrize("tp,recompute", [(1, "none"), pytest.param(2, "full", marks=pytest.mark.slow)])
def test_ep2_trains_bitwise_as_ep1(tp, recompute, corpus_prefix, tmp_path):
    """tp=2 adds sequence parallelism (the experts' tokens gathered over tp first) and full recomputation (each
    block's all-to-alls run again in the backward)."""
    ep1 = run_world(_train, 2 * tp, tmp_path, str(tmp_path), corpus_prefix, 1, tp, recompute, timeout_s=180)
    ep2 = run_world(_train, 2 * tp, tmp_path, str(tmp_path), corpus_prefix, 2, tp, recompute, timeout_s=180)
    assert all(r["experts"] == [0, 1, 2, 3] for r in ep1)
    assert [r["experts"] for r in ep2] == [[0, 1]] * tp + [[2, 3]] * tp  # dp rank 0 holds 0 and 1 on each tp rank
    assert ep2[0]["losses"] == ep1[0]["losses"]
    assert {r["digest"] for r in ep1 + ep2} == {ep1[0]["digest"]}


# Bases at 0 and 2, none at the end: the restore replays step 3's diff.
CHECKPOINT = {"base_interval": 2, "capture_steps": 1, "final_base": False}
# The export's test input: byte tokens, as many positions as the model has.
TOKENS = torch.randint(0, 256, (2, MODEL["max_position_embeddings"]), generator=torch.Generator().manual_seed(0))


def _write(rank: int, tmp: str, prefix: str, ep: int, micro: int) -> dict:
    trainer = Trainer(_config(tmp, prefix, "old", ep=ep, micro=micro, checkpoint=CHECKPOINT))
    trainer.train()
    digest = trainer.canonical_digest()
    with torch.no_grad():  # every rank the same tokens: the all-to-alls serve each its own
        logits = trainer.model.eval()(TOKENS)
    trainer.close()
    return {"digest": digest, "logits": logits}


def _restore(rank: int, tmp: str, prefix: str, ep: int, micro: int) -> tuple[int, str]:
    trainer = Trainer(_config(tmp, prefix, f"new-ep{ep}", ep=ep, micro=micro, checkpoint=CHECKPOINT))
    trainer.restore()
    out = trainer.step, trainer.canonical_digest()
    trainer.close()
    return out


@pytest.fixture(scope="module")
def ep2_job(corpus_prefix, tmp_path_factory) -> tuple[str, list[dict]]:
    """An ep=2 x dp=2 job's checkpoints (directory) and, per rank, its final digest and logits of TOKENS."""
    tmp_path = tmp_path_factory.mktemp("ep2job")
    written = run_world(_write, 2, tmp_path, str(tmp_path), corpus_prefix, 2, 2, timeout_s=180)
    assert len({r["digest"] for r in written}) == 1
    return str(tmp_path), written


def test_an_ep2_checkpoint_restores_at_ep1_on_two_ranks_and_on_one(corpus_prefix, ep2_job):
    tmp, written = ep2_job
    for world in (2, 1):  # the same (tp, pp, dp), then resharded to dp=1
        restored = run_world(_restore, world, Path(tmp), tmp, corpus_prefix, 1, 2, timeout_s=180)
        assert restored == [(STEPS, written[0]["digest"])] * world, world


def test_an_ep2_job_exports_a_mixtral_transformers_computes(ep2_job, capsys):
    """megatier-convert export gathers both ranks' experts by canonical name: transformers' logits equal the ep=2
    job's own (computed with the experts on two ranks) within 1e-4, and the export's digest is the job's."""
    transformers = pytest.importorskip("transformers")
    tmp, written = ep2_job
    out = Path(tmp, "hf")
    assert convert.main(["export", "--job-id", "epjob", "--local-root", f"{tmp}/shm", "--remote-url",
                         f"{tmp}/remote", str(out)]) == 0
    assert f"canonical_digest: {written[0]['digest']}" in capsys.readouterr().out
    theirs = transformers.MixtralForCausalLM.from_pretrained(out).eval()
    assert theirs.config.num_local_experts == MODEL["moe"]["num_experts"]
    with torch.no_grad():
        want = theirs(TOKENS).logits
    for r in written:
        assert (r["logits"][..., :want.shape[-1]] - want).abs().max() <= 1e-4


@pytest.mark.slow
def test_an_ep1_checkpoint_restores_at_ep2(corpus_prefix, tmp_path):
    tmp = str(tmp_path)
    written = run_world(_write, 2, tmp_path, tmp, corpus_prefix, 1, 2, timeout_s=180)
    restored = run_world(_restore, 2, tmp_path, tmp, corpus_prefix, 2, 2, timeout_s=180)
    assert restored == [(STEPS, written[0]["digest"])] * 2


@pytest.mark.slow
def test_an_ep4_checkpoint_of_four_ranks_restores_at_ep2_on_two(corpus_prefix, tmp_path):
    """ep=4 x dp=4 (one expert a rank) to ep=2 x dp=2 (two a rank): the resharding restore regroups the experts
    by canonical name and the state keeps the writing job's digest. One sample a micro-batch, so 4 samples fill
    dp=4."""
    tmp = str(tmp_path)
    written = run_world(_write, 4, tmp_path, tmp, corpus_prefix, 4, 1, timeout_s=180)
    assert len({r["digest"] for r in written}) == 1
    restored = run_world(_restore, 2, tmp_path, tmp, corpus_prefix, 2, 1, timeout_s=180)
    assert restored == [(STEPS, written[0]["digest"])] * 2
