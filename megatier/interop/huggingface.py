"""Hugging Face model directories for either architecture: export and import by ``model.arch``.

    export_hf(state, model_cfg, out_dir, tokenizer=...)   GPT2LMHeadModel (gpt2) or LlamaForCausalLM (llama)
    load_hf(path, model_cfg, vocab_size)                  the canonical state of such a directory
"""
from __future__ import annotations

from typing import Optional

import torch

from megatier.config import ModelConfig
from megatier.interop.gpt2 import export_gpt2, load_gpt2
from megatier.interop.llama import export_llama, load_llama

_EXPORT = {"gpt2": export_gpt2, "llama": export_llama}
_LOAD = {"gpt2": load_gpt2, "llama": load_llama}


def export_hf(state: dict[str, torch.Tensor], model_cfg: ModelConfig, out_dir: str, *,
              tokenizer: Optional[dict] = None) -> None:
    _EXPORT[model_cfg.arch](state, model_cfg, out_dir, tokenizer=tokenizer)


def load_hf(path: str, model_cfg: ModelConfig, vocab_size: int) -> dict[str, torch.Tensor]:
    return _LOAD[model_cfg.arch](path, model_cfg, vocab_size)
