"""How a launch ends: its exit status, the one line a refusal prints, and the lines a finished launch prints.

Exit statuses (docs/operations.md):

    0    trained to train.iters (or the job had already finished), every checkpoint durable
    2    refused: this configuration cannot run (an unknown key or bad value, checkpoints of another
         configuration or job, an unusable checkpoint.remote.url, a model.init_from that does not fit,
         another live run of the job)
    3    trained, but Tier-3 stayed behind: the newest checkpoints are only in node memory
    4    recovery refused: checkpoints of this job exist but no consistent state can be restored from them
    5    stopped as diverged: a step's gradient was not finite (reliability.on_nonfinite=stop), too many steps
         in a row were skipped, or the state about to be checkpointed held NaN or inf; the checkpoints end at the
         last finite state
    6    stopped in a restore loop: the job failed right after every point it could restore (the previous base
         and Tier-3's included; reliability.loop_window, loop_limit); relaunching repeats it
    7    in-process recovery could not re-form the job (no spare for a lost rank, the membership store gone);
         relaunch: the next launch restores as after any failure
    0    also: stopped by SIGTERM (a scheduler's limit, a launcher's stop), train.exit_interval or
         train.exit_duration_in_mins, every checkpoint durable (3 while Tier-3 is behind), as Megatron's
         --exit-signal-handler ends: a scheduler reads the job as ended well, and the relaunch goes on
    130  interrupted (Ctrl-C); relaunch the same command to resume
    143  a second SIGTERM stopped the launch at once, without draining (as a second Ctrl-C ends with 130)

Anything else is a failure, with its traceback. A refusal is raised on every rank the same way; only global
rank 0 prints it, so a job of any size prints one line.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from megatier.checkpoint.commit.lease import LeaseHeld
from megatier.checkpoint.format.finite import NonFiniteState
from megatier.checkpoint.recover.inventory import ConfigRefusal, RecoveryError
from megatier.checkpoint.recover.loops import RestoreLoop
from megatier.config import ConfigError
from megatier.interop.hf_files import HFFormatError
from megatier.training.inprocess import RoundFailed
from megatier.training.nonfinite import NonFiniteStep

EXIT_TRAINED, EXIT_CONFIG, EXIT_TIER3_BEHIND, EXIT_RECOVERY_REFUSED, EXIT_DIVERGED = 0, 2, 3, 4, 5
EXIT_RESTORE_LOOP, EXIT_REFORM_FAILED = 6, 7
EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143  # 128 + SIGINT, 128 + SIGTERM
STATUS_DIR = "MEGATIER_STATUS_DIR"  # where megatier-run's workers leave their exit statuses (record_status)
# How long a rank other than 0 keeps a refused launch alive for rank 0 to print its line (rank 0 may have failed
# otherwise and never will).
REFUSAL_WAIT_S = 60.0
# What stops a run as diverged (exit 5): a non-finite step, or a non-finite state about to be checkpointed.
DIVERGED = (NonFiniteStep, NonFiniteState)


def drop_process_group() -> None:
    """At the end of a launch that did not close (a refusal, a crash): destroy the process group now rather than
    leave it to the interpreter's exit, where its threads may still be joinable when C++ tears it down."""
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_skipping_teardown(status: int) -> None:
    """End the process now with ``status``, its output and logs flushed, skipping the interpreter's teardown of
    torch's C++ objects (see :func:`megatier.train.cli`); the status is left where ``megatier-run`` reads it
    (:func:`record_status`)."""
    record_status(status)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(status)


def record_status(status: int) -> None:
    """Under ``megatier-run`` (``STATUS_DIR`` set), write this worker's exit status to ``<dir>/<LOCAL_RANK>``:
    torchrun's agent, stopped by a signal, forgets its workers' statuses, and the launch ends with theirs."""
    directory = os.environ.get(STATUS_DIR)
    if directory:
        try:
            with open(os.path.join(directory, os.environ.get("LOCAL_RANK", "0")), "w") as f:
                f.write(str(status))
        except OSError:  # the launch has ended already (it gave up waiting): nobody reads it
            pass


def recorded_statuses(directory: str, workers: int) -> Optional[list[int]]:
    """The statuses :func:`record_status` left in ``directory`` by ``workers`` workers; None unless every one
    ended on its own (a worker killed, or still draining when torchrun gave up on it, wrote none)."""
    found = []
    for local_rank in range(workers):
        try:
            with open(os.path.join(directory, str(local_rank))) as f:
                found.append(int(f.read()))
        except (OSError, ValueError):
            return None
    return found


def is_rank0() -> bool:
    """Global rank 0 (or a launch without a launcher), from the environment: valid before any process group."""
    return int(os.environ.get("RANK", "0")) == 0


def say(line: str, *, err: bool = False) -> None:
    if is_rank0():
        print(line, file=sys.stderr if err else sys.stdout, flush=True)


def refusal(error: BaseException) -> Optional[tuple[int, str]]:
    """(exit status, the line to print) when ``error`` is a refusal, else None (a failure: let it raise)."""
    if isinstance(error, ConfigError):
        return EXIT_CONFIG, f"config error: {error}"
    if isinstance(error, HFFormatError):
        return EXIT_CONFIG, f"config error: model.init_from: {error}"
    if isinstance(error, (ConfigRefusal, LeaseHeld)):
        return EXIT_CONFIG, str(error)
    if isinstance(error, RestoreLoop):
        return EXIT_RESTORE_LOOP, str(error)
    if isinstance(error, RecoveryError):
        return EXIT_RECOVERY_REFUSED, str(error)
    if isinstance(error, RoundFailed):
        return EXIT_REFORM_FAILED, (f"in-process recovery could not re-form the job: {error}; relaunch it (the "
                                    f"next launch restores from the checkpoints as after any failure)")
    return None


