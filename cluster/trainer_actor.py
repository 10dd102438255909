"""The online trainer as a Ray actor beside serving, or alone as `specd train`.

`specd serve` starts `TrainerActor` (unless trainer.enabled=false) against the same Redis as the
ReplayWriter; it publishes versions into its own store (trainer.out_dir: its volume) and through Redis,
where the DraftWorkers on every node follow them (drafter_trainer/version_channel.py). `specd train`
runs the same loop in the foreground against a Redis URL (replay.redis_url, password from
replay.password_env) until SIGINT/SIGTERM; it needs no volume shared with the DraftWorkers.

Failures of the loop. Redis away: the trainer waits for it (serving goes on without it) and shows the
error in stats(). Anything else (a bug, a full disk, an unreadable version file) is logged with its
traceback, counted in stats() (`failures`, `error`; specd_trainer_failures and specd_trainer_up on
the metrics port) and retried with back-off; FAILURES_BEFORE_RESTART of them in a row end the actor's
process, so that Ray restarts it (trainer.max_restarts): a fresh actor re-reads its checkpoint and the
version store, which clears a stuck state, and Ray's restart budget bounds a failure that persists,
after which the actor stays dead and stats() raises (specd_trainer_up 0). The loop never ends unseen
while the actor lives on.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from specd.cluster.redis_server import RedisEndpoint, endpoint_from_config

log = logging.getLogger(__name__)
TRAINER_NAME = "specd-trainer"   # the shared trainer's actor name (trainer.lifetime=cluster)
FAILURES_BEFORE_RESTART = 3     # non-Redis failures in a row that end the actor (Ray restarts it)
RESTART_EXIT_CODE = 70          # the process's exit status then (EX_SOFTWARE)


@dataclass
class LoopHealth:
    """What the loop has been through, for stats() and the metrics."""

    error: str | None = None        # the last failure; None once a poll succeeds
    redis_errors: int = 0           # polls that failed on Redis
    failures: int = 0               # polls that failed otherwise, since this process started
    consecutive: int = 0            # non-Redis failures in a row


def exit_for_restart(reason: str) -> None:
    """End this process so that Ray restarts the actor (an exit Ray sees as intended would not)."""
    log.critical("trainer: %d failures in a row, exiting for a restart: %s", FAILURES_BEFORE_RESTART, reason)
    logging.shutdown()
    os._exit(RESTART_EXIT_CODE)


def poll_once(trainer) -> None:
    """One round: versions Redis missed while away (or lost, coming back empty) go out again, then a
    poll of the stream. A store without a Redis mirror has nothing to send."""
    sync = getattr(trainer.store, "sync_pending", None)
    if sync is not None:
        sync()
    trainer.poll(block_ms=500)


def run_loop(trainer, stop: threading.Event, health: LoopHealth,
             die: Callable[[str], None] = exit_for_restart,
             retry_s: float = 1.0) -> None:
    """trainer.poll() until `stop` is set; failures handled as the module's docstring says."""
    import redis

    while not stop.is_set():
        try:
            poll_once(trainer)
        except redis.RedisError as exc:   # Redis away: serving goes on, the trainer waits for it
            if health.error is None:
                log.warning("trainer: Redis unavailable (%s); retrying", type(exc).__name__)
            health.redis_errors += 1
            health.error = f"{type(exc).__name__}: {exc}"
            stop.wait(retry_s)
            continue
        except Exception as exc:  # every failure is counted and shown, then retried or restarted
            health.failures += 1
            health.consecutive += 1
            health.error = f"{type(exc).__name__}: {exc}"
            log.exception("trainer: poll failed (%d in a row)", health.consecutive)
            if health.consecutive >= FAILURES_BEFORE_RESTART:
                die(health.error)
                return
            stop.wait(retry_s * 2 ** (health.consecutive - 1))
            continue
        health.error = None
        health.consecutive = 0


def store_root(cfg) -> Path:
    """Where online versions are published: trainer.out_dir, else <cache>/drafters/online."""
    from specd.workers.models.loader import default_cache_dir

    if cfg.trainer.out_dir:
        return Path(cfg.trainer.out_dir)
    return Path(cfg.cache_dir or default_cache_dir()) / "drafters" / "online"


