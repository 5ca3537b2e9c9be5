"""Evaluation only (``train.eval_only=true``, Megatron's --eval-only / --skip-train): evaluate the job's checkpoint.

The Trainer, built as for training but without a checkpointer (nothing of the job is opened for writing: no
Tier-3 lease, no restore history, no cleanup, no new base) and without a goodput ledger, hands itself to
:func:`evaluate_checkpoint` instead of training:

1. The job's state is read as ``megatier-convert export`` reads it (:mod:`megatier.checkpoint.offline`): the
   recovery point a restore would choose (the furthest step every rank of a layout reaches) from this machine's
   node memory (``checkpoint.local.root``) and Tier-3 (``checkpoint.remote.url``), whatever layout wrote it.
2. Each rank cuts its own shard of the canonical state (master weights and Adam moments) for this launch's
   layout, loads it into its optimizer and publishes the weights into the model: the state a restore installs.
3. The evaluation of ``train.eval_interval`` runs once (``train.eval_iters`` validation batches) at the
   restored step; its record (``event: eval_only``, ``val_loss``) goes to every sink, and rank 0 prints it.

A job with no checkpoint is a config error (exit 2); a checkpoint that cannot be read whole, a recovery error
(exit 4). The launch then closes as any other (the summary carries the restored state's digests) and exits 0.
"""
from __future__ import annotations

import logging
import time

from megatier.checkpoint.offline.state import choose_point, point_fingerprint, rebuild, run_configs
from megatier.checkpoint.offline.tiers import NOTHING, ExportError, OfflineTiers
from megatier.checkpoint.recover.inventory import RecoveryError
from megatier.checkpoint.shard import ShardAccess
from megatier.checkpoint.tiers.base import TIER1, TIER2, TIER3
from megatier.config import ConfigError
from megatier.optim.canonical import ReshardError, cut_shard

log = logging.getLogger(__name__)

TIER_LABELS = {"local": TIER1, "peer": TIER2, "remote": TIER3}  # checkpoint.tiers -> the tiers' labels


def load_checkpoint(trainer) -> int:
    """Install the job's newest recoverable state into ``trainer``'s optimizer and model; its step."""
    c = trainer.cfg.checkpoint
    labels = [TIER_LABELS[t] for t in c.tiers if t in TIER_LABELS]
    try:
        tiers = OfflineTiers(c.job_id, c.local.root, c.remote.url, endpoint_url=c.remote.endpoint_url, tiers=labels)
        holdings = tiers.holdings()
        point = choose_point(holdings, c.job_id, None)
        fp_id, fingerprint = point_fingerprint(holdings, point)
        _, optim_cfg = run_configs(fingerprint, fp_id)
        rebuilt = rebuild(tiers, point, optim_cfg)
    except ExportError as e:
        if e.status == NOTHING:
            raise ConfigError(f"train.eval_only=true: {e}") from None
        raise RecoveryError(f"train.eval_only=true: {e}") from None
    o, ps = trainer.optimizer, trainer.ps
    try:
        shard = cut_shard(rebuilt.canonical, o.shard_segments, ps.tp_rank, ps.tp, o.master.numel())
    except ReshardError as e:
        raise ConfigError(f"train.eval_only=true: job {c.job_id!r}'s checkpoint does not fit this model: {e}") \
            from None
    access = ShardAccess(o, trainer.cfg.train.global_batch_size)
    access.load_state({k: v.to(o.master.device) for k, v in shard.items()}, point.end, None,
                      f"job {c.job_id!r} at step {point.end}")
    access.publish()
    return point.end


def evaluate_checkpoint(trainer) -> None:
    """Load the job's checkpoint, evaluate it once, log and print the result (``trainer.last_record``)."""
    t = trainer.cfg.train
    trainer.step = load_checkpoint(trainer)
    start = time.perf_counter()
    val = trainer.evaluate()
    record = {"step": trainer.step, "event": "eval_only", "val_loss": val, "eval_iters": t.eval_iters,
              "eval_time_s": time.perf_counter() - start}
    trainer.logger.log(record)
    if trainer.ps.rank == 0:
        what = "no validation batches (train.eval_iters=0 or data.val_fraction too small)" if val is None else \
            f"val_loss {val:.4f} over train.eval_iters={t.eval_iters} batches"
        log.info("eval-only: job %r at step %d: %s; nothing trained, its checkpoints untouched",
                 trainer.cfg.checkpoint.job_id, trainer.step, what)
    trainer.last_record = {**record, "loss": float("nan") if val is None else val}