def refuse(status: int, line: str, speaker: Optional[bool] = None) -> int:
    """Print a refusal's line (rank 0, or this process when ``speaker``: the one the refusal chose) and return
    its exit status, once it is printed. Under torchrun's agent the first worker to exit makes the agent stop
    the others, so a rank that reached the refusal before rank 0 (a loaded machine) got rank 0 killed before
    its line. Rank 0 marks the line said in the agent's store; the other ranks wait for the mark before they
    exit."""
    store = _agent_store()
    key = f"megatier/refusal_said/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if is_rank0() if speaker is None else speaker:
        print(line, file=sys.stderr, flush=True)
        if store is not None:
            store.set(key, "1")
    elif store is not None:
        try:
            store.wait([key], timedelta(seconds=REFUSAL_WAIT_S))
        except RuntimeError:  # rank 0 ended otherwise: its own status tells
            pass
    return status


def _agent_store() -> Optional[dist.Store]:
    """The store torchrun's agent serves its workers (None without that agent, or when it cannot be reached)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=timedelta(seconds=REFUSAL_WAIT_S))
    except (KeyError, ValueError, RuntimeError):
        return None


def diverged(trainer, error: BaseException) -> int:
    """Print the line of a run stopped as diverged (:data:`DIVERGED`) and return the exit status. After a
    non-finite step (neither applied nor checkpointed) the checkpointer is closed first, so the last finite
    state is made durable; a non-finite state found by the save thread is not checkpointed at all."""
    resume = ""
    if trainer is not None and isinstance(error, NonFiniteStep):
        try:
            summary = trainer.close(failed=True)
            resume = f"; checkpoints are durable at step {summary['step']}" if trainer.checkpointer else ""
        except NonFiniteState as state:  # the last state itself is not finite: not checkpointed either
            resume = f"; and {state}"
    say(f"stopped: {error}{resume}", err=True)
    return EXIT_DIVERGED


def interrupted_twice(trainer, sig: Optional[signal.Signals]) -> int:
    """Print the line of a launch a second Ctrl-C (or SIGTERM, ``sig``) ended without draining (``trainer``
    None: during the build) and return the exit status."""
    step = trainer.step if trainer is not None else 0
    resume = None if trainer is None or trainer.checkpointer is None else \
        "the newest checkpoint in node memory (at most the step in flight is lost)"
    sig = sig or signal.SIGINT
    say(interrupted(step, resume, sig.name), err=True)
    return 128 + sig


def interrupted(step: int, resume_from: Optional[str], cause: str = "SIGINT") -> str:
    """The line of a launch stopped after ``step`` by ``cause`` (a signal's name or a time limit's key);
    ``resume_from`` says where a relaunch goes on (None: checkpointing is off)."""
    what = {"SIGINT": "interrupted", "SIGTERM": "terminated (SIGTERM)"}.get(cause, f"stopped by {cause}")
    if resume_from is None:
        return (f"{what} at step {step}; checkpointing is off (checkpoint=disabled), so a relaunch starts "
                f"again from step 0")
    return f"{what} at step {step}; relaunch the same command to resume from {resume_from}"


def stop_status(cause: str) -> Optional[int]:
    """The exit status of a loop stopped by ``cause``: 130 for Ctrl-C (a person stopped it); None for SIGTERM and
    the time limits, which end as a finished launch does (0, or 3 while Tier-3 is behind)."""
    return EXIT_INTERRUPTED if cause == "SIGINT" else None


def finished(trainer, summary: dict) -> int:
    """Print how the launch ended (rank 0) and return its exit status."""
    cfg = trainer.cfg
    if trainer.already_finished:
        say(f"job {cfg.checkpoint.job_id!r} had already finished: its checkpoints are at step {trainer.step} and "
            f"train.iters={cfg.train.iters}; nothing to train (raise train.iters to train longer). "
            f"state_digest {summary['state_digest']}")
    elif cfg.train.eval_only:  # its val_loss line is printed; nothing was trained
        say(f"eval-only: state_digest {summary['state_digest']} at step {summary['step']}")
    elif trainer.interrupted_at is None:
        say(f"done: step {summary['step']} loss {summary.get('loss', float('nan')):.4f} "
            f"state_digest {summary['state_digest']}")
    say(f"metrics: {trainer.logger.path}")
    if trainer.logger.wandb_dir:
        say(f"wandb ({cfg.logging.wandb.mode}): {trainer.logger.wandb_dir}")
    if summary.get("checkpoint_behind"):
        durable = summary["checkpoint_durable_step"]
        durable = "none yet" if durable is None else f"v{durable}"
        say(f"checkpoints: Tier-3 is {summary['checkpoint_units_behind']} units behind; the last durable version "
            f"is {durable} (see the warning above)", err=True)
    if trainer.interrupted_at is not None:
        resume = f"step {summary['step']}" if trainer.checkpointer is not None else None
        cause = trainer.last_record["stop_requested"]
        say(interrupted(trainer.interrupted_at, resume, _with_value(cause, cfg.train)), err=True)
        if stop_status(cause) is not None:
            return stop_status(cause)
    return EXIT_TIER3_BEHIND if summary.get("checkpoint_behind") else EXIT_TRAINED


def _with_value(cause: str, train) -> str:
    """A time limit's key as the user set it (``train.exit_interval=50``); a signal's name as it is."""
    return f"{cause}={getattr(train, cause.split('.')[1])}" if cause.startswith("train.") else cause
