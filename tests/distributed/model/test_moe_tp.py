"""model.moe at tp=2, with and without sequence parallelism, equals tp=1: Mixtral's shape against transformers'
MixtralForCausalLM (logits), and a Qwen-MoE-style model (softmax_topk routing, a gated shared expert, z-loss,
MoE on every other layer) against itself at tp=1 (logits, loss with the router losses, every gradient)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatier.config import ModelConfig
from megatier.config.schema import MoEConfig
from megatier.interop.huggingface import load_hf
from megatier.model.gpt import GPTStage, init_weights, load_full_state
from megatier.model.params import VOCAB_PARAMS, stage_spec
from megatier.parallel.state import build_parallel_state
from megatier.slicing import full_from_shards
from tests.distributed.world import run_world
from tests.hf_mixtral import save_random_mixtral

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(240)

VOCAB = 259
MIXTRAL = ModelConfig(name="moe_t", arch="llama", num_layers=2, hidden_size=64, num_heads=4, num_query_groups=2,
                      ffn_hidden_size=96, max_position_embeddings=64,
                      moe=MoEConfig(num_experts=4, top_k=2, moe_ffn_hidden_size=48, aux_loss_coeff=0.02))
QWENLIKE = ModelConfig(name="moe_q", arch="llama", num_layers=3, hidden_size=64, num_heads=4, num_query_groups=2,
                       ffn_hidden_size=96, max_position_embeddings=64,
                       moe=MoEConfig(num_experts=6, top_k=3, moe_ffn_hidden_size=32, router_norm="softmax_topk",
                                     aux_loss_coeff=0.01, z_loss_coeff=1e-3, shared_expert_hidden_size=64,
                                     layer_freq=2))


def _model(cfg: ModelConfig, ps, tp: int, sequence_parallel: bool) -> GPTStage:
    spec = stage_spec(cfg, tp=tp, pp=1, tp_rank=ps.tp_rank, pp_rank=0)
    return GPTStage(cfg, VOCAB, spec, tp_group=ps.tp_group, dropout_generator=torch.Generator(),
                    sequence_parallel=sequence_parallel)


def _logits(model: GPTStage, tokens: torch.Tensor, group) -> torch.Tensor:
    with torch.no_grad():
        local = model.eval()(tokens)
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return torch.cat(parts, dim=-1)[..., :VOCAB]


def _loss_and_grads(model: GPTStage, tokens: torch.Tensor, group) -> tuple[float, dict]:
    loss = model.train()(tokens[:, :-1], tokens[:, 1:]).float().mean()
    loss.backward()
    for p in model.parameters():  # what the trainer does: partial sums of token-sliced params over tp
        if getattr(p, "sequence_parallel", False):
            dist.all_reduce(p.grad, group=group)
    return loss.item(), {n: (p.grad.clone(), p.tp_partition_dim, p.tp_partition_stride)
                         for n, p in model.named_parameters()}


def _run(rank: int, hf_dir: str, tp: int, sequence_parallel: bool, tokens: torch.Tensor) -> dict:
    ps = build_parallel_state(tp, 1, 60.0, torch.device("cpu"))
    mixtral = _model(MIXTRAL, ps, tp, sequence_parallel)
    load_full_state(mixtral, load_hf(hf_dir, MIXTRAL, VOCAB))
    qwenlike = _model(QWENLIKE, ps, tp, sequence_parallel)
    init_weights(qwenlike, seed=11)
    loss, grads = _loss_and_grads(qwenlike, tokens, ps.tp_group)
    return {"mixtral": _logits(mixtral, tokens[:, :-1], ps.tp_group),
            "qwenlike": _logits(qwenlike, tokens[:, :-1], ps.tp_group), "loss": loss, "grads": grads}


def _full_grads(results: list[dict]) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient (the vocabulary's true rows: the padding depends on tp)."""
    full = {name: full_from_shards([r["grads"][name][0] for r in results], dim, stride)
            for name, (_, dim, stride) in results[0]["grads"].items()}
    return {name: grad[:VOCAB] if name in VOCAB_PARAMS else grad for name, grad in full.items()}


def runs_by_layout(run, theirs, tmp_path) -> tuple[torch.Tensor, dict]:
    """``run`` on the imported model at tp=1, tp=2 and tp=2 with sequence parallelism (each world its rank's
    results), and the Hugging Face model's logits on the same tokens."""
    tokens = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(tokens[:, :-1]).logits
    layouts = {(1, False): 1, (2, False): 2, (2, True): 2}
    return expected, {(tp, sp): run_world(run, n, tmp_path, str(tmp_path / "hf"), tp, sp, tokens, timeout_s=120)
                      for (tp, sp), n in layouts.items()}


def test_tp2_moe_with_and_without_sequence_parallelism_equals_tp1(tmp_path):
    expected, runs = runs_by_layout(_run, save_random_mixtral(str(tmp_path / "hf"), MIXTRAL, VOCAB), tmp_path)
    one = runs[(1, False)][0]
    one_grads = _full_grads(runs[(1, False)])
    for layout, results in runs.items():
        worst = (results[0]["mixtral"] - expected).abs().max()
        print(f"tp={layout[0]} sp={layout[1]}: max logit difference from transformers' Mixtral {worst:.2e}")
        assert worst <= 1e-4, (layout, worst)
        assert (results[0]["qwenlike"] - one["qwenlike"]).abs().max() <= 1e-4, layout
        assert results[0]["loss"] == pytest.approx(one["loss"], rel=1e-6), layout
        grads = _full_grads(results)
        for name in one_grads:
            torch.testing.assert_close(grads[name], one_grads[name], rtol=1e-5, atol=1e-7, msg=f"{layout} {name}")
