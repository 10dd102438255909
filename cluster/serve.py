"""`specd serve`: bring the whole system up, serve until SIGINT/SIGTERM, shut down cleanly.

Order of bring-up: the gRPC server first (health NOT_SERVING, so probes see the process), then Ray,
the target model directory and tokenizer, the placement group and worker actors, the scheduler, a
warm-up request per replica, the metrics endpoint; then health turns SERVING and the address is
printed. Shutdown runs the same list backwards. `specd generate` (cluster/client_cli.py) is the matching
small client.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specd.cluster import console
from specd.cluster.console import phase
from specd.configs.schema import SpecdConfig
from specd.workers.core.sampling import SamplingParams
from specd.workers.engine.types import NewRequest, SpecParams

log = logging.getLogger("specd.cluster.serve")   # also when run as __main__ (python -m)
WORKER_STATS_PERIOD_S = 10.0


@dataclass
class ServeHandle:
    """Given to ready_callback once the server is SERVING; stop() may be called from any thread."""

    address: str
    port: int
    metrics_port: int | None
    info: dict
    _loop: asyncio.AbstractEventLoop = field(repr=False)
    _stop: asyncio.Event = field(repr=False)

    http_port: int | None = None        # the OpenAI-compatible HTTP API (None = server.http_port off)

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)


@dataclass
class _Resources:
    """What bring-up has created so far; shutdown frees exactly that."""

    grpc: Any = None
    http: Any = None                    # the OpenAI-compatible HTTP API (cluster/http_api.py)
    started_ray: bool = False
    cluster: Any = None
    scheduler: Any = None
    metrics_http: Any = None
    online: Any = None                  # specd.cluster.online.OnlineParts
    online_redis: Any = None            # (endpoint, managed server or None) before `online` takes it
    vllm_actors: list = field(default_factory=list)   # target.backend=vllm: VllmTarget actors
    tasks: list[asyncio.Task] = field(default_factory=list)
    grace_s: float = 10.0               # server.shutdown_grace_s


class SignalStop:
    """SIGINT/SIGTERM handling. The first signal starts a graceful shutdown (health NOT_SERVING at once,
    new requests refused, in-flight ones get server.shutdown_grace_s to finish); a second one exits the
    process at once with 128 + the signal number, for an operator who will not wait."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, loop: asyncio.AbstractEventLoop, stop: asyncio.Event, before_hard_exit=None):
        """before_hard_exit: kills what would outlive the process (Ray's own processes fate-share with
        the driver; a managed redis-server does not)."""
        self.loop, self.stop, self.before_hard_exit = loop, stop, before_hard_exit

    def install(self) -> None:
        for sig in self.SIGNALS:
            self.loop.add_signal_handler(sig, self._on_signal, sig)

    def remove(self) -> None:
        for sig in self.SIGNALS:
            self.loop.remove_signal_handler(sig)

    def _on_signal(self, sig: int) -> None:
        if self.stop.is_set():
            print(f"specd: second {signal.Signals(sig).name}: exiting now", file=sys.stderr, flush=True)
            if self.before_hard_exit is not None:
                with contextlib.suppress(Exception):
                    self.before_hard_exit()
            os._exit(128 + sig)
        phase("%s: stopping gracefully (a second signal exits at once)", signal.Signals(sig).name)
        self.stop.set()


def serve(cfg: SpecdConfig, ready_callback=None) -> int:
    """Run the server until SIGINT/SIGTERM (main thread) or ServeHandle.stop(); returns an exit code."""
    return asyncio.run(_serve(cfg, ready_callback))


