"""Ray bring-up of the workers: one placement group, a TargetWorker and a DraftWorker actor per replica.

Actor options are computed from the config by builder functions (as Ray Serve LLM does), so they are
read and tested without starting anything. Each actor asks for its own bundle: with target.num_gpus=1
and drafter.num_gpus=1 the drafter and the target get different GPUs, which is what lets the scheduler
overlap drafting and verification across devices; with 0 GPUs (this machine) both are CPU actors.
The worker classes are injected (default: the real ones), so tests can place fakes the same way.
The scheduler reaches the actors through the typed handles of workers/engine/handles.py; Ray itself
is imported only inside the functions that need it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import uuid
from dataclasses import dataclass
from typing import Any

from specd.cluster import cpu_affinity
from specd.cluster.compiled_calls import CompiledCalls, serialised
from specd.configs.schema import SpecdConfig
from specd.workers.engine.build import worker_seeds

# A bundle must reserve something; an actor configured with no CPU and no GPU gets this sliver.
_MIN_CPU = 0.01


def ray_init_kwargs(cfg: SpecdConfig) -> dict[str, Any]:
    """Arguments of ray.init: connect to cfg.ray.address, or start a local cluster big enough for
    every bundle plus the driver (Ray's CPUs are logical: the 2-core machine still fits 4).

    Without an address, ray.init() would follow RAY_ADDRESS or the <tmp>/ray/ray_current_cluster file
    that any earlier cluster on the machine left behind (even one stopped uncleanly) and then refuse
    num_cpus; address="local" always starts our own. Joining a cluster is what ray.address is for."""
    kwargs: dict[str, Any] = {"namespace": cfg.ray.namespace, "include_dashboard": cfg.ray.include_dashboard}
    if cfg.ray.address:
        kwargs["address"] = cfg.ray.address
        del kwargs["include_dashboard"]        # only meaningful when starting a cluster
        if cfg.ray.address == "auto":
            # This node's raylet, not just any on this host: Ray prefers the head among raylets that share
            # an IP, and a router on a worker node must not ride on the head's (it would die with it).
            # `ray start` without --temp-dir uses this same default; a pod's /tmp is its own.
            from ray._common.utils import get_default_ray_temp_dir

            kwargs["_temp_dir"] = get_default_ray_temp_dir()
    else:
        kwargs["address"] = "local"
        needed = sum(b.get("CPU", 0.0) for b in placement_bundles(cfg)) + 1
        if cfg.replay.enabled and cfg.trainer.enabled:
            needed += cfg.trainer.num_cpus      # the online trainer's actor (cluster/trainer_actor.py)
        kwargs["num_cpus"] = max(os.cpu_count() or 1, math.ceil(needed))
        # workers on the driver's CPUs, not pinned to one by what they inherit (cluster/cpu_affinity.py)
        kwargs["runtime_env"] = cpu_affinity.runtime_env()
    return kwargs


def init_ray(cfg: SpecdConfig) -> bool:
    """ray.init unless already connected; True when this call started or connected the session."""
    import ray

    if ray.is_initialized():
        return False
    if cfg.ray.address == "auto":
        _connect_local_node(cfg)
        return True
    try:
        ray.init(**ray_init_kwargs(cfg))
    except Exception as exc:
        # Seen once on this 2-core machine, on a fresh local start: "The current node timed out during
        # startup"; the next start worked. A local start is ours to retry; a cluster address is not.
        if cfg.ray.address:
            raise
        logging.getLogger(__name__).warning("local ray.init failed (%s); retrying once", exc)
        ray.shutdown()
        ray.init(**ray_init_kwargs(cfg))
    return True


def _connect_local_node(cfg: SpecdConfig) -> None:
    """ray.init(address="auto"), tried again until this node's raylet is up or ray.connect_timeout_s
    has passed: a router container starts beside its pod's `ray start`, not after it."""
    import time

    import ray

    deadline = time.monotonic() + cfg.ray.connect_timeout_s
    while True:
        try:
            ray.init(**ray_init_kwargs(cfg))
            return
        except (ConnectionError, RuntimeError) as exc:
            ray.shutdown()
            if time.monotonic() > deadline:
                raise
            logging.getLogger(__name__).info("waiting for this node's raylet (%s)", exc)
            time.sleep(2.0)


def router_id(cfg: SpecdConfig) -> str:
    """This router's name: ray.router_id, else the host name (a pod's own name in Kubernetes, where the
    kubelet also sets $HOSTNAME to it)."""
    import socket

    return cfg.ray.router_id or os.environ.get("HOSTNAME") or socket.gethostname()


def _bundle(num_cpus: float, num_gpus: float, resources: dict | None = None) -> dict[str, float]:
    """resources: custom Ray resources (e.g. {"specd_target": 1}) that pin the actor to the nodes
    advertising them, such as the Helm chart's target and draft worker groups."""
    bundle = {"CPU": float(num_cpus), "GPU": float(num_gpus)}
    bundle.update({str(k): float(v) for k, v in (resources or {}).items()})
    bundle = {k: v for k, v in bundle.items() if v > 0}
    return bundle or {"CPU": _MIN_CPU}


def gpu_shares(cfg: SpecdConfig, node_gpus: int) -> tuple[float, float]:
    """Ray GPUs for (target, drafter) of one replica on a node with `node_gpus` GPUs.

    A num_gpus set in config wins. A worker on device cuda with num_gpus 0 is placed automatically:
    with two or more GPUs per node the drafter gets its own (1 each, so drafting and verifying run on
    different devices); with one, target and drafter share it (0.5 each; Ray then gives both actors
    the same CUDA_VISIBLE_DEVICES). A CPU worker asks for no GPU.
    """
    drafter_device = cfg.drafter.device or cfg.target.device     # None: follows the target (load_config)
    on_gpu = [cfg.target.device.startswith("cuda"), drafter_device.startswith("cuda")]
    asked = [cfg.target.num_gpus, cfg.drafter.num_gpus]
    auto = [gpu and n == 0 for gpu, n in zip(on_gpu, asked, strict=True)]
    share = 1.0 if node_gpus >= 2 or not all(on_gpu) else 0.5
    target, drafter = (share if a else float(n) for a, n in zip(auto, asked, strict=True))
    return target, drafter


def node_gpu_count() -> int:
    """GPUs of the largest node of the connected Ray cluster (0 without GPUs)."""
    import ray

    return int(max((node["Resources"].get("GPU", 0) for node in ray.nodes() if node["Alive"]), default=0))


def placement_bundles(cfg: SpecdConfig, node_gpus: int = 0) -> list[dict[str, float]]:
    """Bundle 2i is replica i's target, bundle 2i+1 its drafter."""
    target_gpus, drafter_gpus = gpu_shares(cfg, node_gpus)
    out = []
    for _ in range(cfg.target.replicas):
        out.append(_bundle(cfg.target.num_cpus, target_gpus, cfg.target.resources))
        out.append(_bundle(cfg.drafter.num_cpus, drafter_gpus, cfg.drafter.resources))
    return out


def create_placement_group(cfg: SpecdConfig, name: str = "", node_gpus: int = 0):
    """PACK keeps a replica's pair on one node when it fits (the draft/verify round trip stays local)."""
    from ray.util.placement_group import placement_group

    return placement_group(placement_bundles(cfg, node_gpus), strategy="PACK", name=name)


def _options(bundle: dict[str, float], pg, index: int, name: str, max_restarts: int = 0) -> dict[str, Any]:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {
        "num_cpus": bundle.get("CPU", 0.0),
        "num_gpus": bundle.get("GPU", 0.0),
        "resources": {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
        "name": name,
        # A restarted target has lost every KV cache: the scheduler retries or ends its requests and
        # takes it out of dispatch until it answers. A restarted drafter's requests finish target-only.
        "max_restarts": max_restarts,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=index
        ),
    }


def target_actor_options(
    cfg: SpecdConfig, pg, replica: int, tag: str = "", node_gpus: int = 0
) -> dict[str, Any]:
    bundle = _bundle(cfg.target.num_cpus, gpu_shares(cfg, node_gpus)[0], cfg.target.resources)
    return _options(bundle, pg, 2 * replica, f"specd-target-{replica}{tag}", cfg.target.max_restarts)


def drafter_actor_options(
    cfg: SpecdConfig, pg, replica: int, tag: str = "", node_gpus: int = 0
) -> dict[str, Any]:
    bundle = _bundle(cfg.drafter.num_cpus, gpu_shares(cfg, node_gpus)[1], cfg.drafter.resources)
    return _options(bundle, pg, 2 * replica + 1, f"specd-drafter-{replica}{tag}", cfg.drafter.max_restarts)


@dataclass
class ReplicaActors:
    index: int
    target: Any       # Ray actor handle of a TargetWorker
    drafter: Any      # Ray actor handle of a DraftWorker


@dataclass
class Cluster:
    placement_group: Any
    replicas: list[ReplicaActors]


def _default_classes() -> tuple[type, type]:
    from specd.workers.engine.draft_worker import DraftWorker
    from specd.workers.engine.target_worker import TargetWorker

    return TargetWorker, DraftWorker


def create_cluster(
    cfg: SpecdConfig, model_dir: str, target_cls: type | None = None, drafter_cls: type | None = None,
    versions: dict | None = None,
) -> Cluster:
    """Reserve the placement group and start every actor (they load their models in the background;
    the first call on a handle waits for its constructor). versions: where the DraftWorkers read the
    serving drafter version (specd.cluster.redis_server.versions_spec), so that a drafter on another node, or
    restarted on one, never needs this machine's disk; None: drafter.path on their own node."""
    import ray

    if target_cls is None or drafter_cls is None:
        default_target, default_drafter = _default_classes()
        target_cls, drafter_cls = target_cls or default_target, drafter_cls or default_drafter
    # one lock per worker and a dispatch method for the compiled graphs of cluster/compiled_calls.py
    target_remote = ray.remote(serialised(target_cls))
    drafter_remote = ray.remote(serialised(drafter_cls))
    # Several routers share one cluster: each names its actors after itself, and a restarted router
    # starts its own again (a driver's actors and placement group die with it), never another's.
    tag = f"-{router_id(cfg)}-{uuid.uuid4().hex[:6]}"
    gpus = node_gpu_count()
    pg = create_placement_group(cfg, name=f"specd{tag}", node_gpus=gpus)
    replicas = []
    for i in range(cfg.target.replicas):
        # Each replica gets its own seeds so replicas do not draw identical random streams.
        target_seed, drafter_seed = worker_seeds(cfg.seed, i)
        target = target_remote.options(**target_actor_options(cfg, pg, i, tag, gpus)).remote(
            cfg.target, target_seed, cfg.cache_dir
        )
        extra = {"versions": versions} if versions is not None else {}
        drafter = drafter_remote.options(**drafter_actor_options(cfg, pg, i, tag, gpus)).remote(
            cfg.drafter, cfg.spec, str(model_dir), drafter_seed, cfg.cache_dir, **extra
        )
        replicas.append(ReplicaActors(i, target, drafter))
    return Cluster(pg, replicas)


def replica_handles(cluster: Cluster, compiled: bool = False, idle_s: float = 10.0) -> list[tuple[Any, Any]]:
    """The scheduler's (TargetHandle, DrafterHandle) per replica; compiled: their calls go through a
    compiled graph where the actor shares the router's node (cluster/compiled_calls.py)."""
    from specd.workers.engine.handles import DrafterHandle, TargetHandle

    out = []
    for rep in cluster.replicas:
        pair = []
        for cls, actor, name in ((TargetHandle, rep.target, f"target-{rep.index}"),
                                 (DrafterHandle, rep.drafter, f"drafter-{rep.index}")):
            transport = CompiledCalls(actor, name, idle_s) if compiled else None
            pair.append(cls(actor, name, "actor", transport))
        out.append((pair[0], pair[1]))
    return out


def shutdown_cluster(cluster: Cluster) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group

    # Best effort: an actor that already died or a group already removed has nothing left to free.
    for rep in cluster.replicas:
        for handle in (rep.target, rep.drafter):
            with contextlib.suppress(Exception):
                ray.kill(handle)
    with contextlib.suppress(Exception):
        remove_placement_group(cluster.placement_group)
