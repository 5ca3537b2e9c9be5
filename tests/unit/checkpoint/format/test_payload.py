"""Checkpoint payloads: bitwise round trips, stamps, and clear errors for corrupt or foreign payloads."""
from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from megatier.checkpoint.format.payload import (
    BaseState,
    DiffStep,
    EncodedPayload,
    PayloadError,
    Stamp,
    checksum,
    decode_base,
    decode_diff_batch,
    encode_base,
    encode_diff_batch,
    read_metadata,
    verify_payload,
)
from megatier.checkpoint.format.units import PayloadId
from megatier.parallel.layout import Layout

pytestmark = pytest.mark.timeout(30)

LAYOUT = Layout(tp=2, pp=2, dp=2, tp_rank=1, pp_rank=0, dp_rank=1)
JOB = "run42"


def make_base(version: int = 50, n: int = 37) -> BaseState:
    g = torch.Generator().manual_seed(version)
    master = torch.randn(n, generator=g)
    # Values a careless (e.g. text or fp16) round trip would change (a NaN or an inf is refused: see below).
    master[:5] = torch.tensor([-3.4e38, -0.0, 1.2e-38, 1e-45, 3.4e38])
    return BaseState(
        version=version, adam_steps=version - 2,
        master=master, exp_avg=torch.randn(n, generator=g), exp_avg_sq=torch.rand(n, generator=g),
        schedule={"lr": 6e-4, "min_lr": 6e-5, "warmup_iters": 10, "decay_iters": 100},
        loss_scaler={"scale": 32768.0, "hysteresis_left": 2, "clean_steps": 17},
        data_position={"consumed_samples": version * 8, "epoch": 0},
        rng={"cpu": torch.get_rng_state()},
        segments=[{"name": "wte.weight", "shard_offset": 0, "param_offset": 40, "numel": 30, "shape": [10, 7],
                   "decay": True, "in_norm": True},
                  {"name": "ln.bias", "shard_offset": 30, "param_offset": 0, "numel": 7, "shape": [7],
                   "decay": False, "in_norm": False}],
    )


def make_steps(first: int = 46, count: int = 5) -> list[DiffStep]:
    steps = []
    for i, step in enumerate(range(first, first + count)):
        g = torch.Generator().manual_seed(step)
        tensors = {"codes": torch.randint(-127, 128, (64,), dtype=torch.int8, generator=g),
                   "scales": torch.rand(2, generator=g),
                   "values": torch.randn(9, generator=g).half(),
                   "indices": torch.randperm(1000, generator=g)[:9].int()}
        skipped = i == 2
        steps.append(DiffStep(step, 0.1 + 0.2 * step, step - 3 - (i > 2), skipped, {} if skipped else tensors,
                              {"mode": "adaptive", "segments": [[0, 64, "int8"], [64, 1000, "topk"]]}))
    return steps


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def test_base_round_trip_is_bitwise():
    state = make_base()
    payload = encode_base(state, job_id=JOB, layout=LAYOUT)
    verify_payload(payload.data, payload.stamp, "mem")
    assert payload.stamp.pid == PayloadId.base(50)
    assert payload.stamp.size == len(payload.data) and payload.stamp.xxh64 == checksum(payload.data)
    back = decode_base(payload, job_id=JOB, layout=LAYOUT, source="mem")
    for name in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(bits(getattr(back, name)), bits(getattr(state, name))), name
    assert torch.equal(back.rng["cpu"], state.rng["cpu"])
    for name in ("version", "adam_steps", "schedule", "loss_scaler", "data_position", "segments"):
        assert getattr(back, name) == getattr(state, name), name


def test_base_metadata_names_job_layout_and_unit():
    payload = encode_base(make_base(), job_id=JOB, layout=LAYOUT)
    meta = read_metadata(payload.data, "mem")
    assert meta["job_id"] == JOB and Layout.from_dict(meta["layout"]) == LAYOUT
    assert PayloadId.from_dict(meta) == PayloadId.base(50)


