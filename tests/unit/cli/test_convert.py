"""megatier-convert export (megatier/cli/convert.py) on hand-made units of a tiny GPT in file-system tiers.

Each job holds one canonical state (random master and moments) cut into the shards of its layout, saved as
base v0, then 4 steps of lossless diff records of the same random gradients (batches v1-2 and v3-4); so jobs
of any layout describe one state at every step.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from megatier import ops
from megatier.checkpoint.commit.committer import Committer
from megatier.checkpoint.commit.records import DoneMarker, marker_key, object_key
from megatier.checkpoint.format.payload import BaseState, DiffStep, encode_base, encode_diff_batch
from megatier.checkpoint.format.units import PayloadId
from megatier.checkpoint.offline.state import step_ranges
from megatier.checkpoint.shard import tiling_segments
from megatier.checkpoint.storage.directory import DirectoryStore
from megatier.checkpoint.tiers.node_memory import NodeMemory
from megatier.cli import convert
from megatier.config import Config, ModelConfig, OptimConfig
from megatier.config.fingerprint import fingerprint_hash, state_fingerprint
from megatier.interop.gpt2 import load_gpt2
from megatier.model.gpt import GPTStage
from megatier.model.params import StageSpec, canonical_shapes
from megatier.optim.canonical import STATE_KINDS, cut_shard
from megatier.optim.flat import FlatLayout
from megatier.parallel.layout import Layout
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(120)

VOCAB = 259  # padded to 384 rows: the shards carry padding the export must drop
CFG = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, ffn_hidden_size=96, max_position_embeddings=32)
CONFIG = Config(model=CFG, optim=OptimConfig(lr=1e-2, weight_decay=0.1))
FINGERPRINT = state_fingerprint(CONFIG, "data-xxh64")
FP_ID = fingerprint_hash(FINGERPRINT)
STEPS = 4


def _canonical(seed: int) -> dict[str, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in canonical_shapes(CFG, VOCAB).items():
        master, avg = torch.randn(shape, generator=gen) * 0.3, torch.randn(shape, generator=gen) * 1e-2
        out[name] = {"master": master, "exp_avg": avg, "exp_avg_sq": avg * avg + 1e-6}
    return out


STATE = _canonical(0)
GRADS = {step: {n: {k: kinds["master"] for k in STATE_KINDS} for n, kinds in _canonical(step).items()}
         for step in range(1, STEPS + 1)}


class Job:
    """The units of one job in layout tp=1 pp=1 dp=``dp``: payloads by (rank, unit)."""

    def __init__(self, process_group, job_id: str, dp: int, codec: str = "fp32"):
        model = GPTStage(CFG, VOCAB, StageSpec(range(CFG.num_layers), True, True), tp_group=process_group.tp_group,
                         dropout_generator=torch.Generator())
        flat = FlatLayout.from_module(model, dp, tp_rank=0)
        self.job_id, self.dp, self.codec, self.units = job_id, dp, codec, {}
        for rank in range(dp):
            segs = flat.shard_segments(rank)
            layout = Layout(1, 1, dp, 0, 0, rank)
            state = cut_shard(STATE, segs, 0, 1, flat.shard_size)
            base = BaseState(0, 0, state["master"], state["exp_avg"], state["exp_avg_sq"], {}, None, {},
                             segments=[s.to_dict() for s in segs])
            self.units[(rank, PayloadId.base(0))] = encode_base(base, job_id=job_id, layout=layout,
                                                                fingerprint=FP_ID)
            records = [self._record(step, segs, flat.shard_size, codec) for step in range(1, STEPS + 1)]
            for first in range(1, STEPS + 1, 2):
                batch = encode_diff_batch(records[first - 1:first + 1], job_id=job_id, layout=layout,
                                          fingerprint=FP_ID)
                self.units[(rank, batch.stamp.pid)] = batch

    @staticmethod
    def _record(step: int, segs, size: int, codec: str) -> DiffStep:
        grad = cut_shard(GRADS[step], segs, 0, 1, size)["master"]
        record = ops.compress_segments(grad, tiling_segments(segs, size), codec, seed=step)
        return DiffStep(step, 1e-2 / step, step, False, dict(record.tensors), dict(record.header))

    def to_memory(self, root: str, node: str = "node0", pids=None) -> NodeMemory:
        memory = NodeMemory(root, self.job_id, node)
        memory.write_fingerprint(FP_ID, FINGERPRINT)
        for (_, pid), payload in self.units.items():
            if pids is None or pid in pids:
                memory.save(payload)
        return memory

    def to_remote(self, remote: str, pids, commit: bool = True) -> DirectoryStore:
        store = DirectoryStore(f"{remote}/{self.job_id}", fsync=False)
        store.put(f"_fingerprints/{FP_ID}.json", json.dumps(FINGERPRINT, sort_keys=True).encode())
        for (_, pid), payload in self.units.items():
            if pid in pids:
                store.put(object_key(payload.stamp), payload.data)
                store.put(marker_key(pid, payload.stamp.rank),
                          DoneMarker(object_key(payload.stamp), payload.stamp, "launch0").to_json())
        for pid in pids if commit else ():
            assert Committer(store, self.job_id).try_commit(pid, self.dp) is not None
        return store


B0, D12, D34 = PayloadId.base(0), PayloadId.diff(1, 2), PayloadId.diff(3, 4)


def _export(tmp_path, job_id: str, out: str, *extra: str) -> int:
    return convert.main(["export", "--job-id", job_id, "--local-root", str(tmp_path / "shm"), "--remote-url",
                         str(tmp_path / "remote"), str(tmp_path / out), *extra])


def _one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    return lines[0]


def test_step_ranges():
    assert step_ranges([3, 0, 1, 2, 8, 10, 11]) == "0-3, 8, 10-11"


def test_exports_of_two_layouts_are_bitwise_equal_and_step_0_is_the_base(process_group, tmp_path, capsys):
    Job(process_group, "two", 2).to_memory(str(tmp_path / "shm"))
    Job(process_group, "one", 1).to_memory(str(tmp_path / "shm"))
    assert _export(tmp_path, "two", "a") == 0
    out_two = capsys.readouterr().out
    assert _export(tmp_path, "one", "b") == 0
    out_one = capsys.readouterr().out
    assert "step 4 from base v0 (2 diff units replayed per rank), written by tp=1 pp=1 dp=2 (2 ranks)" in out_two
    assert "replay: steps 1-4 from fp32 diffs: exact" in out_two
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert out_two.splitlines()[-1] == out_one.splitlines()[-1]  # the canonical digest, moments included
    assert not torch.equal(a["transformer.wte.weight"], STATE["word.weight"]["master"])  # the replay moved it

    assert _export(tmp_path, "two", "zero", "--step", "0") == 0
    assert "replay: none (the base is at step 0)" in capsys.readouterr().out
    exported = load_gpt2(str(tmp_path / "zero"), CFG, VOCAB)
    assert all(torch.equal(exported[n], STATE[n]["master"]) for n in STATE)


def test_lossy_diffs_replay_and_say_so(process_group, tmp_path, capsys):
    Job(process_group, "lossy", 2, codec="int8").to_memory(str(tmp_path / "shm"))
    assert _export(tmp_path, "lossy", "hf", "--step", "3") == 0
    lines = capsys.readouterr().out.splitlines()
    assert "replay: steps 1-3 from int8 diffs: lossy, the state a restore to step 3 installs" in lines[2]
    assert "lossy diffs make it differ from the training run's summary" in lines[-1]
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_a_corrupt_copy_falls_back_and_a_corrupt_only_copy_fails(process_group, tmp_path, capsys):
    job = Job(process_group, "job", 2)
    memory = job.to_memory(str(tmp_path / "shm"))
    job.to_remote(str(tmp_path / "remote"), [B0, D12])
    path = tmp_path / "shm" / "job" / "node0" / "own" / "rank00001" / "base" / "v00000000.safetensors"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert _export(tmp_path, "job", "ok") == 0
    out = capsys.readouterr().out
    assert any(line.startswith("fallback: rank 1 base v0: tier1 node0 own area: xxh64") and "read tier3 instead" in line
               for line in out.splitlines()), out

    assert _export(tmp_path, "job", "bad", "--tier", "tier1") == 2
    line = _one_error_line(capsys)
    assert "rank 1's base v0 has no good copy" in line and "xxh64" in line and "drop --tier" in line
    assert not (tmp_path / "bad").exists()
    assert memory.load(0, B0).data == job.units[(0, B0)].data  # nothing modified


def test_an_unreachable_or_uncommitted_step_names_the_reachable_ones(process_group, tmp_path, capsys):
    job = Job(process_group, "job", 2)
    job.to_remote(str(tmp_path / "remote"), [B0, D12])
    job.to_remote(str(tmp_path / "remote"), [D34], commit=False)
    assert _export(tmp_path, "job", "x", "--step", "4") == 1
    line = _one_error_line(capsys)
    assert "step 4 is not a recovery point of job 'job'" in line and "steps 0-2 (tp=1 pp=1 dp=2)" in line
    assert "Tier-3 holds diff v3-4 uncommitted" in line
    assert _export(tmp_path, "job", "x", "--step", "7") == 1
    assert "uncommitted" not in _one_error_line(capsys)
    assert not (tmp_path / "x").exists()
    assert _export(tmp_path, "job", "x") == 0  # the newest committed point
    assert "point: job 'job' step 2 from base v0" in capsys.readouterr().out


def test_a_base_missing_for_one_rank_is_no_recovery_point(process_group, tmp_path, capsys):
    job = Job(process_group, "job", 2)
    job.to_memory(str(tmp_path / "shm"), pids=[D12])
    NodeMemory(str(tmp_path / "shm"), "job", "node0").save(job.units[(0, B0)])
    assert _export(tmp_path, "job", "x") == 1
    line = _one_error_line(capsys)
    assert "has no recovery point" in line and "bases per rank [[0], []]" in line


def test_a_used_output_directory_is_refused_untouched(process_group, tmp_path, capsys):
    Job(process_group, "job", 1).to_memory(str(tmp_path / "shm"))
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "notes.txt").write_text("mine")
    assert _export(tmp_path, "job", "used") == 1
    assert "used exists and is not empty" in _one_error_line(capsys)
    assert [p.name for p in (tmp_path / "used").iterdir()] == ["notes.txt"]
    assert (tmp_path / "used" / "notes.txt").read_text() == "mine"


def test_data_of_another_checksum_is_refused(process_group, corpus_prefix, tmp_path, capsys):
    Job(process_group, "job", 1).to_memory(str(tmp_path / "shm"))
    assert _export(tmp_path, "job", "x", "--data-prefix", corpus_prefix) == 1
    assert "holds other tokens" in _one_error_line(capsys)
    assert not (tmp_path / "x").exists()


def test_no_checkpoints_from_the_command_line(tmp_path):
    result = subprocess.run([sys.executable, "scripts/convert.py", "export", "--job-id", "nope", "--local-root",
                             str(tmp_path), "--remote-url", str(tmp_path / "r"), str(tmp_path / "out")],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "no checkpoints of job 'nope'" in result.stderr
    assert "--job-id" in result.stderr and not (tmp_path / "out").exists()


def test_a_run_on_the_default_corpus_exports_its_tokenizer_without_data_prefix(tmp_path, monkeypatch):
    from megatier.data.corpus import build_dataset, stdlib_files
    from megatier.data.indexed import IndexedDataset

    monkeypatch.setenv("MEGATIER_CACHE", str(tmp_path / "cache"))
    prefix = str(tmp_path / "cache" / "stdlib_byte")
    (tmp_path / "cache").mkdir()
    build_dataset(stdlib_files(2**16), prefix, tokenizer="byte")
    checksum = IndexedDataset(prefix).checksum
    assert convert.data_tokenizer(None, {"data.checksum": json.dumps(checksum)})["type"] == "byte"
    assert convert.data_tokenizer(None, {"data.checksum": json.dumps("0" * 16)}) is None  # not in the cache


def test_a_llama_job_exports_a_llama_directory_transformers_loads(tiny_config, tmp_path, capsys):
    from megatier.training.trainer import Trainer

    transformers = pytest.importorskip("transformers")
    cfg = tiny_config("model=llama_tiny", "checkpoint=tiered", "checkpoint.tiers=[local]", "train.iters=6",
                      f"checkpoint.local.root={tmp_path}/shm", "checkpoint.job_id=llamajob")
    trainer = Trainer(cfg)
    trainer.train()
    summary = trainer.close()
    capsys.readouterr()
    assert convert.main(["export", "--job-id", "llamajob", "--local-root", f"{tmp_path}/shm", "--tier", "tier1",
                         str(tmp_path / "hf")]) == 0
    out = capsys.readouterr().out
    assert f"canonical_digest: {summary['canonical_digest']}" in out  # the final base: the trained state itself
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.config.num_key_value_heads == 2 and not model.config.tie_word_embeddings
