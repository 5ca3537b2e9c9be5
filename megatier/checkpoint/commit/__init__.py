"""Tier-3 two-phase commit: uploads, done markers, commit records, the coordinator (see megatier.checkpoint)."""
