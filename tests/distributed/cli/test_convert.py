"""megatier-convert export on the units of real runs: transformers computes MegaTier's model, every layout exports
the same bytes, a lossy export is what a restore installs, and import then export gives back the imported weights.

A tiny GPT (3 layers, so pp=2 splits it 2 + 1) trains E=8 steps at tp=1 with lossless diffs (bases at 0 and
6, batches of 2: the newest point replays v6 -> 8). Relaunching the same job on tp=2 or pp=2 with nothing left
to train reshards it at restore and writes a base at E in the new layout; exporting --step E then reads only
the new layout's units.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatier.cli import convert
from megatier.config import (
    Config,
    ModelConfig,
)
from megatier.interop.gpt2 import load_gpt2
from megatier.model.gpt import GPTStage, load_full_state
from megatier.model.params import StageSpec
from megatier.optim.canonical import ShardState, assemble, shard_pieces
from megatier.training.trainer import Trainer
from tests.distributed.configs import tiny_job
from tests.distributed.world import run_world
from tests.hf_gpt2 import save_random_gpt2

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(120)

JOB, E, VOCAB = "exportjob", 8, 257  # the byte corpus: 257 ids, padded to 384 rows at tp=1 and 512 at tp=2
MODEL = ModelConfig(name="tiny3", num_layers=3, hidden_size=32, num_heads=4, max_position_embeddings=32,
                    make_vocab_size_divisible_by=128)


def _config(prefix: str, tmp: str, run: str, degrees, iters: int, model: ModelConfig, codec: str) -> Config:
    tp, pp, _ = degrees
    # No final base: these exports replay the chain from base 6 (a final base would be the state itself).
    return tiny_job(tmp, JOB, prefix, iters=iters, tp=tp, pp=pp, run=run, model=model,
                    checkpoint={"final_base": False, "diff": {"compression": codec}})

def _run(rank: int, prefix: str, tmp: str, degrees, iters: int, model: ModelConfig = MODEL,
         codec: str = "fp32") -> dict:
    """Train (or, relaunched with nothing left to train, restore and re-base) and return this rank's shard."""
    os.environ.update(MEGATIER_NODE_NAME="node0")
    trainer = Trainer(_config(prefix, tmp, f"run-{degrees}", degrees, iters, model, codec))
    trainer.train()
    o, ps = trainer.optimizer, trainer.ps
    shard = ShardState(ps.tp_rank, ps.tp, o.shard_segments, {k: v.clone() for k, v in o.state_tensors().items()})
    return {"shard": shard, "digest": trainer.close()["canonical_digest"]}


def _export(tmp: Path, out: str, capsys, *extra: str) -> list[str]:
    code = convert.main(["export", "--job-id", JOB, "--local-root", str(tmp / "shm"), "--remote-url",
                         str(tmp / "remote"), str(tmp / out), *extra])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out.splitlines()


def _greedy(next_logits, prompt: torch.Tensor, n: int = 20) -> torch.Tensor:
    tokens = prompt
    for _ in range(n):
        tokens = torch.cat([tokens, next_logits(tokens).argmax(-1, keepdim=True)], dim=1)
    return tokens[:, prompt.shape[1]:]


@pytest.fixture(scope="module")
def trained(corpus_prefix, tmp_path_factory) -> dict:
    """The tp=1 run to E: its tiers' root, its canonical state and digest at E."""
    tmp = tmp_path_factory.mktemp("tp1")
    results = run_world(_run, 1, tmp, corpus_prefix, str(tmp), (1, 1, 1), E, timeout_s=90)
    canonical = assemble(shard_pieces(results[0]["shard"]))
    return {"tmp": tmp, "canonical": canonical, "digest": results[0]["digest"]}


def _copy_tiers(src: Path, dst: Path) -> None:
    for tier in ("shm", "remote"):
        shutil.copytree(src / tier, dst / tier)


