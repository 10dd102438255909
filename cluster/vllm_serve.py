"""Bring-up of `specd serve target.backend=vllm`: Ray, the target model and tokenizer, one VllmTarget actor
per replica (cluster/vllm_actor.py) and the VllmScheduler over them (cluster/vllm_scheduler.py). The rest
of `specd serve` (gRPC, auth, health, metrics, warm-up, shutdown) is cluster/serve.py's, unchanged."""

from __future__ import annotations

import asyncio
import logging

from specd.cluster.vllm_actor import VllmTarget
from specd.cluster.vllm_scheduler import VllmScheduler, vllm_limits

log = logging.getLogger(__name__)


def actor_options(cfg) -> dict:
    """One actor per replica: the target's CPUs and GPUs (the proposer runs in its process, on its device);
    concurrency so that poll() long-polls while submit() and abort() come in.

    On cuda the actor reserves whole GPUs, target.tensor_parallel_size of them, unless target.num_gpus
    says otherwise: vLLM sizes its KV cache from a share of each GPU's memory
    (target.gpu_memory_utilization), so a GPU it shares unreserved with another replica or the trainer
    would run out of memory. Ray then sets the actor's CUDA_VISIBLE_DEVICES to exactly those GPUs."""
    gpus = float(cfg.target.num_gpus)
    if gpus == 0 and cfg.target.device == "cuda":
        gpus = float(cfg.target.tensor_parallel_size)
    if cfg.target.device == "cuda" and gpus < cfg.target.tensor_parallel_size:
        raise ValueError(f"target.num_gpus={cfg.target.num_gpus} is fewer than "
                         f"target.tensor_parallel_size={cfg.target.tensor_parallel_size}")
    return {
        "num_cpus": max(float(cfg.target.num_cpus), 0.01),
        "num_gpus": gpus,
        "resources": dict(cfg.target.resources or {}),
        "max_concurrency": 8,
    }


async def bring_up_vllm(cfg, res, install_signals):
    """Returns (model dir, chat codec, each replica's info, each replica's request capacity), like
    serve._start_workers; the actors are the scheduler's to close."""
    import ray

    from specd.cluster import actors, console
    from specd.workers.engine.vllm_engine import vllm_missing
    from specd.workers.models.chat import ChatCodec
    from specd.workers.models.loader import ensure_target_model, load_tokenizer, scoped_cache_dir

    missing = vllm_missing()
    if missing:
        raise RuntimeError(f"target.backend=vllm: {missing}")
    for limit in vllm_limits(cfg):
        log.warning("target.backend=vllm does not apply %s", limit)
    if cfg.spec.enabled and cfg.target.vllm_speculation == "vllm-draft-model" and cfg.target.device == "cpu":
        log.warning("target.vllm_speculation=vllm-draft-model on a CPU: vLLM's eager draft_model path "
                    "measured slower than vLLM alone and than specd's proposer there (docs/benchmarks.md); "
                    "it is meant for GPUs")
    console.quiet_ray_logger(cfg.server.verbose)
    res.started_ray = await asyncio.to_thread(actors.init_ray, cfg)
    install_signals()
    console.route_actor_output(cfg.server.verbose)
    model_dir = await asyncio.to_thread(ensure_target_model, cfg.target.model_path, cfg.cache_dir,
                                        cfg.target.model)
    cfg.cache_dir = scoped_cache_dir(cfg.cache_dir, cfg.target.model_path, model_dir,  # drafters per target
                                     cfg.target.model)
    codec = ChatCodec(await asyncio.to_thread(load_tokenizer, model_dir))
    from specd.cluster.first_start import ensure_serving_drafter, publish_first_version

    # no bootstrapped drafter in the cache: the quick token-only one, as the torch path does (first_start.py)
    await asyncio.to_thread(ensure_serving_drafter, cfg, str(model_dir))
    versions = None
    if cfg.replay.enabled:
        # Redis carries the versions, as for DraftWorkers (docs/decisions/drafter-versions-redis.md)
        versions = await asyncio.to_thread(publish_first_version, cfg, res, str(model_dir))
    remote = ray.remote(VllmTarget).options(**actor_options(cfg))
    res.vllm_actors = [remote.remote(cfg, 0, versions) for _ in range(cfg.target.replicas)]
    infos = await asyncio.gather(*[a.info.remote() for a in res.vllm_actors])
    for i, info in enumerate(infos):
        log.info("replica %d: vLLM engine up in %.1f s (cost sweep %.1f s), speculation %s, drafter %s",
                 i, info["load_s"], info["profile_s"], info["speculation"], info["drafter_version"])
    capacity = [int(i["max_slots"]) for i in infos]
    return model_dir, codec, infos, capacity


class ReplicaDrafter:
    """What online adaptation asks of a replica's drafter (cluster/online.py), for a vLLM replica: the
    proposer inside its engine follows the version store it was given at start (the one the trainer
    publishes to, bring_up_vllm), so watching is already done; its swaps come with the actor's stats."""

    def __init__(self, actor):
        self.actor = actor

    async def watch_versions(self, store, model_dir: str, poll_s: float) -> str:
        return (await self.actor.stats.remote())["drafter_version"]

    async def pin_version(self, version: str | None) -> str:
        raise RuntimeError("drafter.version_pin is not applied on target.backend=vllm")

    async def swap_stats(self) -> dict:
        return (await self.actor.stats.remote())["swaps"]


def vllm_bounds(bounds, cfg, info: dict):
    """What a request may ask of a vLLM target: chains only (no tree_width > 1), the engine's γ policy,
    γ within its num_speculative_tokens (spec.gamma), and per-request on/off and γ only where the
    engine's proposer hears them (info's per_request_speculation). Beyond that, INVALID_ARGUMENT."""
    import dataclasses

    return dataclasses.replace(
        bounds, tree_width_default=1, tree_width_max=1, policies=(str(cfg.spec.policy),),
        gamma_max=min(bounds.gamma_max, cfg.spec.gamma),
        per_request_speculation=bool(info.get("per_request_speculation", False)))


def vllm_scheduler(cfg, res, capacity: list[int], info: dict, observer) -> VllmScheduler:
    return VllmScheduler(res.vllm_actors, capacity=capacity, max_queue=cfg.server.max_queue,
                         max_running=cfg.server.max_running, eos_token_ids=info["eos_token_ids"],
                         observer=observer)
