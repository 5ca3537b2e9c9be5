"""Byte stores under the tiers and the commit protocol: one small interface (store), a directory, S3, spare files."""
