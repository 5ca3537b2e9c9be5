"""Named crash points for failure drills, armed by ``MEGATIER_CRASH_AT``.

    MEGATIER_CRASH_AT=<point>:<step>[:<rank>][:stop|:node][,<point>:<step>[:<rank>][:stop|:node]...]

kills this process with SIGKILL (no cleanup, no flush: a real crash) the first
time code reaches ``point`` for a step or version at or after ``step``, on
``rank`` only when given, else on every rank that gets there. With ``stop`` the
process SIGSTOPs itself instead: a hung rank, which its peers must notice
within their timeout. With ``node`` it SIGKILLs its whole process group at once: on a node of
``megatier-launch`` that is the node's agent, every rank and every spare, as when the machine dies (nobody is
left to report a death; the agent's lease runs out). Several points
may be armed at once (the first reached fires), e.g. a crash point that may not
be reached and ``train.step_end`` as a backstop. Code calls a
:data:`FaultHook` at each point (a :class:`FaultInjector`, or :func:`no_faults`
in code paths built without one); when nothing is armed that is one
comparison.

Transient faults for the reliability drills, each firing once in a launch: ``MEGATIER_FLIP_AT=<step>[:<rank>]``
flips a bit of an activation (:class:`ActivationFlip`), ``MEGATIER_GRAD_NAN_AT=<step>[:<rank>]`` plants a NaN
into the local gradient and ``MEGATIER_PARAM_FLIP_AT=<step>[:<rank>]`` flips a bit of the rank's parameters
after the all-gather (:class:`TensorFault`).
"""
from __future__ import annotations

import enum
import os
import signal
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import torch

ENV = "MEGATIER_CRASH_AT"


class CrashPoint(str, enum.Enum):
    """Every point a drill can crash at, with where it lands and what it proves."""

    T1_MID_WRITE = "t1.mid_write"  # a Tier-1 payload written, its stamp not: the unit stays invisible
    T2_MID_CHUNK = "t2.mid_chunk"  # a paced base replica half sent: the receiver discards it
    T2_MID_RECORD = "t2.mid_record"  # a diff batch or step unit announced to the peer, its bytes not sent
    T3_BEFORE_MARKER = "t3.before_marker"  # a rank's Tier-3 object uploaded, its done marker not: no commit
    T3_BEFORE_COMMIT = "t3.before_commit"  # every marker in, ``_COMMITTED`` not written: no commit
    T3_AFTER_COMMIT = "t3.after_commit_before_watermark"  # committed on Tier-3, the watermark not yet advanced
    GC_MID_DELETE = "gc.mid_delete"  # reclamation interrupted between two deletions
    REPLAY_MID_BATCH = "replay.mid_batch"  # recovery killed while replaying the diff chain
    # A rank dies before its launch's first world forms (importing, composing its config): the others wait in
    # the rendezvous. Reached once per launch, at step 0.
    LAUNCH_FIRST_WORLD = "launch.first_world"
    # Recovery killed after its inventory, while rank 0 decides: at the step a survivor keeps in memory (0 at a
    # launch), so ``recover.consensus:1`` fires only in an in-place recovery.
    RECOVER_CONSENSUS = "recover.consensus"
    # The training process dies as step S begins, nothing of it applied: a step that crashes whenever it is
    # reached (the restart-loop guard must not restore into it forever).
    TRAIN_STEP_BEGIN = "train.step_begin"
    # The training process dies after step S and its checkpoint hand-off: how the drill kills a node at S.
    TRAIN_STEP_END = "train.step_end"

    def __str__(self) -> str:
        return self.value


# hook(point, step_or_version): called at a crash point; it may kill the process (or raise, in tests).
FaultHook = Callable[[CrashPoint, int], None]


def no_faults(point: CrashPoint, step: int) -> None:
    """The hook of code paths that inject nothing."""


@dataclass(frozen=True)
class Armed:
    """One armed crash: ``point`` at a step or version >= ``step``, on ``only_rank`` (None: any rank)."""

    point: CrashPoint
    step: int = 0
    only_rank: Optional[int] = None
    stop: bool = False  # hang (SIGSTOP) instead of dying (SIGKILL)
    node: bool = False  # kill the process group (the simulated node: its agent and every process it started)


