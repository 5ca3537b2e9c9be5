"""What a GPT's parameters are, in one place: their names, full shapes, how tensor parallelism cuts them, which
are copies of others, and which pipeline stage holds which.

Two decoders share these names (``model.arch``): GPT-2 and Llama (:mod:`.llama` lists its parameters).
Parameter names use global layer indices (``layers.7.attn.qkv.weight``) so a name means the same tensor in every
layout. Pipeline split rule: stage i gets num_layers // pp layers, and the first num_layers % pp stages get one
more (the last stage already carries the head). Vocabulary tensors (:data:`VOCAB_PARAMS`) hold
:func:`padded_vocab_size` rows so every tp rank holds an equal slice.

The model (:mod:`.gpt`) builds its parameters from this description and records it on each one
(``full_shape``, ``tp_partition_dim``/``_stride``, ``copy_of``); the optimizer's segment table, the canonical
state, the size plan and the Hugging Face interop read it from there or from here (:func:`stage_parameters` is
the description of a stage without building it, tested equal to the built one).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence

from megatier.config import ModelConfig
from megatier.config.schema import expert_ffn_size, ffn_size, is_moe_layer
from megatier.optim.flat import ParamSpec
from megatier.parallel.checkfree_plus import REPLICA_SOURCES, replica_parameters, replicas_of
from megatier.parallel.interleaved import chunk_layers

# Parameters with one row per vocabulary id; padded to padded_vocab_size rows in a GPTStage.
VOCAB_PARAMS = ("word.weight", "head_weight", "word_replica.weight", "head_replica.weight")


def copies_of(cfg: ModelConfig) -> dict[str, str]:
    """Parameters that hold a copy of another stage's parameter -> the parameter they copy: GPT-2's output head
    on a last stage (pp > 1; tied to the word embedding) and CheckFree+'s replicas (of the position embedding
    and the final LayerNorm; Llama: of the word embedding, the final RMSNorm and the head). Llama's head is a
    parameter of its own."""
    tied = {"head_weight": "word.weight"} if cfg.arch == "gpt2" else {}
    return {**tied, **REPLICA_SOURCES}


def canonical_name(name: str, cfg: ModelConfig = ModelConfig()) -> str:
    """The parameter whose values ``name`` holds in a model of ``cfg``: a copy's source, else the name itself."""
    return copies_of(cfg).get(name, name)


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Round the vocabulary up so every tp rank holds an equal slice of a multiple of ``divisible_by``."""
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def stage_layers(num_layers: int, pp: int, pp_rank: int) -> range:
    """Global indices of the layers on pipeline stage ``pp_rank`` (see the module docstring)."""
    base, extra = divmod(num_layers, pp)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


def stage_spec(cfg: ModelConfig, *, tp: int, pp: int, tp_rank: int, pp_rank: int,
               virtual_stages: int = 1) -> "StageSpec":
    """What pipeline stage ``pp_rank`` of ``pp`` holds on tp rank ``tp_rank`` (layers, ends, replicas); with
    ``virtual_stages`` v > 1 its v model chunks (megatier.parallel.interleaved: chunk c is block c * pp + pp_rank
    of num_layers / (pp * v) layers)."""
    replicas = replicas_of(cfg.pipeline_order, pp, pp_rank, cfg.arch)
    if virtual_stages == 1:
        return StageSpec(stage_layers(cfg.num_layers, pp, pp_rank), pp_rank == 0, pp_rank == pp - 1, tp_rank, tp,
                         replicas)
    chunks = tuple(chunk_layers(num_layers=cfg.num_layers, pp=pp, virtual_stages=virtual_stages, rank=pp_rank))
    return StageSpec(tuple(i for chunk in chunks for i in chunk), pp_rank == 0, pp_rank == pp - 1, tp_rank, tp,
                     replicas, chunks)


@dataclass(frozen=True)
class StageSpec:
    """Which part of the model this rank holds: ``layers`` by global index, in the order they run; under the
    interleaved schedule ``chunks``, the layers of each model chunk (the first chunk of the first stage embeds,
    the last chunk of the last stage holds the head)."""

    layers: Sequence[int]
    is_first: bool
    is_last: bool
    tp_rank: int = 0
    tp: int = 1
    # Copies of a neighbouring stage's parameters this stage keeps (CheckFree+: "pos", "word", "final_norm",
    # "head"; megatier.parallel.checkfree_plus.replicas_of). They are trained as copies: same gradient, same update.
    replicas: tuple[str, ...] = ()
    chunks: tuple[range, ...] = ()  # () : one chunk, ``layers``

    def model_chunks(self) -> tuple[Sequence[int], ...]:
        """The layers of each model chunk this rank runs, in chunk order."""
        return self.chunks or (self.layers,)


def canonical_shapes(cfg: ModelConfig, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Name -> full, unpadded shape of every parameter of the whole model (a pp=1 stage: GPT-2's tied head is
    the word embedding; Llama's is ``head_weight``)."""
    h, ffn = cfg.hidden_size, ffn_size(cfg)
    if cfg.arch == "llama":
        heads, groups = cfg.num_heads, cfg.num_query_groups or cfg.num_heads
        hd = h // heads
        shapes = {"word.weight": (vocab_size, h)}
        per_layer = {"ln1.weight": (h,), "attn.q.weight": (heads * hd, h), "attn.kv.weight": (2 * groups * hd, h),
                     "attn.proj.weight": (h, heads * hd), "ln2.weight": (h,), "mlp.gate_up.weight": (2 * ffn, h),
                     "mlp.proj.weight": (h, ffn)}
        final = {"final_norm.weight": (h,), "head_weight": (vocab_size, h)}
        if cfg.qkv_bias:
            per_layer = _with_qkv_bias(per_layer)
    else:
        shapes = {"word.weight": (vocab_size, h), "pos.weight": (cfg.max_position_embeddings, h)}
        per_layer = {"ln1.weight": (h,), "ln1.bias": (h,), "attn.qkv.weight": (3 * h, h),
                     "attn.qkv.bias": (3 * h,), "attn.proj.weight": (h, h), "attn.proj.bias": (h,),
                     "ln2.weight": (h,), "ln2.bias": (h,), "mlp.fc.weight": (ffn, h), "mlp.fc.bias": (ffn,),
                     "mlp.proj.weight": (h, ffn), "mlp.proj.bias": (h,)}
        final = {"final_norm.weight": (h,), "final_norm.bias": (h,)}
    for i in range(cfg.num_layers):
        block = {**per_layer, **moe_shapes(cfg)} if is_moe_layer(cfg, i) else per_layer
        shapes.update({f"layers.{i}.{key}": shape for key, shape in block.items()
                       if not (key.startswith("mlp.") and is_moe_layer(cfg, i))})
    shapes.update(final)
    return shapes


