"""Tiered checkpointing: a diff every step, a base every few dozen, on three tiers (docs/architecture.md).

The trainer sees one protocol (:mod:`.checkpointer`); everything else is laid
out by stage, policy on top and mechanism below:

  checkpointer        Checkpointer protocol (restore / after_step / close), TrainState, build_checkpointer
  manager             CheckpointManager: the policy (what to save when, watermark, reclamation, recovery points)
  context             CheckpointContext (config, layout, node, ordered tiers, collectives); build_context
  comm                CheckpointComm: gathers, transfers and barriers on gloo groups, or a world of one
  shard               ShardAccess: the one door to the optimizer shard (capture, compress, load, replay, publish)
  threads             helper threads kept off the training loop's cores

  format/units        PayloadId (a base or a diff batch) and the names every tier derives from it
  format/payload      payload encoding (safetensors), Stamp, xxh64 verification, base and diff-batch codecs
  format/chain        the diff-chain walk every recovery point is computed with

  save/worker         SaveWorker: the diff and base streams, serialized once into the first tier

  tiers/base          the Tier interface and Copy; tier labels and the cascade order
  tiers/local         Tier-1: this rank's units in its node's memory
  tiers/peer          Tier-2: replicas in the ring peer's memory (a lockstep tier)
  tiers/replicator    the Tier-2 ring protocol (headers, paced chunks, acks) in a background thread
  tiers/ring          pacing plan, legs and ticks of the ring transfers
  tiers/remote        Tier-3: remote storage through the commit protocol; open_remote_store
  tiers/node_memory   NodeMemory: one node's area under /dev/shm (own and replica areas, progress keys)
  tiers/store         the ObjectStore contract, its errors, retry with backoff
  tiers/directory     DirectoryStore: atomic files (node memory, Tier-3 on a shared file system)
  tiers/s3            S3Store: boto3, conditional creates, multipart uploads

  commit/records      Tier-3 object layout, done markers, commit records, unit listing and deletion order
  commit/uploader     phase 1: each rank's background uploader (objects, then its done marker)
  commit/committer    phase 2: ``_COMMITTED`` once every rank's marker is in
  commit/coordinator  rank 0's thread: commits and Tier-3 reclamation in one place
  commit/reader       reading committed units back, verified
  commit/lease        the owner lease on the job's Tier-3 prefix: one live writer per job

  recover/inventory   every tier's listing, gathered and merged the same way on every rank
  recover/consensus   base V and end E every rank reaches; the cheapest-first cascade order
  recover/cascade     fetching each rank's units round by round from the cheapest good copy
  recover/record      the recovery record (failure class, tiers, bytes, timings, steps lost)
  recover/restore     restore(): inventory, consensus, cascade, replay, cleanup

  reclaim/policy      which units a watermark (or a recovery point) makes obsolete, per tier
  reclaim/executor    the one deletion executor every reclaiming caller uses
"""
