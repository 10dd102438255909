"""Drafter versions through Redis: what the router and the trainer write so that every DraftWorker, on
any node, reaches the serving version with nothing shared on disk (docs/decisions/drafter-versions-redis.md).

- The router publishes its first-start drafter as version 0 (`publish_first_version`) before any
  DraftWorker starts, unless Redis already names a serving version for the same target: a restarted
  router serves on with what the trainer published.
- The trainer keeps its own VersionStore (its volume: a PVC in the chart) and mirrors it: every version
  it publishes and every rollback reaches Redis (`MirroredStore`). At start it adopts the version Redis
  names (what serves now), or, when Redis has lost its keys, writes its own CURRENT back into Redis.
- A Redis that is down when the trainer publishes costs nothing but delay: the version is on the
  trainer's volume, and `sync_pending` pushes it once Redis answers.

The key layout and the reader are workers/drafters/redis_versions.py; the on-disk store is publish.py.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import redis

from specd.drafter_trainer.drafter_format import load_drafter
from specd.drafter_trainer.publish import VersionStore
from specd.workers.drafters.redis_versions import (
    fetch_version,
    prune,
    push_version,
    redis_client,
    redis_current,
    set_current,
)
from specd.workers.drafters.versions import (
    META_FILE,
    held_out_acceptance,
    read_meta,
    target_checksum,
    version_dir,
    write_current,
)

log = logging.getLogger(__name__)


class RedisMirror:
    """The Redis side of a version store: `spec` as redis_versions.redis_client takes it."""

    def __init__(self, spec: dict, prefix: str):
        self.spec, self.prefix = spec, prefix
        self.client = redis_client(spec, socket_timeout=30.0)

    def current(self) -> str | None:
        return redis_current(self.client, self.prefix)

    def has(self, version: str) -> bool:
        return bool(self.client.exists(f"{self.prefix}:v:{version}"))

    def meta(self, version: str) -> dict:
        raw = self.client.hget(f"{self.prefix}:v:{version}", "meta")
        return json.loads(raw) if raw else {}


class MirroredStore(VersionStore):
    """A VersionStore whose published versions, CURRENT and rollbacks are copied to Redis."""

    def __init__(self, root: str | Path, mirror: RedisMirror, keep: int = 5):
        super().__init__(root, keep=keep)
        self.mirror = mirror
        self.pending = False        # local CURRENT not yet in Redis (Redis was away)

    def publish(self, state_dict, config, *, version, parent, target_checksum, make_current=True, **meta):
        name = super().publish(state_dict, config, version=version, parent=parent,
                               target_checksum=target_checksum, make_current=make_current, **meta)
        if make_current:
            self._push_current()
        return name

    def roll_back(self, version: str) -> str:
        parent = super().roll_back(version)
        self._push_current()
        return parent

    def _push_current(self) -> None:
        try:
            self.push_current()
        except redis.RedisError as exc:
            self.pending = True
            log.warning("drafter versions: Redis unavailable (%s); %s waits on the trainer's volume",
                        type(exc).__name__, self.current())

    def push_current(self) -> None:
        """Make Redis's CURRENT this store's CURRENT (pushing the version, and its parent for rollbacks,
        where Redis lacks them), then prune Redis to the store's `keep`."""
        current = self.current()
        if current is None:
            return
        parent = self.meta(current).get("parent_version")
        for v in (parent, current):
            if v and version_dir(self.root, v).is_dir() and not self.mirror.has(v):
                push_version(self.mirror.client, self.mirror.prefix, version_dir(self.root, v),
                             make_current=False)
        set_current(self.mirror.client, self.mirror.prefix, current)
        prune(self.mirror.client, self.mirror.prefix, self.keep, {current, parent})
        self.pending = False

    def sync_pending(self) -> None:
        """The trainer's loop calls this: after Redis was away, what was published meanwhile goes out; a
        Redis that came back empty (no persistence) gets the serving version back, so that a DraftWorker
        starting later still finds one."""
        if self.pending or (self.current() is not None and self.mirror.current() is None):
            self.push_current()
            log.info("drafter versions: CURRENT %s pushed to Redis again", self.current())

    def adopt(self, target_sum: str) -> str | None:
        """At start: take Redis's serving version (downloaded into this store) when it is for this
        target, else give Redis this store's CURRENT. Returns the store's CURRENT afterwards."""
        serving = self.mirror.current()
        meta = self.mirror.meta(serving) if serving else {}
        if serving and meta.get("target_checksum") == target_sum:
            parent = meta.get("parent_version")
            if parent and self.mirror.has(parent):      # so that a rollback has somewhere to go
                fetch_version(self.mirror.client, self.mirror.prefix, parent, self.root)
            fetch_version(self.mirror.client, self.mirror.prefix, serving, self.root)
            if self.current() != serving:
                write_current(self.root, serving)
            return serving
        if self.current() is not None:
            self.push_current()
        return self.current()


def publish_first_version(spec: dict, prefix: str, drafter_dir: str | Path, target_dir: str | Path,
                          store_root: str | Path) -> str:
    """The router's first-start drafter as the serving version in Redis, unless Redis already serves a
    version for this target. `store_root`: a store directory on the router's own disk, where the version
    is written first (the same files then go to Redis). Returns the serving version."""
    mirror = RedisMirror(spec, prefix)
    target_sum = target_checksum(target_dir)
    serving = mirror.current()
    if serving and mirror.meta(serving).get("target_checksum") == target_sum:
        log.info("drafter versions: Redis serves %s; the first-start drafter is not published", serving)
        return serving
    store = VersionStore(store_root)
    state, config, meta = load_drafter(drafter_dir)
    version = meta.get("version")
    figure = held_out_acceptance(meta)
    # published by an earlier start of this router: the same files go to Redis again
    if not (version and version_dir(store.root, version).is_dir()):
        version = store.publish(state, config, version=version, parent=None, target_checksum=target_sum,
                                origin=str(drafter_dir), held_out_acceptance=figure)
    else:
        carry_held_out(version_dir(store.root, version), figure)
    push_version(mirror.client, prefix, version_dir(store.root, version), make_current=True)
    log.info("drafter versions: first-start drafter %s published to Redis (%s)", version, prefix)
    return version


def carry_held_out(vdir: Path, figure: float | None) -> None:
    """A version an older specd published carries no `held_out_acceptance`: copy the drafter's figure into
    its record (the weights and their sha256 are untouched), or every DraftWorker that swaps to it plans
    with the flat prior, six times what the quick drafter gets accepted
    (docs/decisions/version-acceptance-prior.md)."""
    meta = read_meta(vdir)
    if figure is None or held_out_acceptance(meta) is not None:
        return
    tmp = vdir / (META_FILE + ".tmp")
    tmp.write_text(json.dumps({**meta, "held_out_acceptance": figure}, indent=2) + "\n")
    os.replace(tmp, vdir / META_FILE)
    log.info("drafter versions: %s carried no held-out acceptance; recorded %.4f", vdir.name, figure)


__all__ = ["MirroredStore", "RedisMirror", "carry_held_out", "publish_first_version"]
