"""A fast first start: `specd serve` on a machine where no drafter has been bootstrapped yet.

The full offline bootstrap (`specd bootstrap-drafter`, most of an hour on a CPU) is no longer needed to
serve. With drafter.path unset and no bootstrapped drafter in the cache, serve uses the quick drafter
(`boot-quick`, and `boot-quick-hidden` that reads the target's hidden states), building it first when
it is missing too: a couple of minutes on 2 CPU cores (the bootstrap's --quick preset). Online
distillation then improves it on live traffic. A bootstrapped drafter, when there is one, wins.

A quick drafter in the cache that an earlier version built from other prompt sources (its specd_drafter.json
names them; docs/decisions/quick-drafter-general-turns.md) is rebuilt once: a machine that
upgrades starts from the same drafter a fresh one does.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

log = logging.getLogger(__name__)
QUICK_NAME = "boot-quick"


def quick_drafter_dirs(cache_dir: str | None) -> tuple[Path, Path]:
    from specd.workers.models.loader import default_cache_dir

    root = Path(cache_dir or default_cache_dir()) / "drafters"
    return root / QUICK_NAME, root / f"{QUICK_NAME}-hidden"


def ensure_serving_drafter(cfg, model_dir: str) -> str | None:
    """Set cfg.drafter.path to the quick drafter when serving would otherwise find none; returns the
    path chosen, or None when config or the cache already name a drafter (or none is needed)."""
    from specd.workers.drafters.model import default_drafter_dir

    d = cfg.drafter
    hidden = bool(d.target_hidden) and cfg.target.backend == "torch"
    from specd.workers.drafters.registry import drafter_class

    if d.path or not drafter_class(d.kind).has_weights(d):
        return None
    if (default_drafter_dir(cfg.cache_dir, target_hidden=hidden) / "config.json").exists():
        return None
    token_dir, hidden_dir = quick_drafter_dirs(cfg.cache_dir)
    want = hidden_dir if hidden else token_dir
    from specd.drafter_trainer.bootstrap import BootstrapConfig, bootstrap_drafter

    quick = BootstrapConfig.quick(target_dir=str(model_dir), out_dir=str(token_dir),
                                  hidden_out_dir=str(hidden_dir), target_hidden=hidden, progress=True)
    built = (want / "config.json").exists()
    stale = built and trained_sources(want) not in (None, list(quick.sources))
    if not built or stale:
        if stale:
            log.warning("the cached quick drafter %s learned %s; this version's quick drafter learns %s: "
                        "rebuilding it", want, trained_sources(want), list(quick.sources))
        else:
            log.warning("no bootstrapped drafter in the cache: building the quick one (a few minutes; "
                        "`specd bootstrap-drafter` builds the full one offline); online training improves it")
        t0 = time.perf_counter()
        bootstrap_drafter(quick)
        log.info("quick drafter built in %.0f s", time.perf_counter() - t0)
    d.path = str(want)
    return d.path


def trained_sources(drafter_dir: Path) -> list[str] | None:
    """The prompt sources a bootstrapped drafter learned (its specd_drafter.json), None when unrecorded."""
    try:
        meta = json.loads((drafter_dir / "specd_drafter.json").read_text())
        sources = meta["train"]["prompts"]["sources"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return list(sources) if isinstance(sources, list) else None


def publish_first_version(cfg, res, model_dir: str) -> dict | None:
    """Open Redis (when replay is on) and publish the drafter this router starts from as the serving
    version there, unless one serves already; returns where DraftWorkers read versions (None: from
    drafter.path, no online adaptation). `res` is serve's resources: res.online_redis is set here."""
    from specd.cluster.online import open_online_redis
    from specd.cluster.redis_server import versions_spec
    from specd.drafter_trainer.version_channel import publish_first_version as publish
    from specd.workers.drafters.registry import drafter_class
    from specd.workers.models.loader import default_cache_dir

    res.online_redis = open_online_redis(cfg)
    if res.online_redis is None or not drafter_class(cfg.drafter.kind).has_weights(cfg.drafter):
        return None
    import redis

    from specd.drafter_trainer.drafter_format import DrafterFormatError
    from specd.workers.drafters.model import resolve_drafter_dir
    from specd.workers.drafters.versions import VersionError

    hidden = bool(cfg.drafter.target_hidden) and cfg.target.backend == "torch"
    endpoint = res.online_redis[0]
    spec = versions_spec(cfg, endpoint)
    redis_spec = {**spec["redis"], "password": endpoint.password}
    store = Path(cfg.cache_dir or default_cache_dir()) / "drafters" / "router-published"
    try:
        drafter_dir = resolve_drafter_dir(cfg.drafter.path, cfg.cache_dir, hidden)   # None: bootstrapped
        publish(redis_spec, spec["prefix"], drafter_dir, model_dir, store)
    except (OSError, DrafterFormatError, VersionError, redis.RedisError) as exc:
        # a drafter without specd's metadata, or Redis refusing: drafters load drafter.path on their node
        log.warning("first-start drafter not published to Redis (%s); DraftWorkers read drafter.path", exc)
        return None
    return spec
