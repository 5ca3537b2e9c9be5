"""Payload format: unit ids, encoding and verification, the diff-chain walk (see megatier.checkpoint)."""