def lower_priority(tcfg) -> None:
    """Where the trainer shares CPUs with serving (this machine), serving comes first. Called before torch
    starts its thread pool, whose threads inherit it (Linux applies both per thread)."""
    if tcfg.nice:
        os.nice(tcfg.nice)
    if tcfg.sched_idle and tcfg.device == "cpu" and hasattr(os, "SCHED_IDLE"):
        # With nice 10 alone the trainer still took about half a core beside a busy server on this
        # 2-core machine; under SCHED_IDLE it runs only on what serving leaves idle.
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def build_trainer(cfg, endpoint: RedisEndpoint):
    """An OnlineTrainer for `cfg` (specd.configs.schema.SpecdConfig) reading the stream at `endpoint`."""
    import torch

    from specd.drafter_trainer.online import OnlineTrainer
    from specd.drafter_trainer.online_data import TargetTeacher, trainer_dtype
    from specd.drafter_trainer.replay_source import ReplaySource
    from specd.workers.drafters.model import resolve_drafter_dir
    from specd.workers.models.loader import ensure_target_model, scoped_cache_dir

    torch.set_num_threads(max(1, int(cfg.trainer.num_cpus)))
    target_dir = ensure_target_model(cfg.target.model_path, cfg.cache_dir, cfg.target.model)
    cfg.cache_dir = scoped_cache_dir(cfg.cache_dir, cfg.target.model_path, target_dir,  # as the router's
                                     cfg.target.model)
    store = versions_store(cfg, endpoint, target_dir)
    # The serving version from Redis when there is one: the drafter the router started from (version 0)
    # may sit on the router's disk only. A base drafter on this node's disk (the image's) is still what
    # the trainer falls back to when the serving version turns out unreadable.
    try:
        base = resolve_drafter_dir(cfg.drafter.path, cfg.cache_dir, cfg.drafter.target_hidden)
    except FileNotFoundError:
        if store.current() is None:
            raise
        base = None
    # No socket timeout: XREADGROUP blocks on purpose; a dead server still fails the call.
    client = endpoint.client(socket_timeout=None)
    source = ReplaySource(client, cfg.replay.stream, cfg.trainer.group, cfg.trainer.consumer)
    teacher = TargetTeacher(target_dir, top_k=cfg.trainer.teacher_topk, device=str(cfg.trainer.device),
                            max_seq_len=cfg.target.max_seq_len,
                            dtype=trainer_dtype(str(cfg.trainer.dtype), str(cfg.trainer.device)))
    return OnlineTrainer(cfg.trainer, source, target_dir, base, store_root(cfg), teacher=teacher,
                         seed=cfg.seed, store=store)


def versions_store(cfg, endpoint: RedisEndpoint, target_dir):
    """The trainer's own store (trainer.out_dir or its cache: its volume) mirrored to Redis, after
    adopting the version Redis serves (drafter_trainer/version_channel.py)."""
    from specd.cluster.redis_server import versions_spec
    from specd.drafter_trainer.version_channel import MirroredStore, RedisMirror
    from specd.workers.drafters.versions import target_checksum

    spec = versions_spec(cfg, endpoint)
    spec["redis"]["password"] = endpoint.password
    store = MirroredStore(store_root(cfg), RedisMirror(spec["redis"], spec["prefix"]),
                          keep=cfg.trainer.keep_versions)
    store.adopt(target_checksum(target_dir))
    return store


class TrainerActor:
    """Runs OnlineTrainer.poll() on a thread; Ray calls stats() and stop() while it runs."""

    def __init__(self, cfg, endpoint: RedisEndpoint):
        # A Ray worker process has no logging set up: without this the trainer's rounds, publishes and
        # rollbacks would not reach its log file (the worker-*.err of this actor).
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        lower_priority(cfg.trainer)
        self._settings = trainer_settings(cfg)
        self.trainer = build_trainer(cfg, endpoint)
        self._stop = threading.Event()
        self.health = LoopHealth()
        self._thread = threading.Thread(target=run_loop, args=(self.trainer, self._stop, self.health),
                                        name="specd-trainer", daemon=True)
        self._thread.start()
        self._restarted = _was_restarted()     # a restart runs __init__ again: read once per life

    def stats(self) -> dict:
        """The trainer's figures, its loop's health, and whether Ray restarted this actor."""
        return {**self.trainer.stats.as_dict(), **asdict(self.health), "restarted": self._restarted,
                "pid": os.getpid(), "alive": self._thread.is_alive(), "store": str(self.trainer.store.root)}

    def settings(self) -> str:
        """trainer_settings() of the config this actor was started with."""
        return self._settings

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def _was_restarted() -> bool:
    """Whether Ray has restarted this actor: the GCS record RuntimeContext.was_current_actor_reconstructed
    reads, without that property's deprecated actor_id (a RayDeprecationWarning on every call)."""
    import ray
    from ray._private.state import actors

    info = actors(actor_id=ray.get_runtime_context().get_actor_id())
    return bool(info) and info.get("NumRestarts", 0) != 0