def test_diff_batch_round_trip_keeps_records_and_scalars_exactly():
    steps = make_steps()
    payload = encode_diff_batch(steps, job_id=JOB, layout=LAYOUT)
    assert payload.stamp.pid == PayloadId.diff(46, 50)
    back = decode_diff_batch(payload, job_id=JOB, layout=LAYOUT, source="mem")
    assert [s.step for s in back] == list(range(46, 51))
    for got, want in zip(back, steps):
        assert (got.lr, got.adam_step, got.skipped, got.header) == (want.lr, want.adam_step, want.skipped,
                                                                     want.header)
        assert got.tensors.keys() == want.tensors.keys()
        for name, t in want.tensors.items():
            assert got.tensors[name].dtype == t.dtype and torch.equal(got.tensors[name], t), name
    assert back[2].skipped and back[2].tensors == {}


@pytest.mark.parametrize("where", ["master", "exp_avg_sq"])
def test_a_base_holding_nan_or_inf_is_not_a_recovery_source(where):
    """Its bytes match their checksum (they were written so): decoding still refuses it, as a poisoned state."""
    state = make_base()
    getattr(state, where)[7] = float("nan") if where == "master" else float("inf")
    payload = encode_base(state, job_id=JOB, layout=LAYOUT)
    verify_payload(payload.data, payload.stamp, "mem")
    with pytest.raises(PayloadError, match=rf"^mem: {where} hold NaN or inf although the bytes match their "
                                           rf"checksum: a poisoned state"):
        decode_base(payload, job_id=JOB, layout=LAYOUT, source="mem")


def test_a_diff_batch_holding_nan_is_not_a_recovery_source():
    steps = make_steps()
    steps[1].tensors["values"][3] = float("nan")
    payload = encode_diff_batch(steps, job_id=JOB, layout=LAYOUT)
    with pytest.raises(PayloadError, match=r"s47/values hold NaN or inf"):
        decode_diff_batch(payload, job_id=JOB, layout=LAYOUT, source="mem")


def test_diff_batch_rejects_gaps():
    steps = make_steps()
    with pytest.raises(ValueError, match="consecutive"):
        encode_diff_batch(steps[:2] + steps[3:], job_id=JOB, layout=LAYOUT)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_bytes_fail_verification_naming_the_source(damage):
    payload = encode_base(make_base(), job_id=JOB, layout=LAYOUT)
    data = bytearray(payload.data)
    if damage == "flip":
        data[-3] ^= 0x40
    else:
        del data[-10:]
    with pytest.raises(PayloadError) as err:
        verify_payload(bytes(data), payload.stamp, "/dev/shm/x/base.safetensors")
    message = str(err.value)
    assert "/dev/shm/x/base.safetensors" in message and "another tier" in message
    assert ("xxh64" if damage == "flip" else "size") in message


def test_wrong_job_or_layout_is_refused():
    payload = encode_base(make_base(), job_id=JOB, layout=LAYOUT)
    with pytest.raises(PayloadError, match="job.*other.*checkpoint.job_id"):
        decode_base(payload, job_id="other", layout=LAYOUT, source="src")
    other = dataclasses.replace(LAYOUT, dp_rank=0)
    with pytest.raises(PayloadError, match="layout"):
        decode_base(payload, job_id=JOB, layout=other, source="src")


def test_stamp_that_disagrees_with_payload_is_refused():
    payload = encode_base(make_base(), job_id=JOB, layout=LAYOUT)
    forged = EncodedPayload(payload.data, dataclasses.replace(payload.stamp, job_id="other"))
    with pytest.raises(PayloadError, match="stamp"):
        decode_base(forged, job_id="other", layout=LAYOUT, source="src")
    relabelled = EncodedPayload(payload.data, dataclasses.replace(payload.stamp, pid=PayloadId.base(100)))
    with pytest.raises(PayloadError, match="base v50"):
        decode_base(relabelled, job_id=JOB, layout=LAYOUT, source="src")