@dataclass(frozen=True)
class FaultInjector:
    """Crashes this process at an armed point; a disarmed injector (nothing armed) does nothing."""

    rank: int
    armed_points: tuple[Armed, ...] = ()

    @classmethod
    def from_env(cls, rank: int, environ: Optional[dict] = None) -> "FaultInjector":
        """Parse ``MEGATIER_CRASH_AT``; a malformed value is an error that shows the expected form."""
        spec = (environ if environ is not None else os.environ).get(ENV, "").strip()
        if not spec:
            return cls(rank)
        names = ", ".join(p.value for p in CrashPoint)
        usage = (f"{ENV}={spec!r} is not <point>:<step>[:<rank>][:stop|:node][,...] with point one of {names}; "
                 f"fix or unset it")
        armed = []
        for item in spec.split(","):
            parts = item.strip().split(":")
            how = parts[-1] if parts[-1] in ("stop", "node") else None
            parts = parts[:-1] if how else parts
            try:
                if len(parts) not in (2, 3):
                    raise ValueError
                rank_part = int(parts[2]) if len(parts) == 3 else None
                armed.append(Armed(CrashPoint(parts[0]), int(parts[1]), rank_part, how == "stop", how == "node"))
            except ValueError:
                raise ValueError(usage) from None
        return cls(rank, tuple(a for a in armed if a.only_rank in (None, rank)))

    @property
    def armed(self) -> bool:
        return bool(self.armed_points)

    @property
    def point(self) -> Optional[CrashPoint]:
        """The first armed point (None when disarmed)."""
        return self.armed_points[0].point if self.armed_points else None

    def hit(self, point: CrashPoint, step: int) -> None:
        """Crash here if ``point`` is armed for ``step`` (at or after the armed step) on this rank."""
        hit = next((a for a in self.armed_points if a.point == point and step >= a.step), None)
        if hit is None:
            return
        what = "hanging" if hit.stop else "killing its node" if hit.node else "crashing"
        sys.stderr.write(f"[megatier] {ENV}: rank {self.rank} {what} at {point} (step {step})\n")
        sys.stderr.flush()
        if hit.node:
            os.killpg(os.getpgrp(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGSTOP if hit.stop else signal.SIGKILL)

    # Mechanism code takes a plain FaultHook callable.
    __call__ = hit


FLIP_ENV = "MEGATIER_FLIP_AT"
GRAD_NAN_ENV = "MEGATIER_GRAD_NAN_AT"
PARAM_FLIP_ENV = "MEGATIER_PARAM_FLIP_AT"


def _armed_step(env: str, rank: int, environ: Optional[dict]) -> Optional[int]:
    """The step ``<step>[:<rank>]`` in ``env`` arms on ``rank`` (every rank when none is given), or None."""
    spec = (environ if environ is not None else os.environ).get(env, "").strip()
    if not spec:
        return None
    try:
        parts = [int(p) for p in spec.split(":")]
        if len(parts) not in (1, 2):
            raise ValueError
    except ValueError:
        raise ValueError(f"{env}={spec!r} is not <step>[:<rank>]; fix or unset it") from None
    return parts[0] if len(parts) == 1 or parts[1] == rank else None


@dataclass
class ActivationFlip:
    """A transient fault for reliability drills, armed by ``MEGATIER_FLIP_AT=<step>[:<rank>]``: the first forward
    pass of ``step`` on ``rank`` (every rank when not given) flips bit 30 (the exponent's highest) of the first
    element of a block's output, once, as faulty hardware might. Run again, the step computes the right result
    (megatier.training.sdc must notice and use it)."""

    step: Optional[int] = None
    current: int = 0
    fired: bool = False

    @classmethod
    def from_env(cls, rank: int, environ: Optional[dict] = None) -> "ActivationFlip":
        return cls(_armed_step(FLIP_ENV, rank, environ))

    def install(self, module) -> None:
        """Hook ``module`` (a torch module whose output is a float tensor) when armed."""
        if self.step is not None:
            module.register_forward_hook(self._hook)

    def begin(self, step: int) -> None:
        """Training step ``step`` starts."""
        self.current = step

    def _hook(self, module, inputs, output):
        if self.fired or self.current != self.step or not module.training:
            return None
        self.fired = True
        flipped = output.detach().clone()
        flipped.view(-1)[:1].view(torch.int32).bitwise_xor_(1 << 30)
        sys.stderr.write(f"[megatier] {FLIP_ENV}: flipped a bit of an activation at step {self.step}\n")
        return output + (flipped - output.detach())  # the flipped values; gradients pass as they would


@dataclass
class TensorFault:
    """A transient fault for reliability drills that poisons one tensor once: at ``step`` (armed by ``env`` as
    ``<step>[:<rank>]``) its first element becomes NaN (``nan``) or inf (``inf``), or has bit 30 flipped
    (``flip``).

    - :data:`GRAD_NAN_ENV`: this rank's local gradient after the step's first backward pass. The step's second
      run is clean (megatier.training.sdc); a NaN must never reach a checkpoint.
    - :data:`PARAM_FLIP_ENV`: this rank's copy of the parameters after the optimizer step's all-gather, as a
      flipped bit in memory or on the wire would leave it; the replica check must find it
      (megatier.checkpoint.policy.replicas).
    """

    env: str
    kind: str  # "nan" | "inf" | "flip"
    step: Optional[int] = None
    fired: bool = False

    @classmethod
    def from_env(cls, env: str, kind: str, rank: int, environ: Optional[dict] = None) -> "TensorFault":
        return cls(env, kind, _armed_step(env, rank, environ))

    def plant(self, step: int, tensor: torch.Tensor) -> None:
        """Poison ``tensor`` when armed for ``step`` (once)."""
        if self.fired or step != self.step:
            return
        self.fired = True
        first = tensor.detach().view(-1)[:1]
        if self.kind == "flip":
            first.view(torch.int32).bitwise_xor_(1 << 30)
        else:
            first.fill_(float(self.kind))  # "nan" or "inf"
        sys.stderr.write(f"[megatier] {self.env}: {self.kind} planted at step {step}\n")


def gradient_nan(rank: int, environ: Optional[dict] = None) -> TensorFault:
    return TensorFault.from_env(GRAD_NAN_ENV, "nan", rank, environ)


def parameter_flip(rank: int, environ: Optional[dict] = None) -> TensorFault:
    return TensorFault.from_env(PARAM_FLIP_ENV, "flip", rank, environ)
