"""Move a GPT-2-shaped job between MegaTier and Megatron-core's ``torch_dist`` checkpoints (a Llama-shaped one,
dense or MoE: :mod:`megatier.interop.megatron_dist_llama`).

A ``torch_dist`` checkpoint (Megatron-LM's ``<save>/iter_NNNNNNN/``, the newest named by
``latest_checkpointed_iteration.txt``) is a PyTorch DCP directory plus ``metadata.json`` (the backends) and
``common.pt`` (what is not sharded: the iteration, the optimizer's param groups with Adam's step, the LR
scheduler with its sample count, the arguments). DCP keys are the ShardedTensor keys of a GPTModel, one
global tensor each, the layers stacked on a leading axis (layer-wise keys, any tp/pp/dp)::

    word.weight                 embedding.word_embeddings.weight          rows padded to Megatron's vocabulary
    pos.weight                  embedding.position_embeddings.weight
    layers.i.ln1.*              decoder.layers.self_attention.linear_qkv.layer_norm_{weight,bias}[i]
    layers.i.attn.qkv.*         decoder.layers.self_attention.linear_qkv.{weight,bias}[i]   rows per head (below)
    layers.i.attn.proj.*        decoder.layers.self_attention.linear_proj.*[i]
    layers.i.ln2.*              decoder.layers.mlp.linear_fc1.layer_norm_{weight,bias}[i]
    layers.i.mlp.fc.*           decoder.layers.mlp.linear_fc1.*[i]
    layers.i.mlp.proj.*         decoder.layers.mlp.linear_fc2.*[i]
    final_norm.*                decoder.final_layernorm.*

The distributed optimizer's default ``fully_sharded_model_space`` state adds, per model key K,
``optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.K`` of K's global shape; fp32_param is the master copy.
Megatron orders the fused QKV rows per head ([q_h; k_h; v_h] for each head h), MegaTier (as GPT-2) [q; k; v]:
a row permutation, so weights and moments move bitwise.
"""
from __future__ import annotations

import json
import math
import os
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp

from megatier.config import ModelConfig, OptimConfig
from megatier.interop.job_state import KINDS, JobFormatError, JobState, as_fp32, check_model, check_shapes
from megatier.interop.megatron_dist_llama import check_llama, check_llama_keys, to_canonical_llama
from megatier.interop.megatron_dist_llama import global_tensors as llama_tensors
from megatier.interop.torchtitan_dcp import read_dcp

_LAYER = [("ln1.weight", "self_attention.linear_qkv.layer_norm_weight"),
          ("ln1.bias", "self_attention.linear_qkv.layer_norm_bias"),
          ("attn.qkv.weight", "self_attention.linear_qkv.weight"), ("attn.qkv.bias", "self_attention.linear_qkv.bias"),
          ("attn.proj.weight", "self_attention.linear_proj.weight"),
          ("attn.proj.bias", "self_attention.linear_proj.bias"),
          ("ln2.weight", "mlp.linear_fc1.layer_norm_weight"), ("ln2.bias", "mlp.linear_fc1.layer_norm_bias"),
          ("mlp.fc.weight", "mlp.linear_fc1.weight"), ("mlp.fc.bias", "mlp.linear_fc1.bias"),
          ("mlp.proj.weight", "mlp.linear_fc2.weight"), ("mlp.proj.bias", "mlp.linear_fc2.bias")]
_GLOBAL = [("word.weight", "embedding.word_embeddings.weight"), ("pos.weight", "embedding.position_embeddings.weight"),
           ("final_norm.weight", "decoder.final_layernorm.weight"), ("final_norm.bias", "decoder.final_layernorm.bias")]
_OPTIM = {"master": "fp32_param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
            "common_backend_version": 1}


def iteration_dir(path: str) -> str:
    """``path`` itself (it has metadata.json), or the iteration Megatron-LM's tracker file names in it."""
    path = os.path.expanduser(path)
    return tracked_iteration(path, os.path.isfile(os.path.join(path, "metadata.json")), "metadata.json")


def tracked_iteration(path: str, is_iteration: bool, marker: str) -> str:
    """``path`` when ``is_iteration`` (it holds ``marker``), else the iteration the tracker file of Megatron-LM's
    --save directory names in it (``latest_checkpointed_iteration.txt``: a number or ``release``)."""
    if is_iteration:
        return path
    tracker = os.path.join(path, "latest_checkpointed_iteration.txt")
    if not os.path.isfile(tracker):
        raise JobFormatError(f"{path} has neither {marker} nor latest_checkpointed_iteration.txt; give "
                             f"Megatron-LM's --save directory or one iter_NNNNNNN in it")
    with open(tracker) as f:
        text = f.read().strip()
    return os.path.join(path, text if text == "release" else f"iter_{int(text):07d}")


