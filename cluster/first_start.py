"""A fast first start: `specd serve` on a machine where no drafter has been trained yet.

With drafter.path unset and no bootstrapped drafter in the cache, serve takes the quick drafter when one
was built (`specd bootstrap-drafter --quick`, or the image's: `boot-quick`, and `boot-quick-hidden` that
reads the target's hidden states), else the seed drafter (drafter_trainer/seed.py), built in seconds:
the target's first layers and a frequent-token head, untrained, with its measured held-out match, so
the planner drafts from the suffix index until online distillation has trained a version that the gate
passes and the drafters swap in. A bootstrapped drafter, when there is one, wins. Building the quick
drafter before serving cost minutes for a few points of greedy match
(docs/decisions/first-start.md).

A quick drafter in the cache that an earlier version built from other prompt sources (its
specd_drafter.json names them; docs/decisions/quick-drafter-general-turns.md) is passed over for the
seed: a machine that upgrades starts as a fresh one does.
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


def seed_drafter_dirs(cache_dir: str | None) -> tuple[Path, Path]:
    from specd.drafter_trainer.seed import SEED_NAME
    from specd.workers.models.loader import default_cache_dir

    root = Path(cache_dir or default_cache_dir()) / "drafters"
    return root / SEED_NAME, root / f"{SEED_NAME}-hidden"


def ensure_serving_drafter(cfg, model_dir: str) -> str | None:
    """Set cfg.drafter.path to the quick drafter, or to the seed (built when missing), when serving would
    otherwise find none; returns the path chosen, or None when config or the cache already name a
    drafter (or none is needed)."""
    from specd.drafter_trainer.bootstrap import BootstrapConfig
    from specd.workers.drafters.model import default_drafter_dir
    from specd.workers.drafters.registry import drafter_class

    d = cfg.drafter
    hidden = bool(d.target_hidden) and cfg.target.backend == "torch"
    if d.path or not drafter_class(d.kind).has_weights(d):
        return None
    if (default_drafter_dir(cfg.cache_dir, target_hidden=hidden) / "config.json").exists():
        return None
    quick = quick_drafter_dirs(cfg.cache_dir)[1 if hidden else 0]
    if (quick / "config.json").exists():
        sources = trained_sources(quick)
        if sources in (None, list(BootstrapConfig.quick().sources)):
            d.path = str(quick)
            return d.path
        log.info("the cached quick drafter %s learned %s, not this version's %s: starting from the seed",
                 quick, sources, list(BootstrapConfig.quick().sources))
    token_dir, hidden_dir = seed_drafter_dirs(cfg.cache_dir)
    want = hidden_dir if hidden else token_dir
    if not (want / "config.json").exists():
        from specd.drafter_trainer.seed import build_seed_drafter

        t0 = time.perf_counter()
        build_seed_drafter(model_dir, token_dir, hidden_dir if hidden else None)
        log.info("seed drafter built in %.0f s (untrained: the suffix index drafts until online training "
                 "gives a better version)", time.perf_counter() - t0)
    d.path = str(want)
    return d.path


def drafter_summary(cfg) -> str:
    """What serves as the drafter, for the start-up line: kind, and the model drafter's version and
    held-out match where its directory records them."""
    from specd.workers.drafters.model import resolve_drafter_dir
    from specd.workers.drafters.registry import drafter_class
    from specd.workers.drafters.versions import held_out_acceptance

    d = cfg.drafter
    if not drafter_class(d.kind).has_weights(d):
        return f"{d.kind} (no model drafter)"
    hidden = bool(d.target_hidden) and cfg.target.backend == "torch"
    try:
        path = resolve_drafter_dir(d.path, cfg.cache_dir, hidden)
        meta = json.loads((path / "specd_drafter.json").read_text())
    except (OSError, ValueError):
        return f"{d.kind} with the model drafter at {d.path}"
    notes = []
    if (match := held_out_acceptance(meta)) is not None:
        notes.append(f"held-out greedy match {match:.1%}")
    if meta.get("train", {}).get("steps") == 0:
        notes.append("untrained: online training improves it")
    return f"{d.kind} with model drafter {meta.get('version', path.name)}" + (
        f" ({'; '.join(notes)})" if notes else "")


def build_quick_drafter(cache_dir: str | None, model_dir: str, hidden: bool = True) -> Path:
    """The quick drafter, built when missing (the benchmarks' start: bench/osd.py); returns its path."""
    from specd.drafter_trainer.bootstrap import BootstrapConfig, bootstrap_drafter

    token_dir, hidden_dir = quick_drafter_dirs(cache_dir)
    want = hidden_dir if hidden else token_dir
    quick = BootstrapConfig.quick(target_dir=str(model_dir), out_dir=str(token_dir),
                                  hidden_out_dir=str(hidden_dir), target_hidden=hidden, progress=True)
    if not (want / "config.json").exists() or trained_sources(want) not in (None, list(quick.sources)):
        bootstrap_drafter(quick)
    return want


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
