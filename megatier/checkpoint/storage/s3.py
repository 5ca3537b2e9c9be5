"""A store on S3 or any S3-compatible endpoint, through boto3.

- ``put`` is one PutObject up to ``part_size`` and a multipart upload above it
  (PutObject stops at 5 GiB; a 40B-parameter shard is larger). Both make the
  object visible only once complete. A failed multipart upload is aborted.
- ``put_if_absent`` is PutObject with ``If-None-Match: *`` (HTTP 412 when the
  key exists). AWS S3, MinIO and moto honour it; :meth:`S3Store.check` probes
  the endpoint and refuses one that silently ignores the header. If a retry
  follows an attempt whose response was lost, the retry sees 412 and returns
  False although the object holds this caller's bytes; callers that care read
  the object back and compare (the committer does).
- Every call runs under :func:`retry_call`: connection errors, timeouts,
  throttling and 5xx are retried with exponential backoff and jitter; botocore's
  own retries are off so the policy alone decides. Missing buckets, bad
  credentials and denied access fail at once with a message naming the URL.

Credentials come from the usual AWS environment (variables, profile, role).
"""
from __future__ import annotations

import copy
import logging
import secrets
from typing import Callable, Optional, TypeVar

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    NoCredentialsError,
    NoRegionError,
    ParamValidationError,
    PartialCredentialsError,
)

from megatier.checkpoint.storage.store import (
    ObjectNotFound,
    ObjectStore,
    RetryPolicy,
    StoreError,
    StoreUnavailable,
    TransientStoreError,
    check_key,
    retry_call,
)

T = TypeVar("T")
log = logging.getLogger(__name__)

_MIB = 1 << 20
_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
                    "InternalError", "ServiceUnavailable", "ConditionalRequestConflict", "OperationAborted"}
_DENIED_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "403"}


