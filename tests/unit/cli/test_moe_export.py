"""A model=tiny_moe job trained with checkpoints exports (megatier-convert export) to a MixtralForCausalLM
directory that transformers loads and that computes the trained model's logits; its step records carry the
router figures."""
from __future__ import annotations

import json

import pytest
import torch

from megatier.cli import convert

pytestmark = pytest.mark.timeout(120)


def test_a_moe_job_exports_a_mixtral_transformers_computes(tiny_config, tmp_path, capsys):
    from megatier.training.trainer import Trainer

    transformers = pytest.importorskip("transformers")
    cfg = tiny_config("model=tiny_moe", "checkpoint=tiered", "checkpoint.tiers=[local]", "train.iters=6",
                      f"checkpoint.local.root={tmp_path}/shm", "checkpoint.job_id=moejob")
    trainer = Trainer(cfg)
    trainer.train()
    summary = trainer.close()
    capsys.readouterr()
    assert convert.main(["export", "--job-id", "moejob", "--local-root", f"{tmp_path}/shm", "--tier", "tier1",
                         str(tmp_path / "hf")]) == 0
    assert f"canonical_digest: {summary['canonical_digest']}" in capsys.readouterr().out
    theirs = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert theirs.config.num_local_experts == 4 and theirs.config.router_aux_loss_coef == 0.02
    vocab = theirs.config.vocab_size
    tokens = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = trainer.model.eval()(tokens)[..., :vocab]
        assert (ours - theirs(tokens).logits).abs().max() <= 1e-4
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        steps = [r for r in map(json.loads, f) if "event" not in r and "loss" in r]
    assert steps and all(r["moe_dropped_tokens"] == 0 and r["moe_tokens_per_expert_max"] > 0 for r in steps)