async def _serve(cfg: SpecdConfig, ready_callback) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    in_main = threading.current_thread() is threading.main_thread()

    res = _Resources(grace_s=cfg.server.shutdown_grace_s)
    signals = SignalStop(loop, stop, before_hard_exit=lambda: _kill_children(res))

    def install_signals() -> None:
        if in_main:
            signals.install()

    install_signals()
    stopper = asyncio.create_task(stop.wait())
    try:
        bring_up = asyncio.create_task(_bring_up(cfg, res, loop, stop, ready_callback, install_signals))
        await asyncio.wait({bring_up, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if not bring_up.done():          # a signal during loading: stop loading
            bring_up.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await bring_up               # re-raises a bring-up failure
        await stopper
        return 0
    finally:
        stopper.cancel()
        await _shut_down(res)
        if in_main:
            signals.remove()


async def _bring_up(
    cfg: SpecdConfig, res: _Resources, loop, stop: asyncio.Event, ready_callback, install_signals
) -> None:
    from specd.cluster.auth import ServerSecurity
    from specd.cluster.metrics import SpecdMetrics
    from specd.cluster.router import GrpcServer, SpecdServicer
    from specd.cluster.scheduler import Scheduler
    from specd.cluster.serving import Backend, ServingCore
    from specd.cluster.validation import Bounds
    from specd.configs import flatten

    security = ServerSecurity.from_config(cfg.server)
    core = ServingCore()           # the front ends' one serving core (cluster/serving.py)
    res.grpc = GrpcServer(SpecdServicer(core), cfg.server.host, cfg.server.port, security=security,
                          max_message_bytes=cfg.server.max_message_bytes,
                          health_port=cfg.server.health_port or None)
    await res.grpc.start()
    phase("gRPC on %s (NOT_SERVING while loading)", res.grpc.address)
    if cfg.server.http_port is not None:
        from specd.cluster.http_api import HttpApi, HttpServer

        api = HttpApi(core, authorize=security.authorize, serving=res.grpc.serving,
                      max_body_bytes=cfg.server.max_message_bytes)
        res.http = HttpServer(api, cfg.server.host, cfg.server.http_port, cfg.server,
                              grace_s=cfg.server.shutdown_grace_s)
        await res.http.start()
        phase("HTTP (OpenAI-compatible) on %s (503 while loading)", res.http.url)

    if cfg.target.backend == "vllm":
        from specd.cluster.vllm_serve import bring_up_vllm

        model_dir, codec, infos, capacity = await bring_up_vllm(cfg, res, install_signals)
    else:
        model_dir, codec, infos, capacity = await _start_workers(cfg, res, install_signals)
    info = infos[0]
    phase("workers up: %s on %d replica(s)", info["model"], len(infos))

    metrics = SpecdMetrics()
    metrics.server_insecure.set(1.0 if security.insecure else 0.0)
    from specd.cluster.actors import router_id

    metrics.router.info({"router": router_id(cfg)})
    from specd.cluster.online import OnlineMetrics, follow_again, follow_trainer, start_online
    from specd.cluster.replay import ObserverFanout

    vllm = cfg.target.backend == "vllm"
    if vllm:
        from specd.cluster.vllm_serve import ReplicaDrafter, vllm_bounds, vllm_scheduler

        drafters = [ReplicaDrafter(a) for a in res.vllm_actors]
    else:
        drafters = [r.drafter for r in res.cluster.replicas]
    res.online = await asyncio.to_thread(start_online, cfg, str(model_dir), drafters, metrics.registry,
                                         res.online_redis)
    observer = ObserverFanout([metrics, res.online.recorder]) if res.online.recorder else metrics
    if vllm:
        res.scheduler = vllm_scheduler(cfg, res, capacity, info, observer)
    else:
        from specd.cluster.actors import replica_handles

        res.scheduler = Scheduler(
            replica_handles(res.cluster, cfg.ray.compiled_calls, cfg.ray.compiled_calls_idle_s),
            capacity=capacity,
            max_queue=cfg.server.max_queue,
            max_running=cfg.server.max_running,
            pipeline_groups=cfg.server.pipeline_groups,
            eos_token_ids=info["eos_token_ids"],
            observer=observer,
            on_drafter_back=lambda i: follow_again(res.online, i, str(model_dir), cfg.drafter.version_pin),
            guard_window_steps=cfg.spec.guard_window_steps,
        )
    await res.scheduler.start()
    if cfg.server.warmup:
        await _warm_up(res.scheduler, codec, cfg, len(infos))
        await res.scheduler.reset_stats()
        phase("warm")

    metrics_port = None
    if cfg.server.metrics_port:
        res.metrics_http, metrics_port = metrics.serve_http(cfg.server.metrics_port, cfg.server.host)
    res.tasks.append(asyncio.create_task(_poll_worker_stats(res.scheduler, metrics, res.online,
                                                            OnlineMetrics(metrics.registry))))
    if res.online is not None:
        res.tasks.append(asyncio.create_task(follow_trainer(res.online, str(model_dir),
                                                            cfg.drafter.version_pin)))

    bounds = Bounds.from_config(cfg, info)
    if vllm:
        bounds = vllm_bounds(bounds, cfg, info)
    backend = Backend(
        scheduler=res.scheduler, codec=codec, bounds=bounds, model=info["model"],
        eos_token_ids=tuple(info["eos_token_ids"]), replicas=len(infos),
        pipeline_groups=cfg.server.pipeline_groups, max_queue=cfg.server.max_queue, metrics=metrics,
        config=flatten(cfg), drafters=[] if vllm else [r.drafter for r in res.cluster.replicas],
    )
    metrics.set_live_config(backend.bounds, cfg.drafter.version_pin)
    await res.grpc.attach(backend)
    if cfg.server.health_probe_s > 0:
        from specd.cluster.health_probe import HealthProber

        spec = SpecParams.from_config(cfg.spec)
        prober = HealthProber(res.scheduler, codec.encode("Hello"), spec, res.grpc.set_serving,
                              cfg.server.health_probe_s, timeout_s=cfg.server.health_probe_s)
        res.tasks.append(asyncio.create_task(prober.run()))
    metrics_note = f", metrics on http://{cfg.server.host}:{metrics_port}/metrics" if metrics_port else ""
    http_note = f", OpenAI-compatible HTTP on {res.http.url}/v1" if res.http is not None else ""
    print(f"specd serving {info['model']} on {res.grpc.address}{http_note}{metrics_note}", flush=True)
    if ready_callback is not None:
        ready_callback(ServeHandle(res.grpc.address, res.grpc.port, metrics_port, info, loop, stop,
                                   http_port=res.http.port if res.http is not None else None))


async def _start_workers(cfg: SpecdConfig, res: _Resources, install_signals):
    """Ray, the target model (converted once), a drafter to serve with, and every replica's actors;
    returns (model dir, chat codec, each replica's target info, each replica's request capacity)."""
    from specd.cluster import actors
    from specd.cluster.first_start import drafter_summary, ensure_serving_drafter, publish_first_version
    from specd.workers.models.chat import ChatCodec
    from specd.workers.models.loader import (
        ensure_target_model,
        is_converted,
        load_tokenizer,
        named_model_dir,
        scoped_cache_dir,
    )

    console.quiet_ray_logger(cfg.server.verbose)
    # Ray starts while the target is found or converted: neither needs the other, and Ray's start is
    # mostly waiting for its processes
    ray_up = asyncio.create_task(asyncio.to_thread(actors.init_ray, cfg))
    try:
        named = named_model_dir(cfg.target.model, cfg.cache_dir)
        if cfg.target.model_path is None and not is_converted(named):
            phase("model: de-quantizing %s into the cache, once (about half a minute for the default, "
                  "minutes for a 1.5B, on two cores)", named.name)
        model_dir = await asyncio.to_thread(ensure_target_model, cfg.target.model_path, cfg.cache_dir,
                                            cfg.target.model)
    finally:
        res.started_ray = await ray_up     # also when the model failed: shutdown then stops Ray
    install_signals()       # ray.init puts its own SIGTERM handler in place; ours must win
    console.route_actor_output(cfg.server.verbose)
    phase("model %s ready", model_dir.name)
    cfg.cache_dir = scoped_cache_dir(cfg.cache_dir, cfg.target.model_path, model_dir,  # drafters per target
                                     cfg.target.model)
    codec = ChatCodec(await asyncio.to_thread(load_tokenizer, model_dir))
    await asyncio.to_thread(ensure_serving_drafter, cfg, str(model_dir))
    phase("drafter %s", drafter_summary(cfg))
    versions = await asyncio.to_thread(publish_first_version, cfg, res, str(model_dir))
    res.cluster = await asyncio.to_thread(actors.create_cluster, cfg, str(model_dir), versions=versions)
    await res.cluster.placement_group.ready()
    infos = await asyncio.gather(*[r.target.info.remote() for r in res.cluster.replicas])
    drafter_slots = await asyncio.gather(*[r.drafter.max_slots.remote() for r in res.cluster.replicas])
    capacity = [min(int(i["max_slots"]), int(d)) for i, d in zip(infos, drafter_slots, strict=True)]
    return model_dir, codec, infos, capacity


async def _warm_up(scheduler, codec, cfg: SpecdConfig, replicas: int) -> None:
    """Short greedy requests on every replica (the dispatcher spreads them), so the first clients do not
    pay for lazy initialisation in the workers. With decode=compiled (the CUDA default) that is
    torch.compile's specialisations, seconds each: one row and several, one new token and a verify of
    several, the drafter's chain. So a first round sends one request per replica as configured, and a
    second two per replica side by side, one drafting a fixed γ and one target-only."""
    prompt = codec.encode("Hello")
    configured = SpecParams.from_config(cfg.spec)
    rounds = [[configured] * replicas]
    if configured.enabled:
        drafting = dataclasses.replace(configured, policy="fixed", gamma=max(configured.gamma, 1))
        rounds.append([drafting, SpecParams(enabled=False)] * replicas)
    for r, specs in enumerate(rounds):
        reqs = [NewRequest(f"warmup-{r}-{i}", prompt, SamplingParams(), 4, spec)
                for i, spec in enumerate(specs)]
        for _, fin in await asyncio.gather(*[scheduler.generate(q, ignore_eos=True) for q in reqs]):
            if fin.reason == "error":
                raise RuntimeError(f"warm-up failed: {fin.error}")


async def _poll_worker_stats(scheduler, metrics, online=None, online_metrics=None) -> None:
    from specd.cluster.online import poll_online

    while True:
        await asyncio.sleep(WORKER_STATS_PERIOD_S)
        try:
            metrics.set_worker_stats(await scheduler.worker_stats())
            if online is not None:
                await poll_online(online, online_metrics)
        except Exception:  # a dying worker must not end the poller; the next poll tries again
            log.warning("worker stats poll failed", exc_info=True)


def _managed_redis(res: _Resources):
    if res.online is not None:
        return res.online.managed_redis
    return res.online_redis[1] if res.online_redis else None


def _kill_children(res: _Resources) -> None:
    redis = _managed_redis(res)
    if redis is not None and redis.proc is not None:
        redis.proc.kill()


async def _shut_down(res: _Resources) -> None:
    for task in res.tasks:
        task.cancel()
    fronts = [*([res.grpc.stop(grace=res.grace_s)] if res.grpc is not None else []),
              *([res.http.stop()] if res.http is not None else [])]
    await asyncio.gather(*fronts)      # both stop taking requests at once and share the grace period
    if res.scheduler is not None:
        await res.scheduler.stop()
    if res.online is not None:
        await asyncio.to_thread(res.online.stop)
    elif _managed_redis(res) is not None:       # bring-up failed between opening Redis and start_online
        await asyncio.to_thread(_managed_redis(res).stop)
    if res.metrics_http is not None:
        res.metrics_http.shutdown()
    if res.cluster is not None:
        from specd.cluster.actors import shutdown_cluster

        await asyncio.to_thread(shutdown_cluster, res.cluster)
    if res.started_ray:
        import ray

        await asyncio.to_thread(ray.shutdown)
    phase("stopped")


# ---- command line ------------------------------------------------------------------------------
def _cmd_serve(args: argparse.Namespace) -> int:
    from specd.cluster.redact import install_log_redaction
    from specd.configs import ConfigError

    try:
        cfg = config_from_args(args)
    except ConfigError as err:
        print(f"specd serve: invalid config: {err}", file=sys.stderr)
        return 2
    cfg.server.verbose = cfg.server.verbose or bool(getattr(args, "verbose", False))
    if not cfg.server.verbose:
        console.quiet_native_libraries()
    log_file = None if getattr(args, "check", False) else (
        Path(args.log_file) if getattr(args, "log_file", None) else console.default_log_file(cfg.cache_dir))
    console.setup(cfg.server.verbose, log_file)
    install_log_redaction()
    if log_file is not None and not cfg.server.verbose:
        phase("log file %s (--verbose shows it here)", log_file)
    if getattr(args, "check", False):
        http = cfg.server.http_port if cfg.server.http_port is not None else "off"
        print(f"specd serve: config OK ({cfg.name}: {cfg.target.backend} target on {cfg.target.device}, "
              f"drafter {cfg.drafter.kind}, γ policy {cfg.spec.policy}, gRPC {cfg.server.host}:"
              f"{cfg.server.port}, HTTP {http})")
        return 0
    try:
        return serve(cfg)
    except Exception as exc:  # a failed bring-up: one line on the console, the traceback in the log file
        log.error("could not start: %s", exc, exc_info=True)
        return 1


def config_from_args(args: argparse.Namespace) -> SpecdConfig:
    """The validated config of `specd serve [--config-dir D] [--config-name N] [--overrides-file F]
    overrides...`: a bad key or value fails here, before Ray or a model loads."""
    from specd.configs import load_config

    overrides = read_overrides_file(args.overrides_file) + list(args.overrides)
    return load_config(overrides, config_name=args.config_name, config_dir=args.config_dir)


def add_config_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*",
                   help="Hydra overrides and groups, e.g. drafter=ngram spec=tree spec.tree_width=3")
    p.add_argument("--config-name", default="config",
                   help="yaml to start from (default: the embedded configs/config.yaml)")
    p.add_argument("--config-dir", default=None,
                   help="directory holding --config-name's yaml (its defaults list specd_schema)")
    p.add_argument("--overrides-file", default=None,
                   help="file of Hydra overrides, one per line (applied before the command line's)")


def read_overrides_file(path: str | None) -> list[str]:
    """One Hydra override per line ('#' comments and blank lines skipped): how the Helm chart's
    ConfigMap reaches `specd serve` without shell word-splitting of values."""
    if not path:
        return []
    with open(path) as f:
        return [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]


def add_cli(subparsers) -> None:
    """Register `specd serve` (called by cluster/cli.py)."""
    p = subparsers.add_parser("serve", help="start the gRPC and HTTP servers (local Ray by default)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_options(p)
    p.add_argument("--check", action="store_true",
                   help="validate the configuration (schema, ranges, groups) and exit: 0 = it would start")
    add_console_options(p)
    p.set_defaults(func=_cmd_serve)


def add_console_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verbose", action="store_true",
                   help="every log record on the console (Ray's, gRPC's, the actors'): server.verbose=true")
    p.add_argument("--log-file", default=None,
                   help="where every record goes at INFO (default: <cache>/logs/serve-<time>-<pid>.log)")


def main(argv: list[str] | None = None) -> int:
    """`python -m specd.cluster.serve [overrides]`: `specd serve` (benchmarks start it this way)."""
    parser = argparse.ArgumentParser(prog="python -m specd.cluster.serve")
    add_config_options(parser)
    add_console_options(parser)
    return _cmd_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
