"""A random Hugging Face Llama saved locally (nothing downloaded), shaped like a MegaTier ``model.arch=llama``
ModelConfig, with non-trivial RMSNorm weights."""
from __future__ import annotations

import torch

from megatier.config import ModelConfig
from megatier.config.schema import ffn_size


def save_random_llama(path: str, cfg: ModelConfig, vocab_size: int, seed: int = 0, **overrides):
    """Save a LlamaForCausalLM of ``cfg``'s shape with weights perturbed off their init; returns it in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=ffn_size(cfg),
                         num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                         num_key_value_heads=cfg.num_query_groups or cfg.num_heads,
                         max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.norm_eps,
                         rope_theta=cfg.rope_theta, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                         bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1, **overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # non-trivial RMSNorms, larger logits than the 0.02 init
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    model.save_pretrained(path)
    return model.eval()


def greedy(next_logits, prompt: torch.Tensor, n: int = 20) -> torch.Tensor:
    """``n`` tokens chosen greedily after ``prompt`` by ``next_logits(tokens) -> (b, vocab)``."""
    tokens = prompt
    for _ in range(n):
        tokens = torch.cat([tokens, next_logits(tokens).argmax(-1, keepdim=True)], dim=1)
    return tokens[:, prompt.shape[1]:]
