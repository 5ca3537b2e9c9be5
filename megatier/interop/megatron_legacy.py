"""Move a GPT-2-shaped job between MegaTier and Megatron-LM's legacy checkpoints (``--ckpt-format torch``).

``<save>/iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt`` holds, per tensor- (and pipeline-) parallel rank,
``{"iteration", "args", "model": <the GPTModel's state_dict, this rank's slices>, "optimizer",
"opt_param_scheduler", "rng_state", ...}``; ``latest_checkpointed_iteration.txt`` names the newest. With the
distributed optimizer, ``distrib_optim.pt`` next to it holds the rank's fp32 main parameters and Adam's moments
(:mod:`megatier.interop.megatron_distrib_optim`), and ``optimizer`` only the param groups with Adam's step.
The ranks' slices are joined along Megatron's tensor-parallel dimension of each parameter (column-parallel:
rows, row-parallel: columns, the vocabulary: rows), the pipeline stages' local layer numbers made global, and
the result is the stacked ``torch_dist`` layout :mod:`megatier.interop.megatron_dist` reads.

A checkpoint without ``distrib_optim.pt`` (Megatron's non-distributed optimizer keys its state by parameter-group
order) carries the weights alone: Adam's moments start at zero (said in one line). With several pipeline stages the
last holds a tied embedding's copy as ``output_layer.weight``; it is read for the buffer's layout and dropped.
Export writes the local-spec names (``input_layernorm``, ``pre_mlp_layernorm``) at ``tp`` x ``pp`` ranks, layers
split evenly over the stages, and ``distrib_optim.pt`` in Megatron-core's buckets for the bucket size asked.
"""
from __future__ import annotations

import argparse
import math
import os
import re
from typing import Optional

import torch

from megatier.config import ModelConfig, OptimConfig
from megatier.interop.job_state import KINDS, JobFormatError, JobState, check_model, check_shapes
from megatier.interop.megatron_dist import check_keys, global_tensors, param_groups, to_canonical, tracked_iteration
from megatier.interop.megatron_distrib_optim import bucket_size_of, param_state, read_param_state, stage_buffer

# Local-spec names -> the names torch_dist uses (Transformer Engine's fused layer norms).
_ALIASES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
            "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
            "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
            "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias"}
# A local-spec GPTModel's parameters of one layer, in its order (the order of the distributed optimizer's buffer).
_LAYER_ORDER = ("input_layernorm.weight", "input_layernorm.bias", "self_attention.linear_proj.weight",
                "self_attention.linear_proj.bias", "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
                "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias", "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
                "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")
_COLUMNS = ("linear_proj.weight", "linear_fc2.weight")  # row-parallel: split along the input (dim 1)
_REPLICATED = ("layer_norm", "layernorm", "linear_proj.bias", "linear_fc2.bias", "position_embeddings")
_FLAT = {"master": "optimizer.state.fp32_param.", "exp_avg": "optimizer.state.exp_avg.",
         "exp_avg_sq": "optimizer.state.exp_avg_sq."}


def _iteration_dir(path: str) -> str:
    path = os.path.expanduser(path)
    ranks = any(d.startswith("mp_rank_") for d in (os.listdir(path) if os.path.isdir(path) else []))
    return tracked_iteration(path, ranks, "mp_rank_* directories")


def _rank_dirs(where: str) -> dict[tuple[int, int], str]:
    out = {}
    for name in sorted(os.listdir(where)):
        match = re.fullmatch(r"mp_rank_(\d+)(?:_(\d+))?", name)
        if match:
            out[(int(match.group(1)), int(match.group(2) or 0))] = os.path.join(where, name)
    if not out:
        raise JobFormatError(f"{where} has no mp_rank_*/model_optim_rng.pt")
    return out


def _tied(args) -> bool:
    return not getattr(args, "untie_embeddings_and_output_weights", False)


def _rank_state(rank_dir: str, ckpt: dict, pp: int, pps: int) -> dict[str, dict[str, torch.Tensor]]:
    """kind -> key -> this rank's tensor: ``weights`` (the model's), and where ``distrib_optim.pt`` is there the
    distributed optimizer's master and moments. The last stage's copy of a tied embedding (``output_layer``
    with several stages) is read for the buffer's layout and then dropped: the first stage's is the same."""
    model = {k: v for k, v in ckpt["model"].items() if isinstance(v, torch.Tensor) and "_extra_state" not in k}
    args = ckpt.get("args")
    copy = ("output_layer.weight",) if pps > 1 and _tied(args) else ()
    path = os.path.join(rank_dir, "distrib_optim.pt")
    if not os.path.isfile(path):
        return {"weights": _without(model, copy)}
    bucket, shared = stage_buffer(bucket_size_of(args), pp, pps, _tied(args))
    params = [(k, v.numel()) for k, v in model.items()]
    state = read_param_state(path, params, {k: v.shape for k, v in model.items()}, bucket, shared)
    return {"weights": _without(model, copy), **{kind: _without(v, copy) for kind, v in state.items()}}


