"""The committed generated code of proto/ must match what proto/build.py produces from the .proto files."""

from __future__ import annotations

from pathlib import Path

import pytest

from specd.proto import build

pytest.importorskip("grpc_tools")


def test_committed_generated_code_is_fresh(tmp_path: Path) -> None:
    fresh = build.generate(tmp_path)
    assert fresh, "build.generate produced no files"
    stale = []
    for path in fresh:
        committed = build.PROTO_ROOT / path.relative_to(tmp_path)
        if not committed.is_file() or committed.read_text() != path.read_text():
            stale.append(str(committed.relative_to(build.PROTO_ROOT.parent)))
    assert not stale, f"generated code is stale, run `python -m specd.proto.build`: {stale}"


def test_generated_modules_import_from_the_repo_package() -> None:
    from specd.proto.specd.v1 import serving_pb2, serving_pb2_grpc

    assert serving_pb2.DESCRIPTOR.package == "specd.v1"
    assert "Specd" in serving_pb2.DESCRIPTOR.services_by_name
    assert hasattr(serving_pb2_grpc, "SpecdStub")
    assert hasattr(serving_pb2_grpc, "add_SpecdServicer_to_server")
