"""model.arch=llama at tp=2 (grouped-query attention: 4 query heads over 2 key/value groups) equals
transformers.LlamaForCausalLM, with and without sequence parallelism; the two also agree on every gradient."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatier.config import ModelConfig
from megatier.interop.llama import load_llama
from megatier.model.gpt import GPTStage, load_full_state
from megatier.model.params import stage_spec
from megatier.parallel.state import build_parallel_state
from megatier.slicing import full_from_shards
from tests.distributed.world import run_world
from tests.hf_llama import save_random_llama

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(180)

VOCAB = 259
CFG = ModelConfig(name="llama_t", arch="llama", num_layers=2, hidden_size=64, num_heads=4, num_query_groups=2,
                  ffn_hidden_size=96, max_position_embeddings=64, hidden_dropout=0.1)


def _run(rank: int, hf_dir: str, sequence_parallel: bool, tokens: torch.Tensor) -> dict:
    ps = build_parallel_state(2, 1, 60.0, torch.device("cpu"))
    gen = torch.Generator()
    model = GPTStage(CFG, VOCAB, stage_spec(CFG, tp=2, pp=1, tp_rank=ps.tp_rank, pp_rank=0), tp_group=ps.tp_group,
                     dropout_generator=gen, sequence_parallel=sequence_parallel)
    load_full_state(model, load_llama(hf_dir, CFG, VOCAB))
    with torch.no_grad():
        local = model.eval()(tokens[:, :-1])  # (b, s, padded/tp); s = 32: a multiple of tp for the slices
    parts = [torch.empty_like(local) for _ in range(2)]
    dist.all_gather(parts, local, group=ps.tp_group)
    model.train()
    gen.manual_seed(7)  # the same dropout masks in both runs (drawn for the whole sequence under SP)
    loss = model(tokens[:, :-1], tokens[:, 1:]).float().mean()
    loss.backward()
    for _, p in model.named_parameters():  # what the trainer does: partial sums of token-sliced params over tp
        if getattr(p, "sequence_parallel", False):
            dist.all_reduce(p.grad, group=ps.tp_group)
    grads = {n: (p.grad.clone(), p.tp_partition_dim, p.tp_partition_stride) for n, p in model.named_parameters()}
    return {"logits": torch.cat(parts, dim=-1)[..., :VOCAB], "loss": loss.item(), "grads": grads}


def _full_grads(results: list[dict]) -> dict[str, torch.Tensor]:
    out = {}
    for name, (_, dim, stride) in results[0]["grads"].items():
        out[name] = full_from_shards([r["grads"][name][0] for r in results], dim, stride)
    return out


def test_tp2_llama_with_and_without_sequence_parallelism_equals_hugging_face(tmp_path):
    theirs = save_random_llama(str(tmp_path / "hf"), CFG, VOCAB)
    tokens = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(tokens[:, :-1]).logits
    runs = {sp: run_world(_run, 2, tmp_path, str(tmp_path / "hf"), sp, tokens, timeout_s=120) for sp in (False, True)}
    for sp, results in runs.items():
        for r in results:
            assert (r["logits"] - expected).abs().max() <= 1e-4, (sp, (r["logits"] - expected).abs().max())
    plain, sliced = _full_grads(runs[False]), _full_grads(runs[True])
    assert runs[False][0]["loss"] == pytest.approx(runs[True][0]["loss"], rel=1e-6)
    for name in plain:
        torch.testing.assert_close(sliced[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)
