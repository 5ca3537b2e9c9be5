"""CheckFree+ (arXiv:2506.15461, section 4.3): what ``model.pipeline_order=checkfree_plus`` adds besides its routes.

The odd micro-batches of every step take the swapped route (:mod:`.route_schedule`),
so stage 1's layers learn to stand in for stage 0's and stage P-2's for stage
P-1's (:func:`stand_in`). A lost first or last stage is then rebuilt by copying
its stand-in's layers (:mod:`megatier.checkpoint.recover.checkfree`), and its
(de)embedding from copies kept on other stages (:func:`replicas_of`):

- the word embedding needs no replica: with pp > 1 the last stage's output head
  is its tied copy, and stage 0's embedding is the head's;
- stage 1 keeps a copy of stage 0's position embedding (``pos_replica.weight``);
- stage P-2 keeps a copy of the last stage's final LayerNorm
  (``final_norm_replica.*``).

A replica is a parameter of its stage that its forward never uses; every step it
receives exactly its source's gradient (:func:`sync_replica_grads`), so the same
AdamW update keeps it bitwise equal to its source (weights and moments), as the
tied head is kept. The replicas cost (max_positions + 2) x hidden parameters and
one transfer of their gradients per step; the paper's Table 1 counts O(E).
"""
from __future__ import annotations

from megatier.optim.grad_buffer import GradBuffer
from megatier.parallel.p2p import PipelineComm

PIPELINE_ORDERS = ("standard", "checkfree_plus")
# Which stage keeps which replica (a StageSpec.replicas entry), counted from either end of the pipeline.
_REPLICA_HOLDERS = {"pos": 1, "final_norm": -2}
_REPLICA_PARAMS = {"pos": ("pos_replica.weight",), "final_norm": ("final_norm_replica.weight",
                                                                  "final_norm_replica.bias")}
# Each replica parameter -> the parameter it copies (part of megatier.model.params.copies_of).
REPLICA_SOURCES = {"pos_replica.weight": "pos.weight", "final_norm_replica.weight": "final_norm.weight",
                   "final_norm_replica.bias": "final_norm.bias"}


def replicas_of(pipeline_order: str, pp: int, stage: int) -> tuple[str, ...]:
    """The replicas pipeline stage ``stage`` of ``pp`` keeps (none outside CheckFree+)."""
    if pipeline_order != "checkfree_plus":
        return ()
    return tuple(kind for kind, holder in _REPLICA_HOLDERS.items() if holder % pp == stage)


def has_stand_ins(stage_names) -> bool:
    """Whether a job whose stages hold ``stage_names`` (a set of parameter names per stage) trained with
    CheckFree+: its first and last stage have stand-ins exactly when its replicas exist."""
    return any(name in names for names in stage_names for params in _REPLICA_PARAMS.values() for name in params)


def stand_in(stage: int, pp: int) -> int:
    """The stage whose layers stand in for a lost first or last stage: its swap partner."""
    if stage not in (0, pp - 1):
        raise ValueError(f"stage {stage} of {pp} has two neighbours; CheckFree averages them instead")
    return 1 if stage == 0 else pp - 2


def _source_stage(kind: str, pp: int) -> int:
    return 0 if kind == "pos" else pp - 1


def sync_replica_grads(grads: GradBuffer, comm: PipelineComm, pipeline_order: str) -> None:
    """Send each replica's source gradient to the stage that keeps it (same tp and dp coordinates), and
    receive into this stage's replicas; after the step's backward, before the optimizer. A no-op outside
    CheckFree+."""
    if pipeline_order != "checkfree_plus":
        return
    pp, me = comm.num_stages, comm.stage
    posted = []
    for kind, holder in _REPLICA_HOLDERS.items():
        holder, source = holder % pp, _source_stage(kind, pp)
        for name in _REPLICA_PARAMS[kind]:
            if me == source:
                posted.append(comm.isend_to(holder, grads.view_of(REPLICA_SOURCES[name])))
            elif me == holder:
                view = grads.view_of(name)
                view.copy_(comm.recv_from(source, tuple(view.shape)).view_as(view))
    for works, _ in posted:
        for work in works:
            work.wait()
