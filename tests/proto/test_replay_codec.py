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
