"""A job that lost a node and recovered from Tier-2 exports, at step 12, exactly what the same job without a
failure exports: to torchtitan's DCP (a Llama job) and Megatron-core's torch_dist (a GPT-2 job), bit for bit,
and the reference code loads the export (torchtitan's CheckpointManager; megatron-core's dist_checkpointing.load
into a GPTModel built on CPU). torchtitan's Llama then takes step 13 on the samples MegaTier's recovered job took
at 13, with its loss. The GPT-2 job's state also goes out in Megatron-LM's legacy torch format at tp=2 and reads
back as the torch_dist export does.

The drill (megatier-drill --fail node --compare) kills node1 after step 9 of 13; its rank comes back from the
replica node0 holds (Tier-2). The drilled job keeps its node memory under the test's directory, so its export
reads whatever tier holds step 12; the fault-free reference's node memory is freed by the drill, so its export
reads Tier-3 alone."""
from __future__ import annotations

import json
import os
from functools import partial

import pytest
import torch

from megatier.cli import convert
from megatier.config import compose_config
from megatier.interop.megatron_dist import load_megatron_dist
from megatier.interop.megatron_legacy import load_megatron_legacy
from megatier.interop.torchtitan_dcp import read_dcp
from tests.distributed.cli.test_drill import drill
from tests.distributed.interop.titan_continue import load_in_torchtitan, step_batches, step_in_torchtitan
from tests.distributed.world import run_world

STEPS, EXPORTED, FAIL_AT = 13, 12, 9
JOB = [f"train.iters={STEPS}", "checkpoint.base_interval=10", "checkpoint.diff.compression=fp32",
       "logging.wandb.mode=disabled", "data.seq_len=64", "train.global_batch_size=4", "train.micro_batch_size=2",
       "parallel.timeout_s=20"]


def _export(fmt: str, job_id: str, out: str, remote: str, local: str, *extra: str) -> str:
    args = ["export", "--format", fmt, "--job-id", job_id, "--step", str(EXPORTED), "--remote-url", remote,
            "--local-root", local]
    assert convert.main([*args, *extra, out]) == 0
    (step,) = [d for d in os.listdir(out) if d.startswith(("step-", "iter_"))]
    return os.path.join(out, step)


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == b[key].dtype and torch.equal(value, b[key]), key
        else:
            assert value == b[key], key


