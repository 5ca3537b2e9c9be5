"""The distributed optimizer's distrib_optim.pt in Megatron-LM legacy checkpoints: read at tp=2, the moments
carried into MegaTier's canonical state, and written back bitwise (Megatron legacy -> MegaTier -> Megatron legacy).

megatron-core 0.16's DistributedOptimizer allocates CUDA tensors in its constructor, so it cannot save here; its
DistributedDataParallel builds on CPU once ``torch.cuda.current_device`` names the CPU, and its gradient buffer
(``param_index_map``, ``bucket_indices``, each bucket's ``numel_unpadded``) places the parameters. The source's
distrib_optim.pt is laid out from that buffer as ``get_parameter_state_dp_zero`` does (each bucket's unpadded
part, concatenated), so the layout under test is Megatron-core's own, not this package's: at tp=2, and at pp=2
with the first stage in several buckets and the tied embedding in buckets of its own."""
from __future__ import annotations

import argparse
import os
from functools import partial

import pytest
import torch

from megatier.config import ModelConfig, OptimConfig
from megatier.interop.job_state import JobFormatError
from megatier.interop.megatron_distrib_optim import buffer_layout, stage_buffer
from megatier.interop.megatron_legacy import export_megatron_legacy, load_megatron_legacy
from tests.distributed.world import run_world

pytest.importorskip("megatron.core")

MODEL = ModelConfig(name="mc", num_layers=2, hidden_size=32, num_heads=4, max_position_embeddings=32)
VOCAB = 256  # Megatron's padded vocabulary: no padding row is dropped, so the round trip is whole
KEYS = ("param", "exp_avg", "exp_avg_sq")


def _coalesced(buffer, values: dict) -> torch.Tensor:
    """``values`` (param -> tensor) placed in ``buffer``'s layout, each bucket's unpadded part concatenated."""
    flat = torch.zeros(buffer.numel)
    for param, (start, end, _) in buffer.param_index_map.items():
        flat[start:end] = values[param].reshape(-1)
    return torch.cat([flat[s:s + b.numel_unpadded] for (s, _), b in zip(buffer.bucket_indices, buffer.buckets)])