def _without(tensors: dict[str, torch.Tensor], keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in tensors.items() if k not in keys}


def _ranks(where: str) -> tuple[dict[tuple[int, int], dict], dict[tuple[int, int], dict]]:
    """(tp rank, pp rank) -> that rank's model_optim_rng.pt, and -> its tensors by kind (:func:`_rank_state`)."""
    dirs = _rank_dirs(where)
    ckpts = {r: torch.load(os.path.join(d, "model_optim_rng.pt"), map_location="cpu", weights_only=False)
             for r, d in dirs.items()}
    pps = len({p for _, p in dirs})
    return ckpts, {r: _rank_state(d, ckpts[r], r[1], pps) for r, d in dirs.items()}


def _tp_dim(key: str) -> Optional[int]:
    if any(part in key for part in _REPLICATED):
        return None
    return 1 if key.endswith(_COLUMNS) else 0


def _stage_layers(states: dict[tuple[int, int], dict]) -> dict[int, int]:
    """pp rank -> its first global layer (stages in order, each as many layers as its keys number)."""
    firsts, start = {}, 0
    for pp in sorted({p for _, p in states}):
        firsts[pp] = start
        keys = states[(0, pp)]["weights"]
        start += len({int(m.group(1)) for k in keys if (m := re.match(r"decoder\.layers\.(\d+)\.", k))})
    return firsts


def _stacked(states: dict[tuple[int, int], dict], kind: str) -> dict[str, torch.Tensor]:
    """The ranks' ``kind`` slices as torch_dist's keys: joined over tp, layers global and stacked."""
    tps, firsts = sorted({t for t, _ in states}), _stage_layers(states)
    layers: dict[str, dict[int, torch.Tensor]] = {}
    flat = {}
    for (tp, pp), state in states.items():
        if tp != 0:
            continue
        for key, value in state[kind].items():
            dim = _tp_dim(key)
            full = value if dim is None else torch.cat([states[(t, pp)][kind][key] for t in tps], dim=dim)
            match = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", key)
            if match is None:
                flat[key] = full
                continue
            rest = _ALIASES.get(match.group(2), match.group(2))
            layers.setdefault(f"decoder.layers.{rest}", {})[firsts[pp] + int(match.group(1))] = full
    for key, by_layer in layers.items():
        flat[key] = torch.stack([by_layer[i] for i in sorted(by_layer)])
    return flat


def _flat(states: dict[tuple[int, int], dict]) -> dict[str, torch.Tensor]:
    """The weights, and where every rank has its distributed optimizer's state, the master and the moments."""
    flat = _stacked(states, "weights")
    if all("master" in s for s in states.values()):
        for kind, prefix in _FLAT.items():
            flat.update({prefix + k: v for k, v in _stacked(states, kind).items()})
    return flat


def load_megatron_legacy(path: str, m: ModelConfig, vocab: int, o: Optional[OptimConfig] = None) -> JobState:
    """The job of the legacy checkpoint ``path`` (an iteration directory or Megatron-LM's --save directory)."""
    check_model("megatron_legacy", m, "gpt2")
    where = _iteration_dir(path)
    ckpts, states = _ranks(where)
    flat = _flat(states)
    check_keys(flat, where)
    moments = any(k.startswith("optimizer.") for k in flat)
    notes = [] if moments else ["optimizer: no distrib_optim.pt (the non-distributed optimizer's state is not "
                                "read): Adam's moments start at zero, step 0"]
    notes.append("not carried: the RNG states, fp8 scaling state and the arguments (MegaTier's config rules)")
    canonical = to_canonical(flat, m, vocab, notes)
    check_shapes(canonical, m, vocab, where)
    first = ckpts[min(ckpts)]
    iteration = int(first.get("iteration", 0))
    groups = ((first.get("optimizer") or {}).get("optimizer") or {}).get("param_groups") or [{}]
    args = first.get("args")
    samples = getattr(args, "consumed_train_samples", None) if args is not None else None
    return JobState(canonical, iteration, int(groups[0].get("step", iteration)) if moments else 0,
                    consumed_samples=samples, source=f"Megatron-LM legacy checkpoint {where} ({len(ckpts)} ranks)",
                    notes=notes)


