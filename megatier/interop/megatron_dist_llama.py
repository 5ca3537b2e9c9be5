"""Move a Llama-shaped job, dense or Mixtral-shaped MoE, between MegaTier and Megatron-core's ``torch_dist``.

The same directory and ``common.pt`` as GPT-2's (:mod:`megatier.interop.megatron_dist`); the GPTModel is
Megatron's Llama (RMSNorm, SwiGLU, rotary on halves as MegaTier's, grouped-query attention, no biases but
optionally q/k/v's, an untied ``output_layer``), with ``num_moe_experts`` its MLPs are MoE layers. Layer-wise
keys, layers stacked on the leading axis, experts on the next (the global expert index, whatever Megatron's
expert parallelism)::

    word.weight                  embedding.word_embeddings.weight            rows padded to Megatron's vocabulary
    layers.i.ln1.weight          decoder.layers.self_attention.linear_qkv.layer_norm_weight[i]
    layers.i.attn.q/kv.weight    decoder.layers.self_attention.linear_qkv.weight[i]   rows per query group (below)
    layers.i.attn.q/kv.bias      decoder.layers.self_attention.linear_qkv.bias[i]     model.qkv_bias (add_qkv_bias)
    layers.i.attn.proj.weight    decoder.layers.self_attention.linear_proj.weight[i]
    layers.i.ln2.weight          decoder.layers.mlp.linear_fc1.layer_norm_weight[i]   (MoE layers too)
    layers.i.mlp.gate_up.weight  decoder.layers.mlp.linear_fc1.weight[i]              gate rows, then up
    layers.i.mlp.proj.weight     decoder.layers.mlp.linear_fc2.weight[i]
    layers.i.moe.router.weight   decoder.layers.mlp.router.weight[i]
    layers.i.moe.experts.e.gate_up.weight  decoder.layers.mlp.experts.experts.linear_fc1.weight[i, e]
    layers.i.moe.experts.e.proj.weight     decoder.layers.mlp.experts.experts.linear_fc2.weight[i, e]
    final_norm.weight            decoder.final_layernorm.weight
    head_weight                  output_layer.weight                          rows padded

Megatron's fused QKV holds, per query group, that group's query heads, its key, its value; MegaTier keeps the
queries (``attn.q``) and the keys then values (``attn.kv``) apart: a row permutation, so weights and moments
move bitwise; Qwen2's q/k/v biases (``model.qkv_bias``, Megatron's ``add_qkv_bias``) the same way. MoE on
every layer only (``model.moe.layer_freq=1``) and no shared expert: Megatron stacks every
layer under one key, so a mix of dense and MoE layers, or its ``shared_experts``, are refused naming the key.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatier.config import ModelConfig
from megatier.interop.job_state import KINDS, JobFormatError, JobState, as_fp32

_OPTIM = {"master": "fp32_param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
_ATTN = {"ln1.weight": "self_attention.linear_qkv.layer_norm_weight",
         "attn.proj.weight": "self_attention.linear_proj.weight", "ln2.weight": "mlp.linear_fc1.layer_norm_weight"}
_DENSE = {"mlp.gate_up.weight": "mlp.linear_fc1.weight", "mlp.proj.weight": "mlp.linear_fc2.weight"}
_EXPERT = {"gate_up.weight": "mlp.experts.experts.linear_fc1.weight",
           "proj.weight": "mlp.experts.experts.linear_fc2.weight"}
_QKV = "decoder.layers.self_attention.linear_qkv.weight"
_QKV_BIAS = "decoder.layers.self_attention.linear_qkv.bias"
_ROUTER = "decoder.layers.mlp.router.weight"
_GLOBAL = {"word.weight": "embedding.word_embeddings.weight", "final_norm.weight": "decoder.final_layernorm.weight",
           "head_weight": "output_layer.weight"}


def check_llama(m: ModelConfig) -> None:
    """Refuse a MegaTier model whose torch_dist form this module does not write, naming the key."""
    e = m.moe
    if e.num_experts and e.layer_freq != 1:
        raise JobFormatError(f"model.moe.layer_freq={e.layer_freq}: Megatron stacks every layer under one key, so "
                             f"torch_dist moves MoE on every layer only (model.moe.layer_freq=1)")
    if e.num_experts and e.shared_expert_hidden_size:
        raise JobFormatError(f"model.moe.shared_expert_hidden_size={e.shared_expert_hidden_size}: Megatron's "
                             f"shared_experts keys are not mapped; torch_dist moves MoE without a shared expert")


def model_keys(m: ModelConfig) -> set[str]:
    """The torch_dist model keys of ``m``."""
    mlp = _EXPERT.values() if m.moe.num_experts else _DENSE.values()
    extra = ([_ROUTER] if m.moe.num_experts else []) + ([_QKV_BIAS] if m.qkv_bias else [])
    return set(_GLOBAL.values()) | {_QKV, *extra} | {f"decoder.layers.{k}" for k in [*_ATTN.values(), *mlp]}


def _groups(m: ModelConfig) -> tuple[int, int, int]:
    groups = m.num_query_groups or m.num_heads
    return groups, m.num_heads // groups, m.hidden_size // m.num_heads


def _fuse_qkv(q: torch.Tensor, kv: torch.Tensor, m: ModelConfig) -> torch.Tensor:
    """Rows of q (heads) and kv (keys, then values) -> Megatron's per-group rows; a weight or a bias."""
    groups, per, d = _groups(m)
    k, v = kv.chunk(2, dim=0)
    parts = [q.reshape(groups, per * d, -1), k.reshape(groups, d, -1), v.reshape(groups, d, -1)]
    return torch.cat(parts, dim=1).reshape(-1, *q.shape[1:]).contiguous()


