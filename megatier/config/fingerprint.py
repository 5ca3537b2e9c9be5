"""The config fingerprint: what shapes a run's training state, recorded with every checkpoint unit.

A run resumes only its own job. Two runs with the same ``checkpoint.job_id``
but another model, optimizer, data, seed or precision produce states that must
never be mixed, so every unit's stamp carries the xxh64 of this fingerprint and
restore refuses units whose fingerprint differs, naming the keys that differ
(``checkpoint.allow_changes`` lists keys a relaunch may change on purpose,
such as ``optim.lr``).

Included: every model and optimizer setting (the LR schedule's decay horizon
resolved, since it defaults to ``train.iters``; left unset, a relaunch follows
the horizon recorded with the job, and with ``optim.use_checkpoint_scheduler``
the whole recorded schedule: :func:`followed_keys`), the tp/pp layout, the data
window (sequence length, split, sampler seed) and the checksum of the token
file, the batch sizes, seed and precision. Not included: ``train.iters`` (a
resumed run may train longer), evaluation, logging, devices, threads, paths
(``model.init_from`` too: it sets the state of step 0, which a restore replaces),
the libraries that compute the same function (``model.impl``,
``model.layernorm_impl``, ``model.compile`` and its backend, ``optim.grad_norm_impl``:
the state's names and shapes do not depend on them) and the checkpoint settings
themselves.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Optional

import xxhash

from megatier.config.schema import Config, MoEConfig
from megatier.data.source import megatron_sample_counts, uses_megatron_splits


def _flat(prefix: str, obj) -> dict[str, str]:
    """Key -> JSON value of every field, a nested group's fields under its own prefix (``model.moe.top_k``)."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out.update(_flat(f"{prefix}.{f.name}", value))
        else:
            out[f"{prefix}.{f.name}"] = json.dumps(value, sort_keys=True)
    return out


def state_fingerprint(cfg: Config, data_checksum: str) -> dict[str, str]:
    """Key -> JSON value of every setting that shapes the training state (see the module docstring)."""
    fp = {**_flat("model", cfg.model), **_flat("optim", cfg.optim)}
    fp["optim.decay_iters"] = json.dumps(cfg.optim.decay_iters or cfg.train.iters)
    t, d = cfg.train, cfg.data
    for key, value in (("parallel.tp", cfg.parallel.tp), ("parallel.pp", cfg.parallel.pp),
                       ("parallel.virtual_stages", cfg.parallel.virtual_stages),
                       ("data.seq_len", d.seq_len), ("data.val_fraction", d.val_fraction), ("data.seed", d.seed),
                       ("data.checksum", data_checksum), ("train.global_batch_size", t.global_batch_size),
                       ("train.micro_batch_size", t.micro_batch_size), ("train.seed", t.seed),
                       ("train.rampup_batch_size", t.rampup_batch_size),
                       ("train.precision", t.precision)):
        fp[key] = json.dumps(value)
    if uses_megatron_splits(d):  # a blend's order is built for its sample count: training longer changes it
        fp["data.train_samples"] = json.dumps(megatron_sample_counts(t, d.train_samples)["train"])
    fp.pop("model.name")  # a preset's label, not a shape
    fp.pop("model.init_from")  # a path that seeds step 0 only; a restore replaces what it set
    for key in ("model.impl", "model.layernorm_impl", "model.compile", "model.compile_backend", "optim.grad_norm_impl"):
        fp.pop(key)  # which library computes the same function: a relaunch may switch it
    fp.pop("optim.use_checkpoint_scheduler")  # how a resume treats the recorded schedule, not a state
    for key, default in ADDED_LATER.items():  # at the value that trains as before they existed: not recorded
        if fp[key] == json.dumps(default):
            del fp[key]
    return fp


# Keys added after jobs were already checkpointed, with the value that trains as those jobs did. A job written
# before a key existed has the same fingerprint as one that leaves it there, so an upgrade refuses no relaunch.
ADDED_LATER = {"optim.warmup_fraction": None, "optim.warmup_init_lr": 0.0, "optim.decay_style": "cosine",
               "optim.wsd_decay_iters": None, "optim.wsd_decay_style": "exponential",
               "train.rampup_batch_size": None, "model.qkv_bias": False, "parallel.virtual_stages": 1,
               **{f"model.moe.{key}": value for key, value in dataclasses.asdict(MoEConfig()).items()}}


# The LR schedule's keys, which optim.use_checkpoint_scheduler takes from the job's record.
SCHEDULE_KEYS = ("optim.lr", "optim.min_lr", "optim.warmup_iters", "optim.warmup_fraction", "optim.warmup_init_lr",
                 "optim.decay_iters", "optim.decay_style", "optim.wsd_decay_iters", "optim.wsd_decay_style")


def fingerprint_keys() -> set[str]:
    """Every key a fingerprint may hold (those :data:`ADDED_LATER` too, which a default config leaves out)."""
    return set(state_fingerprint(Config(), "")) | set(ADDED_LATER)


def recorded_value(record: dict[str, str], key: str) -> Optional[str]:
    """``key``'s JSON value in a job's ``record``: a key added later and absent there has its earlier value."""
    if key in record:
        return record[key]
    return json.dumps(ADDED_LATER[key]) if key in ADDED_LATER else None


def followed_keys(cfg: Config) -> tuple[str, ...]:
    """Fingerprint keys this launch takes from the job's record instead of comparing: the whole LR schedule with
    ``optim.use_checkpoint_scheduler``; else an unset ``optim.decay_iters`` follows the horizon the job's first
    launch resolved (its ``train.iters`` then), so a relaunch with more ``train.iters`` trains longer on the same
    schedule; set it to change the schedule."""
    if cfg.optim.use_checkpoint_scheduler:
        return SCHEDULE_KEYS
    return ("optim.decay_iters",) if cfg.optim.decay_iters is None else ()


def fingerprint_hash(fp: dict[str, str]) -> str:
    """16 hex digits naming a fingerprint (the empty fingerprint, of tools that set none, is "")."""
    return xxhash.xxh64(json.dumps(fp, sort_keys=True).encode()).hexdigest() if fp else ""


def changed_keys(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """``key: old -> new`` for every key whose value differs (or exists in one only), sorted."""
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return [f"{k}: {old.get(k, '(unset)')} -> {new.get(k, '(unset)')}" for k in keys]
