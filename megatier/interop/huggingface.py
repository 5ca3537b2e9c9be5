"""Hugging Face model directories for either architecture: export and import by ``model.arch``.

    export_hf(state, model_cfg, out_dir, tokenizer=...)   GPT2LMHeadModel (gpt2), LlamaForCausalLM (llama) or
                                                          MixtralForCausalLM (llama with model.moe)
    load_hf(path, model_cfg, vocab_size)                  the canonical state of such a directory
"""
from __future__ import annotations

from typing import Optional

import torch

from megatier.config import ModelConfig
from megatier.interop.gpt2 import export_gpt2, load_gpt2
from megatier.interop.llama import export_llama, load_llama
from megatier.interop.mixtral import export_mixtral, load_mixtral

_EXPORT = {"gpt2": export_gpt2, "llama": export_llama, "mixtral": export_mixtral}
_LOAD = {"gpt2": load_gpt2, "llama": load_llama, "mixtral": load_mixtral}


def hf_kind(model_cfg: ModelConfig) -> str:
    """The Hugging Face model a MegaTier model exchanges weights with: model.arch's, Mixtral's with experts."""
    return "mixtral" if model_cfg.arch == "llama" and model_cfg.moe.num_experts else model_cfg.arch


def export_hf(state: dict[str, torch.Tensor], model_cfg: ModelConfig, out_dir: str, *,
              tokenizer: Optional[dict] = None) -> None:
    _EXPORT[hf_kind(model_cfg)](state, model_cfg, out_dir, tokenizer=tokenizer)


def load_hf(path: str, model_cfg: ModelConfig, vocab_size: int) -> dict[str, torch.Tensor]:
    return _LOAD[hf_kind(model_cfg)](path, model_cfg, vocab_size)