def _mcore_load(rank: int, where: str, m) -> dict:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    mpu.initialize_model_parallel(1, 1)
    cfg = TransformerConfig(num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_heads,
                            use_cpu_initialization=True,
                            activation_func=partial(torch.nn.functional.gelu, approximate="tanh"))
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=384, max_sequence_length=m.max_position_embeddings,
                     position_embedding_type="learned_absolute", share_embeddings_and_output_weights=True)
    sharded = {k: v for k, v in model.sharded_state_dict().items() if isinstance(v, ShardedTensor)}
    model.load_state_dict(dist_checkpointing.load(sharded, where, strict="assume_ok_unexpected"), strict=False)
    mpu.destroy_model_parallel()
    return {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def _loss_at(run_dir: str, step: int) -> float:
    """The loss the job's last launch logged at ``step``."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    (loss,) = [r["loss"] for r in records if r.get("step") == step and "event" not in r]
    return loss


def _continues_in_torchtitan(where: str, overrides: list[str], flat: dict, prefix: str, run_dir: str,
                             tmp_path) -> None:
    """torchtitan loads the export (every tensor, Adam's step and moments) and takes MegaTier's next step."""
    from tests.torchtitan_llama import import_torchtitan
    import_torchtitan()
    cfg = compose_config(overrides)
    job = load_in_torchtitan(os.path.dirname(where), EXPORTED, cfg.model, cfg.optim, 257, tmp_path)
    unfused = [(n, p) for n, p in job.model.named_parameters() if ".wqkv." not in n]  # the fused is kept in rows
    assert len(unfused) == 15  # every tensor but the 2 fused qkv
    for name, param in unfused:
        assert torch.equal(param.detach(), flat[name]), name
    state = job.optimizers.optimizers[0].state[job.model.norm.weight]
    assert int(state["step"]) == EXPORTED
    assert torch.equal(state["exp_avg"], flat["optimizer.state.norm.weight.exp_avg"])
    loss = step_in_torchtitan(job, step_batches(prefix, cfg, EXPORTED + 1))
    assert loss == pytest.approx(_loss_at(run_dir, EXPORTED + 1), rel=0, abs=1e-5)


def _loads_in_megatron(where: str, overrides: list[str], flat: dict, tmp_path) -> None:
    pytest.importorskip("megatron.core")
    state = run_world(_mcore_load, 1, tmp_path, where, compose_config(overrides).model, timeout_s=90)[0]
    assert torch.equal(state["embedding.word_embeddings.weight"], flat["embedding.word_embeddings.weight"])
    assert torch.equal(state["decoder.layers.1.mlp.linear_fc1.weight"],
                       flat["decoder.layers.mlp.linear_fc1.weight"][1])


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("model,fmt", [("llama_tiny", "torchtitan"), ("tiny", "torch_dist")])
def test_a_job_recovered_from_tier2_exports_what_its_fault_free_run_does(corpus_prefix, tmp_path, model, fmt):
    if fmt == "torchtitan":
        pytest.importorskip("torchtitan")
    else:
        pytest.importorskip("megatron.core")
    local = str(tmp_path / "shm")
    overrides = [f"model={model}", f"data.prefix={corpus_prefix}", *JOB]
    report = drill(tmp_path, "--nodes", "2", "--procs-per-node", "1", "--fail", "node", "--at-step", str(FAIL_AT),
                   "--compare", overrides=[*overrides, f"checkpoint.local.root={local}"])
    assert report["ok"], report["stdout"]
    (rec,) = report["recoveries"]
    assert rec["failure_class"] == "node" and rec["rank_tiers"] == [["tier1"], ["tier2"]], rec
    assert rec["bytes_tier3"] == 0 and report["final_digest"] == report["reference_digest"]

    work = tmp_path / "work"
    ours = _export(fmt, "drill", str(tmp_path / "drilled"), str(work / "drill" / "remote"), local)
    theirs = _export(fmt, "reference", str(tmp_path / "fault-free"), str(work / "reference" / "remote"), local,
                     "--tier", "tier3")
    assert os.path.basename(ours) == os.path.basename(theirs) == (f"step-{EXPORTED}" if fmt == "torchtitan"
                                                                  else f"iter_{EXPORTED:07d}")
    flat = read_dcp(ours)
    _same(flat, read_dcp(theirs))
    if fmt == "torchtitan":
        _continues_in_torchtitan(ours, overrides, flat, corpus_prefix, report["run_dir"], tmp_path)
    else:
        common = [torch.load(os.path.join(w, "common.pt"), weights_only=False) for w in (ours, theirs)]
        assert common[0] == common[1] and common[0]["iteration"] == EXPORTED
        _loads_in_megatron(ours, overrides, flat, tmp_path)
        # The same state in Megatron-LM's torch format at tp=2 (distrib_optim.pt): the same job read back.
        legacy = _export("megatron_legacy", "drill", str(tmp_path / "legacy"), str(work / "drill" / "remote"), local,
                         "--tp", "2")
        assert sorted(os.listdir(legacy)) == ["mp_rank_00", "mp_rank_01"]
        m = compose_config(overrides).model
        a, b = load_megatron_dist(ours, m, 257), load_megatron_legacy(legacy, m, 257)
        assert (b.iteration, b.adam_steps, b.consumed_samples) == (EXPORTED, EXPORTED, EXPORTED * 4)
        for name, kinds in a.canonical.items():
            assert all(torch.equal(v, b.canonical[name][k]) for k, v in kinds.items()), name
