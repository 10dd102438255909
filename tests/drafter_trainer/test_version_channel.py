"""Drafter versions through Redis between processes that share no disk: the router's first-start drafter
as version 0, a DraftWorker with its own cache starting on it and following the trainer's versions, and
what happens when Redis goes away, the trainer loses its volume, or a DraftWorker restarts elsewhere.
Real redis-server, the tiny Llama target and a tiny drafter; each "node" has its own directories."""

from __future__ import annotations

import shutil
import time

import pytest
import torch

from specd.cluster.redis_server import ManagedRedis
from specd.configs import load_config
from specd.drafter_trainer.drafter_format import load_drafter
from specd.drafter_trainer.version_channel import MirroredStore, RedisMirror, publish_first_version
from specd.workers.drafters.versions import target_checksum
from specd.workers.engine.draft_worker import DraftWorker
from tests.drafter_trainer.online_helpers import make_tiny_drafter

PREFIX = "specd:replay:drafters"
pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")


@pytest.fixture
def redis_server():
    with ManagedRedis() as server:
        yield server


def _spec(server) -> dict:
    return {"url": server.endpoint.url, "password": server.password}


def _worker(target_dir, cache_dir, server, path="/router/only/drafter") -> DraftWorker:
    """A DraftWorker on another node: drafter.path names the router's disk, which it cannot read."""
    cfg = load_config([f"target.model_path={target_dir}", f"drafter.path={path}", "drafter.kind=model",
                       "drafter.max_slots=4", "drafter.dtype=float32", "drafter.pack=none"])
    return DraftWorker(cfg.drafter, cfg.spec, str(target_dir), cache_dir=str(cache_dir),
                       versions={"redis": _spec(server), "prefix": PREFIX})


def _trained(drafter_dir, scale=0.1):
    state, config, _ = load_drafter(drafter_dir)
    return {k: (v + torch.randn_like(v) * scale if v.is_floating_point() else v)
            for k, v in state.items()}, config


def test_versions_reach_a_draft_worker_with_no_shared_disk(tmp_path, tiny_llama_dir, redis_server):
    router, trainer_vol, draft_node = tmp_path / "router", tmp_path / "trainer", tmp_path / "draft"
    drafter_dir = make_tiny_drafter(tiny_llama_dir, router / "drafter")
    v0 = publish_first_version(_spec(redis_server), PREFIX, drafter_dir, tiny_llama_dir, router / "store")
    assert v0 == load_drafter(drafter_dir)[2]["version"]
    # a second router start finds the version serving and publishes nothing
    assert publish_first_version(_spec(redis_server), PREFIX, drafter_dir, tiny_llama_dir,
                                 router / "store2") == v0

    worker = _worker(tiny_llama_dir, draft_node, redis_server)
    assert worker.version() == v0
    store = MirroredStore(trainer_vol, RedisMirror(_spec(redis_server), PREFIX))
    assert store.adopt(target_checksum(tiny_llama_dir)) == v0        # the trainer starts from it too
    worker.watch_versions({"redis": _spec(redis_server), "prefix": PREFIX}, str(tiny_llama_dir), poll_s=0.05)

    state, config = _trained(drafter_dir)
    checksum = target_checksum(tiny_llama_dir)
    t0 = time.perf_counter()
    v1 = store.publish(state, config, version=None, parent=v0, target_checksum=checksum)
    while worker.swap_stats()["version"] != v1:
        worker.propose([])                 # a swap is applied at the start of a step
        assert time.perf_counter() - t0 < 30, worker.swap_stats()
        time.sleep(0.01)
    print(f"\npublish -> swapped on the draft worker: {1000 * (time.perf_counter() - t0):.0f} ms "
          "(poll 50 ms)")
    head = worker.drafter.weights_drafter.runner.model.lm_head.weight
    assert torch.allclose(head, state["lm_head.weight"].to(head.dtype))

    store.roll_back(v1)                    # a rollback reaches the draft node the same way
    deadline = time.monotonic() + 30
    while worker.swap_stats()["version"] != v0:
        worker.propose([])
        assert time.monotonic() < deadline
        time.sleep(0.01)
    worker._swapper.stop()


