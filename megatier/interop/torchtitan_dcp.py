"""Move a Llama job between MegaTier and torchtitan's DCP checkpoints (``<folder>/step-N/``).

torchtitan's CheckpointManager saves one torch.distributed.checkpoint (DCP) directory per step holding, as
flattened keys: the model's parameters at the top level (``tok_embeddings.weight``, ...), its AdamW state as
``optimizer.state.<fqn>.{step,exp_avg,exp_avg_sq}`` and ``optimizer.param_groups.<fqn>.<setting>`` (the
FQN-keyed layout of its OptimizersContainer), ``lr_scheduler.last_epoch``, ``train_state.{step,ntokens_seen}``
and ``dataloader.*``. Its Llama fuses the query, key and value projections into one ``qkv_linear.wqkv`` whose
optimizer state is kept fused (rows per kv group: its query heads, its key, its value), while the model's keys
are the split ``wq``/``wk``/``wv``; an export writes the same. DCP is layout-free: any torchtitan FSDP/TP
sharding reads back as full tensors here.

Name map (per layer i; torchtitan <= 0.2 spells ``attention.wq`` without ``qkv_linear.``, also read)::

    word.weight               tok_embeddings.weight
    layers.i.ln1.weight       layers.i.attention_norm.weight
    layers.i.attn.q.weight    layers.i.attention.qkv_linear.wq.weight       rows permuted (below)
    layers.i.attn.kv.weight   ...qkv_linear.wk.weight (permuted) and wv.weight, stacked
    layers.i.attn.proj.weight layers.i.attention.wo.weight
    layers.i.ln2.weight       layers.i.ffn_norm.weight
    layers.i.mlp.gate_up.weight layers.i.feed_forward.w1.weight and w3.weight, stacked
    layers.i.mlp.proj.weight  layers.i.feed_forward.w2.weight
    final_norm.weight         norm.weight
    head_weight               lm_head.weight

torchtitan's rotary embedding rotates interleaved pairs, MegaTier's (as Hugging Face's) the two halves of each
head, so wq and wk carry each head's rows in another order: the permutation of torchtitan's own Hugging Face
adapter. It reorders rows only, so weights and both moments move bitwise.
"""
from __future__ import annotations

import os
import re
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatier.config import ModelConfig, OptimConfig
from megatier.interop.job_state import KINDS, JobFormatError, JobState, as_fp32, check_model, check_shapes

_BLOCK = [("ln1.weight", ("attention_norm.weight",)),
          ("attn.q.weight", ("attention.qkv_linear.wq.weight",)),
          ("attn.kv.weight", ("attention.qkv_linear.wk.weight", "attention.qkv_linear.wv.weight")),
          ("attn.proj.weight", ("attention.wo.weight",)),
          ("ln2.weight", ("ffn_norm.weight",)),
          ("mlp.gate_up.weight", ("feed_forward.w1.weight", "feed_forward.w3.weight")),
          ("mlp.proj.weight", ("feed_forward.w2.weight",))]
_SECTIONS = ("optimizer.", "lr_scheduler.", "dataloader", "train_state.")
_ADAM = {"step", "exp_avg", "exp_avg_sq"}


def name_map(num_layers: int) -> list[tuple[str, tuple[str, ...]]]:
    """(MegaTier name, the torchtitan names stacked into it) for every tensor of the model."""
    names = [("word.weight", ("tok_embeddings.weight",))]
    for i in range(num_layers):
        names += [(f"layers.{i}.{ours}", tuple(f"layers.{i}.{t}" for t in theirs)) for ours, theirs in _BLOCK]
    return names + [("final_norm.weight", ("norm.weight",)), ("head_weight", ("lm_head.weight",))]


def _heads(fqn: str, m: ModelConfig) -> Optional[int]:
    """The heads whose rows of ``fqn`` are permuted between the rotary conventions (None: not permuted)."""
    if fqn.endswith(".wq.weight"):
        return m.num_heads
    if fqn.endswith(".wk.weight"):
        return m.num_query_groups or m.num_heads
    return None


