"""GPT-2 on tensor-parallel layers; one instance is one pipeline stage.

GPT-2 architecture: learned positions, pre-LayerNorm blocks, GELU MLP, causal
attention through scaled_dot_product_attention, output head tied to the word
embedding. Parameter names use global layer indices (``layers.7.attn.qkv.weight``)
so a name means the same tensor in every layout.

Pipeline split rule: stage i gets num_layers // pp layers, and the first
num_layers % pp stages get one more (the last stage already carries the head).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatier.config import ModelConfig
from megatier.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatier.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    mark_partition,
    shard_of_full,
)
from megatier.parallel.mappings import copy_to_region
from megatier.seeding import derive_seed


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Round the vocabulary up so every tp rank holds an equal slice of a multiple of ``divisible_by``."""
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def stage_layers(num_layers: int, pp: int, pp_rank: int) -> range:
    """Global indices of the layers on pipeline stage ``pp_rank`` (see the module docstring)."""
    base, extra = divmod(num_layers, pp)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


@dataclass(frozen=True)
class StageSpec:
    """Which part of the model this rank holds."""

    layers: range
    is_first: bool
    is_last: bool
    tp_rank: int = 0
    tp: int = 1


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, group: dist.ProcessGroup):
        super().__init__()
        tp = dist.get_world_size(group)
        self.local_heads = cfg.num_heads // tp
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.dropout = cfg.attention_dropout
        # Fused q/k/v; stride 3 keeps each rank's q, k and v heads together.
        self.qkv = ColumnParallelLinear(cfg.hidden_size, 3 * cfg.hidden_size, group=group, stride=3)
        self.proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, 3, self.local_heads, self.head_dim)  # (b, s, 3, nh/tp, hd)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (b, nh/tp, s, hd)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        out = out.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)  # (b, s, h/tp)
        return self.proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, group: dist.ProcessGroup):
        super().__init__()
        ffn = cfg.ffn_hidden_size or 4 * cfg.hidden_size
        self.fc = ColumnParallelLinear(cfg.hidden_size, ffn, group=group)
        self.proj = RowParallelLinear(ffn, cfg.hidden_size, group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))  # GPT-2's GELU


def _layer_norm(cfg: ModelConfig) -> nn.LayerNorm:
    norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_eps)
    mark_partition(norm.weight, None)
    mark_partition(norm.bias, None)
    return norm


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, group: dist.ProcessGroup, hidden_dropout: "HiddenDropout"):
        super().__init__()
        self.ln1 = _layer_norm(cfg)
        self.attn = Attention(cfg, group)
        self.ln2 = _layer_norm(cfg)
        self.mlp = MLP(cfg, group)
        self.hidden_dropout = hidden_dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.hidden_dropout(self.attn(self.ln1(x)))
        return x + self.hidden_dropout(self.mlp(self.ln2(x)))


class HiddenDropout(nn.Module):
    """Dropout on activations that are replicated across tp ranks.

    Draws its mask from a generator seeded identically on every tp rank of a
    model replica, so replicated activations stay identical across tp.
    """

    def __init__(self, p: float, generator: torch.Generator):
        super().__init__()
        self.p = p
        self.generator = generator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = torch.rand(x.shape, generator=self.generator, device=x.device) >= self.p
        return x * keep / (1.0 - self.p)


class GPTStage(nn.Module):
    """The layers of one pipeline stage of a GPT-2 model.

    First stage: word + position embeddings. Last stage: final LayerNorm and the
    LM head, whose weight is the word embedding (the same Parameter when pp == 1,
    a copy kept equal by all-reducing its gradient over the embedding group when pp > 1).
    """

    def __init__(self, cfg: ModelConfig, vocab_size: int, spec: StageSpec, *, tp_group: dist.ProcessGroup,
                 dropout_generator: torch.Generator):
        super().__init__()
        self.cfg, self.spec, self.tp_group = cfg, spec, tp_group
        self.vocab_size = vocab_size
        dropout = HiddenDropout(cfg.hidden_dropout, dropout_generator)
        self.embed_dropout = dropout
        if spec.is_first:
            self.word = VocabParallelEmbedding(vocab_size, cfg.hidden_size, group=tp_group)
            self.pos = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
            mark_partition(self.pos.weight, None)
        self.layers = nn.ModuleDict({str(i): Block(cfg, tp_group, dropout) for i in spec.layers})
        if spec.is_last:
            self.final_norm = _layer_norm(cfg)
            if not spec.is_first:
                self.head_weight = mark_partition(nn.Parameter(torch.empty(vocab_size // spec.tp, cfg.hidden_size)), 0)

    @property
    def output_weight(self) -> nn.Parameter:
        return self.word.weight if self.spec.is_first else self.head_weight

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """x: token ids (b, s) on the first stage, else hidden states (b, s, h).

        Returns hidden states (b, s, h) on non-last stages; on the last stage the
        per-token loss (b, s) when labels are given, else vocab-parallel logits (b, s, V/tp).
        """
        if self.spec.is_first:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.embed_dropout(self.word(x) + self.pos(positions))  # (b, s, h)
        for layer in self.layers.values():
            x = layer(x)
        if not self.spec.is_last:
            return x
        x = copy_to_region(self.final_norm(x), self.tp_group)
        logits = F.linear(x, self.output_weight)  # (b, s, V/tp)
        if labels is None:
            return logits
        vocab_start = self.spec.tp_rank * (self.vocab_size // self.spec.tp)
        return vocab_parallel_cross_entropy(logits, labels, vocab_start=vocab_start, group=self.tp_group)

    def shared_embedding_params(self) -> list[nn.Parameter]:
        """Parameters whose gradients are all-reduced over the embedding group (pp > 1)."""
        if self.spec.is_first == self.spec.is_last:
            return []
        return [self.word.weight] if self.spec.is_first else [self.head_weight]


@torch.no_grad()
def init_weights(model: GPTStage, seed: int) -> None:
    """GPT-2 initialisation, layout independent.

    Each parameter's full tensor is drawn from a generator seeded by (seed, name)
    and this rank keeps its tp slice, so every layout starts from the same model.
    Residual output projections get std / sqrt(2 * num_layers) (GPT-2).
    """
    cfg, spec = model.cfg, model.spec
    for name, param in model.named_parameters():
        init_name = "word.weight" if name == "head_weight" else name
        dim = param.tp_partition_dim
        full_shape = list(param.shape)
        if dim is not None:
            full_shape[dim] *= spec.tp
        owner = name.rsplit(".", 1)[0] if "." in name else ""  # "layers.0.ln1", "" for head_weight
        if name.endswith(".bias"):
            full = torch.zeros(full_shape)
        elif owner.rsplit(".", 1)[-1] in ("ln1", "ln2", "final_norm"):
            full = torch.ones(full_shape)
        else:
            std = cfg.init_std
            if name.endswith("proj.weight"):
                std /= math.sqrt(2 * cfg.num_layers)
            gen = torch.Generator().manual_seed(derive_seed(seed, "init", init_name))
            full = torch.randn(full_shape, generator=gen) * std
        param.copy_(shard_of_full(full, dim, param.tp_partition_stride, spec.tp_rank, spec.tp))


def count_parameters(cfg: ModelConfig, vocab_size: int) -> int:
    """Parameters of the whole (unsharded) model with tied embeddings."""
    h, ffn = cfg.hidden_size, cfg.ffn_hidden_size or 4 * cfg.hidden_size
    per_layer = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * ffn + ffn) + (ffn * h + h)
    return vocab_size * h + cfg.max_position_embeddings * h + cfg.num_layers * per_layer + 2 * h
