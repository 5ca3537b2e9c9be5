"""Megatron-core's ``distrib_optim.pt``: the distributed optimizer's state in Megatron-LM's legacy checkpoints.

Next to each ``mp_rank_TT[_PPP]/model_optim_rng.pt`` (whose ``optimizer`` entry keeps only the param groups and
Adam's step), data-parallel rank 0 saves ``DistributedOptimizer.save_parameter_state``: the fp32 main
parameters and Adam's moments of that tensor-/pipeline-parallel rank gathered over the data-parallel group, as

    {"buckets_coalesced": True,
     <buffer index>: {(param dtype, grad dtype): {"param": flat, "exp_avg": flat, "exp_avg_sq": flat,
                                                  "numel_unpadded": N}}}

one flat fp32 tensor per key over the rank's gradient buffer (one buffer per model chunk and dtype; a dense
fp32 or bf16 model with one chunk has buffer 0 alone). The buffer holds the model's trainable parameters in
reverse order (roughly backprop's), each starting at a multiple of 64 elements from its bucket's start (zeros
between), cut into buckets of ``ddp_bucket_size`` elements when gradient reduction overlaps the backward pass
(one bucket otherwise), with a shared embedding in a bucket of its own (pipeline-parallel tied embeddings). Each
bucket's end padding (to a multiple of the data-parallel size and 128) is stripped, so the flat tensors do not
depend on the data-parallel size. Checkpoints of older cores (no ``buckets_coalesced``) keep one tensor per
bucket instead; the same layout, concatenated.

:func:`buffer_layout` rebuilds where each parameter lies from the names and sizes of the rank's parameters
(``model_optim_rng.pt``'s model, in order) and the bucket size; a total other than the file's is refused.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from megatier.interop.job_state import JobFormatError

STATE_KEYS = {"master": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
_ALIGN = 64


def bucket_size_of(args) -> Optional[int]:
    """The gradient buffer's bucket size Megatron-LM's arguments imply (None: one bucket)."""
    if args is None or not getattr(args, "overlap_grad_reduce", False):
        return None
    size = getattr(args, "ddp_bucket_size", None)
    return size if size is not None else max(40_000_000, 1_000_000 * int(getattr(args, "data_parallel_size", 1)))


def buffer_layout(params: list[tuple[str, int]], bucket_size: Optional[int],
                  shared: tuple[str, ...] = ()) -> tuple[dict[str, tuple[int, int]], int]:
    """(name -> (start, end) in the coalesced flat tensors, their length) for ``params`` (name, numel) in the
    model's order, as Megatron-core's _ParamAndGradBuffer places them; ``shared`` names a shared embedding."""
    where, base, pos, count = {}, 0, 0, 0
    for name, numel in reversed(params):
        pos = math.ceil(pos / _ALIGN) * _ALIGN
        if name in shared and count:  # the open bucket ends at this (aligned) start
            base, pos, count = base + pos, 0, 0
        where[name] = (base + pos, base + pos + numel)
        pos, count = pos + numel, count + 1
        if (bucket_size is not None and pos >= bucket_size) or name in shared:
            base, pos, count = base + pos, 0, 0
    return where, base + pos


def _buffer(state: dict, where: str) -> dict:
    buffers = [k for k in state if isinstance(k, int)]
    if buffers != [0] or len(state[0]) != 1:
        raise JobFormatError(f"{where} has gradient buffers {buffers} ({len(state.get(0, {}))} dtypes in the first): "
                             f"more than one model chunk or dtype (virtual pipeline stages, experts, mixed dtypes), "
                             f"which MegaTier's GPT-2 does not have")
    return next(iter(state[0].values()))


def read_param_state(path: str, params: list[tuple[str, int]], shapes: dict[str, torch.Size],
                     bucket_size: Optional[int], shared: tuple[str, ...] = ()) -> dict[str, dict[str, torch.Tensor]]:
    """kind (master, exp_avg, exp_avg_sq) -> name -> this rank's tensor, from the ``distrib_optim.pt`` at
    ``path``; ``params`` and ``shapes`` are the rank's model parameters."""
    tensors = _buffer(torch.load(path, map_location="cpu", weights_only=False), path)
    flat = {kind: tensors[key] for kind, key in STATE_KEYS.items() if key in tensors}
    if "master" not in flat:
        raise JobFormatError(f"{path} holds {sorted(k for k in tensors if isinstance(k, str))}, not the fp32 "
                             f"'param' and Adam's 'exp_avg'/'exp_avg_sq'")
    flat = {k: torch.cat(list(v)) if isinstance(v, (list, tuple)) else v for k, v in flat.items()}
    where, total = buffer_layout(params, bucket_size, shared)
    if flat["master"].numel() != total:
        raise JobFormatError(f"{path}: its flat state has {flat['master'].numel()} elements where the rank's "
                             f"parameters laid out as Megatron-core does take {total} (args.overlap_grad_reduce/"
                             f"ddp_bucket_size give bucket size {bucket_size}); it is not this model's state")
    return {kind: {name: value[s:e].view(shapes[name]) for name, (s, e) in where.items()}
            for kind, value in flat.items()}


def stage_buffer(bucket_size: Optional[int], stage: int, stages: int, tied: bool = True
                 ) -> tuple[Optional[int], tuple[str, ...]]:
    """(bucket size, shared embedding names) of pipeline stage ``stage``'s gradient buffer: Megatron-core's
    DistributedDataParallel buckets the first stage only, and with several stages a tied word embedding (the
    first stage's embedding, the last's copy of it as ``output_layer``) sits in a bucket of its own."""
    shared = () if stages == 1 or not tied else \
        ("embedding.word_embeddings.weight",) if stage == 0 else ("output_layer.weight",)
    return (bucket_size if stage == 0 else None), shared


def param_state(tensors: dict[str, dict[str, torch.Tensor]], params: list[tuple[str, int]],
                bucket_size: Optional[int] = None, shared: tuple[str, ...] = ()) -> dict:
    """A ``distrib_optim.pt``'s content (fp32, buckets of ``bucket_size``, ``shared`` alone in its bucket) for
    kind -> name -> this rank's tensor."""
    where, total = buffer_layout(params, bucket_size, shared)
    out: dict[str, object] = {}
    for kind, key in STATE_KEYS.items():
        flat = torch.zeros(total, dtype=torch.float32)
        for name, (s, e) in where.items():
            flat[s:e] = tensors[kind][name].reshape(-1)
        out[key] = flat
    out["numel_unpadded"] = total
    return {"buckets_coalesced": True, 0: {(torch.float32, torch.float32): out}}