def _save(rank: int, tp: int, save: str, bucket_size, pp: int = 1) -> dict:
    """A GPTModel's stage at (tp rank, pp rank) saved as Megatron-LM's torch format with the distributed optimizer;
    a pp > 1 model ties its embedding, whose last-stage copy (``output_layer``) has the first stage's moments."""
    torch.cuda.current_device = lambda: "cpu"  # DDP allocates its buffers there; nothing else asks for CUDA
    torch.Tensor.cuda = lambda self, *a, **k: self  # the tied embedding's first all-reduce moves it "to the GPU"
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    mpu.initialize_model_parallel(tp, pp)
    t, s = mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank()
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            pipeline_dtype=torch.float32,
                            activation_func=partial(torch.nn.functional.gelu, approximate="tanh"))
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=32,
                     position_embedding_type="learned_absolute", share_embeddings_and_output_weights=True,
                     pre_process=s == 0, post_process=s == pp - 1)
    ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=bucket_size is not None,
                                            bucket_size=bucket_size)
    ddp = DistributedDataParallel(cfg, ddp_cfg, model)
    (buffer,) = ddp.buffers
    names = {p: n for n, p in model.named_parameters()}
    values = {"param": {p: p.detach() for p in names}, "exp_avg": {}, "exp_avg_sq": {}}
    for i, (p, name) in enumerate(names.items()):  # replicated and tied parameters: the same moments, as in training
        seed = 0 if name == "output_layer.weight" else 100 * i + 10_000 * s
        g = torch.Generator().manual_seed(seed + (t if getattr(p, "tensor_model_parallel", False) else 0))
        values["exp_avg"][p] = torch.randn(p.shape, generator=g)
        values["exp_avg_sq"][p] = torch.rand(p.shape, generator=g)
    flat = {k: _coalesced(buffer, values[k]) for k in KEYS}
    where = os.path.join(save, "iter_0000005", f"mp_rank_{t:02d}" + (f"_{s:03d}" if pp > 1 else ""))
    os.makedirs(where, exist_ok=True)
    args = argparse.Namespace(consumed_train_samples=40, overlap_grad_reduce=bucket_size is not None,
                              ddp_bucket_size=bucket_size, data_parallel_size=1)
    group = {"step": 5, "lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}
    torch.save({"iteration": 5, "checkpoint_version": 3.0, "model": model.state_dict(), "args": args,
                "optimizer": {"optimizer": {"param_groups": [group]}}}, os.path.join(where, "model_optim_rng.pt"))
    torch.save({"buckets_coalesced": True, 0: {(torch.float32, torch.float32): {
        **flat, "numel_unpadded": buffer.numel_unpadded}}}, os.path.join(where, "distrib_optim.pt"))
    if rank == 0:
        with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("5")
    ours, _ = buffer_layout([(n, p.numel()) for n, p in model.named_parameters()], *stage_buffer(bucket_size, s, pp))
    theirs = {names[p]: (lo - buffer.bucket_indices[b][0] + sum(x.numel_unpadded for x in buffer.buckets[:b]), hi -
                         buffer.bucket_indices[b][0] + sum(x.numel_unpadded for x in buffer.buckets[:b]))
              for p, (lo, hi, b) in buffer.param_index_map.items()}
    mpu.destroy_model_parallel()
    return {"layout_equal": ours == theirs, "buckets": len(buffer.buckets),
            "moments": {names[p]: v.clone() for p, v in values["exp_avg"].items()}}


def _same_files(src: str, again: str, rank_dirs: list[str]) -> None:
    """Both ranks' model_optim_rng.pt (model, iteration, Adam's step) and distrib_optim.pt equal, bit for bit."""
    assert sorted(os.listdir(os.path.join(again, "iter_0000005"))) == rank_dirs
    for name in rank_dirs:
        a, b = (os.path.join(w, "iter_0000005", name) for w in (src, again))
        theirs, ours = (torch.load(os.path.join(d, "model_optim_rng.pt"), weights_only=False) for d in (a, b))
        model = {k: v for k, v in theirs["model"].items() if "_extra_state" not in k}
        assert list(model) == list(ours["model"])  # the GPTModel's order: the buffer's order
        assert all(torch.equal(v, ours["model"][k]) for k, v in model.items())
        assert ours["iteration"] == 5 and ours["optimizer"]["optimizer"]["param_groups"][0]["step"] == 5
        theirs, ours = (torch.load(os.path.join(d, "distrib_optim.pt"), weights_only=False)[0] for d in (a, b))
        assert theirs.keys() == ours.keys()
        (theirs,), (ours,) = theirs.values(), ours.values()
        assert theirs["numel_unpadded"] == ours["numel_unpadded"]
        assert all(torch.equal(theirs[k], ours[k]) for k in KEYS)
    with open(os.path.join(again, "latest_checkpointed_iteration.txt")) as f:
        assert f.read() == "5"


@pytest.mark.timeout(120)
def test_buckets_are_laid_out_as_megatron_core_does(tmp_path):
    (got,) = run_world(_save, 1, tmp_path, 1, str(tmp_path / "b"), 3000, timeout_s=90)
    assert got["buckets"] > 2 and got["layout_equal"]


@pytest.mark.timeout(150)
def test_tp2_moments_carry_over_and_round_trip_bitwise(tmp_path):
    ranks = run_world(_save, 2, tmp_path, 2, str(tmp_path / "src"), None, timeout_s=120)
    assert all(r["layout_equal"] and r["buckets"] == 1 for r in ranks)
    o = OptimConfig()
    job = load_megatron_legacy(str(tmp_path / "src"), MODEL, VOCAB, o)
    assert (job.iteration, job.adam_steps, job.consumed_samples) == (5, 5, 40)
    assert not any("start at zero" in line for line in job.notes)
    fc1 = torch.cat([r["moments"]["decoder.layers.1.mlp.linear_fc1.weight"] for r in ranks])
    assert torch.equal(job.canonical["layers.1.mlp.fc.weight"]["exp_avg"], fc1)  # joined over tp
    assert torch.equal(job.canonical["final_norm.bias"]["exp_avg"], ranks[0]["moments"]["decoder.final_layernorm.bias"])

    where = export_megatron_legacy(job, MODEL, o, str(tmp_path / "again"), lr=1e-3, tp=2)
    assert where.endswith("iter_0000005")
    _same_files(str(tmp_path / "src"), str(tmp_path / "again"), ["mp_rank_00", "mp_rank_01"])


@pytest.mark.timeout(150)
def test_pp2_stages_and_buckets_round_trip_bitwise(tmp_path):
    """Two stages, the first in buckets of 3000 elements, the tied embedding alone in its bucket on both."""
    ranks = run_world(_save, 2, tmp_path, 1, str(tmp_path / "src"), 3000, 2, timeout_s=120)
    assert all(r["layout_equal"] for r in ranks) and ranks[0]["buckets"] > 2 and ranks[1]["buckets"] == 2
    o = OptimConfig()
    job = load_megatron_legacy(str(tmp_path / "src"), MODEL, VOCAB, o)
    assert (job.iteration, job.adam_steps, job.consumed_samples) == (5, 5, 40)
    assert torch.equal(job.canonical["layers.1.mlp.fc.weight"]["exp_avg"],  # stage 1's layer 0 is layer 1
                       ranks[1]["moments"]["decoder.layers.0.mlp.linear_fc1.weight"])
    assert torch.equal(job.canonical["word.weight"]["exp_avg"], ranks[0]["moments"]["embedding.word_embeddings.weight"])
    export_megatron_legacy(job, MODEL, o, str(tmp_path / "again"), lr=1e-3, pp=2, bucket_size=3000)
    _same_files(str(tmp_path / "src"), str(tmp_path / "again"), ["mp_rank_00_000", "mp_rank_00_001"])
    with pytest.raises(JobFormatError, match="model.num_layers=2"):
        export_megatron_legacy(job, MODEL, o, str(tmp_path / "odd"), lr=1e-3, pp=3)
