"""The trainer's checkpoint and its acknowledgement rule, against a real redis-server: a new trainer on
the same store continues with the candidate, AdamW state, lr schedule and counters the last one
checkpointed; records are acknowledged only once their update is durable, and records that feed no
update at once."""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest
import torch

from specd.cluster.redis_server import ManagedRedis
from specd.drafter_trainer import checkpoint
from specd.drafter_trainer.online import OnlineTrainer
from specd.drafter_trainer.online_data import TargetTeacher, is_held_out
from specd.drafter_trainer.replay_source import RECORD_FIELD, ReplaySource
from specd.proto.replay_codec import encode_record
from specd.workers.drafters.versions import target_checksum
from tests.drafter_trainer.online_helpers import greedy_continuations, make_record, make_tiny_drafter
from tests.drafter_trainer.test_online import CFG

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
NO_PUBLISH = replace(CFG, gate_margin=1.0, update_every_s=1000.0)   # updates are made by hand here


@pytest.fixture(scope="module")
def redis_server():
    with ManagedRedis() as server:
        yield server


@pytest.fixture(scope="module")
def teacher(tiny_llama_dir):
    return TargetTeacher(tiny_llama_dir, top_k=8, max_seq_len=128)


@pytest.fixture(scope="module")
def continuations(tiny_llama_dir):
    return greedy_continuations(tiny_llama_dir, 12, new_tokens=12)


def _trainer(tmp_path, tiny_llama_dir, redis_server, teacher, stream, cfg=NO_PUBLISH):
    base = tmp_path / "base"
    if not base.exists():
        make_tiny_drafter(tiny_llama_dir, base)
    source = ReplaySource(redis_server.endpoint.client(), stream, cfg.group, cfg.consumer)
    return OnlineTrainer(cfg, source, tiny_llama_dir, base, tmp_path / "store", teacher=teacher)


def _add(redis_server, stream, continuations, checksum="", start=0):
    client = redis_server.endpoint.client()
    return [client.xadd(stream, {RECORD_FIELD: encode_record(make_record(start + i, p, o, "tiny-t",
                                                                         checksum=checksum))}).decode()
            for i, (p, o) in enumerate(continuations)]


def _drain(trainer):
    while trainer.poll(block_ms=100):
        pass


def test_a_new_trainer_resumes_from_the_checkpoint(tmp_path, tiny_llama_dir, redis_server, teacher,
                                                   continuations):
    first = _trainer(tmp_path, tiny_llama_dir, redis_server, teacher, "s-resume")
    _add(redis_server, "s-resume", continuations)
    _drain(first)
    first.update()
    first.update()
    assert first.stats.updates >= 2 and first.source.pending() == 0
    second = _trainer(tmp_path, tiny_llama_dir, redis_server, teacher, "s-resume")
    assert second.stats.resumed and second.serving_version == first.serving_version
    for name, value in first.candidate.state_dict().items():
        assert torch.equal(second.candidate.state_dict()[name], value), name
    assert not torch.equal(second.candidate.state_dict()["model.layers.0.mlp.up_proj.weight"],
                           second.serving.state_dict()["model.layers.0.mlp.up_proj.weight"])
    a, b = first.optimizer.state_dict(), second.optimizer.state_dict()
    assert a["state"].keys() == b["state"].keys()
    for index, entries in a["state"].items():
        for key, value in entries.items():
            assert torch.equal(b["state"][index][key], value), (index, key)
    assert second.scheduler.last_epoch == first.scheduler.last_epoch == first.stats.optimizer_steps
    assert second.optimizer.param_groups[0]["lr"] == first.optimizer.param_groups[0]["lr"]
    assert (second.stats.updates, second.stats.optimizer_steps, second.stats.records_seen) == \
        (first.stats.updates, first.stats.optimizer_steps, first.stats.records_seen)
    _add(redis_server, "s-resume", continuations, start=100)   # and it trains on from there
    _drain(second)
    second.update()
    assert second.stats.optimizer_steps == first.stats.optimizer_steps + CFG.steps_per_update * (
        second.stats.updates - first.stats.updates)


def test_a_damaged_checkpoint_is_ignored(tmp_path, tiny_llama_dir, redis_server, teacher, continuations):
    first = _trainer(tmp_path, tiny_llama_dir, redis_server, teacher, "s-damaged")
    _add(redis_server, "s-damaged", continuations[:6])
    _drain(first)
    first.update()
    base = tmp_path / "store" / checkpoint.STATE_DIR
    ckpt = base / checkpoint.read_latest(base)
    (ckpt / "optimizer.safetensors").write_bytes(b"truncated")
    second = _trainer(tmp_path, tiny_llama_dir, redis_server, teacher, "s-damaged")
    assert not second.stats.resumed and second.stats.updates == 0


def test_records_are_acknowledged_only_once_their_update_is_durable(tmp_path, tiny_llama_dir, redis_server,
                                                                    teacher, continuations, monkeypatch):
    trainer = _trainer(tmp_path, tiny_llama_dir, redis_server, teacher, "s-ack")
    ids = _add(redis_server, "s-ack", continuations[:8])
    _drain(trainer)
    trained = [i for i in ids if not is_held_out(i, CFG.holdout_every)]
    assert trainer.source.pending() == len(trained)    # held-out records: acknowledged at once

    def disk_full(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("specd.drafter_trainer.online.save_state", disk_full)
    trainer.update()                                   # gate rejects (margin 1.0), checkpoint fails
    assert trainer.stats.checkpoint_failures == 1 and trainer.source.pending() == len(trained)
    monkeypatch.undo()
    trainer.update()
    assert trainer.source.pending() == 0


def test_records_that_feed_no_update_are_acknowledged_at_once(tmp_path, tiny_llama_dir, redis_server,
                                                             teacher, continuations):
    trainer = _trainer(tmp_path, tiny_llama_dir, redis_server, teacher, "s-unused")
    _add(redis_server, "s-unused", continuations, checksum="another-target")        # skipped
    short = [(p, o[:1]) for p, o in continuations[:4]]                                 # nothing to learn
    _add(redis_server, "s-unused", short, checksum=target_checksum(tiny_llama_dir), start=100)
    _drain(trainer)
    assert trainer.stats.records_skipped == len(continuations) and trainer.stats.updates == 0
    assert trainer.source.pending() == 0               # no update ever came, yet nothing is left pending
