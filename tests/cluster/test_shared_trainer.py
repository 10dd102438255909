"""trainer.lifetime=cluster: routers find the one trainer under its name instead of starting their own,
a router with other trainer settings replaces it, and a router that stops leaves it running (fake
trainers as real Ray actors)."""

from __future__ import annotations

import copy
import time

import pytest
from fake_workers import FakeTrainer

from specd.cluster.online import OnlineParts
from specd.cluster.trainer_actor import TRAINER_NAME, ensure_current_trainer, start_trainer_actor
from specd.configs.schema import SpecdConfig


def config(lifetime: str) -> SpecdConfig:
    cfg = SpecdConfig(name="test")
    cfg.trainer.lifetime = lifetime
    cfg.trainer.num_cpus = 0.0
    return cfg


def same(a, b) -> bool:
    return a._actor_id == b._actor_id


def test_routers_share_one_trainer_and_new_settings_replace_it(ray_session) -> None:
    ray = ray_session
    cfg = config("cluster")
    a = start_trainer_actor(cfg, "router-a", FakeTrainer)
    b = start_trainer_actor(cfg, "router-b", FakeTrainer)
    try:
        assert same(a, b) and same(ray.get_actor(TRAINER_NAME), a)
        assert ray.get(b.stats.remote())["started_by"] == "router-a"
        assert same(ensure_current_trainer(b, cfg, "router-b", FakeTrainer), a)   # same settings: kept
        # a router rolled out with another learning rate brings a trainer of its own settings
        changed = copy.deepcopy(cfg)
        changed.trainer.lr = cfg.trainer.lr * 2
        c = ensure_current_trainer(b, changed, "router-c", FakeTrainer)
        assert not same(c, a) and same(ray.get_actor(TRAINER_NAME), c)
        assert ray.get(c.stats.remote())["started_by"] == "router-c"
        # a router still holding the old handle finds the new trainer under the name when its settings
        # match; the router that stops leaves the shared trainer to the others
        d = ensure_current_trainer(a, changed, "router-d", FakeTrainer)
        assert same(d, c)
        OnlineParts(cfg=changed, trainer=c).stop()
        assert ray.get(c.stats.remote(), timeout=30)["started_by"] == "router-c"
    finally:
        ray.kill(ray.get_actor(TRAINER_NAME))


def test_a_routers_own_trainer_is_its_own_and_stops_with_it(ray_session) -> None:
    ray = ray_session
    cfg = config("router")
    a = start_trainer_actor(cfg, "router-a", FakeTrainer)
    b = start_trainer_actor(cfg, "router-b", FakeTrainer)
    assert not same(a, b)
    assert ensure_current_trainer(a, cfg, "router-a", FakeTrainer) is a
    OnlineParts(cfg=cfg, trainer=a).stop()
    deadline = time.monotonic() + 30           # ray.kill takes effect asynchronously
    with pytest.raises(ray.exceptions.RayActorError):
        while time.monotonic() < deadline:
            ray.get(a.stats.remote(), timeout=30)
            time.sleep(0.2)
    assert ray.get(b.stats.remote(), timeout=30)["started_by"] == "router-b"
    ray.kill(b)