def test_kind_mismatch_is_refused():
    payload = encode_base(make_base(), job_id=JOB, layout=LAYOUT)
    with pytest.raises(PayloadError, match="expected a diff"):
        decode_diff_batch(payload, job_id=JOB, layout=LAYOUT, source="src")


def test_garbage_is_not_a_payload():
    with pytest.raises(PayloadError, match="not a MegaTier safetensors payload"):
        read_metadata(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json", "src")


def test_stamp_json_round_trip_and_malformed_stamps():
    stamp = encode_diff_batch(make_steps(), job_id=JOB, layout=LAYOUT).stamp
    assert Stamp.from_json(stamp.to_json(), "s") == stamp
    with pytest.raises(PayloadError, match="not valid JSON"):
        Stamp.from_json(b"{", "stamp.json")
    with pytest.raises(PayloadError, match="malformed stamp"):
        Stamp.from_json(b'{"format": 1, "kind": "base"}', "stamp.json")


def test_layout_ranks_are_a_bijection_with_tp_fastest():
    tp, pp, dp = 2, 3, 2
    layouts = [Layout(tp, pp, dp, t, p, d) for p, d, t in itertools.product(range(pp), range(dp), range(tp))]
    assert [lay.rank for lay in layouts] == list(range(tp * pp * dp))
    with pytest.raises(ValueError, match="layout"):
        Layout(2, 1, 1, 2, 0, 0)


def test_compressed_gradient_records_survive_a_diff_batch():
    from megatier import ops

    g = torch.Generator().manual_seed(0)
    records = [ops.compress_segments(torch.randn(3000, generator=g), [(0, 200), (200, 2800)], "adaptive", 0.05, 1000)
               for _ in range(3)]
    steps = [DiffStep(10 + i, 1e-3, 10 + i, False, r.tensors, r.header) for i, r in enumerate(records)]
    back = decode_diff_batch(encode_diff_batch(steps, job_id=JOB, layout=LAYOUT), job_id=JOB, layout=LAYOUT,
                             source="mem")
    for step, record in zip(back, records):
        rebuilt = ops.CompressedRecord(step.header, step.tensors)
        rebuilt.validate()
        assert torch.equal(ops.decompress_segments(rebuilt), ops.decompress_segments(record))


def test_draft_pieces_are_a_safetensors_file_for_every_payload_dtype():
    import safetensors.torch

    from megatier.checkpoint.format.payload import PayloadDraft

    storage = torch.arange(10, dtype=torch.float32)
    tensors = {"f32": storage[2:7], "alias": storage[:3], "bf16": torch.randn(5).to(torch.bfloat16),
               "f16": torch.randn(3).half(), "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
               "i32": torch.arange(6, dtype=torch.int32).reshape(2, 3), "u8": torch.tensor([0, 255], dtype=torch.uint8),
               "i64": torch.tensor([2**40]), "bool": torch.tensor([True, False]), "empty": torch.zeros(0),
               "scalar": torch.tensor(3.5)}
    draft = PayloadDraft(PayloadId.base(1), tensors, {"megatier": "{}"}, "j", Layout(1, 1, 1, 0, 0, 0))
    data = draft.to_payload().data
    header_len = int.from_bytes(data[:8], "little")
    assert header_len % 8 == 0  # tensor data starts 8-byte aligned
    loaded = safetensors.torch.load(data)
    assert loaded.keys() == tensors.keys()

    def raw(t):  # compare bits, so NaN payloads and -0.0 count too
        return t.reshape(-1).contiguous().view(torch.uint8)

    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and loaded[name].shape == t.shape, name
        assert torch.equal(raw(loaded[name]), raw(t)), name
    with pytest.raises(ValueError, match="complex64"):
        PayloadDraft(PayloadId.base(1), {"c": torch.zeros(2, dtype=torch.complex64)}, {}, "j",
                     Layout(1, 1, 1, 0, 0, 0)).pieces()
