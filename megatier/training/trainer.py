"""The Trainer: builds every component from its own sub-config and runs the loop.

    trainer = Trainer(cfg)   # process groups, data, model, optimizer, metrics
    trainer.train()          # restore (if checkpointing), steps up to train.iters, validation
    trainer.close()          # drain checkpoints, final summary record with state_digest, teardown

Step s (1-based) reads global batch s, runs forward/backward over its
micro-batches and applies optimizer step s; afterwards the state is "version s".

Global rank 0 also keeps the job's goodput ledger (:mod:`megatier.observe.goodput`) in the run
directory: reconciled after restore, updated every step, its fields in every step record and the summary.

A collective that fails because a peer died or hung is recovered in place when a membership store is known
(:class:`~megatier.training.reform.InPlaceRecovery`, a mixin of the Trainer).

Checkpointing plugs in through a :class:`~megatier.checkpoint.checkpointer.Checkpointer`
(None when disabled): ``Trainer(cfg, checkpointer=factory)`` builds it from the
model and optimizer with the given factory, else with ``build_checkpointer``
when ``checkpoint.enabled``. The overhead benchmark injects its baselines.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Optional

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from megatier.checkpoint.checkpointer import Checkpointer, CheckpointerFactory, TrainState, build_checkpointer
from megatier.checkpoint.policy.rules import check_checkpoint_config, effective_checkpoint_config
from megatier.checkpoint.recover.record import say_recovered
from megatier.config import Config, ConfigError, validate
from megatier.config.fast_path_validation import pick_device
from megatier.config.fingerprint import fingerprint_hash, followed_keys, state_fingerprint
from megatier.data.prefetch import PrefetchingBatches
from megatier.data.source import DataError, build_training_data
from megatier.faults import ActivationFlip, CrashPoint, FaultInjector, gradient_nan, parameter_flip
from megatier.model.gpt import GPTStage, init_weights
from megatier.model.params import stage_spec
from megatier.observe.digest import optimizer_canonical_digest, optimizer_state_digest
from megatier.observe.goodput import GoodputLedger, NullLedger, process_started
from megatier.observe.metrics import MetricsLogger, NullLogger
from megatier.optim.adamw import DistributedAdamW, Reduced
from megatier.optim.flat import FlatLayout, flatten_parameters
from megatier.optim.grad_buffer import GradBuffer
from megatier.optim.loss_scaler import DynamicLossScaler
from megatier.optim.overlap import attach as attach_overlap
from megatier.optim.schedule import schedule_of
from megatier.parallel.checkfree_plus import sync_replica_grads
from megatier.parallel.interleaved_schedule import run_interleaved
from megatier.parallel.p2p import PipelineComm, bubble_ms
from megatier.parallel.route_schedule import checkfree_plus_routes, forward_backward_routes
from megatier.parallel.schedules import forward_backward_1f1b, forward_backward_no_pipeline, forward_pipeline
from megatier.parallel.state import ParallelState, build_parallel_state, init_process_group
from megatier.seeding import derive_seed
from megatier.training.evaluate import evaluate_checkpoint
from megatier.training.inprocess import Membership, join_first_world
from megatier.training.interrupt import StopRequest
from megatier.training.job_import import init_weights_from, with_imported_job
from megatier.training.nonfinite import NonFiniteGuard
from megatier.training.reform import InPlaceRecovery
from megatier.training.sdc import SpikeCheck, ranks_that_differ

log = logging.getLogger(__name__)

# fp8: Transformer Engine's GEMMs in fp8 under GPTStage's autocast; parameters and activations in bf16.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


class Trainer(InPlaceRecovery):
    def __init__(self, cfg: Config, checkpointer: Optional[CheckpointerFactory] = None,
                 stop: Optional[StopRequest] = None, membership: Optional[Membership] = None):
        self.cfg = cfg
        self.stop = stop or StopRequest()  # Ctrl-C, SIGTERM, time limits: stop after a step (training.interrupt)
        self.interrupted_at: Optional[int] = None  # the step a stop request ended the loop after (its record says why)
        self.already_finished = False  # restore found the job at or past train.iters
        self.started = time.time()  # the launch holds its machines from here on (goodput's wall time)
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        validate(cfg, world_size)  # before any side effect: every group but checkpoint, then its own rules
        check_checkpoint_config(cfg.checkpoint)
        self.device = pick_device(cfg.train.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # In-process recovery's membership (megatier.training.inprocess); None: a failure ends the launch.
        self.membership = membership or Membership.connect(cfg.recovery, cfg.parallel.timeout_s)
        self.detected_at = membership.assigned_at if membership is not None else None  # a spare's: given a rank
        self._form_world()
        if self.membership is not None and not self.membership.world:
            self.membership.learn_world(self.ps.checkpoint_group)
        self._checkpoint_cfg = cfg.checkpoint  # as configured; each world takes what its topology allows
        self.step = 0
        self._updating = False  # the optimizer is applying a step (see _recover_in_place)
        self.logger, self.goodput = NullLogger(), NullLedger()
        self._factory = checkpointer  # in-process recovery builds the checkpointer again
        self._build_components()

    # ---- construction -------------------------------------------------------------------------

    def _form_world(self) -> None:
        """torch.distributed and the layout's process groups (on the membership round's store, if any)."""
        join_first_world(self.membership, self.cfg)  # a rank lost on the way is replaced before any step
        store = self.membership.process_group_store() if self.membership is not None else None
        init_process_group("nccl" if self.device.type == "cuda" else "gloo", self.cfg.parallel.timeout_s, store)
        p = self.cfg.parallel
        self.ps: ParallelState = build_parallel_state(p.tp, p.pp, p.timeout_s, self.device, p.ep)

    def _build_components(self) -> None:
        """Everything the current world's layout shapes: data, model, optimizer, guards, rank 0's logger and
        ledger, fault injectors and the checkpointer (again after an in-place recovery that changed the layout)."""
        cfg = self.cfg
        self._fit_checkpointing()
        self._set_threads()
        torch.manual_seed(derive_seed(cfg.train.seed, "torch", self.ps.tp_rank, self.ps.dp_rank, self.ps.pp_rank))
        self._build_data()
        self._build_model()
        self._build_optimizer()
        scaled = self.optimizer.scaler is not None
        self.nonfinite = NonFiniteGuard(cfg.reliability, scaled, self.ps.rank, self.ps.world_group)
        self.spikes = SpikeCheck(cfg.reliability.spike_factor, scaled)
        if (self.ps.rank == 0) != isinstance(self.logger, MetricsLogger):  # rank 0 writes the metrics
            self.logger.close()
            self.logger, self.goodput = self._build_logger(), self._build_ledger()
        self.fault = FaultInjector.from_env(self.ps.rank)
        # Transient faults for drills: a flipped activation bit, a NaN in the gradient (megatier.training.sdc), a
        # flipped bit in the gathered parameters (the replica check).
        self.flip, self.grad_nan = ActivationFlip.from_env(self.ps.rank), gradient_nan(self.ps.rank)
        self.param_flip = parameter_flip(self.ps.rank)
        for block in list(self.model.layers.values())[:1]:
            self.flip.install(block)
        self.checkpointer = with_imported_job(self._build_checkpointer(self._factory), self)  # model.init_from

    def _fit_checkpointing(self) -> None:
        """What this world's topology can take (a warning for each change) becomes the run's checkpoint config,
        the one config.yaml records and checkpointing uses: a re-formed world may span fewer or more nodes."""
        self.cfg.checkpoint = effective_checkpoint_config(self._checkpoint_cfg, self.ps.num_nodes)

    def _set_threads(self) -> None:
        threads = self.cfg.train.threads
        if threads is None and self.device.type == "cpu" and self.ps.world_size > 1:
            per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.ps.world_size))
            threads = max(1, (os.cpu_count() or 1) // per_node)  # don't oversubscribe shared cores
        if threads:
            torch.set_num_threads(threads)

    def _build_data(self) -> None:
        joining = self.membership is not None and self.membership.epoch > 0  # a spare joining a re-formed job
        try:
            data = build_training_data(self.cfg.data, self.cfg.train, self.ps, joining=joining,
                                       vocab_size=self.cfg.model.vocab_size)
        except DataError as e:  # the data the config names cannot give what the job asks: the config's to fix
            raise ConfigError(str(e)) from None
        self.data_prefix, self.data_checksum, self.dataset_meta = data.prefix, data.checksum, data.metadata
        self.batches = PrefetchingBatches(data.batches, self.device, enabled=self.cfg.data.prefetch,
                                          last_step=self.cfg.train.iters)

    def _build_model(self) -> None:
        m, ps, v = self.cfg.model, self.ps, self.cfg.parallel.virtual_stages
        vocab = m.vocab_size or self.dataset_meta["vocab_size"]
        if vocab < self.dataset_meta["vocab_size"]:
            raise ConfigError(f"model.vocab_size={vocab} is smaller than the dataset's vocabulary "
                             f"({self.dataset_meta['vocab_size']}); unset model.vocab_size to take it from the data")
        self.vocab_size = vocab  # the true vocabulary; the model pads its rows (padded logits are -inf)
        spec = stage_spec(m, tp=ps.tp, pp=ps.pp, tp_rank=ps.tp_rank, pp_rank=ps.pp_rank, virtual_stages=v)
        # Re-seeded every step (see train_step) so a resumed run draws the same dropout masks.
        self.dropout_generator = gen = torch.Generator(device=self.device)
        model = GPTStage(m, vocab, spec, tp_group=ps.tp_group, dropout_generator=gen, ep_group=ps.ep_group,
                         fp8=self.cfg.train.precision == "fp8", sequence_parallel=self.cfg.parallel.sequence_parallel)
        self.sequence_parallel_params = [n for n, p in model.named_parameters()
                                         if getattr(p, "sequence_parallel", False)]
        init_weights(model, self.cfg.train.seed)
        init_weights_from(model, m, vocab, ps.rank)  # a Hugging Face model.init_from: before flattening
        self.model = model.to(device=self.device, dtype=DTYPES[self.cfg.train.precision])
        self.layout = FlatLayout.from_module(self.model, ps.dp, tp_rank=ps.tp_rank, ep=ps.ep)
        self.param_flat = flatten_parameters(self.model, self.layout, DTYPES[self.cfg.train.precision], self.device)
        self.grads = GradBuffer(self.model, self.layout, self.device, dp_group=ps.dp_group,
                                expert_dp_group=ps.expert_dp_group)
        flat = self.param_flat
        self.comm = PipelineComm(group=ps.pp_group, dtype=flat.dtype, device=flat.device) if ps.pp > 1 else None

    def _build_optimizer(self) -> None:
        o, t = self.cfg.optim, self.cfg.train
        schedule = schedule_of(o, t.iters, t.global_batch_size, self.batches.ramp)
        scaler = (DynamicLossScaler(o.initial_loss_scale, o.min_loss_scale, o.loss_scale_window, o.hysteresis)
                  if t.precision == "fp16" else None)
        self.optimizer = DistributedAdamW(o, self.layout, self.param_flat, self.grads, dp_rank=self.ps.dp_rank,
                                          dp_group=self.ps.dp_group, norm_group=self.ps.world_group, schedule=schedule,
                                          scaler=scaler, expert_dp_group=self.ps.expert_dp_group)
        attach_overlap(self.cfg.parallel, self.model, self.grads, self.optimizer)  # parallel.overlap_*, bucket_mb

    def _build_checkpointer(self, factory: Optional[CheckpointerFactory]) -> Optional[Checkpointer]:
        state = TrainState(self.ps, self.model, self.optimizer, self.cfg.train.global_batch_size,
                           state_fingerprint(self.cfg, self.data_checksum), followed_keys(self.cfg))
        if factory is not None:
            return factory(state)
        if not self.cfg.checkpoint.enabled or self.cfg.train.eval_only:  # eval-only reads, writes nothing
            return None
        return build_checkpointer(self.cfg.checkpoint, state, timeout_s=self.cfg.parallel.timeout_s, fault=self.fault,
                                  reliability=self.cfg.reliability, reformed=bool(self.membership_epoch))

    def _build_logger(self):
        if self.ps.rank != 0:
            return NullLogger()
        resolved = OmegaConf.to_container(OmegaConf.structured(self.cfg), resolve=True)  # config.yaml's
        return MetricsLogger(self.cfg.logging, self.cfg.logging.run_dir, resolved, total_steps=self.cfg.train.iters)

    def _build_ledger(self):
        if self.ps.rank != 0 or self.cfg.train.eval_only:
            return NullLedger()
        fingerprint = fingerprint_hash(state_fingerprint(self.cfg, self.data_checksum))
        return GoodputLedger.open(self.cfg.logging.run_dir, self.cfg.checkpoint.job_id, fingerprint,
                                  started=self.started, process_started=process_started())

    # ---- one step -----------------------------------------------------------------------------

    def _microbatches(self, batches):
        return [(x.to(self.device), y.to(self.device)) for x, y in batches]

    def _forward_backward(self, batches, *, loss_scale: float, forward_only: bool = False) -> torch.Tensor:
        """Run this rank's micro-batches through the schedule of the layout (pp == 1: no pipeline; else 1F1B, its
        interleaved form with parallel.virtual_stages > 1, or CheckFree+'s routes with its pipeline_order)."""
        mbs, v = self._microbatches(batches), self.cfg.parallel.virtual_stages
        if self.comm is None:
            return forward_backward_no_pipeline(self.model, mbs, loss_scale=loss_scale, forward_only=forward_only)
        shards = self.ps.tp if self.model.sequence_parallel else 1  # activations cut by tokens between stages
        kw = {"comm": self.comm, "hidden_size": self.cfg.model.hidden_size, "seq_shards": shards}
        if v > 1 or forward_only:
            return run_interleaved(self.model, mbs, virtual_stages=v, loss_scale=loss_scale, forward_only=forward_only,
                                   **kw) if v > 1 else forward_pipeline(self.model, mbs, **kw)
        if self.cfg.model.pipeline_order == "checkfree_plus":
            routes = checkfree_plus_routes(self.ps.pp, len(mbs))
            return forward_backward_routes(self.model, mbs, routes, loss_scale=loss_scale, **kw)
        return forward_backward_1f1b(self.model, mbs, loss_scale=loss_scale, **kw)

    def _global_loss(self, local: torch.Tensor) -> tuple[float, Optional[str]]:
        """Mean loss over the global batch, known on every rank (computed on the last stage), and why the ranks
        stop after this step, if they do (the stop flags ride along in the same all-reduce: interrupt.py)."""
        counts = self.ps.tp_rank == 0  # a non-last stage's part: its MoE layers' router losses (0 without)
        contrib = local.double().reshape(1) / self.ps.dp if counts else torch.zeros(1, dtype=torch.float64)
        flags = torch.tensor(self.stop.flags(self.step + 1, self.ps.rank == 0), dtype=torch.float64)
        both = torch.cat([contrib.to(self.device), flags.to(self.device)])
        dist.all_reduce(both, group=self.ps.world_group)
        loss, *votes = both.tolist()
        return loss, self.stop.agreed(votes)

    def _sync_copies(self) -> None:
        """Give each copy its source's gradient: the tied embedding's two copies are summed; CheckFree+'s replicas
        receive theirs (megatier.parallel.checkfree_plus). Under sequence parallelism the parameters applied to
        token slices (the norms, GPT-2's row-parallel biases) hold partial gradients: summed over tp."""
        if self.sequence_parallel_params:
            self.grads.all_reduce_segments(self.sequence_parallel_params, self.ps.tp_group)
        if self.ps.embedding_group is not None:
            shared = self.model.shared_embedding_params()
            names = [n for n, p in self.model.named_parameters() if any(p is q for q in shared)]
            self.grads.all_reduce_segments(names, self.ps.embedding_group)
        if self.comm is not None:
            sync_replica_grads(self.grads, self.comm, self.cfg.model.pipeline_order, self.cfg.model.arch)

    def train_step(self, step: int) -> dict:
        """Run training step ``step`` and return its metrics record."""
        start = time.perf_counter()
        self.model.train()
        self.flip.begin(step)
        local_loss, reduced = self._gradient(step)
        loss, stop = self._global_loss(local_loss)
        why = self.spikes.suspicious(loss, reduced.sumsq)
        rerun = None if why is None else self._rerun(step, why, (local_loss, reduced.grad))
        loss, reduced = rerun if rerun is not None else (loss, reduced)
        self._updating = True  # a failure from here until the step is counted leaves the state between versions
        stats = self.optimizer.step(step, reduced)
        self.param_flip.plant(step, self.optimizer.param_flat)
        self.nonfinite.check(step, stats.skipped, loss, self.optimizer.last_grad, self.optimizer.shard_segments)
        if not stats.skipped:
            self.spikes.applied(loss, stats.grad_norm)
        elapsed = time.perf_counter() - start
        tokens = self.batches.ramp.batch(step) * self.cfg.data.seq_len
        record = {"step": step, "loss": loss, "lr": stats.lr, "grad_norm": stats.grad_norm,
                  "iter_time_s": elapsed, "tokens_per_s": tokens / elapsed, **self.model.step_metrics(self.ps.pp_group),
                  "consumed_samples": self.batches.consumed_before(step + 1), "skipped": stats.skipped,
                  "data_wait_ms": self.batches.take_wait_ms(), **self.optimizer.take_wait_ms(), **bubble_ms(self.comm)}
        if stop:
            record["stop_requested"] = stop
        if why is not None:
            record["rerun"] = why
        if self.optimizer.scaler is not None:
            record["loss_scale"] = stats.loss_scale
        elif stats.skipped:  # reliability.on_nonfinite=skip_step
            record["nonfinite_skipped"] = self.nonfinite.nonfinite_steps
            if self.ps.rank == 0:
                log.warning("step %d: the gradient is not finite (loss %s); skipped, nothing applied "
                            "(reliability.on_nonfinite=skip_step)", step, loss)
        return record

    def _gradient(self, step: int) -> tuple[torch.Tensor, Reduced]:
        """Step ``step``'s forward and backward (its batch, its dropout masks) and its reduced gradient."""
        ps, batches = self.ps, self.batches.train_microbatches(step)
        self.dropout_generator.manual_seed(derive_seed(self.cfg.train.seed, "dropout", step, ps.dp_rank, ps.pp_rank))
        self.grads.zero(micro_batches=len(batches))
        scale = self.optimizer.scaler.scale if self.optimizer.scaler is not None else 1.0
        local_loss = self._forward_backward(batches, loss_scale=scale)
        self.grad_nan.plant(step, self.grads.flat)
        self._sync_copies()
        return local_loss, self.optimizer.reduce()

    def _rerun(self, step: int, why: str, first: tuple[torch.Tensor, torch.Tensor]) -> Optional[tuple[float, Reduced]]:
        """Run suspicious step ``step`` again (megatier.training.sdc); the second loss and gradient when the two
        runs differ (a transient fault), None when they agree."""
        first = tuple(t.detach().clone() for t in first)
        local_loss, reduced = self._gradient(step)
        loss, _ = self._global_loss(local_loss)
        # The ranks whose own loss changed (an activation fault names its rank), else whose gradient did.
        group = self.ps.world_group
        ranks = ranks_that_differ(first[:1], (local_loss,), group, self.device) or \
            ranks_that_differ(first[1:], (reduced.grad,), group, self.device)
        if self.ps.rank == 0:
            if ranks:
                log.warning("step %d: %s; run again it gave another result on rank(s) %s: a transient fault "
                            "(silent data corruption); training goes on with the second result", step, why, ranks)
            else:
                log.info("step %d: %s; run again it gave the same result: not a transient fault", step, why)
        self.logger.log({"step": step, "event": "rerun", "why": why, "transient": bool(ranks), "ranks": ranks})
        return (loss, reduced) if ranks else None

    @torch.no_grad()
    def evaluate(self) -> Optional[float]:
        batches = self.batches.val_microbatches(self.cfg.train.eval_iters)
        if not batches:
            return None
        self.model.eval()
        local = self._forward_backward(batches, loss_scale=1.0, forward_only=True)
        return self._global_loss(local)[0]

    # ---- the loop -----------------------------------------------------------------------------

    def restore(self) -> None:
        """Let the checkpointer recover the newest consistent state; logs its recovery record and reconciles the
        goodput ledger with the step training goes on from (steps an earlier launch made past it are lost)."""
        record = None
        if self.checkpointer is not None:
            self.step, record = self.checkpointer.restore()
        if record is not None and self.goodput.continues_clean_exit:
            record["failure_class"] = "none"  # the previous launch exited cleanly: a continuation, no failure
        if record is not None and record.get("resharded"):
            # The state just moved to another layout: its layout-free fingerprint, to compare with the old run's.
            record["canonical_digest"] = self.canonical_digest()
        if record is not None:
            self.logger.log({"step": self.step, **record})
            say_recovered(record, self.ps.rank)
        self.goodput.resume(self.step, record, detected_at=self.detected_at)
        self.detected_at, self._intact = None, True
        self._say_schedule(record)

    def _say_schedule(self, record: Optional[dict]) -> None:
        """One line, when optim.decay_iters is unset, on the LR schedule this launch follows."""
        if self.cfg.optim.decay_iters is not None or self.ps.rank != 0:
            return
        horizon = self.optimizer.schedule.decay_iters
        if record is not None and "optim.decay_iters" in (record.get("adopted") or {}):
            log.info("optim.decay_iters is unset: following the LR schedule of job %r, which decays over %d steps "
                     "(set at its first launch); set optim.decay_iters to change it", self.cfg.checkpoint.job_id,
                     horizon)
        elif self.checkpointer is not None:
            log.info("optim.decay_iters is unset: the LR decays over train.iters=%d steps; later launches of this "
                     "job keep that schedule", horizon)

    def train(self) -> None:
        """Restore (at the launch), then train to train.iters; recovers a lost peer in place (InPlaceRecovery)."""
        t = self.cfg.train
        if t.eval_only:  # evaluate the job's checkpoint instead (megatier.training.evaluate)
            return evaluate_checkpoint(self)
        if self.step == 0:
            self._carry_on(self._attempt(self.restore)[1])
            self.already_finished = self.step >= t.iters > 0 and not self.membership_epoch  # a spare joins a job
        while self.step < t.iters and self.interrupted_at is None:
            self._carry_on(self._attempt(self._loop_step)[1])

    def _loop_step(self) -> None:
        """One pass of the loop: train step E+1, checkpoint it, validate when due, account and log it."""
        t = self.cfg.train
        step = self.step + 1
        self.fault(CrashPoint.TRAIN_STEP_BEGIN, step)
        record = self.train_step(step)
        self.step, self._updating = step, False
        if self.checkpointer is not None:
            start = time.perf_counter()
            record.update(self.checkpointer.after_step(step))
            record["ckpt_stall_ms"] = 1000.0 * (time.perf_counter() - start)
        if step % t.eval_interval == 0 or step == t.iters:
            start = time.perf_counter()
            val = self.evaluate()
            if val is not None:
                record.update(val_loss=val, eval_time_s=time.perf_counter() - start)
        record.update(self.goodput.step(record))  # persisted before the record is logged
        self.logger.log(record)
        self.logger.progress(step, record["loss"], record["tokens_per_s"])
        self.last_record = record
        self.fault(CrashPoint.TRAIN_STEP_END, step)
        if record.get("stop_requested"):
            self.interrupted_at = step

    def state_digest(self) -> str:
        return optimizer_state_digest(self.optimizer, self.step, self.ps.checkpoint_group)

    def canonical_digest(self) -> str:
        """Equal for equal state under any layout (:func:`~megatier.observe.digest.optimizer_canonical_digest`)."""
        return optimizer_canonical_digest(self.optimizer, self.ps.tp_rank, self.ps.tp, self.ps.checkpoint_group)

    def close(self, *, failed: bool = False) -> dict:
        """Drain checkpoints, write the summary record (with state_digest), shut down sinks and groups; ``failed``:
        the launch ends on a failure it found itself (a diverged step)."""
        status, digests, drain_s = self._closed(failed)
        summary = {"step": self.step, "event": "summary", **digests, **(status or {})}
        last = getattr(self, "last_record", None)
        if last is not None:
            summary.update(loss=last["loss"], val_loss=last.get("val_loss"))
        summary.update(self.goodput.close(drain_s))
        self.logger.summary(summary)
        self.logger.close()
        self.batches.close()
        self.grads.remove_hooks()
        if dist.is_initialized():
            dist.barrier(group=self.ps.checkpoint_group)
            dist.destroy_process_group()
        return summary
