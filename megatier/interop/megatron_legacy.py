"""Continue a GPT-2-shaped job from Megatron-LM's legacy checkpoint (``--ckpt-format torch``).

``<save>/iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt`` holds, per tensor- (and pipeline-) parallel rank,
``{"iteration", "args", "model": <the GPTModel's state_dict, this rank's slices>, "optimizer",
"opt_param_scheduler", "rng_state", ...}``; ``latest_checkpointed_iteration.txt`` names the newest. The ranks'
slices are joined along Megatron's tensor-parallel dimension of each parameter (column-parallel: rows,
row-parallel: columns, the vocabulary: rows), the pipeline stages' local layer numbers made global, and the
result is the stacked ``torch_dist`` layout :mod:`megatier.interop.megatron_dist` reads.

Only the weights, the iteration and the consumed samples carry over: the legacy optimizer state is keyed by
Megatron's parameter-group order (and with the distributed optimizer lives in ``distrib_optim.pt`` buckets),
which MegaTier does not reconstruct, so Adam's moments start at zero (said in one line). Export is to
``torch_dist``, Megatron's default since core 0.7.
"""
from __future__ import annotations

import os
import re
from typing import Optional

import torch

from megatier.config import ModelConfig, OptimConfig
from megatier.interop.job_state import JobFormatError, JobState, check_model, check_shapes
from megatier.interop.megatron_dist import check_keys, to_canonical, tracked_iteration

# Local-spec names -> the names torch_dist uses (Transformer Engine's fused layer norms).
_ALIASES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
            "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
            "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
            "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias"}
_COLUMNS = ("linear_proj.weight", "linear_fc2.weight")  # row-parallel: split along the input (dim 1)
_REPLICATED = ("layer_norm", "layernorm", "linear_proj.bias", "linear_fc2.bias", "position_embeddings")


def _iteration_dir(path: str) -> str:
    path = os.path.expanduser(path)
    ranks = any(d.startswith("mp_rank_") for d in (os.listdir(path) if os.path.isdir(path) else []))
    return tracked_iteration(path, ranks, "mp_rank_* directories")


def _ranks(where: str) -> dict[tuple[int, int], dict]:
    """(tp rank, pp rank) -> that rank's loaded model_optim_rng.pt."""
    out = {}
    for name in sorted(os.listdir(where)):
        match = re.fullmatch(r"mp_rank_(\d+)(?:_(\d+))?", name)
        if match:
            path = os.path.join(where, name, "model_optim_rng.pt")
            out[(int(match.group(1)), int(match.group(2) or 0))] = torch.load(path, map_location="cpu",
                                                                               weights_only=False)
    if not out:
        raise JobFormatError(f"{where} has no mp_rank_*/model_optim_rng.pt")
    return out


def _tp_dim(key: str) -> Optional[int]:
    if any(part in key for part in _REPLICATED):
        return None
    return 1 if key.endswith(_COLUMNS) else 0


def _stage_layers(ckpts: dict[tuple[int, int], dict]) -> dict[int, int]:
    """pp rank -> its first global layer (stages in order, each as many layers as its keys number)."""
    firsts, start = {}, 0
    for pp in sorted({p for _, p in ckpts}):
        firsts[pp] = start
        layers = {int(m.group(1)) for k in ckpts[(0, pp)]["model"] if (m := re.match(r"decoder\.layers\.(\d+)\.", k))}
        start += len(layers)
    return firsts


def _stacked(ckpts: dict[tuple[int, int], dict]) -> dict[str, torch.Tensor]:
    """The ranks' model slices as torch_dist's keys: joined over tp, layers global and stacked."""
    tps, firsts = sorted({t for t, _ in ckpts}), _stage_layers(ckpts)
    layers: dict[str, dict[int, torch.Tensor]] = {}
    flat = {}
    for (tp, pp), ckpt in ckpts.items():
        if tp != 0:
            continue
        for key, value in ckpt["model"].items():
            if "_extra_state" in key or not isinstance(value, torch.Tensor):
                continue
            dim = _tp_dim(key)
            full = value if dim is None else torch.cat([ckpts[(t, pp)]["model"][key] for t in tps], dim=dim)
            match = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", key)
            if match is None:
                flat[key] = full
                continue
            rest = _ALIASES.get(match.group(2), match.group(2))
            layers.setdefault(f"decoder.layers.{rest}", {})[firsts[pp] + int(match.group(1))] = full
    for key, by_layer in layers.items():
        flat[key] = torch.stack([by_layer[i] for i in sorted(by_layer)])
    return flat


def load_megatron_legacy(path: str, m: ModelConfig, vocab: int, o: Optional[OptimConfig] = None) -> JobState:
    """The job of the legacy checkpoint ``path`` (an iteration directory or Megatron-LM's --save directory)."""
    check_model("megatron_legacy", m, "gpt2")
    where = _iteration_dir(path)
    ckpts = _ranks(where)
    flat = _stacked(ckpts)
    check_keys(flat, where)
    notes = ["optimizer: the legacy optimizer state is not read: Adam's moments start at zero, step 0",
             "not carried: the RNG states, fp8 scaling state and the arguments (MegaTier's config rules)"]
    canonical = to_canonical(flat, m, vocab, [])
    check_shapes(canonical, m, vocab, where)
    first = ckpts[min(ckpts)]
    args = first.get("args")
    samples = getattr(args, "consumed_train_samples", None) if args is not None else None
    return JobState(canonical, int(first.get("iteration", 0)), 0, consumed_samples=samples,
                    source=f"Megatron-LM legacy checkpoint {where} ({len(ckpts)} ranks)", notes=notes)
