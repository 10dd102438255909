"""No secret leaves the server: the replay URL's password never reaches a log line (a real
redis-server with a password, the real start_online), nor a metric label or the masked config."""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import time

import pytest
import redis
from prometheus_client import CollectorRegistry, generate_latest

from specd.cluster.metrics import SpecdMetrics
from specd.cluster.online import start_online
from specd.cluster.redact import redact_config, redact_text
from specd.cluster.validation import Bounds
from specd.configs import load_config

PASSWORD = "pa55-word-that-must-not-leak"


@pytest.fixture
def redis_with_password(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--requirepass",
                             PASSWORD, "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, password=PASSWORD, socket_timeout=1)
    end = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < end, "redis-server did not start"
            time.sleep(0.05)
    yield port
    proc.terminate()
    proc.wait(10)


def test_replay_url_password_never_logged(redis_with_password, tmp_path, caplog) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"not a real model, only checksummed")
    url = f"redis://:{PASSWORD}@127.0.0.1:{redis_with_password}/0"
    cfg = load_config([f"replay.redis_url='{url}'", "trainer.enabled=false"])
    caplog.set_level(logging.DEBUG)
    parts = start_online(cfg, str(tmp_path), [], CollectorRegistry())
    try:
        assert parts.writer is not None and parts.managed_redis is None
    finally:
        parts.stop()
    lines = [r.getMessage() for r in caplog.records]
    assert any(f"redis://:***@127.0.0.1:{redis_with_password}/0" in line for line in lines), lines
    assert not any(PASSWORD in line for line in lines)


def test_metric_labels_and_config_are_masked() -> None:
    metrics = SpecdMetrics(CollectorRegistry())
    metrics.set_live_config(Bounds(vocab_size=10, max_seq_len=8), f"redis://u:{PASSWORD}@h:1/0")
    exported = generate_latest(metrics.registry).decode()
    assert PASSWORD not in exported and "redis://u:***@h:1/0" in exported
    shown = redact_config({"replay.redis_url": f"rediss://:{PASSWORD}@h:6380/0?password={PASSWORD}&db=1",
                           "target.model_path": "/m/a,b=c"})
    assert shown == {"replay.redis_url": "rediss://:***@h:6380/0?password=***&db=1",
                     "target.model_path": "/m/a,b=c"}


@pytest.mark.parametrize("text, shown", [
    ("redis://:pw@h:6379/0", "redis://:***@h:6379/0"),
    ("redis://user:pw@h/0", "redis://user:***@h/0"),
    ("redis://token-only@h/0", "redis://***@h/0"),
    ("redis://h:6379/0", "redis://h:6379/0"),
    ("unix:///run/redis.sock?db=0&password=pw", "unix:///run/redis.sock?db=0&password=***"),
    ("error connecting to redis://:pw@h:1/0: refused", "error connecting to redis://:***@h:1/0: refused"),
    ("/plain/path", "/plain/path"),
])
def test_redact_text(text, shown) -> None:
    assert redact_text(text) == shown


def test_log_redaction_filter_masks_messages_and_tracebacks() -> None:
    import io

    from specd.cluster.redact import install_log_redaction

    stream = io.StringIO()
    logger = logging.getLogger("specd-test-redaction")
    logger.propagate = False
    logger.addHandler(logging.StreamHandler(stream))
    install_log_redaction(logger)
    url = f"redis://:{PASSWORD}@h:1/0"
    logger.warning("connecting to %s", url)
    try:
        raise ConnectionError(f"cannot reach {url}")
    except ConnectionError:
        logger.exception("failed")
    text = stream.getvalue()
    assert PASSWORD not in text and text.count("redis://:***@h:1/0") == 2
