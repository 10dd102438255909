"""Replay records survive encode/decode exactly, tensors included; bad bytes give one clear error."""

from __future__ import annotations

import pytest
import torch

from specd.proto.replay_codec import (
    RecordBuilder,
    ReplayFormatError,
    decode_record,
    encode_record,
    tensor_from_torch,
    tensor_to_torch,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64])
def test_tensor_round_trip(dtype: torch.dtype) -> None:
    t = (torch.randn(3, 5) * 100).to(dtype)
    back = tensor_to_torch(tensor_from_torch(t))
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back, t)


def test_tensor_bytes_are_little_endian() -> None:
    msg = tensor_from_torch(torch.tensor([1, 256], dtype=torch.int32))
    assert msg.data == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    assert list(msg.shape) == [2] and msg.dtype == "int32"


def test_record_round_trip() -> None:
    b = RecordBuilder("req-1", [5, 6, 7], domain="gsm8k", temperature=0.7, target_checksum="abc")
    b.first_tokens([8])
    b.step([9, 10, 11], accepted=2, bonus=False, emitted=[9, 10, 12], drafter_version="v1")
    b.step([13, 14], accepted=2, bonus=True, emitted=[13, 14, 15], drafter_version="v2")
    b.step([16, 17, 18], accepted=1, bonus=False, emitted=[16], drafter_version="v1", parents=[0, 1, 0])
    ids = torch.tensor([[9, 3], [10, 4]])
    lps = torch.tensor([[-0.1, -2.5], [-0.2, -3.0]], dtype=torch.float16)
    b.teacher_topk(1, ids, lps)
    rec = decode_record(encode_record(b.finish()))

    assert rec.request_id == "req-1" and rec.domain == "gsm8k" and rec.target_checksum == "abc"
    assert rec.temperature == pytest.approx(0.7)
    assert list(rec.prompt_token_ids) == [5, 6, 7]
    assert list(rec.output_token_ids) == [8, 9, 10, 12, 13, 14, 15, 16]
    assert list(rec.drafter_versions) == ["v1", "v2"]
    assert [s.output_offset for s in rec.steps] == [1, 4, 7]
    assert [list(s.drafted) for s in rec.steps] == [[9, 10, 11], [13, 14], [16, 17, 18]]
    assert [s.accepted for s in rec.steps] == [2, 2, 1]
    assert [s.bonus for s in rec.steps] == [False, True, False]
    assert [rec.drafter_versions[s.drafter_version] for s in rec.steps] == ["v1", "v2", "v1"]
    assert list(rec.steps[2].parents) == [0, 1, 0] and not rec.steps[0].parents
    assert rec.teacher.first_output_position == 1
    assert torch.equal(tensor_to_torch(rec.teacher.ids), ids.to(torch.int32))
    assert torch.equal(tensor_to_torch(rec.teacher.logprobs), lps)


def test_garbage_and_inconsistent_records_are_rejected() -> None:
    with pytest.raises(ReplayFormatError):
        decode_record(b"\xff\xff\xff not a record")
    b = RecordBuilder("r", [1])
    b.step([2], accepted=1, bonus=True, emitted=[2, 3])
    rec = b.finish()
    rec.steps[0].accepted = 5
    with pytest.raises(ReplayFormatError, match="accepted > drafted"):
        decode_record(encode_record(rec))
    rec.format = 99
    with pytest.raises(ReplayFormatError, match="format"):
        decode_record(encode_record(rec))
    bad = tensor_from_torch(torch.zeros(4))
    bad.shape[:] = [5]
    with pytest.raises(ReplayFormatError, match="cannot hold"):
        tensor_to_torch(bad)


def _hostile(**change):
    """A valid record over vocab 100, then `change` applied: fields set on the record or its first step."""
    b = RecordBuilder("r", [5, 6])
    b.first_tokens([7])
    b.step([8, 9], accepted=1, bonus=False, emitted=[8, 10], drafter_version="v1")
    b.teacher_topk(0, torch.tensor([[7, 1], [8, 2], [10, 3]]), torch.full((3, 2), -1.0))
    rec = b.finish()
    for fn in change.values():
        fn(rec)
    return encode_record(rec)


def _set_shape(tensor, shape):
    tensor.shape[:] = shape


@pytest.mark.parametrize("name,change,match", [
    ("negative prompt id", lambda r: r.prompt_token_ids.append(-3), "prompt token id -3"),
    ("output id beyond vocab", lambda r: r.output_token_ids.append(100), "output token id 100"),
    ("drafted id beyond vocab", lambda r: r.steps[0].drafted.append(1 << 30), "drafted token id"),
    ("tree parent outside the step", lambda r: r.steps[0].parents.extend([0, 7]), "parents"),
    ("teacher id beyond vocab", lambda r: r.teacher.ids.CopyFrom(tensor_from_torch(
        torch.tensor([[7, 1], [8, 2], [10, 300]], dtype=torch.int32))), "teacher token id 300"),
    ("teacher NaN", lambda r: r.teacher.logprobs.CopyFrom(tensor_from_torch(
        torch.tensor([[0.0, float("nan")]] * 3))), "NaN"),
    ("teacher float ids", lambda r: r.teacher.ids.CopyFrom(tensor_from_torch(torch.zeros(3, 2))), "dtypes"),
    ("unknown dtype", lambda r: setattr(r.teacher.ids, "dtype", "complex128"), "dtype"),
    ("teacher rows beyond output", lambda r: setattr(r.teacher, "first_output_position", 2), "beyond"),
    # 2^32 * 2^32 wraps to 0 in 64-bit arithmetic: an empty payload passed the old size check
    ("overflowing shape", lambda r: (_set_shape(r.teacher.ids, [1 << 32, 1 << 32]),
                                     setattr(r.teacher.ids, "data", b"")), "dimension"),
    ("overflowing product", lambda r: (_set_shape(r.teacher.ids, [1 << 20, 1 << 20, 0]),
                                       setattr(r.teacher.ids, "data", b"")), "exceeds"),
    ("too many dims", lambda r: _set_shape(r.teacher.ids, [1] * 9), "dimensions"),
])
def test_hostile_records_are_rejected_with_the_reason(name, change, match) -> None:
    assert decode_record(_hostile(), vocab_size=100).request_id == "r"
    with pytest.raises(ReplayFormatError, match=match):
        decode_record(_hostile(x=change), vocab_size=100)


def test_negative_ids_are_rejected_without_a_vocab_size() -> None:
    with pytest.raises(ReplayFormatError, match="-1"):
        decode_record(_hostile(x=lambda r: r.steps[0].drafted.append(-1)))
    assert decode_record(_hostile(x=lambda r: r.output_token_ids.append(10**6))).request_id == "r"