def _split_qkv(w: torch.Tensor, m: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`_fuse_qkv`."""
    groups, per, d = _groups(m)
    q, k, v = w.reshape(groups, (per + 2) * d, -1).split([per * d, d, d], dim=1)
    rows = w.shape[1:]
    return q.reshape(-1, *rows).contiguous(), torch.cat([k.reshape(-1, *rows), v.reshape(-1, *rows)]).contiguous()


def _padded(value: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([value, value.new_zeros(rows - value.shape[0], *value.shape[1:])]) if value.shape[0] < rows \
        else value


def global_tensors(job: JobState, m: ModelConfig, kind: str, padded_vocab: int) -> dict[str, torch.Tensor]:
    """torch_dist key -> ``kind``'s global tensor of ``job`` (layers stacked, experts next, vocabulary padded)."""
    c, layers = job.canonical, range(m.num_layers)
    out = {theirs: _padded(c[ours][kind].to(torch.float32), padded_vocab) if ours != "final_norm.weight"
           else c[ours][kind].to(torch.float32) for ours, theirs in _GLOBAL.items()}
    for key, part in ((_QKV, "weight"), (_QKV_BIAS, "bias"))[:1 + m.qkv_bias]:
        out[key] = torch.stack([_fuse_qkv(c[f"layers.{i}.attn.q.{part}"][kind], c[f"layers.{i}.attn.kv.{part}"][kind],
                                          m) for i in layers])
    for ours, theirs in _ATTN.items():
        out[f"decoder.layers.{theirs}"] = torch.stack([c[f"layers.{i}.{ours}"][kind] for i in layers])
    if not m.moe.num_experts:
        for ours, theirs in _DENSE.items():
            out[f"decoder.layers.{theirs}"] = torch.stack([c[f"layers.{i}.{ours}"][kind] for i in layers])
        return {k: v.to(torch.float32).contiguous() for k, v in out.items()}
    out[_ROUTER] = torch.stack([c[f"layers.{i}.moe.router.weight"][kind] for i in layers])
    for ours, theirs in _EXPERT.items():
        out[f"decoder.layers.{theirs}"] = torch.stack([torch.stack(
            [c[f"layers.{i}.moe.experts.{e}.{ours}"][kind] for e in range(m.moe.num_experts)]) for i in layers])
    return {k: v.to(torch.float32).contiguous() for k, v in out.items()}


def _value(flat: dict, key: str, kind: str, notes: list[str]) -> Optional[torch.Tensor]:
    name = key if kind == "master" and f"optimizer.state.fp32_param.{key}" not in flat else \
        f"optimizer.state.{_OPTIM[kind]}.{key}"
    value = flat.get(name)
    return None if value is None else as_fp32(value, "the weights" if kind == "master" else "Adam's moments", notes)


def check_llama_keys(flat: dict, m: ModelConfig, where: str) -> None:
    model = {k for k in flat if not k.startswith("optimizer.") and "_extra_state" not in k}
    ours = model_keys(m)
    extra = sorted(model - ours)
    if extra:
        raise JobFormatError(f"{where}: MegaTier's {'MoE ' if m.moe.num_experts else ''}Llama cannot represent "
                             f"{extra[0]} ({len(extra)} such keys: biases other than q/k/v's, qk-layernorm, "
                             f"shared experts or expert bias; model.moe.num_experts={m.moe.num_experts} and "
                             f"model.qkv_bias={str(m.qkv_bias).lower()} must match the checkpoint)")
    missing = sorted(ours - model)
    if missing:
        raise JobFormatError(f"{where} has no {missing[0]}; set model.* (num_layers, model.moe.num_experts) to the "
                             f"checkpoint's model")


def to_canonical_llama(flat: dict, m: ModelConfig, vocab: int, notes: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    state: dict[str, dict[str, torch.Tensor]] = {}
    for kind in KINDS:
        full = {k: _value(flat, k, kind, notes) for k in model_keys(m)}
        if any(v is None for v in full.values()):
            full = {k: torch.zeros_like(_value(flat, k, "master", notes)) for k in full}

        def put(name: str, value: torch.Tensor, kind: str = kind) -> None:
            state.setdefault(name, {})[kind] = value.contiguous()
        for ours, theirs in _GLOBAL.items():
            put(ours, full[theirs][:vocab] if ours != "final_norm.weight" else full[theirs])
        for i in range(m.num_layers):
            for key, part in ((_QKV, "weight"), (_QKV_BIAS, "bias"))[:1 + m.qkv_bias]:
                q, kv = _split_qkv(full[key][i], m)
                put(f"layers.{i}.attn.q.{part}", q)
                put(f"layers.{i}.attn.kv.{part}", kv)
            for ours, theirs in _ATTN.items():
                put(f"layers.{i}.{ours}", full[f"decoder.layers.{theirs}"][i])
            if not m.moe.num_experts:
                for ours, theirs in _DENSE.items():
                    put(f"layers.{i}.{ours}", full[f"decoder.layers.{theirs}"][i])
                continue
            put(f"layers.{i}.moe.router.weight", full[_ROUTER][i])
            for ours, theirs in _EXPERT.items():
                for e in range(m.moe.num_experts):
                    put(f"layers.{i}.moe.experts.{e}.{ours}", full[f"decoder.layers.{theirs}"][i, e])
    return state
