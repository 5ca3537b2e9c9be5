"""Tiered checkpointing (DESIGN.md section 4): the mechanism layer.

Modules, bottom up:
  naming      PayloadId (a base or a diff batch) and the names every tier derives from it
  payload     safetensors payloads (base, diff batch), stamps, xxh64 checks, PayloadError
  store       the store interface every tier implements, its errors, retry with backoff
  directory   DirectoryStore: atomic files (Tier-1 on /dev/shm, Tier-3 as a directory)
  s3          S3Store: boto3, conditional creates with If-None-Match, multipart for big payloads
  remote      open_remote_store: checkpoint.remote.url -> the job's Tier-3 store
  local       LocalTier: one node's Tier-1 area (own payloads and peer replicas)
  commit      Tier-3 layout, done markers, the coordinator's two-phase commit, RemoteReader
  uploader    Uploader: the per-rank background Tier-3 writer
  reclaim     watermark-driven deletion sets and their execution
  validation  validate_checkpoint_config: cross-field checks of the checkpoint config group
"""
