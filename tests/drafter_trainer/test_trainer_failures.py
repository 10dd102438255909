"""The trainer's loop against a real redis-server: a transient failure is counted, shown and retried
without losing a record; a persistent one ends the process for a restart (cluster/trainer_actor.py
run_loop, the loop TrainerActor runs on its thread), and the restarted trainer recovers from the
unreadable version that caused it."""

from __future__ import annotations

import shutil
import threading
import time
from dataclasses import replace

import pytest

from specd.cluster.redis_server import ManagedRedis
from specd.cluster.trainer_actor import FAILURES_BEFORE_RESTART, LoopHealth, run_loop
from specd.drafter_trainer.online import OnlineTrainer
from specd.drafter_trainer.online_data import TargetTeacher
from specd.drafter_trainer.replay_source import RECORD_FIELD, ReplaySource
from specd.proto.replay_codec import encode_record
from specd.workers.drafters.versions import META_FILE, read_current, version_dir
from tests.drafter_trainer.online_helpers import greedy_continuations, make_record, make_tiny_drafter
from tests.drafter_trainer.test_online import CFG

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")


@pytest.fixture(scope="module")
def redis_server():
    with ManagedRedis() as server:
        yield server


@pytest.fixture(scope="module")
def teacher(tiny_llama_dir):
    return TargetTeacher(tiny_llama_dir, top_k=8, max_seq_len=128)


@pytest.fixture(scope="module")
def records(tiny_llama_dir):
    return [encode_record(make_record(i, p, o, "tiny-t"))
            for i, (p, o) in enumerate(greedy_continuations(tiny_llama_dir, 8, new_tokens=12))]


def _trainer(tmp_path, tiny_llama_dir, redis_server, teacher, stream):
    base = make_tiny_drafter(tiny_llama_dir, tmp_path / "base")
    source = ReplaySource(redis_server.endpoint.client(socket_timeout=None), stream, CFG.group, CFG.consumer)
    cfg = replace(CFG, update_every_s=0.5)        # an update as soon as the stream is drained
    return OnlineTrainer(cfg, source, tiny_llama_dir, base, tmp_path / "store", teacher=teacher)


def _run(trainer, die=None):
    stop, health, died = threading.Event(), LoopHealth(), []
    thread = threading.Thread(target=run_loop, args=(trainer, stop, health),
                              kwargs={"die": die or died.append, "retry_s": 0.05}, daemon=True)
    thread.start()
    return stop, health, died, thread


def _wait(cond, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_transient_failure_is_counted_shown_and_retried_without_losing_a_record(
        tmp_path, tiny_llama_dir, redis_server, teacher, records, monkeypatch):
    trainer = _trainer(tmp_path, tiny_llama_dir, redis_server, teacher, "s-transient")
    label, calls = teacher.label, []

    def fails_once(*args, **kw):
        calls.append(1)
        if len(calls) == 3:                    # the third record of the first round
            raise RuntimeError("device lost for a moment")
        return label(*args, **kw)

    monkeypatch.setattr(teacher, "label", fails_once)
    client = redis_server.endpoint.client()
    for data in records:
        client.xadd("s-transient", {RECORD_FIELD: data})
    stop, health, died, thread = _run(trainer)
    try:
        _wait(lambda: trainer.stats.updates >= 1 and trainer.source.pending() == 0)
        assert health.failures == 1 and health.consecutive == 0 and health.error is None
        assert not died and thread.is_alive()
        # every record taken in once: the two before the failure were not read twice, the rest again
        assert trainer.stats.records_seen == len(records)
        assert len(trainer.buffer) + len(trainer.holdout) == len(records)
    finally:
        stop.set()
        thread.join(10)


def test_a_persistent_failure_ends_the_loop_for_a_restart_and_the_restart_recovers(
        tmp_path, tiny_llama_dir, redis_server, teacher, records):
    trainer = _trainer(tmp_path, tiny_llama_dir, redis_server, teacher, "s-persistent")
    broken = trainer.serving_version
    (version_dir(trainer.store.root, broken) / META_FILE).write_text("{not json")   # unreadable from now on
    stop, health, died, thread = _run(trainer)
    try:
        _wait(lambda: died)
        thread.join(10)
        assert not thread.is_alive()           # ended, and said so: died was called with the reason
        assert health.failures == FAILURES_BEFORE_RESTART and "unreadable" in died[0]
    finally:
        stop.set()
    restarted = _trainer(tmp_path, tiny_llama_dir, redis_server, teacher, "s-persistent")
    assert read_current(restarted.store.root) == restarted.serving_version
    assert any(p.name.startswith(f".broken-{broken}") for p in (restarted.store.root / "versions").iterdir())
    client = redis_server.endpoint.client()
    for data in records:
        client.xadd("s-persistent", {RECORD_FIELD: data})
    stop, health, died, thread = _run(restarted)
    try:
        _wait(lambda: restarted.stats.updates >= 1)
        assert health.failures == 0 and not died
    finally:
        stop.set()
        thread.join(10)