def test_redis_loss_trainer_restart_and_draft_worker_restart(tmp_path, tiny_llama_dir, redis_server):
    router = tmp_path / "router"
    drafter_dir = make_tiny_drafter(tiny_llama_dir, router / "drafter")
    v0 = publish_first_version(_spec(redis_server), PREFIX, drafter_dir, tiny_llama_dir, router / "store")
    store = MirroredStore(tmp_path / "trainer", RedisMirror(_spec(redis_server), PREFIX))
    store.adopt(target_checksum(tiny_llama_dir))
    worker = _worker(tiny_llama_dir, tmp_path / "draft-a", redis_server)
    worker.watch_versions({"redis": _spec(redis_server), "prefix": PREFIX}, str(tiny_llama_dir), poll_s=3600)
    worker._swapper.stop()                 # checks by hand below

    redis_server.stop(remove_files=False)
    assert worker._swapper.check() is None and not worker._swapper.rejected   # Redis away: nothing rejected
    state, config = _trained(drafter_dir)
    checksum = target_checksum(tiny_llama_dir)
    v1 = store.publish(state, config, version=None, parent=v0, target_checksum=checksum)
    assert store.pending and store.current() == v1      # on the trainer's volume, waiting for Redis

    redis_server.start()                   # same port and password, no data: every key is gone
    store.sync_pending()
    assert not store.pending
    assert worker._swapper.check() == v1   # the CURRENT the trainer wrote back, with its parent
    worker.propose([])
    assert worker.version() == v1

    # Redis restarts empty again with nothing pending: the trainer's loop gives it the serving version back
    redis_server.stop(remove_files=False)
    redis_server.start()
    assert store.mirror.current() is None
    store.sync_pending()
    assert store.mirror.current() == v1

    # the trainer pod restarts without its volume: it adopts what serves
    fresh = MirroredStore(tmp_path / "trainer-new-pod", RedisMirror(_spec(redis_server), PREFIX))
    assert fresh.adopt(target_checksum(tiny_llama_dir)) == v1
    assert fresh.roll_back(v1) == v0       # the parent came along, so a rollback has somewhere to go
    # a DraftWorker restarted on another node starts on the serving version
    again = _worker(tiny_llama_dir, tmp_path / "draft-b", redis_server)
    assert again.version() == v0


def test_a_version_an_older_router_published_gets_the_drafters_held_out_figure(tmp_path, tiny_llama_dir,
                                                                                redis_server):
    """An older specd published the first-start drafter without `held_out_acceptance`; the next start finds
    that version in its store and sends the same files to Redis. The record now carries the drafter's
    figure, so DraftWorkers that swap to it plan with it rather than the flat prior."""
    import json

    from specd.workers.drafters.versions import held_out_acceptance, read_meta, version_dir

    drafter_dir = make_tiny_drafter(tiny_llama_dir, tmp_path / "drafter")
    store = tmp_path / "router-store"
    v0 = publish_first_version(_spec(redis_server), PREFIX, drafter_dir, tiny_llama_dir, store)
    assert held_out_acceptance(read_meta(version_dir(store, v0))) is None     # the drafter records none
    meta_path = drafter_dir / "specd_drafter.json"
    meta = json.loads(meta_path.read_text())
    meta["train"] = {"eval_after": {"greedy_match": 0.12}}
    meta_path.write_text(json.dumps(meta))
    mirror = RedisMirror(_spec(redis_server), PREFIX)
    mirror.client.flushall()                     # a fresh Redis: the router publishes again
    assert publish_first_version(_spec(redis_server), PREFIX, drafter_dir, tiny_llama_dir, store) == v0
    assert read_meta(version_dir(store, v0))["held_out_acceptance"] == pytest.approx(0.12)
    assert held_out_acceptance(mirror.meta(v0)) == pytest.approx(0.12)