def trainer_settings(cfg) -> str:
    """A digest of what the trainer reads from config (its own section, replay, the models, the seed):
    two routers with equal digests may share one trainer."""
    from specd.configs import flatten

    used = {k: v for k, v in flatten(cfg).items()
            if k.split(".")[0] in ("trainer", "replay", "drafter", "target", "seed")}
    return hashlib.sha256(json.dumps(used, sort_keys=True).encode()).hexdigest()[:16]


def shared_trainer(cfg) -> bool:
    return cfg is not None and str(cfg.trainer.lifetime) == "cluster"


def start_trainer_actor(cfg, endpoint: RedisEndpoint, cls: type | None = None):
    """A Ray actor of TrainerActor (or `cls`, in tests) with the trainer's resources from config.
    trainer.lifetime=cluster: the one detached actor named TRAINER_NAME in this Ray namespace, started
    here unless a router started it already (Ray's get_if_exists settles a race between two routers)."""
    import ray

    options = {
        "num_cpus": cfg.trainer.num_cpus, "num_gpus": cfg.trainer.num_gpus,
        "max_restarts": cfg.trainer.max_restarts,   # a restarted trainer resumes from its consumer group
        "resources": dict(cfg.trainer.resources),    # e.g. the Helm chart's trainer group: specd_trainer
    }
    if shared_trainer(cfg):
        options.update(name=TRAINER_NAME, lifetime="detached", get_if_exists=True)
    return ray.remote(cls or TrainerActor).options(**options).remote(cfg, endpoint)


def ensure_current_trainer(actor, cfg, endpoint: RedisEndpoint, cls: type | None = None):
    """The shared trainer, replaced when it runs other settings than this router's (a config change
    rolled out: the router that starts with it brings the trainer along; an older router never sets it
    back, as it checks only here, at its start). Blocks until the trainer answers."""
    import ray

    if not shared_trainer(cfg):
        return actor
    from ray.exceptions import RayActorError

    wanted = trainer_settings(cfg)
    for _ in range(3):
        try:
            running = ray.get(actor.settings.remote())
        except RayActorError:    # another router replaced it first: take the one under the name now
            actor = start_trainer_actor(cfg, endpoint, cls)
            continue
        if running == wanted:
            return actor
        log.warning("the shared trainer runs settings %s, this router %s: replacing it", running, wanted)
        ray.kill(actor, no_restart=True)
        _wait_name_free(TRAINER_NAME)
        actor = start_trainer_actor(cfg, endpoint, cls)
    return actor


def _wait_name_free(name: str, timeout_s: float = 60.0) -> None:
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get_actor(name)
        except ValueError:       # the name is free again
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the old actor {name} did not go away")
        time.sleep(0.5)


# ---- `specd train` -----------------------------------------------------------------------------
def _cmd_train(args: argparse.Namespace) -> int:
    from specd.configs import load_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_config(args.overrides)
    if not cfg.replay.redis_url:
        print("specd train needs replay.redis_url=redis://HOST:PORT/0 (password in $"
              f"{cfg.replay.password_env})", flush=True)
        return 2
    lower_priority(cfg.trainer)
    trainer = build_trainer(cfg, endpoint_from_config(cfg.replay))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"specd trainer on {cfg.replay.stream} (group {cfg.trainer.group}), serving version "
          f"{trainer.serving_version}, store {trainer.store.root}", flush=True)
    updates = 0
    while not stop.is_set():
        poll_once(trainer)
        s = trainer.stats
        if s.updates != updates:
            updates = s.updates
            print(f"update {s.updates}: records_seen={s.records_seen} optimizer_steps={s.optimizer_steps} "
                  f"loss={s.last_loss:.4f} serving={s.serving_version} publishes={s.publishes} "
                  f"rollbacks={s.rollbacks} resumed={s.resumed}", flush=True)
    return 0


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("train", help="run the online drafter trainer alone against a Redis URL",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. replay.redis_url=redis://host:6379/0")
    p.set_defaults(func=_cmd_train)
