"""Hugging Face model directories for either architecture: export and import by ``model.arch``.

    export_hf(state, model_cfg, out_dir, tokenizer=...)   GPT2LMHeadModel (gpt2); for llama: LlamaForCausalLM,
                                                          Qwen2ForCausalLM (model.qkv_bias), MixtralForCausalLM
                                                          (model.moe that Mixtral computes) or Qwen2MoeForCausalLM
                                                          (model.moe with a shared expert, or q/k/v biases)
    load_hf(path, model_cfg, vocab_size)                  the canonical state of such a directory; a llama model
                                                          reads any of the four, by the directory's model_type
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch

from megatier.config import ModelConfig
from megatier.interop.gpt2 import export_gpt2, load_gpt2
from megatier.interop.hf_files import HFFormatError
from megatier.interop.llama import export_llama, load_llama
from megatier.interop.mixtral import check_representable as mixtral_represents
from megatier.interop.mixtral import export_mixtral, load_mixtral
from megatier.interop.qwen2_moe import export_qwen2, load_qwen2

_EXPORT = {"gpt2": export_gpt2, "llama": export_llama, "mixtral": export_mixtral, "qwen2": export_qwen2,
           "qwen2_moe": export_qwen2}
_LOAD = {"gpt2": load_gpt2, "llama": load_llama, "mixtral": load_mixtral, "qwen2": load_qwen2,
         "qwen2_moe": load_qwen2}
_LLAMA_FAMILY = ("llama", "mixtral", "qwen2", "qwen2_moe")
_MOE_KINDS = ("mixtral", "qwen2_moe")
_WITHOUT_QKV_BIAS = ("llama", "mixtral")


def hf_kind(model_cfg: ModelConfig) -> str:
    """The Hugging Face model a MegaTier model exports to: model.arch's; for llama with experts Mixtral's if it
    computes the model, else Qwen2-MoE's; Qwen2's for a dense llama with q/k/v biases."""
    if model_cfg.arch != "llama":
        return model_cfg.arch
    if not model_cfg.moe.num_experts:
        return "qwen2" if model_cfg.qkv_bias else "llama"
    if model_cfg.qkv_bias:
        return "qwen2_moe"
    try:
        mixtral_represents(model_cfg)
    except HFFormatError:
        return "qwen2_moe"
    return "mixtral"


def _directory_kind(path: str) -> Optional[str]:
    """The model_type of directory ``path``'s config.json, if it reads (the loaders report what does not)."""
    try:
        with open(os.path.join(os.path.expanduser(path), "config.json")) as f:
            return json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def export_hf(state: dict[str, torch.Tensor], model_cfg: ModelConfig, out_dir: str, *,
              tokenizer: Optional[dict] = None) -> None:
    _EXPORT[hf_kind(model_cfg)](state, model_cfg, out_dir, tokenizer=tokenizer)


def load_hf(path: str, model_cfg: ModelConfig, vocab_size: int) -> dict[str, torch.Tensor]:
    kind = hf_kind(model_cfg)
    if model_cfg.arch == "llama":
        found = _directory_kind(path)  # one of the readers for the model's kind (dense or MoE)
        if found in _LLAMA_FAMILY and (found in _MOE_KINDS) == bool(model_cfg.moe.num_experts):
            kind = found
        if model_cfg.qkv_bias and kind in _WITHOUT_QKV_BIAS:
            raise HFFormatError(f"{path} holds a {kind} (no q/k/v biases) but model.qkv_bias=true; set "
                                f"model.qkv_bias=false to load it")
    return _LOAD[kind](path, model_cfg, vocab_size)