def _qkv_to_ours(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows [q_h; k_h; v_h] per head -> [q; k; v] (any trailing shape)."""
    return w.reshape(heads, 3, -1, *w.shape[1:]).transpose(0, 1).reshape(w.shape).contiguous()


def _qkv_to_theirs(w: torch.Tensor, heads: int) -> torch.Tensor:
    return w.reshape(3, heads, -1, *w.shape[1:]).transpose(0, 1).reshape(w.shape).contiguous()


def _read_common(where: str) -> dict:
    path = os.path.join(where, "common.pt")
    if not os.path.isfile(path):
        raise JobFormatError(f"{where} has no common.pt; it is not a complete torch_dist checkpoint")
    return torch.load(path, map_location="cpu", weights_only=False)


def check_keys(flat: dict, where: str) -> None:
    ours = {k for _, k in _GLOBAL} | {f"decoder.layers.{k}" for _, k in _LAYER}
    model = {k for k in flat if not k.startswith("optimizer.") and "_extra_state" not in k}
    extra = sorted(model - ours - {"output_layer.weight"})
    if extra:
        raise JobFormatError(f"{where}: MegaTier's GPT-2 block cannot represent {extra[0]} ({len(extra)} such "
                             f"keys: no rotary, no experts, no qk-layernorm)")
    if "output_layer.weight" in flat:
        raise JobFormatError(f"{where}: output_layer.weight is an untied head; MegaTier's GPT-2 ties it to the word "
                             f"embedding (train with share_embeddings_and_output_weights)")
    missing = sorted(ours - model)
    if missing:
        raise JobFormatError(f"{where} has no {missing[0]}; a GPT-shaped torch_dist checkpoint holds all of "
                             f"{sorted(ours)[:3]}...")


def _value(flat: dict, key: str, kind: str, notes: list[str]) -> Optional[torch.Tensor]:
    name = key if kind == "master" and f"optimizer.state.fp32_param.{key}" not in flat else \
        f"optimizer.state.{_OPTIM[kind]}.{key}"
    value = flat.get(name)
    return None if value is None else as_fp32(value, "the weights" if kind == "master" else "Adam's moments", notes)


def to_canonical(flat: dict, m: ModelConfig, vocab: int, notes: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    state = {}
    pairs = [(ours, theirs, None) for ours, theirs in _GLOBAL]
    pairs += [(f"layers.{i}.{ours}", f"decoder.layers.{theirs}", i)
              for i in range(m.num_layers) for ours, theirs in _LAYER]
    for ours, theirs, layer in pairs:
        state[ours] = {}
        for kind in KINDS:
            value = _value(flat, theirs, kind, notes)
            value = torch.zeros_like(_value(flat, theirs, "master", notes)) if value is None else value
            value = value[layer] if layer is not None else value
            value = value[:vocab] if ours == "word.weight" else value
            state[ours][kind] = _qkv_to_ours(value, m.num_heads) if ".attn.qkv." in ours else value.contiguous()
    return state


def _notes(flat: dict, common: dict) -> list[str]:
    out = []
    if not any(k.startswith("optimizer.state.") for k in flat):
        out.append("optimizer: no distributed-optimizer state (fully_sharded_model_space) in the checkpoint: "
                   "Adam's moments start at zero")
    return out + ["not carried: the RNG states, fp8 scaling state and the arguments (MegaTier's config rules)"]


def load_megatron_dist(path: str, m: ModelConfig, vocab: int, o: Optional[OptimConfig] = None) -> JobState:
    """The job of torch_dist checkpoint ``path`` (an iteration directory or Megatron-LM's --save directory)."""
    if m.arch == "llama":
        check_llama(m)
    else:
        check_model("torch_dist", m, "gpt2")
    where = iteration_dir(path)
    flat = read_dcp(where)
    if m.arch == "llama":
        check_llama_keys(flat, m, where)
    else:
        check_keys(flat, where)
    common = _read_common(where)
    notes = _notes(flat, common)
    canonical = (to_canonical_llama if m.arch == "llama" else to_canonical)(flat, m, vocab, notes)
    check_shapes(canonical, m, vocab, where)
    groups = ((common.get("optimizer") or {}).get("optimizer") or {}).get("param_groups") or [{}]
    iteration = int(common.get("iteration", 0))
    scheduler = common.get("opt_param_scheduler") or {}
    args = common.get("args")
    samples = getattr(args, "consumed_train_samples", None) if args is not None else None
    return JobState(canonical, iteration, int(groups[0].get("step", iteration)),
                    consumed_samples=samples if samples is not None else scheduler.get("num_steps"),
                    next_lr=None, source=f"Megatron-core torch_dist {where}", notes=notes)


def global_tensors(job: JobState, m: ModelConfig, kind: str, padded_vocab: int) -> dict[str, torch.Tensor]:
    """torch_dist key -> ``kind``'s global tensor (layers stacked, vocabulary padded with zero rows) of ``job``."""
    names = [(ours, theirs) for ours, theirs in _GLOBAL] + [(f"layers.{ours}", f"decoder.layers.{theirs}")
                                                             for ours, theirs in _LAYER]
    return {theirs: _stacked(job, m, ours, kind, padded_vocab) for ours, theirs in names}


def _stacked(job: JobState, m: ModelConfig, ours: str, kind: str, padded_vocab: int) -> torch.Tensor:
    if ours.startswith("layers."):
        parts = [job.canonical[f"layers.{i}.{ours[len('layers.'):]}"][kind] for i in range(m.num_layers)]
        parts = [_qkv_to_theirs(p, m.num_heads) if ".attn.qkv." in ours else p for p in parts]
        return torch.stack(parts).to(torch.float32).contiguous()
    value = job.canonical[ours][kind].to(torch.float32)
    if ours == "word.weight" and value.shape[0] < padded_vocab:
        value = torch.cat([value, value.new_zeros(padded_vocab - value.shape[0], value.shape[1])])
    return value.contiguous()


def param_groups(job: JobState, o: OptimConfig, lr: float) -> list[dict]:
    """Megatron-core's two default param groups (weight decay, and none for biases and 1-d tensors), each with
    the keys its DistributedOptimizer.load_state_dict matches the model's groups by (wd_mult, lr_mult,
    is_expert_parallel, is_decoupled_lr); a group without them is refused there."""
    group = {"step": job.adam_steps, "lr": lr, "betas": (o.beta1, o.beta2), "eps": o.eps,
             "weight_decay": o.weight_decay, "lr_mult": 1.0, "is_decoupled_lr": False, "is_expert_parallel": False,
             "max_lr": o.lr, "min_lr": o.min_lr, "default_config": True}
    return [{**group, "wd_mult": 1.0}, {**group, "wd_mult": 0.0}]


def _common(job: JobState, o: OptimConfig, lr: float, batch: int) -> dict:
    return {"iteration": job.iteration, "checkpoint_version": 3.0, "num_floating_point_operations_so_far": 0,
            "optimizer": {"optimizer": {"param_groups": param_groups(job, o, lr)},
                          "param_state_sharding_type": "fully_sharded_model_space"},
            "opt_param_scheduler": {"max_lr": o.lr, "min_lr": o.min_lr, "num_steps": job.consumed_samples
                                    if job.consumed_samples is not None else job.iteration * batch}}


def export_megatron_dist(job: JobState, m: ModelConfig, o: OptimConfig, save_dir: str, lr: float, batch: int) -> str:
    """Write ``save_dir``/iter_NNNNNNN as Megatron-LM saves it (and its tracker file); returns that directory. A
    ``model.arch=llama`` job (dense or MoE) goes as :mod:`megatier.interop.megatron_dist_llama` maps it."""
    if m.arch == "llama":
        check_llama(m)
    else:
        check_model("torch_dist", m, "gpt2")
    padded = math.ceil(job.canonical["word.weight"]["master"].shape[0] / m.make_vocab_size_divisible_by) * \
        m.make_vocab_size_divisible_by
    tensors = llama_tensors if m.arch == "llama" else global_tensors
    state: dict[str, object] = {}
    for kind in KINDS:
        for theirs, value in tensors(job, m, kind, padded).items():
            state[theirs if kind == "master" else f"optimizer.state.{_OPTIM[kind]}.{theirs}"] = value
            if kind == "master":
                state[f"optimizer.state.fp32_param.{theirs}"] = value.clone()
    where = os.path.join(save_dir, f"iter_{job.iteration:07d}")
    dcp.save(state, checkpoint_id=where, no_dist=True)
    torch.save(_common(job, o, lr, batch), os.path.join(where, "common.pt"))
    with open(os.path.join(where, "metadata.json"), "w") as f:
        json.dump(METADATA, f)
    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(job.iteration))
    return where
