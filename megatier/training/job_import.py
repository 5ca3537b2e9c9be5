"""``model.init_from``, the one door through which a job starts from something other than its own checkpoints.

A plain path is a Hugging Face directory: its weights replace the initialisation before the optimizer copies
them (fine-tuning; Adam starts afresh). ``<format>:<path>`` (:data:`~megatier.interop.job_state.JOB_FORMATS`)
is a running job of another framework: weights, Adam's moments and count, and the iteration, so the next step
MegaTier takes is the one the source would have taken. That state is installed by :class:`ImportedStart`, a
Checkpointer around the job's own: a launch whose checkpoints hold nothing starts at the imported iteration
(the tiers' first base is that state, at that step), while a launch that restores any state of its own
continues that, so a relaunch never goes back to the import.

Each source is read whole in every rank and cut to the rank's shard (:func:`~megatier.optim.canonical.cut_shard`),
so any source layout goes into any MegaTier layout.
"""
from __future__ import annotations

import logging
from typing import Optional

from megatier.checkpoint.shard import ShardAccess
from megatier.config import ConfigError
from megatier.interop.huggingface import load_hf
from megatier.interop.job_state import JobFormatError, JobState, schedule_notes, split_init_from
from megatier.interop.megatron_dist import load_megatron_dist
from megatier.interop.megatron_legacy import load_megatron_legacy
from megatier.interop.torchtitan_dcp import load_torchtitan
from megatier.model.gpt import load_full_state
from megatier.optim.canonical import cut_shard

log = logging.getLogger(__name__)

_LOADERS = {"torchtitan": load_torchtitan, "torch_dist": load_megatron_dist, "megatron_legacy": load_megatron_legacy}


def init_weights_from(model, m, vocab: int, rank: int) -> None:
    """A Hugging Face ``model.init_from``'s weights into ``model`` (before flattening: the fp32 master is them)."""
    fmt, path = split_init_from(m.init_from)
    if path is None or fmt is not None:
        return
    load_full_state(model, load_hf(path, m, vocab))
    if rank == 0:
        log.info("model.init_from: initialised the %s model from the Hugging Face %s at %s (a restored checkpoint "
                 "replaces it)", m.name, "GPT-2" if m.arch == "gpt2" else "Llama", path)


def load_job(init_from: str, m, vocab: int, o) -> JobState:
    """The job a ``<format>:<path>`` names, or ConfigError naming model.init_from and the fix."""
    fmt, path = split_init_from(init_from)
    loader = _LOADERS.get(fmt)
    if loader is None:
        raise ConfigError(f"model.init_from={init_from!r}: importing {fmt} is not built yet; formats: "
                          f"{', '.join(_LOADERS)}")
    try:
        return loader(path, m, vocab, o)
    except (JobFormatError, OSError) as e:
        raise ConfigError(f"model.init_from={init_from!r}: {e}") from None


def install(optimizer, tp_rank: int, tp: int, job: JobState) -> None:
    """This rank's shard of ``job`` into the optimizer (master, moments, Adam count), then the parameters."""
    tensors = cut_shard(job.canonical, optimizer.shard_segments, tp_rank, tp, optimizer.master.numel())
    scaler = optimizer.scaler.state_dict() if optimizer.scaler is not None else None
    ShardAccess(optimizer, 1).load_state(tensors, job.adam_steps, scaler, job.source)
    optimizer.publish_params()


class ImportedStart:
    """A Checkpointer (``inner``, or none) whose restore starts a job with no state of its own at ``job``."""

    def __init__(self, inner, optimizer, ps, job: JobState, seq_len: int):
        self.inner, self.optimizer, self.ps, self.job, self.seq_len = inner, optimizer, ps, job, seq_len

    def restore(self) -> tuple[int, Optional[dict]]:
        install(self.optimizer, self.ps.tp_rank, self.ps.tp, self.job)
        if self.inner is None:
            self._say()
            return self.job.iteration, None
        shard = getattr(self.inner, "shard", None)
        if not isinstance(shard, ShardAccess):
            raise ConfigError("model.init_from of a whole job needs MegaTier's tiered checkpointer (or "
                              "checkpoint.enabled=false); this launch injects another")
        shard.start_step = self.job.iteration
        step, record = self.inner.restore()
        if record is None:
            self._say()
        return step, record

    def _say(self) -> None:
        if self.ps.rank != 0:
            return
        j, schedule = self.job, self.optimizer.schedule
        samples = j.consumed_samples if j.consumed_tokens is None else j.consumed_tokens // self.seq_len
        j.consumed_samples = samples
        log.info("model.init_from: continuing the %s at iteration %d (Adam step %d): weights and Adam's moments "
                 "carried over", j.source, j.iteration, j.adam_steps)
        for line in j.notes + schedule_notes(j, schedule(j.iteration + 1), schedule.samples_after(j.iteration)):
            log.info("model.init_from: %s", line)

    def after_step(self, step: int) -> dict:
        return self.inner.after_step(step) if self.inner is not None else {}

    def close(self, *, failed: bool = False) -> Optional[dict]:
        return self.inner.close(failed=failed) if self.inner is not None else None

    def __getattr__(self, name: str):
        if name == "inner":  # not yet set
            raise AttributeError(name)
        return getattr(self.inner, name)  # abort and the rest of the tiered checkpointer's calls


def with_imported_job(checkpointer, trainer):
    """``checkpointer``, or an :class:`ImportedStart` around it when model.init_from names a whole job."""
    cfg = trainer.cfg
    fmt, _ = split_init_from(cfg.model.init_from)
    if fmt is None:
        return checkpointer
    job = load_job(cfg.model.init_from, cfg.model, trainer.vocab_size, cfg.optim)
    return ImportedStart(checkpointer, trainer.optimizer, trainer.ps, job, cfg.data.seq_len)
