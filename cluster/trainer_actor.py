"""The online trainer as a Ray actor beside serving, or alone as `specd train`.

`specd serve` starts `TrainerActor` (unless trainer.enabled=false) against the same Redis as the
ReplayWriter; it publishes versions into the store DraftWorkers watch (trainer.out_dir). `specd train`
runs the same loop in the foreground against a Redis URL (replay.redis_url, password from
replay.password_env) until SIGINT/SIGTERM: on a separate machine it must share trainer.out_dir with
the DraftWorkers (a shared volume).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from pathlib import Path

from specd.cluster.redis_server import RedisEndpoint, endpoint_from_config

log = logging.getLogger(__name__)


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
    from specd.workers.models.loader import ensure_target_model

    torch.set_num_threads(max(1, int(cfg.trainer.num_cpus)))
    target_dir = ensure_target_model(cfg.target.model_path, cfg.cache_dir)
    base = resolve_drafter_dir(cfg.drafter.path, cfg.cache_dir, cfg.drafter.target_hidden)
    # No socket timeout: XREADGROUP blocks on purpose; a dead server still fails the call.
    client = endpoint.client(socket_timeout=None)
    source = ReplaySource(client, cfg.replay.stream, cfg.trainer.group, cfg.trainer.consumer)
    teacher = TargetTeacher(target_dir, top_k=cfg.trainer.teacher_topk, device=str(cfg.trainer.device),
                            max_seq_len=cfg.target.max_seq_len,
                            dtype=trainer_dtype(str(cfg.trainer.dtype), str(cfg.trainer.device)))
    return OnlineTrainer(cfg.trainer, source, target_dir, base, store_root(cfg), teacher=teacher,
                         seed=cfg.seed)


class TrainerActor:
    """Runs OnlineTrainer.poll() on a thread; Ray calls stats() and stop() while it runs."""

    def __init__(self, cfg, endpoint: RedisEndpoint):
        # A Ray worker process has no logging set up: without this the trainer's rounds, publishes and
        # rollbacks would not reach its log file (the worker-*.err of this actor).
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        lower_priority(cfg.trainer)
        self.trainer = build_trainer(cfg, endpoint)
        self._stop = threading.Event()
        self._error: str | None = None
        self._thread = threading.Thread(target=self._loop, name="specd-trainer", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        import redis

        while not self._stop.is_set():
            try:
                self.trainer.poll(block_ms=500)
            except redis.RedisError as exc:   # Redis away: serving goes on, the trainer waits for it
                if self._error is None:
                    log.warning("trainer: Redis unavailable (%s); retrying", type(exc).__name__)
                self._error = f"{type(exc).__name__}: {exc}"
                self._stop.wait(1.0)
                continue
            self._error = None

    def stats(self) -> dict:
        return {**self.trainer.stats.as_dict(), "error": self._error, "store": str(self.trainer.store.root)}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def start_trainer_actor(cfg, endpoint: RedisEndpoint):
    """A Ray actor of TrainerActor with the trainer's resources from config."""
    import ray

    actor = ray.remote(TrainerActor).options(
        num_cpus=cfg.trainer.num_cpus, num_gpus=cfg.trainer.num_gpus, name=None,
        max_restarts=cfg.trainer.max_restarts,   # a restarted trainer resumes from its consumer group
        resources=dict(cfg.trainer.resources),    # e.g. the Helm chart's trainer group: specd_trainer
    )
    return actor.remote(cfg, endpoint)


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
        trainer.poll(block_ms=500)
        s = trainer.stats
        if s.updates != updates:
            updates = s.updates
            print(f"update {s.updates}: records_seen={s.records_seen} loss={s.last_loss:.4f} "
                  f"serving={s.serving_version} publishes={s.publishes} rollbacks={s.rollbacks}", flush=True)
    return 0


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("train", help="run the online drafter trainer alone against a Redis URL",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. replay.redis_url=redis://host:6379/0")
    p.set_defaults(func=_cmd_train)
