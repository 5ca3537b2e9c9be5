"""Open the Tier-3 store of a job from ``checkpoint.remote.url``.

``url`` is a directory path (relative paths resolve against the working
directory), ``file:///path``, or ``s3://bucket[/prefix]``. Every job lives
under ``<url>/<job_id>/``; see :mod:`megatier.checkpoint.commit.records` for the layout
inside.
"""
from __future__ import annotations

from typing import Optional
from urllib.parse import urlparse

from megatier.checkpoint.tiers.directory import DirectoryStore
from megatier.checkpoint.format.units import check_path_component
from megatier.checkpoint.tiers.s3 import S3Store
from megatier.checkpoint.tiers.store import ObjectStore, RetryPolicy
from megatier.checkpoint.validation import check_remote_url


def open_remote_store(url: str, job_id: str, *, endpoint_url: Optional[str] = None,
                      retry: RetryPolicy = RetryPolicy(), connect_timeout_s: float = 5.0,
                      read_timeout_s: float = 60.0, fsync: bool = True) -> ObjectStore:
    """The store rooted at ``<url>/<job_id>/``; raises ConfigError for an unsupported url.

    Nothing is contacted here; call ``store.check()`` to fail fast on an
    unreachable endpoint, a missing bucket or a read-only directory. ``fsync``
    applies to directories only (S3 objects are durable once the PUT returns).
    """
    check_remote_url(url, endpoint_url)
    check_path_component(job_id, "checkpoint.job_id")
    parsed = urlparse(url)
    if parsed.scheme == "s3":
        prefix = "/".join(p for p in (parsed.path.strip("/"), job_id) if p)
        return S3Store(parsed.netloc, prefix, endpoint_url=endpoint_url, retry=retry,
                       connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s)
    path = parsed.path if parsed.scheme == "file" else url
    return DirectoryStore(f"{path.rstrip('/')}/{job_id}", fsync=fsync)
