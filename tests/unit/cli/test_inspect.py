"""megatier-inspect (megatier/cli/inspect.py) on populated file-system tiers."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from megatier.checkpoint.commit.committer import Committer
from megatier.checkpoint.commit.records import DoneMarker, marker_key, object_key
from megatier.checkpoint.format.payload import BaseState, DiffStep, encode_base, encode_diff_batch
from megatier.checkpoint.format.units import PayloadId
from megatier.checkpoint.storage.directory import DirectoryStore
from megatier.checkpoint.tiers.node_memory import NodeMemory
from megatier.faults import CrashPoint
from megatier.parallel.layout import Layout
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(60)

JOB = "run42"


@pytest.fixture(scope="module")
def script():
    """The megatier-inspect command's module."""
    import megatier.cli.inspect as module

    return module


def layout(rank: int) -> Layout:
    return Layout(1, 1, 2, 0, 0, rank)


def base(version: int, rank: int):
    t = torch.full((64,), float(rank))
    return encode_base(BaseState(version, version, t, t, t, {}, None, {}), job_id=JOB, layout=layout(rank))


def diff(first: int, last: int, rank: int):
    steps = [DiffStep(s, 1e-3, s, False, {"g": torch.ones(8)}, {}) for s in range(first, last + 1)]
    return encode_diff_batch(steps, job_id=JOB, layout=layout(rank))


def upload(store: DirectoryStore, payload) -> None:
    store.put(object_key(payload.stamp), payload.data)
    store.put(marker_key(payload.stamp.pid, payload.stamp.rank),
              DoneMarker(object_key(payload.stamp), payload.stamp, "launch0").to_json())


@pytest.fixture
def populated(tmp_path):
    """Two nodes' Tier-1 areas and a Tier-3 directory with a committed and an uncommitted base."""
    shm, remote = tmp_path / "shm", tmp_path / "remote"
    node0, node1 = NodeMemory(str(shm), JOB, "node0"), NodeMemory(str(shm), JOB, "node1")
    node0.save(base(50, 0))
    node0.save(diff(46, 50, 0))
    node0.save(base(50, 1), replica=True)
    node1.save(base(50, 1))
    node1.save(base(50, 0), replica=True)

    def crash(point: str, version: int) -> None:
        raise RuntimeError(point)

    with pytest.raises(RuntimeError, match=CrashPoint.T1_MID_WRITE):
        NodeMemory(str(shm), JOB, "node1", fault_hook=crash).save(diff(46, 50, 1))
    store = DirectoryStore(str(remote / JOB))
    for rank in (0, 1):
        upload(store, base(50, rank))
    assert Committer(store, JOB).try_commit(PayloadId.base(50), 2) is not None
    upload(store, base(100, 0))
    return shm, remote


def test_lists_every_tier_and_verifies(script, populated, capsys):
    shm, remote = populated
    code = script.main(["--job-id", JOB, "--local-root", str(shm), "--remote-url", str(remote)])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.splitlines()
    assert lines[1].split()[:4] == ["tier", "where", "rank", "unit"]
    assert sum("Tier-1" in line and "ok" in line for line in lines) == 3
    assert sum("Tier-2" in line and "ok" in line for line in lines) == 2
    assert any("node1/own" in line and "diff v46-50" in line and "incomplete" in line for line in lines)
    assert any("base v50" in line and "committed, 2 verified" in line for line in lines)
    assert any("base v100" in line and "uncommitted (1 done markers)" in line for line in lines)


def test_checksum_failure_exits_nonzero_naming_the_file(script, populated, capsys):
    shm, remote = populated
    path = shm / JOB / "node1" / "replica" / "rank00000" / "base" / "v00000050.safetensors"
    raw = bytearray(path.read_bytes())
    raw[100] ^= 0xFF
    path.write_bytes(bytes(raw))
    code = script.main(["--job-id", JOB, "--local-root", str(shm), "--remote-url", str(remote)])
    captured = capsys.readouterr()
    assert code == 2
    assert any("FAILED" in line and str(path) in line and "xxh64" in line for line in captured.out.splitlines())
    assert "1 payload(s) failed verification" in captured.err


def test_corrupt_committed_object_fails(script, populated, capsys):
    shm, remote = populated
    store = DirectoryStore(str(remote / JOB))
    key = object_key(base(50, 1).stamp)
    store.put(key, store.get(key)[:-1])
    code = script.main(["--job-id", JOB, "--no-local", "--remote-url", str(remote)])
    out = capsys.readouterr().out
    assert code == 2 and any("base v50" in line and "FAILED" in line and key in line for line in out.splitlines())


def test_nothing_found_is_an_error(script, tmp_path, capsys):
    code = script.main(["--job-id", "nope", "--local-root", str(tmp_path), "--remote-url", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 1 and "no checkpoints of job 'nope'" in err and "--job-id" in err


def test_command_line(populated):
    shm, remote = populated
    result = subprocess.run([sys.executable, "scripts/inspect_checkpoints.py", "--job-id", JOB, "--local-root",
                             str(shm), "--remote-url", str(remote)], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert "checkpoints of job 'run42'" in result.stdout and "committed, 2 verified" in result.stdout
