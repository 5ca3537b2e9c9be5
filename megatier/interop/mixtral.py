"""Exchange weights with Hugging Face Mixtral (``transformers.MixtralForCausalLM``) for ``model.arch=llama`` with
``model.moe`` (experts on every layer, no shared expert, Mixtral's router).

Attention, norms, embedding and head map as Llama's (:mod:`megatier.interop.llama`); per layer i and expert e
(the checkpoint's keys, which transformers reads into its fused experts)::

    layers.i.moe.router.weight              model.layers.i.block_sparse_moe.gate.weight
    layers.i.moe.experts.e.gate_up.weight   model.layers.i.block_sparse_moe.experts.e.w1.weight and w3.weight,
                                            stacked (gate first)
    layers.i.moe.experts.e.proj.weight      model.layers.i.block_sparse_moe.experts.e.w2.weight

Loading refuses, naming the key, what MegaTier's block does not compute: Llama's list, router jitter noise, a
sliding window; a model of another shape names the MegaTier keys to set.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from megatier.config import ModelConfig
from megatier.config.schema import expert_ffn_size, ffn_size
from megatier.interop.hf_files import (
    HFFormatError,
    read_config,
)
from megatier.interop.llama import canonical_from, check_llama_config, llama_config, name_map, write_directory
from megatier.model.params import canonical_shapes

SAVED_BY = "megatier-convert export or MixtralForCausalLM.save_pretrained"


def mixtral_name_map(m: ModelConfig) -> list[tuple[str, tuple[str, ...]]]:
    """(MegaTier name, the Hugging Face names stacked into it) for every tensor of the model."""
    names = [(ours, theirs) for ours, theirs in name_map(m.num_layers) if ".mlp." not in ours]
    for i in range(m.num_layers):
        hf = f"model.layers.{i}.block_sparse_moe"
        names.append((f"layers.{i}.moe.router.weight", (f"{hf}.gate.weight",)))
        for e in range(m.moe.num_experts):
            names += [(f"layers.{i}.moe.experts.{e}.gate_up.weight",
                       (f"{hf}.experts.{e}.w1.weight", f"{hf}.experts.{e}.w3.weight")),
                      (f"layers.{i}.moe.experts.{e}.proj.weight", (f"{hf}.experts.{e}.w2.weight",))]
    return names


def check_representable(m: ModelConfig) -> None:
    """Refuse a MegaTier model that MixtralForCausalLM does not compute, naming the key and the fix."""
    e = m.moe
    cannot = [f"{key}={value!r}" for key, value, ok in (
        ("model.moe.layer_freq", e.layer_freq, e.layer_freq == 1),
        ("model.moe.shared_expert_hidden_size", e.shared_expert_hidden_size, e.shared_expert_hidden_size == 0),
        ("model.moe.router_norm", e.router_norm, e.router_norm == "topk_softmax" or e.router_renormalize)) if not ok]
    if e.num_experts == 0 or cannot:
        raise HFFormatError(f"MixtralForCausalLM cannot represent {', '.join(cannot) or 'model.moe.num_experts=0'}"
                            f" (experts on every layer, no shared expert, the top-k weights renormalized)")


def mixtral_config(m: ModelConfig, vocab_size: int, eod_id: Optional[int]) -> dict:
    """config.json of the MixtralForCausalLM computing the same function as a MegaTier model of config ``m``."""
    config = {k: v for k, v in llama_config(m, vocab_size, eod_id).items() if k not in ("mlp_bias", "attention_bias")}
    return {**config, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "intermediate_size": expert_ffn_size(m), "num_local_experts": m.moe.num_experts,
            "num_experts_per_tok": m.moe.top_k, "router_aux_loss_coef": m.moe.aux_loss_coeff,
            "router_jitter_noise": 0.0, "sliding_window": None, "output_router_logits": False}


def check_mixtral_config(config: dict, m: ModelConfig, vocab_size: int, path: str) -> None:
    """Raise one line naming the Mixtral settings that differ from the MegaTier model or that it cannot compute."""
    pairs = [("num_local_experts", config.get("num_local_experts"), "model.moe.num_experts", m.moe.num_experts),
             ("num_experts_per_tok", config.get("num_experts_per_tok"), "model.moe.top_k", m.moe.top_k),
             ("intermediate_size", config.get("intermediate_size"), "model.moe.moe_ffn_hidden_size",
              expert_ffn_size(m))]
    differ = [(hf, theirs, ours, mine) for hf, theirs, ours, mine in pairs if theirs != mine]
    if differ:
        have = ", ".join(f"{hf}={theirs}" for hf, theirs, _, _ in differ)
        fix = " ".join(f"{ours}={theirs}" for _, theirs, ours, _ in differ)
        raise HFFormatError(f"{path} holds a Mixtral with {have}; set {fix} to load it")
    cannot = [f"{key}={config.get(key)!r}" for key, ok in (
        ("router_jitter_noise", not config.get("router_jitter_noise")),
        ("sliding_window", config.get("sliding_window") is None)) if not ok]
    if cannot:
        raise HFFormatError(f"{path}: MegaTier's MoE block cannot represent {', '.join(cannot)} (it has no router "
                            f"noise and attends to the whole sequence)")
    # Llama's checks on the rest (Mixtral's intermediate_size is the experts', checked above)
    check_llama_config({**config, "intermediate_size": ffn_size(m)}, m, vocab_size, path)


def export_mixtral(state: dict[str, torch.Tensor], model_cfg: ModelConfig, out_dir: str, *,
                   tokenizer: Optional[dict] = None) -> None:
    """Write ``out_dir`` so that ``MixtralForCausalLM.from_pretrained(out_dir)`` computes MegaTier's model."""
    check_representable(model_cfg)
    write_directory(state, model_cfg, out_dir, tokenizer, mixtral_name_map(model_cfg), mixtral_config)


def load_mixtral(path: str, model_cfg: ModelConfig, vocab_size: int) -> dict[str, torch.Tensor]:
    """The canonical state (fp32) of the Mixtral directory ``path`` for a model of ``model_cfg`` and vocabulary
    ``vocab_size``; HFFormatError with one line otherwise."""
    check_representable(model_cfg)
    path = os.path.expanduser(path)
    check_mixtral_config(read_config(path, "mixtral", SAVED_BY), model_cfg, vocab_size, path)
    return canonical_from(path, mixtral_name_map(model_cfg), canonical_shapes(model_cfg, vocab_size))
