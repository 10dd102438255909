"""fetch_version when several processes fetch the same version into one cache at once (each replica's
DraftWorker on a node shares it): the first rename wins and every caller gets the complete directory.
Found by the e2e server with target.replicas=2, where the second DraftWorker died at start."""

from __future__ import annotations

import json
import os

import pytest

from specd.workers.drafters import redis_versions
from specd.workers.drafters.versions import META_FILE, WEIGHTS_FILE, VersionError


class OneVersion:
    """A stand-in for the Redis client: the one hash fetch_version reads."""

    def __init__(self, fields: dict[bytes, bytes]):
        self.fields = fields

    def hgetall(self, key: str) -> dict[bytes, bytes]:
        return self.fields if key.endswith(":v:v7") else {}


FIELDS = {b"chunks": b"2", b"w0": b"weig", b"w1": b"hts", b"meta": json.dumps({"version": "v7"}).encode(),
          b"config": b"{}"}


def test_a_fetch_that_loses_the_rename_race_returns_the_winners_directory(tmp_path, monkeypatch) -> None:
    real_rename = os.rename

    def another_reader_first(src, dst):
        # another process finishes the same fetch between this one's check and its rename
        monkeypatch.setattr(redis_versions.os, "rename", real_rename)
        assert redis_versions.fetch_version(OneVersion(FIELDS), "p", "v7", tmp_path) == dst
        real_rename(src, dst)          # raises ENOTEMPTY, as the losing process's rename does

    monkeypatch.setattr(redis_versions.os, "rename", another_reader_first)
    dest = redis_versions.fetch_version(OneVersion(FIELDS), "p", "v7", tmp_path)
    assert (dest / WEIGHTS_FILE).read_bytes() == b"weights" and (dest / META_FILE).is_file()
    assert [p.name for p in dest.parent.iterdir()] == ["v7"], "the loser's temporary directory is left"


def test_other_rename_failures_still_raise(tmp_path, monkeypatch) -> None:
    def no_space(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(redis_versions.os, "rename", no_space)
    with pytest.raises(OSError, match="No space"):
        redis_versions.fetch_version(OneVersion(FIELDS), "p", "v7", tmp_path)
    assert not any((tmp_path / "versions").iterdir())
    with pytest.raises(VersionError, match="not in Redis"):
        redis_versions.fetch_version(OneVersion(FIELDS), "p", "v8", tmp_path)
