"""Replay records (proto/specd/v1/replay.proto) from Python values and back.

The serving side builds a record per finished request with `RecordBuilder` (one `step()` per
speculative step, `finish()` at the end); the trainer decodes with `decode_record` and reads tensors
with `tensor_to_torch`. Tensors travel as raw little-endian bytes with dtype and shape; nothing here
unpickles anything.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

import numpy as np
import torch

from specd.proto.specd.v1.replay_pb2 import ReplayRecord, ReplayStep, TeacherTopK, Tensor

REPLAY_FORMAT = 1
_TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
}
_NAMES = {v: k for k, v in _TORCH_DTYPES.items()}
# bfloat16 has no numpy dtype: its bytes travel as int16.
_NUMPY = {"float32": "<f4", "float16": "<f2", "bfloat16": "<i2", "int32": "<i4", "int64": "<i8"}


class ReplayFormatError(ValueError):
    """The bytes are not a replay record this code can read."""


def tensor_from_torch(t: torch.Tensor) -> Tensor:
    """A Tensor message of `t` (copied to CPU, contiguous, little-endian)."""
    if t.dtype not in _NAMES:
        raise ReplayFormatError(f"dtype {t.dtype} cannot go into a replay record: {list(_TORCH_DTYPES)}")
    cpu = t.detach().to("cpu").contiguous()
    # bfloat16 has no numpy dtype: its bytes are taken through an int16 view of the same memory.
    raw = cpu.view(torch.int16) if cpu.dtype == torch.bfloat16 else cpu
    arr = raw.numpy()
    if sys.byteorder != "little":
        arr = arr.byteswap()
    return Tensor(dtype=_NAMES[t.dtype], shape=list(cpu.shape), data=arr.tobytes())


def tensor_to_torch(msg: Tensor) -> torch.Tensor:
    """The tensor a Tensor message holds; raises ReplayFormatError when dtype, shape and bytes disagree."""
    if msg.dtype not in _TORCH_DTYPES:
        raise ReplayFormatError(f"unknown tensor dtype {msg.dtype!r}")
    dtype = _TORCH_DTYPES[msg.dtype]
    np_dtype = np.dtype(_NUMPY[msg.dtype])
    shape = tuple(int(s) for s in msg.shape)
    count = int(np.prod(shape)) if shape else 1
    if count * np_dtype.itemsize != len(msg.data) or any(s < 0 for s in shape):
        raise ReplayFormatError(f"tensor of {msg.dtype} {shape} cannot hold {len(msg.data)} bytes")
    arr = np.frombuffer(msg.data, dtype=np_dtype).astype(np_dtype.newbyteorder("="))
    out = torch.from_numpy(arr.copy()).reshape(shape)
    return out.view(torch.bfloat16) if dtype == torch.bfloat16 else out


class RecordBuilder:
    """Collects one request's steps as the scheduler applies them; `finish()` makes the record."""

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], *, domain: str = "",
                 temperature: float = 0.0, target_checksum: str = ""):
        self.record = ReplayRecord(
            format=REPLAY_FORMAT, request_id=request_id, prompt_token_ids=list(prompt_token_ids),
            domain=domain, temperature=temperature, target_checksum=target_checksum,
        )
        self._versions: dict[str, int] = {}
        self._emitted = 0

    def first_tokens(self, tokens: Sequence[int]) -> None:
        """The prefill's token(s): output, but no step."""
        self.record.output_token_ids.extend(tokens)
        self._emitted += len(tokens)

    def step(self, drafted: Sequence[int], accepted: int, bonus: bool, emitted: Sequence[int],
             drafter_version: str = "", parents: Sequence[int] | None = None) -> None:
        """One verified step: its drafts, how many were accepted, and the tokens it emitted (already cut
        at EOS / length, so `emitted` may be shorter than accepted + 1 on the last step)."""
        if drafter_version not in self._versions:
            self._versions[drafter_version] = len(self.record.drafter_versions)
            self.record.drafter_versions.append(drafter_version)
        self.record.steps.append(ReplayStep(
            output_offset=self._emitted, drafted=list(drafted), parents=list(parents or ()),
            accepted=accepted, bonus=bonus, drafter_version=self._versions[drafter_version],
        ))
        self.record.output_token_ids.extend(emitted)
        self._emitted += len(emitted)

    def teacher_topk(self, first_output_position: int, ids: torch.Tensor, logprobs: torch.Tensor) -> None:
        """ids [n, k] int, logprobs [n, k]: the target's top-k at output positions first.. (optional)."""
        self.record.teacher.CopyFrom(TeacherTopK(
            first_output_position=first_output_position,
            ids=tensor_from_torch(ids.to(torch.int32)),
            logprobs=tensor_from_torch(logprobs),
        ))

    def finish(self) -> ReplayRecord:
        self.record.created_unix = time.time()
        return self.record


def encode_record(record: ReplayRecord) -> bytes:
    return record.SerializeToString()


def decode_record(data: bytes) -> ReplayRecord:
    """Parse and check a record; raises ReplayFormatError for bytes of another format or shape."""
    record = ReplayRecord()
    try:
        record.ParseFromString(data)
    except Exception as exc:  # protobuf raises its own DecodeError; callers only need one error type
        raise ReplayFormatError(f"not a replay record: {exc}") from exc
    if record.format != REPLAY_FORMAT:
        raise ReplayFormatError(f"replay record format {record.format}, this code reads {REPLAY_FORMAT}")
    n_out = len(record.output_token_ids)
    for step in record.steps:
        if step.output_offset > n_out or step.drafter_version >= max(1, len(record.drafter_versions)):
            raise ReplayFormatError(f"record {record.request_id}: step points outside the record")
        if step.accepted > len(step.drafted):
            raise ReplayFormatError(f"record {record.request_id}: accepted > drafted")
    return record
