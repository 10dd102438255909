"""Bring-up of online adaptation inside `specd serve`: Redis, the replay writer, the trainer actor, and
DraftWorkers following the trainer's published versions. Each part is optional (replay.enabled,
trainer.enabled) and none of them can stop serving: a part that fails to start is logged and left out.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

log = logging.getLogger(__name__)
SWAP_POLL_S = 2.0


@dataclass
class OnlineParts:
    managed_redis: Any = None
    writer: Any = None
    recorder: Any = None
    trainer: Any = None            # Ray actor handle of specd.cluster.trainer_actor.TrainerActor
    trainer_wanted: bool = False   # config asks for the trainer: follow_trainer starts it
    drafters: list = field(default_factory=list)   # DrafterHandles of the DraftWorkers following the store
    store: dict | str | None = None    # where DraftWorkers follow versions (versions_spec)
    cfg: Any = None
    endpoint: Any = None               # the replay Redis (RedisEndpoint)

    def stop(self) -> None:
        """Best effort, in reverse order of start: nothing here may keep the server from exiting. A
        shared trainer (trainer.lifetime=cluster) stays: other routers use it."""
        from specd.cluster.trainer_actor import shared_trainer

        if self.trainer is not None and not shared_trainer(self.cfg):
            import ray

            with contextlib.suppress(Exception):
                ray.get(self.trainer.stop.remote(), timeout=15)
            with contextlib.suppress(Exception):
                ray.kill(self.trainer)
        if self.writer is not None:
            self.writer.stop()
        if self.managed_redis is not None:
            self.managed_redis.stop()


def open_online_redis(cfg):
    """(endpoint, managed server or None) when replay is on and Redis answers, else None; opened before
    the workers start, so that the first-start drafter reaches them through it."""
    from specd.cluster.redis_server import open_redis

    if not cfg.replay.enabled:
        return None
    try:
        return open_redis(cfg.replay)
    except (OSError, RuntimeError) as exc:
        log.warning("online adaptation off: no Redis (%s); install redis-server or set replay.redis_url "
                    "(replay.enabled=false says you mean it)", exc)
        return None


def start_online(cfg, model_dir: str, drafters: list, registry: CollectorRegistry | None,
                 opened=None) -> OnlineParts:
    """Start what config asks for; `drafters`: the replicas' DraftWorkers (Ray actor handles, wrapped here
    in DrafterHandles) or objects with DrafterHandle's async watch_versions, pin_version and swap_stats
    (a vLLM replica's, cluster/vllm_serve.py); opened: open_online_redis's result when the caller opened
    Redis already."""
    from specd.cluster.redact import redact_text
    from specd.cluster.redis_server import versions_spec
    from specd.cluster.replay import ReplayRecorder
    from specd.cluster.replay_writer import ReplayWriter
    from specd.workers.drafters.versions import target_checksum

    parts = OnlineParts(cfg=cfg)
    if not cfg.replay.enabled:
        return parts
    opened = opened or open_online_redis(cfg)
    if opened is None:
        return parts
    endpoint, parts.managed_redis = opened
    parts.endpoint = endpoint
    r = cfg.replay
    parts.writer = ReplayWriter(endpoint, r.stream, maxlen=r.maxlen, queue_size=r.queue_size,
                                socket_timeout_s=r.socket_timeout_s, retry_s=r.retry_s, registry=registry)
    parts.writer.start()
    parts.recorder = ReplayRecorder(parts.writer, target_checksum(model_dir))
    log.info("replay records -> %s stream %s (MAXLEN ~%d)", redact_text(endpoint.url), r.stream, r.maxlen)
    if not cfg.trainer.enabled:
        return parts
    from specd.workers.drafters.registry import drafter_class

    if not drafter_class(cfg.drafter.kind).has_weights(cfg.drafter):
        log.warning("trainer off: drafter.kind=%s has no model drafter to train (use model, hybrid, or "
                    "suffix with drafter.suffix_with_model=true)", cfg.drafter.kind)
        return parts
    # The actor starts in follow_trainer, beside serving: its start-up (the target's teacher loaded, the
    # trainer built) would otherwise share the cores with the workers' warm-up, before SERVING.
    parts.trainer_wanted = True
    parts.store = versions_spec(cfg, endpoint)
    from ray.actor import ActorHandle

    from specd.workers.engine.handles import DrafterHandle

    parts.drafters = [DrafterHandle(d, f"drafter-{i}") if isinstance(d, ActorHandle) else d
                      for i, d in enumerate(drafters)]
    return parts


async def follow_trainer(parts: OnlineParts, model_dir: str, version_pin: str | None = None) -> None:
    """Start the trainer, and once it is up (it publishes the serving drafter as the store's first version
    when the store is empty), point the DraftWorkers at its store. Runs beside serving, never before it.
    version_pin (drafter.version_pin): serve that version of the store instead of its CURRENT."""
    if not parts.trainer_wanted:
        return
    import asyncio

    from specd.cluster.trainer_actor import ensure_current_trainer, start_trainer_actor

    try:
        if parts.trainer is None:
            parts.trainer = await asyncio.to_thread(start_trainer_actor, parts.cfg, parts.endpoint)
        parts.trainer = await asyncio.to_thread(ensure_current_trainer, parts.trainer, parts.cfg,
                                                parts.endpoint)
        await parts.trainer.stats.remote()
        for d in parts.drafters:
            await d.watch_versions(parts.store, str(model_dir), SWAP_POLL_S)
    except Exception:  # the trainer is optional: serving goes on with the drafter it has
        log.exception("online trainer failed to start; serving continues without it")
        parts.drafters = []
        return
    log.info("online trainer up; drafters follow %s", _where(parts.store))
    if version_pin:
        try:
            for d in parts.drafters:
                await d.pin_version(version_pin)
        except Exception as exc:  # an unpublished version is refused: the drafters follow CURRENT
            log.error("drafter.version_pin=%s refused (%s); following CURRENT", version_pin, exc)


def _where(store) -> str:
    from specd.cluster.redact import redact_text

    if isinstance(store, dict):
        return f"redis {redact_text(store['redis']['url'])} {store['prefix']}"
    return str(store)


async def follow_again(parts: OnlineParts, replica: int, model_dir: str,
                       version_pin: str | None = None) -> None:
    """A restarted DraftWorker starts from its configured drafter: point it at the store again."""
    if parts.trainer is None or replica >= len(parts.drafters):
        return
    d = parts.drafters[replica]
    await d.watch_versions(parts.store, str(model_dir), SWAP_POLL_S)
    if version_pin:
        try:
            await d.pin_version(version_pin)
        except Exception as exc:  # refused (unpublished, or pruned since it was unpinned)
            log.error("drafter.version_pin=%s refused (%s); replica %d follows CURRENT", version_pin, exc,
                      replica)


class OnlineMetrics:
    """Gauges of the trainer and the swaps, polled with the worker stats."""

    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.loss = Gauge("specd_trainer_loss", "Latest distillation loss of the online trainer", registry=r)
        self.records = Gauge("specd_trainer_records_seen", "Replay records the trainer has read", registry=r)
        self.gate = Gauge("specd_trainer_gate_expected_acceptance",
                          "Gate: expected acceptance on held-out records", ["model"], registry=r)
        self.gate_match = Gauge("specd_trainer_gate_greedy_match", "Gate: greedy match on held-out records",
                                ["model"], registry=r)
        self.publishes = Gauge("specd_trainer_publishes", "Versions published by the trainer", registry=r)
        self.rollbacks = Gauge("specd_trainer_rollbacks", "Rollbacks to a parent version", registry=r)
        self.up = Gauge("specd_trainer_up", "1 while the trainer answers and its last poll worked, else 0",
                        registry=r)
        self.failures = Gauge("specd_trainer_failures",
                              "Failed trainer polls (not Redis) since its process started", registry=r)
        self.dead = Gauge("specd_trainer_records_dead", "Replay records moved to the dead-letter stream",
                          registry=r)
        self.swaps = Gauge("specd_drafter_swaps", "Hot-swaps applied by a DraftWorker", ["replica"],
                           registry=r)
        self.rejected = Gauge("specd_drafter_versions_rejected", "Published versions a DraftWorker rejected",
                              ["replica"], registry=r)

    def set_trainer(self, s: dict) -> None:
        if s.get("last_loss") == s.get("last_loss"):     # not NaN
            self.loss.set(s["last_loss"])
        self.records.set(s.get("records_seen", 0))
        self.publishes.set(s.get("publishes", 0))
        self.rollbacks.set(s.get("rollbacks", 0))
        self.up.set(1 if s.get("alive", True) and not s.get("error") else 0)
        self.failures.set(s.get("failures", 0))
        self.dead.set(s.get("records_dead", 0))
        for model in ("candidate", "serving"):
            g = s.get(f"gate_{model}") or {}
            if g:
                self.gate.labels(model).set(g["expected_acceptance"])
                self.gate_match.labels(model).set(g["greedy_match"])

    def set_swaps(self, replica: int, s: dict) -> None:
        self.swaps.labels(str(replica)).set(s.get("swaps", 0))
        self.rejected.labels(str(replica)).set(len(s.get("rejected", {})))


async def _restart_shared_trainer(parts: OnlineParts, exc: Exception) -> None:
    """A shared trainer out of Ray's restarts (or killed by hand) leaves its name free: the first router
    to see it dead starts a new one under the name, the others find that one."""
    import asyncio

    from ray.exceptions import ActorDiedError

    from specd.cluster.trainer_actor import shared_trainer, start_trainer_actor

    if isinstance(exc, ActorDiedError) and shared_trainer(parts.cfg):
        parts.trainer = await asyncio.to_thread(start_trainer_actor, parts.cfg, parts.endpoint)


async def poll_online(parts: OnlineParts, metrics: OnlineMetrics) -> None:
    """One poll of Redis, the trainer and the drafters (the serve loop calls it with the worker stats).
    A managed redis-server that died is started again here; a dead trainer actor is restarted by Ray
    (trainer.max_restarts) and resumes from its consumer group. Neither failure reaches serving."""
    import asyncio

    if parts.managed_redis is not None:
        await asyncio.to_thread(parts.managed_redis.ensure_running)
    if parts.trainer is not None:
        try:
            metrics.set_trainer(await parts.trainer.stats.remote())
        except Exception as exc:  # restarting (or out of restarts): serving goes on without its figures
            metrics.up.set(0)
            log.warning("trainer stats unavailable: %s", type(exc).__name__)
            await _restart_shared_trainer(parts, exc)
    for i, d in enumerate(parts.drafters):
        try:
            metrics.set_swaps(i, await d.swap_stats())
        except Exception as exc:  # a restarting DraftWorker (its requests go on target-only)
            log.warning("drafter %d swap stats unavailable: %s", i, type(exc).__name__)
