"""A killed trainer process resumes from its consumer group and its checkpoint: the records it had
read but not acknowledged are delivered again after the restart, acknowledged ones are not, and the
training state (candidate, AdamW, counters) continues from the last durable update."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specd.cluster.redis_server import ManagedRedis
from specd.drafter_trainer.replay_source import RECORD_FIELD
from specd.proto.replay_codec import encode_record
from tests.drafter_trainer.online_helpers import greedy_continuations, make_record, make_tiny_drafter

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")]
REPO = Path(__file__).resolve().parents[2]


def _start(server: ManagedRedis, overrides: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "SPECD_REDIS_PASSWORD": server.password, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "specd.cluster.cli", "train", f"replay.redis_url={server.endpoint.url}",
         *overrides],
        cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
    )


def _wait(cond, proc: subprocess.Popen, log: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def test_killed_trainer_resumes_from_its_consumer_group(tmp_path, tiny_llama_dir) -> None:
    drafter = make_tiny_drafter(tiny_llama_dir, tmp_path / "drafter")
    common = [f"target.model_path={tiny_llama_dir}", f"drafter.path={drafter}",
              f"trainer.out_dir={tmp_path}/store", "target.max_seq_len=128", "trainer.teacher_topk=8",
              "trainer.holdout_every=4",
              "trainer.steps_per_update=2", "trainer.update_every_s=1000"]
    data = greedy_continuations(tiny_llama_dir, 15, new_tokens=12)
    with ManagedRedis() as server:
        client = server.endpoint.client()

        first_ids = [_add(client, i, data) for i in range(10)]
        # held-out records feed no update: acknowledged in the round that read them
        n_pending = sum(1 for e in first_ids if not _held(e))
        log1 = tmp_path / "first.log"
        first = _start(server, [*common, "trainer.update_every_records=1000"], log1)   # never updates
        try:
            _wait(lambda: client.exists("specd:replay") and _pending(client) == n_pending, first, log1)
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait()
        assert _pending(client) == n_pending

        for i in range(10, 15):
            _add(client, i, data)
        log2 = tmp_path / "second.log"
        # 10 pending + 5 new records; without the pending ones, an update would never come
        n_train = sum(1 for e in client.xrange("specd:replay") if not _held(e[0]))
        second = _start(server, [*common, f"trainer.update_every_records={n_train}"], log2)
        try:
            _wait(lambda: "update 1:" in log2.read_text(), second, log2)
            _wait(lambda: _pending(client) == 0, second, log2)
        finally:
            second.send_signal(signal.SIGTERM)
            second.wait(timeout=30)
        assert f"records_seen={n_pending + 5}" in log2.read_text()
        assert (tmp_path / "store" / "CURRENT").is_file()


def _add(client, i: int, data) -> bytes:
    return client.xadd("specd:replay", {RECORD_FIELD: encode_record(make_record(i, *data[i], "tiny-t"))})


def _pending(client) -> int:
    import redis

    try:
        return int(client.xpending("specd:replay", "specd-trainer")["pending"])
    except redis.ResponseError:   # the trainer has not created its group yet
        return -1


def _held(entry_id) -> bool:
    from specd.drafter_trainer.online_data import is_held_out

    return is_held_out(entry_id.decode() if isinstance(entry_id, bytes) else entry_id, 4)


def test_killed_trainer_resumes_from_its_checkpoint_and_gets_its_unacked_records_again(tmp_path,
                                                                                     tiny_llama_dir) -> None:
    drafter = make_tiny_drafter(tiny_llama_dir, tmp_path / "drafter")
    common = [f"target.model_path={tiny_llama_dir}", f"drafter.path={drafter}",
              f"trainer.out_dir={tmp_path}/store", "target.max_seq_len=128", "trainer.teacher_topk=8",
              "trainer.holdout_every=4", "trainer.steps_per_update=2", "trainer.update_every_s=1000",
              "trainer.gate_margin=1.0"]    # nothing publishes: only the checkpoint makes an update durable
    data = greedy_continuations(tiny_llama_dir, 15, new_tokens=12)
    with ManagedRedis() as server:
        client = server.endpoint.client()
        ids = [_add(client, i, data) for i in range(10)]
        n_first = sum(1 for e in ids if not _held(e))
        log1 = tmp_path / "first.log"
        first = _start(server, [*common, f"trainer.update_every_records={n_first}"], log1)
        try:
            _wait(lambda: "update 1:" in log1.read_text() and _pending(client) == 0, first, log1)
            later = [_add(client, i, data) for i in range(10, 15)]
            unacked = sum(1 for e in later if not _held(e))   # held-out ones are acknowledged at once
            assert 0 < unacked < n_first
            _wait(lambda: _pending(client) == unacked and "records_seen" in log1.read_text(), first, log1)
            time.sleep(1.0)                                    # the round that read them has ended
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait()
        assert _pending(client) == unacked
        assert (tmp_path / "store" / "trainer-state" / "LATEST").is_file()

        log2 = tmp_path / "second.log"
        second = _start(server, [*common, f"trainer.update_every_records={unacked}"], log2)
        try:
            _wait(lambda: "update 2:" in log2.read_text(), second, log2)
            _wait(lambda: _pending(client) == 0, second, log2)
        finally:
            second.send_signal(signal.SIGTERM)
            second.wait(timeout=30)
        text = log2.read_text()
        assert "resumed from its checkpoint (1 updates, 2 optimizer steps)" in text
        # counters carried over; the unacknowledged records came again, the acknowledged ones did not
        assert f"update 2: records_seen={10 + unacked} optimizer_steps=4" in text and "resumed=True" in text
