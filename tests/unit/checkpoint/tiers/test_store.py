"""The store contract, checked identically on a directory and on S3 (moto's server on 127.0.0.1)."""
from __future__ import annotations

import random
import socket
import threading
import time

import pytest

from megatier.checkpoint.storage.directory import DirectoryStore
from megatier.checkpoint.storage.s3 import S3Store
from megatier.checkpoint.storage.store import (
    ObjectNotFound,
    RetryPolicy,
    StoreError,
    StoreUnavailable,
    TransientStoreError,
    retry_call,
)
from megatier.checkpoint.tiers.remote import open_remote_store
from megatier.config import ConfigError

pytestmark = pytest.mark.timeout(60)

FAST_RETRY = RetryPolicy(attempts=2, base_delay_s=0.01, max_delay_s=0.05)


def test_put_get_list_delete(remote_store):
    store = remote_store
    store.check()
    store.put("base/v00000050/a.bin", b"hello")
    store.put("base/v00000050/a.bin", b"hello world")  # replace
    store.put("base/v00000100/b.bin", b"x" * 10)
    store.put("diff/v00000046-00000050/c.bin", b"")
    assert store.get("base/v00000050/a.bin") == b"hello world"
    assert store.exists("base/v00000050/a.bin") and not store.exists("base/v00000050/zzz")
    assert store.list("base/") == {"base/v00000050/a.bin": 11, "base/v00000100/b.bin": 10}
    assert store.list("base/v00000050/a") == {"base/v00000050/a.bin": 11}
    assert set(store.list()) == {"base/v00000050/a.bin", "base/v00000100/b.bin", "diff/v00000046-00000050/c.bin"}
    assert store.children("base/") == {"v00000050", "v00000100"} and store.children("diff/") == {
        "v00000046-00000050"}
    assert store.children("step/") == set()
    store.delete("base/v00000050/a.bin")
    store.delete("base/v00000050/a.bin")  # missing is fine
    with pytest.raises(ObjectNotFound, match="a.bin does not exist"):
        store.get("base/v00000050/a.bin")
    assert "base/v00000050/a.bin" not in store.list()
    assert store.children("base/") == {"v00000100"}  # an emptied unit folder is gone with its last key


def test_put_if_absent_is_a_conditional_create(remote_store):
    assert remote_store.put_if_absent("v/_COMMITTED", b"first")
    assert not remote_store.put_if_absent("v/_COMMITTED", b"second")
    assert remote_store.get("v/_COMMITTED") == b"first"


def test_put_if_absent_has_exactly_one_winner_under_contention(remote_store):
    start = threading.Barrier(6)
    wins = []

    def contend(i: int) -> None:
        start.wait()
        if remote_store.put_if_absent("race/_COMMITTED", f"writer{i}".encode()):
            wins.append(i)

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1
    assert remote_store.get("race/_COMMITTED") == f"writer{wins[0]}".encode()


def test_keys_cannot_escape_the_root(remote_store):
    for bad in ("", "/abs", "a/../b", "a//b"):
        with pytest.raises(ValueError, match="invalid store key"):
            remote_store.put(bad, b"x")


def test_directory_crash_mid_write_leaves_nothing_visible(tmp_path, monkeypatch):
    store = DirectoryStore(str(tmp_path))
    store.put("k/obj", b"old")

    def crash(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr("megatier.checkpoint.storage.directory.os.fsync", crash)
    with pytest.raises(StoreError, match="k/obj.*Input/output error"):
        store.put("k/obj", b"new bytes")
    with pytest.raises(StoreError):
        store.put("k/other", b"new")
    monkeypatch.undo()
    assert store.get("k/obj") == b"old"
    assert store.list() == {"k/obj": 3}
    assert not store.exists("k/other")
    assert not [p for p in tmp_path.rglob("*") if ".tmp-" in p.name]


def test_directory_temp_files_are_invisible_and_swept(tmp_path):
    store = DirectoryStore(str(tmp_path))
    partial = store.begin("a/b.bin")
    partial.append(b"half")
    assert store.list() == {} and not store.exists("a/b.bin")
    assert store.sweep_temp("a") == 1
    assert not any(tmp_path.rglob("*.tmp-*"))


def test_multipart_upload_for_large_objects(s3_url):
    url, endpoint = s3_url
    bucket = url.split("/")[2]
    store = S3Store(bucket, "big", endpoint_url=endpoint, retry=FAST_RETRY, part_size=5 << 20)
    data = random.Random(0).randbytes((5 << 20) + 123)  # two parts
    store.put("base/v00000050/rank00000.bin", data)
    assert store.get("base/v00000050/rank00000.bin") == data
    assert store.list() == {"base/v00000050/rank00000.bin": len(data)}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_endpoint_fails_fast_with_a_clear_error(aws_env):
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    store = open_remote_store("s3://nobucket/prefix", "job1", endpoint_url=endpoint, retry=FAST_RETRY,
                              connect_timeout_s=0.5, read_timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(StoreUnavailable) as err:
        store.check()
    assert time.monotonic() - started < 10
    message = str(err.value)
    for part in (endpoint, "s3://nobucket/prefix/job1", "after 2 attempts", "checkpoint.remote.endpoint_url"):
        assert part in message


def test_missing_bucket_is_named(moto_endpoint, aws_env):
    store = open_remote_store("s3://no-such-bucket-here/p", "job1", endpoint_url=moto_endpoint, retry=FAST_RETRY)
    with pytest.raises(StoreUnavailable, match="no-such-bucket-here.*does not exist"):
        store.check()
    with pytest.raises(StoreUnavailable, match="no-such-bucket-here.*does not exist"):
        store.put("k", b"x")


def test_missing_credentials_are_named(moto_endpoint, monkeypatch, tmp_path):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    store = open_remote_store("s3://bkt-x/p", "job1", endpoint_url=moto_endpoint, retry=FAST_RETRY)
    with pytest.raises(StoreUnavailable, match="AWS_ACCESS_KEY_ID"):
        store.check()


def test_unsupported_url_scheme_is_a_config_error():
    with pytest.raises(ConfigError, match="scheme 'gs' is not supported"):
        open_remote_store("gs://bucket/x", "job1")


def test_retry_call_backs_off_then_succeeds_or_gives_up():
    calls, sleeps = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise TransientStoreError("timeout")
        return "ok"

    policy = RetryPolicy(attempts=3, base_delay_s=1.0, max_delay_s=1.5)
    assert retry_call(flaky, policy, "op", sleep=sleeps.append, rng=random.Random(0)) == "ok"
    assert len(sleeps) == 2 and 0 <= sleeps[0] <= 1.0 and 0 <= sleeps[1] <= 1.5
    calls.clear()
    with pytest.raises(StoreUnavailable, match="op failed after 2 attempts: timeout"):
        retry_call(flaky, RetryPolicy(attempts=2, base_delay_s=0.0), "op", sleep=sleeps.append)

    def permanent():
        calls.append(1)
        raise StoreUnavailable("denied")

    calls.clear()
    with pytest.raises(StoreUnavailable, match="denied"):
        retry_call(permanent, policy, "op", sleep=sleeps.append)
    assert len(calls) == 1
