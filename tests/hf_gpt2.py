"""A random Hugging Face GPT-2 saved locally (nothing downloaded), shaped like a MegaTier ModelConfig."""
from __future__ import annotations

import torch

from megatier.config import ModelConfig


def save_random_gpt2(path: str, cfg: ModelConfig, vocab_size: int, seed: int = 0, **overrides):
    """Save a GPT2LMHeadModel of ``cfg``'s shape with weights perturbed off their init; returns it in eval mode."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=cfg.hidden_size, n_layer=cfg.num_layers, n_head=cfg.num_heads,
                        n_positions=cfg.max_position_embeddings, n_inner=cfg.ffn_hidden_size, vocab_size=vocab_size,
                        layer_norm_epsilon=cfg.norm_eps, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1, **overrides)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # non-trivial LayerNorms and biases, larger logits than the 0.02 init
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    model.save_pretrained(path)
    return model.eval()


def expected_state(model, num_layers: int) -> dict[str, torch.Tensor]:
    """MegaTier name -> the HF model's tensor in MegaTier orientation (Conv1D weights transposed)."""
    from megatier.interop.gpt2 import name_map

    hf = model.state_dict()
    return {ours: (hf[theirs].t() if transposed else hf[theirs]) for ours, theirs, transposed in name_map(num_layers)}


@torch.no_grad()
def hf_loss(model, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean per-token loss of the HF model over equal-sized micro-batches of (tokens, shifted labels)."""
    losses = [torch.nn.functional.cross_entropy(model(x).logits.flatten(0, 1), y.flatten()) for x, y in microbatches]
    return float(torch.stack(losses).mean())
