"""GPT-2 on tensor-parallel layers; one instance is one pipeline stage.

GPT-2 architecture: learned positions, pre-LayerNorm blocks, GELU MLP, causal
attention through scaled_dot_product_attention, output head tied to the word
embedding. Parameter names use global layer indices (``layers.7.attn.qkv.weight``)
so a name means the same tensor in every layout.

Pipeline split rule: stage i gets num_layers // pp layers, and the first
num_layers % pp stages get one more (the last stage already carries the head).

Vocabulary padding is storage only: the word embedding and head hold
``padded_vocab_size`` rows so every tp rank holds an equal slice, but the
logits of padded ids are -inf (zero probability, zero gradient), so the model
computes the same function under every tp. Padded rows start at zero and stay
there (no gradient reaches them; weight decay keeps zero at zero).

Every parameter carries ``full_shape``: the shape of the full, unsharded,
unpadded tensor it is a tp slice of (``(vocab, hidden)`` for the embedding and
head), next to ``tp_partition_dim`` / ``tp_partition_stride``.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatier.config import ModelConfig
from megatier.config.schema import ffn_size, is_moe_layer
from megatier.model import te_layers
from megatier.model.compile import compile_blocks
from megatier.model.fused import fused_layer_norm
from megatier.model.llama import LlamaBlock, RMSNorm, rotary_tables
from megatier.model.moe import RouterMetrics, moe_layers, router_losses
from megatier.model.params import VOCAB_PARAMS, StageSpec, copies_of, padded_vocab_size
from megatier.model.recompute import recomputed
from megatier.parallel.cross_entropy import mask_padded_vocab, vocab_parallel_cross_entropy
from megatier.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    mark_partition,
)
from megatier.parallel.mappings import copy_to_region, gather_from_sequence, scatter_to_sequence
from megatier.seeding import derive_seed
from megatier.slicing import shard_of_full


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, group: dist.ProcessGroup, sequence_parallel: bool = False):
        super().__init__()
        tp = dist.get_world_size(group)
        self.local_heads = cfg.num_heads // tp
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.dropout = cfg.attention_dropout
        self.selective = cfg.recompute == "selective"
        # Fused q/k/v; stride 3 keeps each rank's q, k and v heads together.
        self.qkv = ColumnParallelLinear(cfg.hidden_size, 3 * cfg.hidden_size, group=group, stride=3,
                                        sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, group=group,
                                      sequence_parallel=sequence_parallel)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              dropout_p=self.dropout if self.training else 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # the whole sequence (gathered first under sequence parallelism)
        b, s, _ = qkv.shape
        q, k, v = qkv.view(b, s, 3, self.local_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        out = recomputed(self._core, q, k, v) if self.selective and self.training else self._core(q, k, v)
        out = out.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)  # (b, s, h/tp)
        return self.proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, group: dist.ProcessGroup, sequence_parallel: bool = False):
        super().__init__()
        ffn = ffn_size(cfg)
        self.fc = ColumnParallelLinear(cfg.hidden_size, ffn, group=group, sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear(ffn, cfg.hidden_size, group=group, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))  # GPT-2's GELU


def _layer_norm(cfg: ModelConfig, sequence_parallel: bool = False) -> nn.Module:
    """The final norm of the stage, or a GPT-2 block's: LayerNorm (gpt2), RMSNorm (llama). Under sequence
    parallelism it sees this rank's tokens only, so its parameters' gradients are partial sums over tp."""
    if cfg.arch == "llama":
        return RMSNorm(cfg.hidden_size, cfg.norm_eps, sequence_parallel)
    if cfg.layernorm_impl == "apex":
        norm = fused_layer_norm(cfg.hidden_size, cfg.norm_eps)
    else:
        norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
    for param in (norm.weight, norm.bias):
        mark_partition(param, None)
        if sequence_parallel:
            param.sequence_parallel = True
    return norm


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, group: dist.ProcessGroup, hidden_dropout: "HiddenDropout",
                 sequence_parallel: bool = False):
        super().__init__()
        self.ln1 = _layer_norm(cfg, sequence_parallel)
        self.attn = Attention(cfg, group, sequence_parallel)
        self.ln2 = _layer_norm(cfg, sequence_parallel)
        self.mlp = MLP(cfg, group, sequence_parallel)
        self.hidden_dropout = hidden_dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.hidden_dropout(self.attn(self.ln1(x)))
        return x + self.hidden_dropout(self.mlp(self.ln2(x)))


def _block(cfg: ModelConfig, group: dist.ProcessGroup, hidden_dropout: "HiddenDropout",
           sequence_parallel: bool, layer: int, ep_group: dist.ProcessGroup | None = None) -> nn.Module:
    """Global layer ``layer``'s transformer block of ``model.arch`` and ``model.impl``: native, or on Transformer
    Engine's layers with the same parameter names (``te_layers.TEBlock``); llama's a mixture of experts where
    model.moe puts one."""
    if cfg.impl == "te":
        te_block = te_layers.TELlamaBlock if cfg.arch == "llama" else te_layers.TEBlock
        return te_block(cfg, group, hidden_dropout)
    if cfg.arch == "llama":
        return LlamaBlock(cfg, group, hidden_dropout, sequence_parallel, moe=is_moe_layer(cfg, layer),
                          ep_group=ep_group)
    return Block(cfg, group, hidden_dropout, sequence_parallel)


class HiddenDropout(nn.Module):
    """Dropout on activations that are replicated across tp ranks, or under sequence parallelism cut by tokens.

    Draws its mask from a generator seeded identically on every tp rank of a model replica, so replicated
    activations stay identical across tp. With ``sequence_shard`` (this rank, tp) it draws the mask of the whole
    sequence and keeps this rank's tokens: the masks of a run with and without sequence parallelism are equal.
    """

    def __init__(self, p: float, generator: torch.Generator, sequence_shard: "tuple[int, int] | None" = None):
        super().__init__()
        self.p = p
        self.generator = generator
        self.sequence_shard = sequence_shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.sequence_shard is None:
            keep = torch.rand(x.shape, generator=self.generator, device=x.device) >= self.p
        else:
            rank, size = self.sequence_shard
            whole = (x.shape[0], x.shape[1] * size, *x.shape[2:])
            keep = (torch.rand(whole, generator=self.generator, device=x.device) >= self.p).chunk(size, dim=1)[rank]
        return x * keep / (1.0 - self.p)


class GPTStage(nn.Module):
    """The layers of one pipeline stage of a GPT-2 model.

    First stage: word + position embeddings. Last stage: final LayerNorm and the
    LM head, whose weight is the word embedding (the same Parameter when pp == 1,
    a copy kept equal by all-reducing its gradient over the embedding group when pp > 1).

    ``vocab_size`` is the true vocabulary; the embedding and head are padded to
    ``padded_vocab_size(vocab_size, cfg.make_vocab_size_divisible_by, spec.tp)``
    rows, of which this rank holds [vocab_start, vocab_start + padded / tp).

    ``fp8`` (train.precision=fp8, model.impl=te): the layers run under Transformer Engine's fp8 autocast.
    ``ep_group`` (parallel.ep > 1): the expert-parallel group; its MoE layers hold this rank's share of the experts.
    """

    def __init__(self, cfg: ModelConfig, vocab_size: int, spec: StageSpec, *, tp_group: dist.ProcessGroup,
                 dropout_generator: torch.Generator, fp8: bool = False, sequence_parallel: bool = False,
                 ep_group: dist.ProcessGroup | None = None):
        super().__init__()
        if fp8 and cfg.impl != "te":
            raise ValueError("fp8 runs Transformer Engine's layers in fp8: it needs model.impl=te")
        self.fp8_recipe = te_layers.fp8_recipe() if fp8 else None
        self.cfg, self.spec, self.tp_group = cfg, spec, tp_group
        self.tied = cfg.arch == "gpt2"  # the output head is the word embedding (llama: a parameter of its own)
        self.sequence_parallel = sp = sequence_parallel and spec.tp > 1
        self.vocab_size = vocab_size
        self.padded_vocab_size = padded_vocab_size(vocab_size, cfg.make_vocab_size_divisible_by, spec.tp)
        self.vocab_start = spec.tp_rank * (self.padded_vocab_size // spec.tp)
        dropout = HiddenDropout(cfg.hidden_dropout, dropout_generator, (spec.tp_rank, spec.tp) if sp else None)
        self.embed_dropout = dropout
        if spec.is_first:
            self.word = VocabParallelEmbedding(self.padded_vocab_size, cfg.hidden_size, group=tp_group)
            if cfg.arch == "gpt2":
                self.pos = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
                mark_partition(self.pos.weight, None)
        self.layers = nn.ModuleDict({str(i): _block(cfg, tp_group, dropout, sp, i, ep_group) for i in spec.layers})
        if cfg.compile:
            compile_blocks(self.layers, cfg.compile_backend)
        if spec.is_last:
            self.final_norm = _layer_norm(cfg, sp)
            if not (spec.is_first and self.tied):
                rows = self.padded_vocab_size // spec.tp
                self.head_weight = mark_partition(nn.Parameter(torch.empty(rows, cfg.hidden_size)), 0)
        for kind in spec.replicas:  # CheckFree+'s copies of an end stage's parameters, not used in forward
            self.add_module(f"{kind}_replica", self._replica(kind))
        self.router_metrics = RouterMetrics(cfg.moe.num_experts)
        # The layers of the last forward (all, or one model chunk's) and whether it ended in the head.
        self._ran: tuple[dict[str, nn.Module], bool] = (self.layers, spec.is_last)
        self._record_full_shapes()

    def _replica(self, kind: str) -> nn.Module:
        """A module holding a copy of the parameters of ``kind`` (megatier.parallel.checkfree_plus): the position
        embedding, the word embedding or the head (vocabulary rows cut over tp as theirs), the final norm."""
        h = self.cfg.hidden_size
        if kind == "final_norm":
            return _layer_norm(self.cfg)
        if kind == "pos":
            copy = nn.Embedding(self.cfg.max_position_embeddings, h)
            mark_partition(copy.weight, None)
            return copy
        copy = nn.Module()  # word or head: this rank's vocabulary rows
        copy.weight = mark_partition(nn.Parameter(torch.empty(self.padded_vocab_size // self.spec.tp, h)), 0)
        return copy

    def _record_full_shapes(self) -> None:
        """param.full_shape = the full, unsharded, unpadded shape (vocab rows cut back to the true vocabulary);
        param.copy_of = the parameter a copy holds ("" for one of its own; megatier.model.params.copies_of)."""
        copies = copies_of(self.cfg)
        for name, param in self.named_parameters():
            param.copy_of = copies.get(name, "")
            shape = list(param.shape)
            if param.tp_partition_dim is not None:
                shape[param.tp_partition_dim] *= self.spec.tp
            if name in VOCAB_PARAMS:
                shape[0] = self.vocab_size
            param.full_shape = tuple(shape)

    @property
    def output_weight(self) -> nn.Parameter:
        return self.word.weight if self.spec.is_first and self.tied else self.head_weight

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """x: token ids (b, s) on the first stage, else hidden states (b, s, h) (under sequence parallelism
        (b, s/tp, h): this rank's tokens).

        Returns hidden states on non-last stages (as they came); on the last stage the per-token loss (b, s)
        when labels are given (in training plus model.moe's router losses), else vocab-parallel logits
        (b, s, padded / tp) with -inf in the padded columns.
        """
        self._ran = (self.layers, self.spec.is_last)
        if self.spec.is_first:
            x = self.embed(x)
        x = self.run_layers(x)
        if not self.spec.is_last:
            return x
        out = self.head(x, labels)
        return out if labels is None or not self.training else out + self.router_loss()

    def router_loss(self) -> torch.Tensor | float:
        """model.moe's load-balancing and z-losses of this forward's MoE layers, times their coefficients (0 for
        a dense stage); a scalar the per-token loss takes on, so the objective is their sum as in transformers'
        Mixtral."""
        layers = moe_layers(self._ran[0])
        if not layers:
            return 0.0
        aux, z = router_losses(layers, self.cfg, self.tp_group, self.sequence_parallel, self.router_metrics)
        return self.cfg.moe.aux_loss_coeff * aux + self.cfg.moe.z_loss_coeff * z

    def side_loss(self) -> torch.Tensor | None:
        """A non-last stage's own part of the objective, from its last training forward: its MoE layers' router
        losses times their coefficients (router_loss_scope=layer), which its backward adds to what the next
        stage sends back; None for a last stage, a stage without MoE layers, or evaluation."""
        if self._ran[1] or not self.training or not moe_layers(self._ran[0]):
            return None
        return self.router_loss()

    def step_metrics(self, pp_group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """The step record's router figures since the last call (megatier.model.moe.RouterMetrics), else {}; a
        stage of a pipelined MoE model pools them with the other stages over ``pp_group`` (collective)."""
        if not self.cfg.moe.num_experts:
            return {}
        alone = self.spec.is_first and self.spec.is_last
        return self.router_metrics.take(None if alone else pp_group)

    # The three parts of a stage, for schedules that route a micro-batch through them separately (CheckFree+'s
    # swapped order, megatier.parallel.route_schedule).

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """First stage: token ids (b, s) -> word (+ position, gpt2) embeddings (b, s, h), or this rank's tokens
        of them (b, s/tp, h) under sequence parallelism."""
        x = self.word(tokens)
        if self.cfg.arch == "gpt2":
            x = x + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        if self.sequence_parallel:
            x = scatter_to_sequence(x, self.tp_group)
        return self.embed_dropout(x)

    def run_chunk(self, chunk: int, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Model chunk ``chunk`` of this stage (interleaved schedule, megatier.parallel.interleaved_schedule): as
        :meth:`forward`, embedding only in the first stage's first chunk and ending in the head only in the last
        stage's last chunk; a chunk's router losses are read by :meth:`side_loss` right after it."""
        chunks = self.spec.model_chunks()
        first, last = self.spec.is_first and chunk == 0, self.spec.is_last and chunk == len(chunks) - 1
        self._ran = ({str(i): self.layers[str(i)] for i in chunks[chunk]}, last)
        x = self.run_layers(self.embed(x) if first else x, list(self._ran[0].values()))
        if not last:
            return x
        out = self.head(x, labels)
        return out if labels is None or not self.training else out + self.router_loss()

    def run_layers(self, x: torch.Tensor, layers: list[nn.Module] | None = None) -> torch.Tensor:
        """This stage's transformer layers (or ``layers`` of them): (b, s, h) -> (b, s, h) (this rank's tokens
        under sequence parallelism); with ``model.recompute=full`` each layer keeps only its input for the
        backward."""
        rope = ()
        if self.cfg.arch == "llama":
            seq = x.shape[1] * (self.spec.tp if self.sequence_parallel else 1)
            rope = rotary_tables(seq, self.cfg.hidden_size // self.cfg.num_heads, self.cfg.rope_theta, x.device,
                                 x.dtype)
        full = self.cfg.recompute == "full" and self.training
        with te_layers.fp8_autocast(self.fp8_recipe):
            for layer in self.layers.values() if layers is None else layers:
                if full:
                    x = recomputed(layer, x, *rope, generators=[self.embed_dropout.generator])
                else:
                    x = layer(x, *rope)
        return x

    def head(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Last stage: hidden states (b, s, h) -> per-token loss (b, s) with labels, else vocab-parallel logits
        (b, s, padded / tp) with -inf in the padded columns."""
        x = self.final_norm(x)
        x = gather_from_sequence(x, self.tp_group) if self.sequence_parallel else copy_to_region(x, self.tp_group)
        logits = F.linear(x, self.output_weight)  # (b, s, padded/tp)
        logits = mask_padded_vocab(logits, vocab_start=self.vocab_start, vocab_size=self.vocab_size)
        if labels is None:
            return logits
        return vocab_parallel_cross_entropy(logits, labels, vocab_start=self.vocab_start, group=self.tp_group)

    def shared_embedding_params(self) -> list[nn.Parameter]:
        """Parameters whose gradients are all-reduced over the embedding group (pp > 1, a tied head)."""
        if self.spec.is_first == self.spec.is_last or not self.tied:
            return []
        return [self.word.weight] if self.spec.is_first else [self.head_weight]


def shard_for(model: GPTStage, name: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's slice of parameter ``name`` from its full, unpadded tensor (``full_shape``).

    Vocabulary tensors get zero rows up to the padded size first, so padded rows are zero.
    """
    param = model.get_parameter(name)
    if tuple(full.shape) != param.full_shape:
        raise ValueError(f"{param.copy_of or name}: got a tensor of shape {tuple(full.shape)}, the model needs "
                         f"{param.full_shape}; build the state for this model's shape")
    if name in VOCAB_PARAMS:
        full = F.pad(full, (0, 0, 0, model.padded_vocab_size - full.shape[0]))  # (padded, h)
    return shard_of_full(full, param.tp_partition_dim, param.tp_partition_stride, model.spec.tp_rank, model.spec.tp)


@torch.no_grad()
def load_full_state(model: GPTStage, state: dict[str, torch.Tensor]) -> None:
    """Set every parameter to its slice of ``state[canonical_name(name)]`` (full, unpadded tensors by name)."""
    missing = sorted({p.copy_of or n for n, p in model.named_parameters()} - state.keys())
    if missing:
        raise ValueError(f"the state has no tensor for {', '.join(missing)}; give one full tensor per model "
                         f"parameter name")
    for name, param in model.named_parameters():
        param.copy_(shard_for(model, name, state[param.copy_of or name]))


def _initial_full(cfg: ModelConfig, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """GPT-2's initial value of the full tensor ``name`` (a canonical name) of ``shape``."""
    owner = name.rsplit(".", 1)[0]  # "layers.0.ln1", "word"
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if owner.rsplit(".", 1)[-1] in ("ln1", "ln2", "final_norm"):
        return torch.ones(shape)
    std = cfg.init_std
    if name.endswith("proj.weight"):
        std /= math.sqrt(2 * cfg.num_layers)
    gen = torch.Generator().manual_seed(derive_seed(seed, "init", name))
    return torch.randn(shape, generator=gen) * std


@torch.no_grad()
def init_weights(model: GPTStage, seed: int) -> None:
    """GPT-2 initialisation, layout independent.

    Each parameter's full, unpadded tensor is drawn from a generator seeded by
    (seed, canonical name) and this rank keeps its tp slice (padded vocabulary
    rows are zero), so every layout starts from the same model.
    Residual output projections get std / sqrt(2 * num_layers) (GPT-2).
    """
    for name, param in model.named_parameters():
        full = _initial_full(model.cfg, param.copy_of or name, param.full_shape, seed)
        param.copy_(shard_for(model, name, full))