class S3Store(ObjectStore):
    """Objects under ``s3://bucket/prefix/``; ``endpoint_url`` selects an S3-compatible service."""

    def __init__(self, bucket: str, prefix: str = "", *, endpoint_url: Optional[str] = None,
                 retry: RetryPolicy = RetryPolicy(), connect_timeout_s: float = 5.0, read_timeout_s: float = 60.0,
                 part_size: int = 64 * _MIB):
        if part_size < 5 * _MIB:
            raise ValueError(f"part_size={part_size} is below S3's 5 MiB minimum multipart part size")
        self.bucket = bucket
        self.prefix = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
        self.url = f"s3://{bucket}/{self.prefix}"
        self.endpoint = endpoint_url or "AWS S3"
        self.retry = retry
        self.part_size = part_size
        config = Config(connect_timeout=connect_timeout_s, read_timeout=read_timeout_s,
                        retries={"mode": "standard", "total_max_attempts": 1},
                        s3={"addressing_style": "path" if endpoint_url else "auto"})
        try:
            self.client = boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=config)
        except NoRegionError as e:
            raise StoreUnavailable(f"{self.url}: no AWS region configured; set AWS_DEFAULT_REGION") from e

    def fail_fast(self) -> "S3Store":
        fast = copy.copy(self)  # shares the client (thread-safe)
        fast.retry = RetryPolicy(attempts=1)
        return fast

    def _key(self, key: str) -> str:
        return self.prefix + check_key(key)

    def _error(self, e: Exception, what: str, key: str) -> StoreError:
        """Translate a botocore failure into a StoreError whose message says what to check."""
        where = self.describe(key)
        if isinstance(e, (NoCredentialsError, PartialCredentialsError)):
            return StoreUnavailable(f"{what} {where}: no usable AWS credentials ({e}); set AWS_ACCESS_KEY_ID and "
                                    f"AWS_SECRET_ACCESS_KEY or AWS_PROFILE")
        if isinstance(e, ClientError):
            code = str(e.response.get("Error", {}).get("Code", ""))
            status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            if code in ("NoSuchKey", "404", "NotFound"):
                return ObjectNotFound(f"{where} does not exist")
            if code == "NoSuchBucket":
                return StoreUnavailable(f"{what} {where}: bucket {self.bucket!r} does not exist at {self.endpoint}; "
                                        f"create it or fix checkpoint.remote.url / endpoint_url")
            if code in _DENIED_CODES or status == 403:
                return StoreUnavailable(f"{what} {where}: access denied at {self.endpoint} ({code}); check the AWS "
                                        f"credentials and the bucket policy")
            if code in _TRANSIENT_CODES or status >= 500:
                return TransientStoreError(f"{what} {where}: {self.endpoint} answered {code} (HTTP {status})")
            return StoreError(f"{what} {where}: {self.endpoint} answered {code} (HTTP {status}): {e}")
        if isinstance(e, ParamValidationError):
            return StoreError(f"{what} {where}: invalid request ({e})")
        return TransientStoreError(f"{what} {where}: cannot reach {self.endpoint} ({e}); check "
                                   f"checkpoint.remote.endpoint_url, the network and that the service is running")

    def _call(self, what: str, key: str, fn: Callable[[], T]) -> T:
        def attempt() -> T:
            try:
                return fn()
            except (ClientError, BotoCoreError) as e:
                raise self._error(e, what, key) from e
        return retry_call(attempt, self.retry, f"{what} {self.describe(key)}")

    def put(self, key: str, data: bytes) -> None:
        full = self._key(key)
        if len(data) <= self.part_size:
            # A Tier-1 payload arrives as an mmap; botocore wants bytes or a file it may rewind itself.
            body = data if isinstance(data, bytes) else bytes(data)
            self._call("writing", key, lambda: self.client.put_object(Bucket=self.bucket, Key=full, Body=body))
        else:
            self._put_multipart(key, full, data)

    def _put_multipart(self, key: str, full: str, data: bytes) -> None:
        upload = self._call("starting upload of", key, lambda: self.client.create_multipart_upload(
            Bucket=self.bucket, Key=full))["UploadId"]
        try:
            parts = []
            view = memoryview(data)
            for number, offset in enumerate(range(0, len(data), self.part_size), start=1):
                def upload_part(number=number, chunk=bytes(view[offset:offset + self.part_size])) -> dict:
                    return self.client.upload_part(Bucket=self.bucket, Key=full, UploadId=upload,
                                                   PartNumber=number, Body=chunk)
                etag = self._call(f"uploading part {number} of", key, upload_part)["ETag"]
                parts.append({"ETag": etag, "PartNumber": number})
            self._call("completing upload of", key, lambda: self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=full, UploadId=upload, MultipartUpload={"Parts": parts}))
        except BaseException:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload)
            except (ClientError, BotoCoreError) as e:
                # The unfinished upload is invisible to readers; a bucket lifecycle rule removes its parts.
                log.warning("could not abort multipart upload %s of %s: %s", upload, self.describe(key), e)
            raise

    def put_if_absent(self, key: str, data: bytes) -> bool:
        full = self._key(key)

        def create() -> bool:
            try:
                self.client.put_object(Bucket=self.bucket, Key=full, Body=data, IfNoneMatch="*")
                return True
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") == "PreconditionFailed":
                    return False
                raise
        return self._call("creating", key, create)

    def get(self, key: str) -> bytes:
        full = self._key(key)
        return self._call("reading", key, lambda: self.client.get_object(Bucket=self.bucket, Key=full)["Body"].read())

    def exists(self, key: str) -> bool:
        full = self._key(key)
        try:
            self._call("checking", key, lambda: self.client.head_object(Bucket=self.bucket, Key=full))
            return True
        except ObjectNotFound:
            return False

    def list(self, prefix: str = "") -> dict[str, int]:
        def listing() -> dict[str, int]:
            out = {}
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                          Prefix=self.prefix + prefix)
            for page in pages:
                for obj in page.get("Contents", []):
                    out[obj["Key"][len(self.prefix):]] = int(obj["Size"])
            return out
        return self._call("listing", prefix, listing)

    def children(self, prefix: str) -> set[str]:
        """One delimited listing: the common prefixes one level below ``prefix``."""
        def listing() -> set[str]:
            start = self.prefix + prefix
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=start,
                                                                          Delimiter="/")
            return {p["Prefix"][len(start):].rstrip("/") for page in pages for p in page.get("CommonPrefixes", [])}
        return self._call("listing", prefix, listing)

    def delete(self, key: str) -> None:
        full = self._key(key)
        self._call("deleting", key, lambda: self.client.delete_object(Bucket=self.bucket, Key=full))

    def check(self) -> None:
        """Reach the bucket, then prove that conditional creates are enforced (a probe object, removed)."""
        try:
            self._call("opening", "", lambda: self.client.head_bucket(Bucket=self.bucket))
        except ObjectNotFound as e:
            raise StoreUnavailable(f"bucket {self.bucket!r} does not exist at {self.endpoint}; create it or fix "
                                   f"checkpoint.remote.url / endpoint_url") from e
        probe = f"_probe/{secrets.token_hex(8)}"
        try:
            first, second = self.put_if_absent(probe, b"1"), self.put_if_absent(probe, b"2")
        finally:
            self.delete(probe)
        if not (first and not second):
            raise StoreUnavailable(f"{self.url} at {self.endpoint} does not enforce If-None-Match on PutObject; "
                                   f"two-phase commit needs conditional creates, use an endpoint that supports them")
