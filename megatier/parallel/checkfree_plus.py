"""CheckFree+ (arXiv:2506.15461, section 4.3): what ``model.pipeline_order=checkfree_plus`` adds besides its routes.

The odd micro-batches of every step take the swapped route (:mod:`.route_schedule`),
so stage 1's layers learn to stand in for stage 0's and stage P-2's for stage
P-1's (:func:`stand_in`). A lost first or last stage is then rebuilt by copying
its stand-in's layers (:mod:`megatier.checkpoint.recover.checkfree`), and its
(de)embedding from copies kept on other stages (:func:`replicas_of`):

- GPT-2: the word embedding needs no replica: with pp > 1 the last stage's output
  head is its tied copy, and stage 0's embedding is the head's; stage 1 keeps a
  copy of stage 0's position embedding (``pos_replica.weight``), stage P-2 one of
  the last stage's final LayerNorm (``final_norm_replica.*``);
- Llama (untied head, no position table): stage 1 keeps a copy of the word
  embedding (``word_replica.weight``), stage P-2 copies of the final RMSNorm and
  the output head (``final_norm_replica.weight``, ``head_replica.weight``); the
  vocabulary copies are cut over tp as their sources are.

A replica is a parameter of its stage that its forward never uses; every step it
receives exactly its source's gradient (:func:`sync_replica_grads`), so the same
AdamW update keeps it bitwise equal to its source (weights and moments), as the
tied head is kept. The replicas cost (max_positions + 2) x hidden parameters for
GPT-2 and (2 x vocabulary + 1) x hidden for Llama, with one transfer of their
gradients per step; the paper's Table 1 counts O(E).
"""
from __future__ import annotations

from megatier.optim.grad_buffer import GradBuffer
from megatier.parallel.p2p import PipelineComm

PIPELINE_ORDERS = ("standard", "checkfree_plus")
# Each replica a stage can keep: (the stage that keeps it, the stage that holds its source), counted from either
# end of the pipeline, and its parameters.
_REPLICAS = {"pos": (1, 0, ("pos_replica.weight",)),
             "word": (1, 0, ("word_replica.weight",)),
             "final_norm": (-2, -1, ("final_norm_replica.weight", "final_norm_replica.bias")),
             "head": (-2, -1, ("head_replica.weight",))}
_ARCH_REPLICAS = {"gpt2": ("pos", "final_norm"), "llama": ("word", "final_norm", "head")}
# Each replica parameter -> the parameter it copies (part of megatier.model.params.copies_of).
REPLICA_SOURCES = {"pos_replica.weight": "pos.weight", "word_replica.weight": "word.weight",
                   "final_norm_replica.weight": "final_norm.weight", "final_norm_replica.bias": "final_norm.bias",
                   "head_replica.weight": "head_weight"}


def replicas_of(pipeline_order: str, pp: int, stage: int, arch: str = "gpt2") -> tuple[str, ...]:
    """The replicas pipeline stage ``stage`` of ``pp`` keeps in a model of ``arch`` (none outside CheckFree+)."""
    if pipeline_order != "checkfree_plus":
        return ()
    return tuple(kind for kind in _ARCH_REPLICAS[arch] if _REPLICAS[kind][0] % pp == stage)


def replica_parameters(kind: str, arch: str) -> tuple[str, ...]:
    """The parameters of replica ``kind`` in a model of ``arch`` (Llama's RMSNorm has no bias)."""
    names = _REPLICAS[kind][2]
    return tuple(n for n in names if not (arch == "llama" and n.endswith(".bias")))


def has_stand_ins(stage_names) -> bool:
    """Whether a job whose stages hold ``stage_names`` (a set of parameter names per stage) trained with
    CheckFree+: its first and last stage have stand-ins exactly when its replicas exist."""
    return any(name in REPLICA_SOURCES for names in stage_names for name in names)


def stand_in(stage: int, pp: int) -> int:
    """The stage whose layers stand in for a lost first or last stage: its swap partner."""
    if stage not in (0, pp - 1):
        raise ValueError(f"stage {stage} of {pp} has two neighbours; CheckFree averages them instead")
    return 1 if stage == 0 else pp - 2


def sync_replica_grads(grads: GradBuffer, comm: PipelineComm, pipeline_order: str, arch: str = "gpt2") -> None:
    """Send each replica's source gradient to the stage that keeps it (same tp and dp coordinates), and
    receive into this stage's replicas; after the step's backward, before the optimizer. A no-op outside
    CheckFree+."""
    if pipeline_order != "checkfree_plus":
        return
    pp, me = comm.num_stages, comm.stage
    posted = []
    for kind in _ARCH_REPLICAS[arch]:
        holder, source = (end % pp for end in _REPLICAS[kind][:2])
        for name in replica_parameters(kind, arch):
            if me == source:
                posted.append(comm.isend_to(holder, grads.view_of(REPLICA_SOURCES[name])))
            elif me == holder:
                view = grads.view_of(name)
                view.copy_(comm.recv_from(source, tuple(view.shape)).view_as(view))
    for works, _ in posted:
        for work in works:
            work.wait()
