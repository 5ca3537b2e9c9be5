"""Tiered checkpointing: a diff every step, a base every few dozen, on three tiers (docs/architecture.md).

The trainer sees one protocol (:mod:`.checkpointer`); everything else is laid
out by stage, policy on top and mechanism below (the order .importlinter
enforces: a module imports only from the rows below its own):

  checkpointer        Checkpointer protocol (restore / after_step / close), TrainState, build_checkpointer
  offline/tiers       verified reads of every tier without a running job (the conversion and inspection tools)
  offline/state       the recovery point a restore would choose, rebuilt offline in one process
  offline/plan        the size plan: payload bytes and what each tier holds, before a launch
  offline/listing     every unit of a job in every tier, verified (megatier-inspect's rows)

  manager             CheckpointManager: the policy (what to save when, watermark, reclamation, recovery points)

  recover/inventory   every tier's listing, gathered and merged the same way on every rank
  recover/consensus   base V and end E every rank reaches; the cheapest-first cascade order
  recover/cascade     fetching each rank's units round by round from the cheapest good copy
  recover/reshard     restoring the state of another layout
  recover/checkfree   the last resort: a lost pipeline stage rebuilt from its neighbours
  recover/record      the recovery record (failure class, tiers, bytes, timings, steps lost)
  recover/loops       the restart-loop guard: after repeated failing restores, an older base, then a stop
  recover/restore     restore(): inventory, consensus, cascade, replay, cleanup
  save/worker         SaveWorker: the diff and base streams, serialized once into the first tier
  save/base_capture   when and how a base leaves the optimizer (snapshot, spread, Checkflow-scheduled)
  save/capture        a spread capture's parts and their reconciliation by replay
  save/schedule       the Checkflow schedule of the parts over a profiled step (an integer program)
  save/step_ops       a step profiled into operations; the copier that runs scheduled copies

  context             CheckpointContext (config, layout, node, ordered tiers, collectives); build_context

  tiers/base          the Tier interface and Copy; tier labels and the cascade order
  tiers/local         Tier-1: this rank's units in its node's memory
  tiers/peer          Tier-2: replicas in the ring peer's memory (a lockstep tier)
  tiers/replicator    the Tier-2 ring protocol (headers, paced chunks, acks) in a background thread
  tiers/ring          pacing plan, legs and ticks of the ring transfers
  tiers/remote        Tier-3: remote storage through the commit protocol; open_remote_store
  tiers/durable       Tier-3 as the save thread sees it: the bases remote.base_every skips left out
  tiers/node_memory   NodeMemory: one node's area under /dev/shm (own and replica areas, progress keys)
  tiers/adoption      node memory filed under another node name: adopted or reported

  commit/records      Tier-3 object layout, done markers, commit records, unit listing and deletion order
  commit/uploader     phase 1: each rank's background uploader (objects, then its done marker)
  commit/committer    phase 2: ``_COMMITTED`` once every rank's marker is in
  commit/coordinator  rank 0's thread: commits and Tier-3 reclamation in one place
  commit/reader       reading committed units back, verified
  commit/lease        the owner lease on the job's Tier-3 prefix: one live writer per job

  policy/interval     the base interval's cost model (GoCkpt's analysis, with a diff every step)
  policy/auto_interval base_interval=auto: costs measured, the interval chosen after a warm-up
  policy/cadence      which bases Tier-3 gets (remote.base_every)
  policy/replicas     the replica check: which data-parallel replicas hold other parameters than their group
  policy/rules        the checkpoint config's cross-field rules; the effective config on a topology
  reclaim/policy      which units a watermark (or a recovery point) makes obsolete, per tier
  reclaim/executor    the one deletion executor every reclaiming caller uses
  shard               ShardAccess: the one door to the optimizer shard (capture, compress, load, replay, publish)
  comm                CheckpointComm: gathers, transfers and barriers on gloo groups, or a world of one

  format/units        PayloadId (a base, a diff batch or a step unit) and the names every tier derives from it
  format/payload      payload encoding (safetensors), Stamp, xxh64 verification, base and diff-batch codecs
  format/chain        the diff-chain walk every recovery point is computed with
  format/finite       the NaN/inf check of a unit's tensors: a non-finite base or diff is never a recovery point
  threads             helper threads kept off the training loop's cores

  storage/store       the ObjectStore contract, its errors, retry with backoff
  storage/directory   DirectoryStore: atomic files (node memory, Tier-3 on a shared file system)
  storage/s3          S3Store: boto3, conditional creates, multipart uploads
  storage/spare       spare files: deleted units' files, written over by the next units
"""