@torch.no_grad()
def test_export_after_a_tp1_run_computes_megatiers_logits(trained, corpus_prefix, process_group, tmp_path, capsys):
    _copy_tiers(trained["tmp"], tmp_path)
    lines = _export(tmp_path, "hf", capsys, "--data-prefix", corpus_prefix)
    assert lines[0].startswith(f"point: job '{JOB}' step {E} from base v6 (1 diff unit replayed per rank), "
                               f"written by tp=1 pp=1 dp=1 (1 rank)")
    assert "tokenizer: byte of the run's data" in lines[-3]
    assert lines[-1].startswith(f"canonical_digest: {trained['digest']} ")
    masters = {name: kinds["master"] for name, kinds in trained["canonical"].items()}
    exported = load_gpt2(str(tmp_path / "hf"), MODEL, VOCAB)
    assert all(torch.equal(exported[n], masters[n]) for n in masters), "the export is not the state at E"

    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    assert theirs.config.vocab_size == VOCAB and theirs.config.eos_token_id == 256
    ours = GPTStage(MODEL, VOCAB, StageSpec(range(MODEL.num_layers), True, True), tp_group=process_group.tp_group,
                    dropout_generator=torch.Generator())
    load_full_state(ours, masters)
    tokens = torch.randint(0, VOCAB, (3, MODEL.max_position_embeddings), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(theirs(tokens).logits, ours.eval()(tokens)[..., :VOCAB], rtol=0.0, atol=1e-4)
    prompt = tokens[:, :8]
    assert torch.equal(_greedy(lambda t: ours(t)[:, -1, :VOCAB], prompt), _greedy(lambda t: theirs(t).logits[:, -1],
                                                                                  prompt))


@pytest.mark.slow
def test_exports_from_tp2_and_pp2_relaunches_are_bitwise_the_tp1_export(trained, corpus_prefix, tmp_path, capsys):
    exports = {}
    for degrees in ((1, 1, 1), (2, 1, 1), (1, 2, 1)):
        tmp = tmp_path / f"layout{''.join(map(str, degrees))}"
        _copy_tiers(trained["tmp"], tmp)
        if degrees != (1, 1, 1):
            after = run_world(_run, 2, tmp, corpus_prefix, str(tmp), degrees, E, timeout_s=90)
            assert after[0]["digest"] == trained["digest"]
        lines = _export(tmp, "hf", capsys, "--step", str(E))
        written = "tp={} pp={} dp={}".format(*degrees)
        assert f"written by {written}" in lines[0], lines[0]
        assert lines[-1].startswith(f"canonical_digest: {trained['digest']} ")
        exports[degrees] = load_file(tmp / "hf" / "model.safetensors")
    want = exports[(1, 1, 1)]
    for degrees, got in exports.items():
        assert got.keys() == want.keys()
        for name, value in want.items():
            assert torch.equal(got[name], value), f"{name} of the {degrees} export differs from tp=1's"


@pytest.mark.slow
def test_a_lossy_export_is_the_state_a_restore_installs(corpus_prefix, tmp_path, capsys):
    """With int8 diffs the replayed state is not training's, but it is exactly what a relaunch restores."""
    trained = run_world(_run, 1, tmp_path, corpus_prefix, str(tmp_path), (1, 1, 1), E, MODEL, "int8", timeout_s=90)
    lines = _export(tmp_path, "hf", capsys)
    assert "from int8 diffs: lossy" in lines[2]
    digest = lines[-1].split()[1]
    assert digest != trained[0]["digest"]
    restored = run_world(_run, 1, tmp_path, corpus_prefix, str(tmp_path), (1, 1, 1), E, MODEL, "int8",
                         timeout_s=90)
    assert restored[0]["digest"] == digest


def test_import_then_export_is_bitwise_the_imported_weights(corpus_prefix, tmp_path, capsys):
    """model.init_from a random GPT-2; the base the manager writes at step 0 exports to the same tensors."""
    model = ModelConfig(**{**MODEL.__dict__, "init_from": str(tmp_path / "src")})
    save_random_gpt2(str(tmp_path / "src"), MODEL, VOCAB)
    run_world(_run, 1, tmp_path, corpus_prefix, str(tmp_path), (1, 1, 1), 1, model, timeout_s=90)
    lines = _export(tmp_path, "out", capsys, "--step", "0")
    assert "replay: none (the base is at step 0)" in lines
    before, after = load_file(tmp_path / "src" / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert before.keys() == after.keys()
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    with open(tmp_path / "out" / "config.json") as f:
        assert json.load(f)["n_layer"] == MODEL.num_layers