def _with_qkv_bias(per_layer: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """A Llama layer's parameters with q's and kv's biases (``model.qkv_bias``), each after its weight: the order
    the layer registers them."""
    out = {}
    for key, shape in per_layer.items():
        out[key] = shape
        if key in ("attn.q.weight", "attn.kv.weight"):
            out[key.replace(".weight", ".bias")] = shape[:1]
    return out


def moe_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A mixture-of-experts layer's parameters in place of the MLP's (megatier.model.moe), names without the
    "layers.<i>." prefix: the router, each expert's SwiGLU, the shared expert and its gate if any."""
    h, f, s = cfg.hidden_size, expert_ffn_size(cfg), cfg.moe.shared_expert_hidden_size
    shapes = {"moe.router.weight": (cfg.moe.num_experts, h)}
    for e in range(cfg.moe.num_experts):
        shapes.update({f"moe.experts.{e}.gate_up.weight": (2 * f, h), f"moe.experts.{e}.proj.weight": (h, f)})
    if s:
        shapes.update({"moe.shared.gate_up.weight": (2 * s, h), "moe.shared.proj.weight": (h, s),
                       "moe.shared_gate.weight": (1, h)})
    return shapes


# How the parallel layers cut each parameter across tp ranks, (dim, stride) by name (a layer's without its
# "layers.<i>." prefix); absent: replicated. ColumnParallelLinear cuts output rows (GPT-2's fused qkv in 3
# blocks, Llama's stacked k/v and gate/up in 2, a bias as its weight's rows), RowParallelLinear input columns (its
# bias replicated), the vocabulary embedding and the head vocabulary rows.
TP_SPLITS = {"word.weight": (0, 1), "head_weight": (0, 1), "word_replica.weight": (0, 1),
             "head_replica.weight": (0, 1), "attn.qkv.weight": (0, 3), "attn.qkv.bias": (0, 3),
             "attn.proj.weight": (1, 1), "mlp.fc.weight": (0, 1), "mlp.fc.bias": (0, 1), "mlp.proj.weight": (1, 1),
             "attn.q.weight": (0, 1), "attn.kv.weight": (0, 2), "mlp.gate_up.weight": (0, 2),
             "attn.q.bias": (0, 1), "attn.kv.bias": (0, 2),
             "moe.experts.*.gate_up.weight": (0, 2), "moe.experts.*.proj.weight": (1, 1),
             "moe.shared.gate_up.weight": (0, 2), "moe.shared.proj.weight": (1, 1)}


def tp_split(name: str) -> tuple[int | None, int]:
    """(dim, stride) tensor parallelism cuts parameter ``name`` by (None: replicated); every expert as the
    others."""
    key = name.split(".", 2)[-1] if name.startswith("layers.") else name
    return TP_SPLITS.get(re.sub(r"experts\.\d+\.", "experts.*.", key), (None, 1))


def stage_parameters(cfg: ModelConfig, vocab_size: int, spec: StageSpec) -> list[ParamSpec]:
    """The parameters of ``GPTStage(cfg, vocab_size, spec)`` in its order (the flat buffer's), with this tp rank's
    shapes, without building it: what a size plan needs for a model that does not fit here. Equal to the
    stage's own (name, shape, tp_partition_dim, tp_partition_stride, full_shape, copy_of, expert_index) at ep=1
    (tested); its shards are those of every ep (megatier.optim.flat.FlatLayout)."""
    full = canonical_shapes(cfg, vocab_size)
    copies = copies_of(cfg)
    tied = cfg.arch == "gpt2"
    names = [n for n in full if n.startswith("layers.") and int(n.split(".")[1]) in spec.layers]
    if spec.is_first:
        names = ["word.weight", *(["pos.weight"] if tied else [])] + names
    if spec.is_last:
        names += [n for n in full if n.startswith("final_norm.")]
    if spec.is_last and not (spec.is_first and tied):
        names = ["head_weight"] + names  # a parameter of the stage itself: named before its submodules'
    for kind in spec.replicas:
        names += replica_parameters(kind, cfg.arch)
    padded = padded_vocab_size(vocab_size, cfg.make_vocab_size_divisible_by, spec.tp)
    out = []
    for name in names:
        full_shape = full[copies.get(name, name)]
        tp_dim, stride = tp_split(name)
        shape = [padded, *full_shape[1:]] if name in VOCAB_PARAMS else list(full_shape)
        if tp_dim is not None:
            shape[tp_dim] //= spec.tp
        expert = re.search(r"\.experts\.(\d+)\.", name)
        out.append(ParamSpec(name, tuple(shape), tp_dim, stride, full_shape, copies.get(name, ""),
                             int(expert.group(1)) if expert else -1))
    return out


def count_parameters(cfg: ModelConfig, vocab_size: int) -> int:
    """Parameters of the whole (unsharded) model (GPT-2's tied head counted once)."""
    return sum(math.prod(shape) for shape in canonical_shapes(cfg, vocab_size).values())


def count_active_parameters(cfg: ModelConfig, vocab_size: int) -> int:
    """Parameters one token passes through: all but the experts it is not routed to (model.moe.top_k of
    model.moe.num_experts per MoE layer); :func:`count_parameters` for a dense model."""
    idle = cfg.moe.num_experts - cfg.moe.top_k
    one_expert = 3 * cfg.hidden_size * expert_ffn_size(cfg)
    moe_layers = sum(is_moe_layer(cfg, i) for i in range(cfg.num_layers))
    return count_parameters(cfg, vocab_size) - (idle * one_expert * moe_layers if idle > 0 else 0)