def to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of interleaved rotary pairs -> rows of rotated halves (torchtitan -> MegaTier)."""
    return w.view(heads, w.shape[0] // heads // 2, 2, w.shape[1]).transpose(1, 2).reshape(w.shape).contiguous()


def to_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of :func:`to_halves` (MegaTier -> torchtitan)."""
    return w.view(heads, 2, w.shape[0] // heads // 2, w.shape[1]).transpose(1, 2).reshape(w.shape).contiguous()


def step_dir(path: str) -> str:
    """The DCP directory of ``path``: itself, or its newest ``step-N`` (torchtitan's checkpoint folder)."""
    path = os.path.expanduser(path)
    if os.path.isfile(os.path.join(path, ".metadata")):
        return path
    steps = [(int(m.group(1)), d) for d in (os.listdir(path) if os.path.isdir(path) else [])
             if (m := re.fullmatch(r"step-(\d+)", d)) and os.path.isfile(os.path.join(path, d, ".metadata"))]
    if not steps:
        raise JobFormatError(f"{path} is neither a DCP checkpoint (no .metadata) nor a torchtitan checkpoint folder "
                             f"with step-N directories; give torchtitan's checkpoint.folder or one step-N in it")
    return os.path.join(path, max(steps)[1])


def read_dcp(path: str) -> dict[str, object]:
    """Every key of the DCP checkpoint at ``path`` as a full tensor (or the object saved), in this process."""
    reader = FileSystemReader(path)
    meta = reader.read_metadata().state_dict_metadata
    state = {k: torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
             for k, md in meta.items()}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def _renamed(flat: dict[str, object]) -> dict[str, object]:
    """torchtitan <= 0.2's ``attention.w{q,k,v}`` under 0.3's ``attention.qkv_linear.w{q,k,v}``."""
    return {re.sub(r"\.attention\.(w[qkv]\.)", r".attention.qkv_linear.\1", k): v for k, v in flat.items()}


def _fused_parts(m: ModelConfig) -> tuple[int, int]:
    groups = m.num_query_groups or m.num_heads
    return groups, m.num_heads // groups


def _split_fused(flat: dict[str, object], m: ModelConfig) -> dict[str, object]:
    """Optimizer state of torchtitan's fused ``qkv_linear.wqkv`` (rows per kv group: its query heads, its key,
    its value) as the state of the ``wq``/``wk``/``wv`` the model's own keys use."""
    groups, per = _fused_parts(m)
    out = {}
    for key, value in flat.items():
        match = re.fullmatch(r"(optimizer\.(?:state|param_groups)\..*\.qkv_linear\.)wqkv(\.weight\..+)", key)
        if match is None:
            out[key] = value
        elif not isinstance(value, torch.Tensor) or value.dim() != 2:
            out.update({f"{match.group(1)}{w}{match.group(2)}": value for w in ("wq", "wk", "wv")})
        else:
            w = value.reshape(groups, per + 2, -1, value.shape[1])
            parts = (w[:, :per], w[:, per], w[:, per + 1])
            out.update({f"{match.group(1)}{n}{match.group(2)}": p.reshape(-1, value.shape[1]).contiguous()
                        for n, p in zip(("wq", "wk", "wv"), parts)})
    return out


def _fuse(optim: dict[str, object], m: ModelConfig) -> dict[str, object]:
    """The inverse of :func:`_split_fused` on an export's optimizer keys (``state.``/``param_groups.`` ...)."""
    groups, per = _fused_parts(m)
    out = {k: v for k, v in optim.items() if ".qkv_linear.w" not in k}
    for key in [k for k in optim if ".qkv_linear.wq." in k]:
        fused = key.replace(".wq.", ".wqkv.")
        q, k, v = (optim[key.replace(".wq.", f".{w}.")] for w in ("wq", "wk", "wv"))
        if isinstance(q, torch.Tensor) and q.dim() == 2:
            q, k, v = (t.reshape(groups, -1, *t.shape[-1:]).reshape(groups, n, -1, t.shape[-1])
                       for t, n in ((q, per), (k, 1), (v, 1)))
            q = torch.cat([q, k, v], dim=1).reshape(-1, q.shape[-1])
        out[fused] = q
    return out


def _model_tensors(flat: dict[str, object], m: ModelConfig, where: str) -> dict[str, torch.Tensor]:
    wanted = {t for _, theirs in name_map(m.num_layers) for t in theirs}
    model = {k: v for k, v in flat.items() if not k.startswith(_SECTIONS)}
    extra = sorted(model.keys() - wanted)
    if extra:
        raise JobFormatError(f"{where}: MegaTier's Llama cannot represent {extra[0]} ({len(extra)} such keys: its "
                             f"block has no biases, no qk-norm, no experts; a tied head has no lm_head)")
    missing = sorted(wanted - model.keys())
    if missing:
        raise JobFormatError(f"{where} has no {missing[0]}; set model.num_layers and the shape to the checkpoint's")
    return model


def _kind(flat: dict[str, object], fqn: str, kind: str, notes: list[str]) -> Optional[torch.Tensor]:
    if kind == "master":
        return as_fp32(flat[fqn], "the weights", notes)
    value = flat.get(f"optimizer.state.{fqn}.{kind}")
    return None if value is None else as_fp32(value, "Adam's moments", notes)


def _canonical(flat: dict[str, object], m: ModelConfig, notes: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    state = {}
    for ours, theirs in name_map(m.num_layers):
        state[ours] = {}
        for kind in KINDS:
            parts = [_kind(flat, t, kind, notes) for t in theirs]
            if any(p is None for p in parts):
                parts = [torch.zeros_like(flat[t], dtype=torch.float32) for t in theirs]
            parts = [p if _heads(t, m) is None else to_halves(p, _heads(t, m)) for p, t in zip(parts, theirs)]
            state[ours][kind] = torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
    return state


def _optimizer_notes(flat: dict[str, object], o: Optional[OptimConfig]) -> list[str]:
    kinds = {k.rsplit(".", 1)[1] for k in flat if k.startswith("optimizer.state.")}
    if not kinds:
        return ["optimizer: none in the checkpoint (a model-only save): Adam's moments start at zero, step 0"]
    out = [] if kinds <= _ADAM else [f"optimizer: state {sorted(kinds - _ADAM)} is not AdamW's; only exp_avg "
                                     f"and exp_avg_sq carry over"]
    group = {k.rsplit(".", 1)[1]: v for k, v in flat.items() if k.startswith("optimizer.param_groups.tok_embeddings")}
    if o is not None and group.get("betas") not in (None, (o.beta1, o.beta2), [o.beta1, o.beta2]):
        out.append(f"optimizer: the source's betas {group['betas']} differ from optim.beta1/beta2 "
                   f"({o.beta1}, {o.beta2}); MegaTier continues with its own")
    if o is not None and group.get("eps") not in (None, o.eps):
        out.append(f"optimizer: the source's eps {group['eps']} differs from optim.eps={o.eps}")
    return out


def _scalar(value: object) -> Optional[float]:
    return None if value is None else float(value.item() if isinstance(value, torch.Tensor) else value)


def _schedule_notes(flat: dict[str, object], o: Optional[OptimConfig], where: str) -> list[str]:
    """torchtitan's LR scheduler keeps only its position (``lr_scheduler.last_epoch``); the base rate of each
    param group (``initial_lr``) and the rate it reached (``lr``) are the rest of its schedule a checkpoint
    records. Per-group base rates are refused (MegaTier has one optim.lr), a position other than the step and a
    base rate other than optim.lr are said."""
    base = {k: _scalar(v) for k, v in flat.items() if k.startswith("optimizer.param_groups.")
            and k.endswith(".initial_lr")}
    first = next(iter(base.items()), None)
    odd = next((k for k, v in base.items() if v != first[1]), None) if first else None
    if odd is not None:
        raise JobFormatError(f"{where}: {odd}={base[odd]} but {first[0]}={first[1]}: per-parameter base rates are "
                             f"a schedule MegaTier cannot represent (one optim.lr for every parameter)")
    out = []
    if first and o is not None and first[1] != o.lr:
        out.append(f"learning rate: the source's base rate {first[0]}={first[1]:.6g} differs from optim.lr={o.lr:.6g}; "
                   f"MegaTier's schedule follows optim.*")
    position, step = flat.get("lr_scheduler.last_epoch"), flat.get("train_state.step")
    if position is not None and step is not None and int(_scalar(position)) != int(_scalar(step)):
        out.append(f"learning rate: lr_scheduler.last_epoch={int(_scalar(position))} is not train_state.step="
                   f"{int(_scalar(step))}; MegaTier's schedule is a function of the step and continues from the step")
    return out


def _dataloader_note(flat: dict[str, object]) -> str:
    keys = sorted(k for k in flat if k.startswith("dataloader."))
    if not keys:
        return "not carried: the RNG (MegaTier's dropout follows train.seed and the step); no dataloader state saved"
    return (f"not carried: {keys[0]} ({len(keys)} dataloader keys: torchtitan's pickled loader over its own dataset "
            f"and tokenizer, per dp rank) and the RNG; MegaTier's data order follows train.seed and the step, and "
            f"train_state.ntokens_seen carries as the tokens consumed")


def load_torchtitan(path: str, m: ModelConfig, vocab: int, o: Optional[OptimConfig] = None) -> JobState:
    """The job of torchtitan checkpoint ``path`` (a step-N directory or its folder) for a model of ``m``."""
    check_model("torchtitan", m, "llama")
    where = step_dir(path)
    flat = _split_fused(_renamed(read_dcp(where)), m)
    _model_tensors(flat, m, where)
    notes: list[str] = []
    canonical = _canonical(flat, m, notes)
    check_shapes(canonical, m, vocab, where)
    adam = _scalar(flat.get("optimizer.state.tok_embeddings.weight.step")) or 0.0
    step = flat.get("train_state.step", flat.get("lr_scheduler.last_epoch", adam))
    tokens = flat.get("train_state.ntokens_seen")
    notes += _optimizer_notes(flat, o) + _schedule_notes(flat, o, where) + [_dataloader_note(flat)]
    return JobState(canonical, int(_scalar(step)), int(adam), consumed_tokens=None if tokens is None else int(tokens),
                    next_lr=_scalar(flat.get("optimizer.param_groups.tok_embeddings.weight.lr")),
                    source=f"torchtitan DCP {where}", notes=notes)


def _adamw_group(o: OptimConfig, lr: float, decay: bool) -> dict[str, object]:
    """torch.optim.AdamW's param-group settings in this torch and the LR scheduler's initial_lr (the keys
    torchtitan's loader expects)."""
    group = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=lr, betas=(o.beta1, o.beta2), eps=o.eps,
                              weight_decay=o.weight_decay if decay else 0.0).param_groups[0]
    return {**{k: v for k, v in group.items() if k != "params"}, "initial_lr": o.lr}


def export_torchtitan(job: JobState, m: ModelConfig, o: OptimConfig, out_dir: str, lr: float) -> str:
    """Write ``out_dir``/step-N as torchtitan's CheckpointManager does; returns that directory. ``lr``: the rate
    of step N+1 (the param groups' lr after torchtitan's scheduler step). MegaTier decays matrices only, so the
    param groups say weight_decay 0 for the norms."""
    check_model("torchtitan", m, "llama")
    model, optim = {}, {}
    for ours, theirs in name_map(m.num_layers):
        sizes = [len(t) for t in job.canonical[ours]["master"].chunk(len(theirs), dim=0)]
        for kind in KINDS:
            parts = job.canonical[ours][kind].detach().to(torch.float32).split(sizes, dim=0)
            for fqn, part in zip(theirs, parts):
                part = part.contiguous() if _heads(fqn, m) is None else to_pairs(part, _heads(fqn, m))
                if kind == "master":
                    model[fqn] = part.clone()
                else:
                    optim[f"state.{fqn}.{kind}"] = part.clone()
        for fqn in theirs:
            optim[f"state.{fqn}.step"] = torch.tensor(float(job.adam_steps))
            decay = job.canonical[ours]["master"].dim() >= 2
            optim.update({f"param_groups.{fqn}.{k}": v for k, v in _adamw_group(o, lr, decay).items()})
    tokens = job.consumed_tokens or 0
    state = {**model, "optimizer": _fuse(optim, m), "lr_scheduler": {"last_epoch": job.iteration},
             "train_state": {"step": job.iteration, "ntokens_seen": tokens}}
    where = os.path.join(out_dir, f"step-{job.iteration}")
    dcp.save(state, checkpoint_id=where, no_dist=True)
    return where
