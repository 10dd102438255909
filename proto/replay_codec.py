"""Replay records (proto/specd/v1/replay.proto) from Python values and back.

The serving side builds a record per finished request with `RecordBuilder` (one `step()` per
speculative step, `finish()` at the end); the trainer decodes with `decode_record` and reads tensors
with `tensor_to_torch`. Tensors travel as raw little-endian bytes with dtype and shape; nothing here
unpickles anything.

Records come from a Redis stream anyone holding its password can write to, so `decode_record` checks
everything the trainer later indexes with: every token id within the vocabulary, every step inside the
record, tensor dtypes known and shapes bounded (element counts computed with Python ints, so a shape
whose product overflows 64 bits cannot pass the size check). A record that passes can be labelled and
trained on without an index error; one that does not raises ReplayFormatError with the reason.
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
# Bounds of one record: far above any served request (max_seq_len is a few thousand tokens), far below
# what would exhaust the trainer's memory.
MAX_TOKENS = 1 << 20            # prompt + output tokens, and steps
MAX_DRAFTED = 1 << 12           # drafted tokens (tree nodes) of one step
MAX_TENSOR_DIMS = 4
MAX_TENSOR_ELEMENTS = 1 << 26
MAX_TEXT = 1024                 # request id, domain, drafter version names


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
    count = element_count(shape)
    if count * np_dtype.itemsize != len(msg.data):
        raise ReplayFormatError(f"tensor of {msg.dtype} {shape} cannot hold {len(msg.data)} bytes")
    arr = np.frombuffer(msg.data, dtype=np_dtype).astype(np_dtype.newbyteorder("="))
    out = torch.from_numpy(arr.copy()).reshape(shape)
    return out.view(torch.bfloat16) if dtype == torch.bfloat16 else out


def element_count(shape: Sequence[int]) -> int:
    """Elements of a tensor of `shape`, in Python ints (no 64-bit wrap-around); raises ReplayFormatError
    for a negative dimension or more than MAX_TENSOR_DIMS / MAX_TENSOR_ELEMENTS."""
    if len(shape) > MAX_TENSOR_DIMS:
        raise ReplayFormatError(f"tensor of {len(shape)} dimensions (at most {MAX_TENSOR_DIMS})")
    count = 1
    for dim in shape:
        dim = int(dim)
        if dim < 0 or dim > MAX_TENSOR_ELEMENTS:
            raise ReplayFormatError(f"tensor dimension {dim} out of range [0, {MAX_TENSOR_ELEMENTS}]")
        count *= dim
        if count > MAX_TENSOR_ELEMENTS:
            raise ReplayFormatError(f"tensor shape {list(shape)} exceeds {MAX_TENSOR_ELEMENTS} elements")
    return count


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
             drafter_version: str = "", parents: Sequence[int] | None = None,
             unseen_drafted: int = 0) -> None:
        """One verified step: its drafts, how many were accepted, and the tokens it emitted (already cut
        at EOS / length, so `emitted` may be shorter than accepted + 1 on the last step). unseen_drafted:
        drafts after `drafted` whose ids were not reported (the vLLM backend's rejected ones)."""
        if drafter_version not in self._versions:
            self._versions[drafter_version] = len(self.record.drafter_versions)
            self.record.drafter_versions.append(drafter_version)
        self.record.steps.append(ReplayStep(
            output_offset=self._emitted, drafted=list(drafted), parents=list(parents or ()),
            accepted=accepted, bonus=bonus, drafter_version=self._versions[drafter_version],
            unseen_drafted=unseen_drafted,
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


def decode_record(data: bytes, vocab_size: int | None = None) -> ReplayRecord:
    """Parse and check a record; raises ReplayFormatError for bytes of another format, shape or
    vocabulary. vocab_size: the target's; token ids must lie in [0, vocab_size) (None: only >= 0)."""
    record = ReplayRecord()
    try:
        record.ParseFromString(data)
    except Exception as exc:  # protobuf raises its own DecodeError; callers only need one error type
        raise ReplayFormatError(f"not a replay record: {exc}") from exc
    if record.format != REPLAY_FORMAT:
        raise ReplayFormatError(f"replay record format {record.format}, this code reads {REPLAY_FORMAT}")
    name = record.request_id[:64]
    n_out = len(record.output_token_ids)
    if len(record.prompt_token_ids) + n_out > MAX_TOKENS or len(record.steps) > MAX_TOKENS:
        raise ReplayFormatError(f"record {name}: more than {MAX_TOKENS} tokens or steps")
    texts = [record.request_id, record.domain, record.target_checksum, *record.drafter_versions]
    if any(len(t) > MAX_TEXT for t in texts) or len(record.drafter_versions) > MAX_TOKENS:
        raise ReplayFormatError(f"record {name}: a text field is longer than {MAX_TEXT}")
    _check_ids(name, "prompt", record.prompt_token_ids, vocab_size)
    _check_ids(name, "output", record.output_token_ids, vocab_size)
    for step in record.steps:
        if step.output_offset > n_out or step.drafter_version >= max(1, len(record.drafter_versions)):
            raise ReplayFormatError(f"record {name}: step points outside the record")
        if len(step.drafted) + step.unseen_drafted > MAX_DRAFTED:
            raise ReplayFormatError(f"record {name}: a step drafted more than {MAX_DRAFTED} tokens")
        if step.accepted > len(step.drafted):
            raise ReplayFormatError(f"record {name}: accepted > drafted")
        if step.parents and (len(step.parents) != len(step.drafted)
                             or any(p < 0 or p > len(step.drafted) for p in step.parents)):
            raise ReplayFormatError(f"record {name}: tree parents outside the step's drafts")
        if step.parents and step.unseen_drafted:
            raise ReplayFormatError(f"record {name}: a tree step with unseen drafts")
        _check_ids(name, "drafted", step.drafted, vocab_size)
    if record.HasField("teacher"):
        _check_teacher(name, record.teacher, n_out, vocab_size)
    return record


def _check_ids(name: str, what: str, ids: Sequence[int], vocab_size: int | None) -> None:
    if not ids:
        return
    lo, hi = min(ids), max(ids)
    if lo < 0 or (vocab_size is not None and hi >= vocab_size):
        raise ReplayFormatError(f"record {name}: {what} token id {lo if lo < 0 else hi} outside the "
                                f"vocabulary [0, {vocab_size if vocab_size is not None else 'inf'})")


def _check_teacher(name: str, teacher: TeacherTopK, n_out: int, vocab_size: int | None) -> None:
    """The target's top-k: ids [n, k] of an integer dtype within the vocabulary, logprobs [n, k] of a
    float dtype without NaN or +inf, n at most the output positions from first_output_position on."""
    if teacher.ids.dtype not in ("int32", "int64") or teacher.logprobs.dtype not in ("float32", "float16",
                                                                                     "bfloat16"):
        raise ReplayFormatError(f"record {name}: teacher dtypes {teacher.ids.dtype}/{teacher.logprobs.dtype}")
    ids, lps = tensor_to_torch(teacher.ids), tensor_to_torch(teacher.logprobs)
    if ids.dim() != 2 or tuple(ids.shape) != tuple(lps.shape):
        raise ReplayFormatError(f"record {name}: teacher shapes {list(ids.shape)} and {list(lps.shape)}")
    if teacher.first_output_position + ids.shape[0] > n_out:
        raise ReplayFormatError(f"record {name}: teacher rows beyond the output")
    if ids.numel():
        _check_ids(name, "teacher", [int(ids.min()), int(ids.max())], vocab_size)
        if bool(torch.isnan(lps).any()) or bool((lps.float() == float("inf")).any()):
            raise ReplayFormatError(f"record {name}: teacher logprobs hold NaN or +inf")
