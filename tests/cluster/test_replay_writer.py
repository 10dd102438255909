"""ReplayWriter against a real redis-server: records land in the stream; with Redis stopped nothing
raises and drops are counted; after a restart writing resumes by itself."""

from __future__ import annotations

import shutil
import time

import pytest
from prometheus_client import CollectorRegistry

from specd.cluster.redis_server import ManagedRedis
from specd.cluster.replay_writer import RECORD_FIELD, ReplayWriter
from specd.proto.replay_codec import RecordBuilder, decode_record

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")


def _record(i: int):
    b = RecordBuilder(f"req-{i}", [1, 2, 3], domain="test")
    b.first_tokens([4])
    b.step([5, 6], accepted=1, bonus=False, emitted=[5, 7], drafter_version="v0")
    return b.finish()


def _wait(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


@pytest.mark.slow
def test_records_reach_the_stream_with_approximate_maxlen() -> None:
    with ManagedRedis() as server:
        writer = ReplayWriter(server.endpoint, "specd:replay", maxlen=100).start()
        try:
            for i in range(500):
                assert writer.submit(_record(i))
            assert _wait(lambda: writer.written == 500)
        finally:
            writer.stop()
        client = server.endpoint.client()
        n = client.xlen("specd:replay")
        assert 100 <= n < 500          # trimmed, approximately (whole macro nodes)
        last = client.xrevrange("specd:replay", count=1)[0][1][RECORD_FIELD]
        assert decode_record(last).request_id == "req-499"
        assert writer.dropped == 0


@pytest.mark.slow
def test_redis_stopped_and_restarted_while_writing() -> None:
    registry = CollectorRegistry()
    server = ManagedRedis().start()
    writer = ReplayWriter(server.endpoint, "s", maxlen=10_000, queue_size=16, socket_timeout_s=0.3,
                          retry_s=0.2, registry=registry).start()
    try:
        for i in range(10):
            writer.submit(_record(i))
        assert _wait(lambda: writer.written == 10)
        server.stop()
        for i in range(200):            # Redis away: submit neither raises nor blocks on it
            writer.submit(_record(100 + i))
            time.sleep(0.005)
        assert _wait(lambda: writer.dropped > 0)
        dropped = registry.get_sample_value("specd_replay_records_dropped_total", {"reason": "queue_full"})
        assert dropped and dropped > 0
        server.start()                  # same port and password
        written_before = writer.written
        for i in range(30):
            writer.submit(_record(1000 + i))
            time.sleep(0.01)
        assert _wait(lambda: writer.written >= written_before + 30 - 16)
        assert _wait(lambda: server.endpoint.client().xlen("s") > 0)
        assert registry.get_sample_value("specd_replay_records_written_total") == writer.written
        assert writer.written + writer.dropped + writer.pending() == 240
    finally:
        writer.stop()
        server.stop()
