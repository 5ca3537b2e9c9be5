"""Checkpoints read without a running job: verified reads of every tier, a recovery point rebuilt, the size plan."""
