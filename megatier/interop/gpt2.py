"""Exchange weights with Hugging Face GPT-2 (``transformers.GPT2LMHeadModel``).

The canonical state is ``dict[str, torch.Tensor]``: MegaTier parameter name ->
full, unsharded, unpadded fp32 tensor, for the names of a pp=1 GPTStage
(``megatier.model.params.canonical_shapes``; never ``head_weight``, the tied copy
of ``word.weight``). It is what every layout's shards reassemble to, and what
``load_full_state`` cuts into any layout's shards.

Name map (per layer i; GPT-2's Conv1D stores (in, out), the transpose of a
Linear's (out, in) weight)::

    word.weight                  transformer.wte.weight          (V, h)
    pos.weight                   transformer.wpe.weight          (P, h)
    layers.i.ln1.{weight,bias}   transformer.h.i.ln_1.*
    layers.i.attn.qkv.weight     transformer.h.i.attn.c_attn.weight  (3h, h) rows [q; k; v] = c_attn^T
    layers.i.attn.qkv.bias       transformer.h.i.attn.c_attn.bias
    layers.i.attn.proj.*         transformer.h.i.attn.c_proj.*   (weight transposed)
    layers.i.ln2.*               transformer.h.i.ln_2.*
    layers.i.mlp.fc.*            transformer.h.i.mlp.c_fc.*      (weight transposed)
    layers.i.mlp.proj.*          transformer.h.i.mlp.c_proj.*    (weight transposed)
    final_norm.*                 transformer.ln_f.*

``lm_head.weight`` is tied to ``transformer.wte.weight`` and, as
``save_pretrained`` does, not written. Loading also takes the older layout
without the ``transformer.`` prefix and ignores the attention-mask buffers
(``attn.bias``, ``attn.masked_bias``) such files carry.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from megatier.config import ModelConfig
from megatier.interop.gpt2_config import check_gpt2_config, gpt2_config, read_gpt2_config
from megatier.interop.hf_files import (
    HFFormatError,
    check_state,
    prepare_out_dir,
    read_tensors,
    write_model,
    write_tokenizer,
)
from megatier.model.params import canonical_shapes

# (MegaTier suffix, GPT-2 suffix, stored transposed in GPT-2) of every tensor of block i.
_BLOCK = [("ln1.weight", "ln_1.weight", False), ("ln1.bias", "ln_1.bias", False),
          ("attn.qkv.weight", "attn.c_attn.weight", True), ("attn.qkv.bias", "attn.c_attn.bias", False),
          ("attn.proj.weight", "attn.c_proj.weight", True), ("attn.proj.bias", "attn.c_proj.bias", False),
          ("ln2.weight", "ln_2.weight", False), ("ln2.bias", "ln_2.bias", False),
          ("mlp.fc.weight", "mlp.c_fc.weight", True), ("mlp.fc.bias", "mlp.c_fc.bias", False),
          ("mlp.proj.weight", "mlp.c_proj.weight", True), ("mlp.proj.bias", "mlp.c_proj.bias", False)]
# Buffers (causal masks) of older GPT-2 files, not parameters.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")
_HEAD = "lm_head.weight"


def name_map(num_layers: int) -> list[tuple[str, str, bool]]:
    """(MegaTier name, GPT-2 name, transposed) for every tensor of the model, in canonical order."""
    names = [("word.weight", "transformer.wte.weight", False), ("pos.weight", "transformer.wpe.weight", False)]
    for i in range(num_layers):
        names += [(f"layers.{i}.{ours}", f"transformer.h.{i}.{theirs}", t) for ours, theirs, t in _BLOCK]
    return names + [("final_norm.weight", "transformer.ln_f.weight", False),
                    ("final_norm.bias", "transformer.ln_f.bias", False)]


def export_gpt2(state: dict[str, torch.Tensor], model_cfg: ModelConfig, out_dir: str, *,
                tokenizer: Optional[dict] = None) -> None:
    """Write ``out_dir`` so that ``GPT2LMHeadModel.from_pretrained(out_dir)`` computes MegaTier's model.

    state: the canonical state (see the module docstring); its vocabulary is the
    true one (word.weight rows). Writes config.json and model.safetensors (fp32).
    tokenizer: the dataset's tokenizer spec (``IndexedDataset.metadata["tokenizer"]``):
    ``{"type": "bpe", "path": ...}`` also writes tokenizer.json and tokenizer_config.json;
    ``{"type": "byte"}`` has no files (ids are UTF-8 bytes) but sets eos/bos to
    its end-of-document id 256; None leaves both unset. Refuses a non-empty ``out_dir``.
    """
    vocab = check_state(state, model_cfg)
    prepare_out_dir(out_dir)
    eod = write_tokenizer(out_dir, tokenizer, model_cfg.max_position_embeddings)
    tensors = {}
    for ours, theirs, transposed in name_map(model_cfg.num_layers):
        value = state[ours].detach().to(device="cpu", dtype=torch.float32)
        tensors[theirs] = value.t() if transposed else value
    write_model(out_dir, tensors, gpt2_config(model_cfg, vocab, eod))


def _gpt2_tensors(path: str) -> dict[str, torch.Tensor]:
    """The directory's tensors under ``transformer.``-prefixed names, without mask buffers; head checked tied."""
    tensors = {}
    for key, value in read_tensors(path).items():
        if key.endswith(_IGNORED_SUFFIXES):
            continue
        tensors[key if key.startswith(("transformer.", _HEAD)) else f"transformer.{key}"] = value
    head = tensors.pop(_HEAD, None)
    wte = tensors.get("transformer.wte.weight")
    if head is not None and wte is not None and not torch.equal(head, wte):
        raise HFFormatError(f"{path}: lm_head.weight differs from transformer.wte.weight; MegaTier ties the "
                              f"output head to the word embedding, so only tied GPT-2 models load")
    return tensors


def load_gpt2(path: str, model_cfg: ModelConfig, vocab_size: int) -> dict[str, torch.Tensor]:
    """The canonical state (fp32) of the GPT-2 directory ``path`` for a model of ``model_cfg``.

    ``vocab_size`` is the model's true vocabulary (model.vocab_size or the
    data's); the directory's config.json and every tensor must match the
    model's shapes, and it must compute MegaTier's function (tanh GELU, tied
    head). Raises HFFormatError with one line otherwise.
    """
    path = os.path.expanduser(path)
    check_gpt2_config(read_gpt2_config(path), model_cfg, vocab_size, path)
    tensors = _gpt2_tensors(path)
    pairs = name_map(model_cfg.num_layers)
    expected = canonical_shapes(model_cfg, vocab_size)
    unexpected = sorted(tensors.keys() - {theirs for _, theirs, _ in pairs})
    missing = [theirs for _, theirs, _ in pairs if theirs not in tensors]
    if unexpected or missing:
        raise HFFormatError(f"{path}: the weights do not match its config.json (missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}); re-save the model with save_pretrained")
    state = {}
    for ours, theirs, transposed in pairs:
        value = tensors[theirs].to(torch.float32)
        value = value.t().contiguous() if transposed else value
        if tuple(value.shape) != expected[ours]:
            raise HFFormatError(f"{path}: {theirs} has shape {tuple(tensors[theirs].shape)} where its config.json "
                                  f"implies {expected[ours][::-1] if transposed else expected[ours]}; "
                                  f"re-save the model with save_pretrained")
        state[ours] = value
    return state
