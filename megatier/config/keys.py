"""Override keys checked against the schema before Hydra composes anything.

Hydra's struct mode rejects an unknown key written ``train.iter=20`` with a multi-line message that suggests
``+train.iter=20``, and that spelling adds the key, which ``OmegaConf.to_object`` then drops without a word:
the run trains with the default. So every override's key is checked here first, with or without ``+``, and
an unknown one is a :class:`ConfigError` naming it and the closest valid key.
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Optional

from megatier.config.schema import Config, ConfigError

# Names Megatron-LM, Hugging Face or nanoGPT give a setting -> the field's name here. Spelling alone would
# point learning_rate at clip_grad; an unknown key with one of these names gets its field instead.
ALIASES = {
    "learning_rate": "lr", "max_lr": "lr", "min_learning_rate": "min_lr",
    "train_iters": "iters", "max_steps": "iters", "num_iters": "iters", "max_iters": "iters",
    "batch_size": "global_batch_size", "micro_batch": "micro_batch_size",
    "tensor_model_parallel_size": "tp", "tensor_parallel_size": "tp", "tp_size": "tp",
    "pipeline_model_parallel_size": "pp", "pipeline_parallel_size": "pp", "pp_size": "pp",
    "num_attention_heads": "num_heads", "n_head": "num_heads", "n_heads": "num_heads",
    "num_hidden_layers": "num_layers", "n_layer": "num_layers", "n_layers": "num_layers",
    "n_embd": "hidden_size", "d_model": "hidden_size",
    "seq_length": "seq_len", "max_seq_len": "seq_len", "sequence_length": "seq_len", "block_size": "seq_len",
    "grad_clip": "clip_grad", "clip_grad_norm": "clip_grad", "max_grad_norm": "clip_grad",
    "warmup_steps": "warmup_iters", "lr_warmup_iters": "warmup_iters", "lr_decay_iters": "decay_iters",
    "adam_beta1": "beta1", "adam_beta2": "beta2", "adam_eps": "eps",
    "save_interval": "base_interval", "data_path": "prefix",
    "skip_train": "eval_only", "log_freq": "log_interval", "enable_tensorboard": "tensorboard",
    "save_tb_folder": "tensorboard_dir",
}


def _fields(cls) -> dict[str, typing.Any]:
    return {f.name: f.type for f in dataclasses.fields(cls)}


def _dataclass_of(annotation) -> Optional[type]:
    """The dataclass a field holds, or None for a leaf (a number, a string, a list, a Union of leaves)."""
    hints = annotation if isinstance(annotation, type) else None
    return hints if hints is not None and dataclasses.is_dataclass(hints) else None


def _resolved_fields(cls) -> dict[str, typing.Any]:
    hints = typing.get_type_hints(cls)
    return {name: hints.get(name, t) for name, t in _fields(cls).items()}


def all_keys(cls=Config, prefix: str = "") -> list[str]:
    """Every dotted key of the schema, groups included (``train``, ``train.iters``, ...)."""
    out = []
    for name, annotation in _resolved_fields(cls).items():
        key = f"{prefix}{name}"
        out.append(key)
        inner = _dataclass_of(annotation)
        if inner is not None:
            out += all_keys(inner, f"{key}.")
    return out


def unknown_key(key: str, cls=Config) -> Optional[str]:
    """None when ``key`` names a field of the schema (or something inside a leaf field), else the longest
    prefix of it that is unknown."""
    parts = key.split(".")
    for i, part in enumerate(parts):
        fields = _resolved_fields(cls)
        if part not in fields:
            return ".".join(parts[:i + 1])
        inner = _dataclass_of(fields[part])
        if inner is None:
            return None  # a leaf: what lies inside it (a list index, a dict key) is OmegaConf's to check
        cls = inner
    return None


def closest(key: str) -> Optional[str]:
    """The schema key ``key``'s last name is an alias of (:data:`ALIASES`), else the one most like it (same
    group first), or None when none is close."""
    keys = all_keys()
    group = key.rsplit(".", 1)[0] + "." if "." in key else ""
    same_group = [k for k in keys if k.startswith(group) and k.count(".") == key.count(".")]
    alias = ALIASES.get(key.rsplit(".", 1)[-1])
    named = [k for k in same_group + keys if alias is not None and k.rsplit(".", 1)[-1] == alias]
    if named:
        return named[0]
    for pool in (same_group, keys):
        match = difflib.get_close_matches(key, pool, n=1, cutoff=0.6)
        if match:
            return match[0]
    return None


def check_override_keys(overrides: list[str], groups: set[str]) -> None:
    """ConfigError for the first override whose key is not in the schema. ``groups`` are the config group
    names (``model=tiny`` picks a file, it sets no key); ``hydra.*`` keys are Hydra's own."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        raise ConfigError(" ".join(str(e).split())) from None
    for override, text in zip(parsed, overrides):
        key = override.key_or_group
        if key in groups or key.split("/")[0] in groups or key == "hydra" or key.startswith(("hydra.", "hydra/")):
            continue
        bad = unknown_key(key)
        if bad is None:
            continue
        near = closest(bad)
        hint = f"; did you mean {near}?" if near else "; see docs/configuration.md for the keys"
        raise ConfigError(f"unknown config key {bad} (in the override {text!r}){hint}")