def _stage_keys(num_layers: int, stage: int, stages: int) -> list[tuple[str, str, Optional[int]]]:
    """(local-spec key, torch_dist key, global layer) of pipeline stage ``stage`` in a GPTModel's parameter order:
    the embeddings on the first stage, ``num_layers / stages`` layers numbered from 0 on each, the final norm
    on the last, and there, with several stages, ``output_layer`` (the tied embedding's copy)."""
    per, out = num_layers // stages, []
    if stage == 0:
        out += [(k, k, None) for k in ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")]
    for i in range(per):
        out += [(f"decoder.layers.{i}.{k}", f"decoder.layers.{_ALIASES.get(k, k)}", stage * per + i)
                for k in _LAYER_ORDER]
    if stage == stages - 1:
        out += [(k, k, None) for k in ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias")]
        if stages > 1:
            out.append(("output_layer.weight", "embedding.word_embeddings.weight", None))
    return out


def _rank_tensors(job: JobState, m: ModelConfig, tp: int, pp: int,
                  padded: int) -> dict[tuple[int, int], dict[str, dict[str, torch.Tensor]]]:
    """(tp rank, pp rank) -> kind -> local-spec key -> that rank's slice."""
    out = {(t, s): {kind: {} for kind in KINDS} for s in range(pp) for t in range(tp)}
    for kind in KINDS:
        full = global_tensors(job, m, kind, padded)
        for s in range(pp):
            for key, theirs, layer in _stage_keys(m.num_layers, s, pp):
                value = full[theirs] if layer is None else full[theirs][layer]
                dim = _tp_dim(key)
                parts = [value] * tp if dim is None else value.chunk(tp, dim=dim)
                for t in range(tp):
                    out[(t, s)][kind][key] = parts[t].clone()
    return out


def _args(job: JobState, m: ModelConfig, tp: int, pp: int, padded: int,
          bucket_size: Optional[int]) -> argparse.Namespace:
    return argparse.Namespace(num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_heads,
                              max_position_embeddings=m.max_position_embeddings, padded_vocab_size=padded,
                              tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              untie_embeddings_and_output_weights=False, use_distributed_optimizer=True,
                              overlap_grad_reduce=bucket_size is not None, ddp_bucket_size=bucket_size,
                              ckpt_format="torch", consumed_train_samples=job.consumed_samples or 0,
                              consumed_valid_samples=0)


def _check_layout(m: ModelConfig, tp: int, pp: int, bucket_size: Optional[int]) -> None:
    if m.num_heads % tp or m.ffn_hidden_size and m.ffn_hidden_size % tp:
        raise JobFormatError(f"--tp {tp} does not divide the model's heads ({m.num_heads}) and ffn size")
    if m.num_layers % pp:
        raise JobFormatError(f"pp={pp} does not divide model.num_layers={m.num_layers}; Megatron-LM's even "
                             f"split needs a pp that does")
    if bucket_size is not None and bucket_size < 1:
        raise JobFormatError(f"bucket_size={bucket_size}: give a positive number of elements, or None for one bucket")


def export_megatron_legacy(job: JobState, m: ModelConfig, o: OptimConfig, save_dir: str, lr: float,
                           tp: int = 1, pp: int = 1, bucket_size: Optional[int] = None) -> str:
    """Write ``save_dir``/iter_NNNNNNN/mp_rank_TT[_PPP] (``tp`` x ``pp`` ranks, the ``_PPP`` suffix only when
    pp > 1) as Megatron-LM's torch format saves a job with the distributed optimizer, and the tracker file;
    returns the iteration directory. ``bucket_size`` (elements) splits the first stage's ``distrib_optim.pt`` as
    ``--overlap-grad-reduce --ddp-bucket-size`` does (None: one bucket, overlap off)."""
    check_model("megatron_legacy", m, "gpt2")
    _check_layout(m, tp, pp, bucket_size)
    step = m.make_vocab_size_divisible_by * tp
    padded = math.ceil(job.canonical["word.weight"]["master"].shape[0] / step) * step
    where = os.path.join(save_dir, f"iter_{job.iteration:07d}")
    args = _args(job, m, tp, pp, padded, bucket_size)
    for (t, s), tensors in _rank_tensors(job, m, tp, pp, padded).items():
        rank_dir = os.path.join(where, f"mp_rank_{t:02d}" + (f"_{s:03d}" if pp > 1 else ""))
        os.makedirs(rank_dir)
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": job.iteration,
                    "model": tensors["master"], "optimizer": {"optimizer": {"param_groups": param_groups(job, o, lr)}},
                    "opt_param_scheduler": {"max_lr": o.lr, "min_lr": o.min_lr, "num_steps": job.consumed_samples},
                    "num_floating_point_operations_so_far": 0}, os.path.join(rank_dir, "model_optim_rng.pt"))
        params = [(k, v.numel()) for k, v in tensors["master"].items()]
        bucket, shared = stage_buffer(bucket_size, s, pp)
        torch.save(param_state(tensors, params, bucket, shared), os.path.join(rank_dir, "distrib_optim.pt"))
    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(job.iteration))
    return where
