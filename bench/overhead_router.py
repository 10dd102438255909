"""`specd bench overhead` through the router: the scheduler's step loop over Ray actors.

The speculation guard is off (workers/core/guard.py): it turns drafting off when speculative steps
deliver fewer tokens per second than plain ones, and with free forwards they always do, so with it
the cells would measure plain steps whatever the system. The in-process engine runs without it too.

The router's Scheduler (cluster/scheduler.py) drives one replica whose TargetWorker and DraftWorker
are Ray actors (cluster/actors.create_cluster, stand-in models with free forwards in bench/free_models.py
or the real ones). A step's host time is the wall time of one SpecStep.step call of a group: the
propose and verify round trips to the actors, (de)serialisation, both workers' host work and the
step's own. gRPC is not in it. Each group's step is timed by wrapping it after the scheduler starts;
propose and verify are timed on the scheduler's side (the handles' awaits).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

from specd.bench.overhead import MAX_SEQ_LEN, PROMPT_LEN, TREE_MARGIN, median_ms, prompts, system_setup


class _StepClock:
    """Per-step wall seconds of every group's SpecStep.step, and of its propose and verify awaits."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, float, float, int]] = []   # (step, propose, verify, tokens)
        self._propose = self._verify = 0.0

    def wrap_handle(self, handle, name: str) -> None:
        call = getattr(handle, name)

        async def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return await call(*args, **kwargs)
            finally:
                if name == "propose":
                    self._propose += time.perf_counter() - t0
                else:
                    self._verify += time.perf_counter() - t0

        setattr(handle, name, timed)

    def wrap_step(self, step) -> None:
        call = step.step

        async def timed(seqs):
            self._propose = self._verify = 0.0
            t0 = time.perf_counter()
            outcomes = await call(seqs)
            took = time.perf_counter() - t0
            self.steps.append((took, self._propose, self._verify, sum(len(o.new_tokens) for o in outcomes)))
            return outcomes

        step.step = timed


async def _cell(cluster, cfg, system: str, batch: int, steps: int, warmup: int, groups: int,
                salt: int) -> dict[str, Any]:
    from specd.cluster.actors import replica_handles
    from specd.cluster.compiled_calls import wait_compiled
    from specd.cluster.scheduler import Scheduler
    from specd.workers.core.sampling import SamplingParams
    from specd.workers.engine.types import NewRequest

    _, spec = system_setup(system, cfg.spec)
    rep = cluster.replicas[0]
    handles = replica_handles(cluster, cfg.ray.compiled_calls, cfg.ray.compiled_calls_idle_s)[:1]
    scheduler = Scheduler(handles, capacity=batch, max_queue=batch, max_running=batch,
                          pipeline_groups=groups, eos_token_ids=(), guard_window_steps=0)
    await scheduler.start()
    await wait_compiled([h for pair in handles for h in pair])   # time the graph, not plain calls
    clock = _StepClock()
    for r in scheduler.replicas:
        clock.wrap_handle(r.target, "verify")
        clock.wrap_handle(r.drafter, "propose")
        for g in r.groups:
            clock.wrap_step(g.step)
    max_new = MAX_SEQ_LEN - PROMPT_LEN - TREE_MARGIN
    reqs = [NewRequest(f"overhead-router-{system}-{batch}-{salt}-{i}", p, SamplingParams(), max_new, spec)
            for i, p in enumerate(prompts(batch, salt))]
    streams = [scheduler.submit(r, ignore_eos=True) for r in reqs]

    async def drain(stream) -> None:
        async for _event in stream:
            pass

    tasks = [asyncio.create_task(drain(s)) for s in streams]
    busy0 = busy1 = None
    try:
        while len(clock.steps) < warmup + steps:
            if all(t.done() for t in tasks):
                raise RuntimeError("requests ended before the timed steps: fewer --steps")
            if busy0 is None and len(clock.steps) >= warmup:
                busy0 = (len(clock.steps), await _busy(rep))
            await asyncio.sleep(0.05)
        busy1 = (len(clock.steps), await _busy(rep))
    finally:
        await scheduler.stop()
        await asyncio.gather(*tasks, return_exceptions=True)
    timed = clock.steps[warmup:warmup + steps]
    # Each actor's own seconds inside its calls (TargetWorker/DraftWorker.busy_seconds), per step: what
    # the step's wall time leaves to Ray's transport and the processes' contention for the CPUs.
    n0, (d0, t0) = busy0 or (0, (0.0, 0.0))
    n1, (d1, t1) = busy1
    per_step = max(n1 - n0, 1)
    return {
        "system": system, "batch": batch, "where": "router", "compiled_calls": bool(cfg.ray.compiled_calls),
        "host_ms_per_step": median_ms([s[0] for s in timed]), "clock": "wall time",
        "phases_ms": {"propose": median_ms([s[1] for s in timed]), "verify": median_ms([s[2] for s in timed]),
                      "rest": median_ms([s[0] - s[1] - s[2] for s in timed])},
        "steps": len(timed), "tokens_per_step": round(sum(s[3] for s in timed) / max(len(timed), 1), 3),
        "actor_busy_ms": {"drafter": round((d1 - d0) / per_step * 1e3, 3),
                          "target": round((t1 - t0) / per_step * 1e3, 3)},
    }


async def _busy(rep) -> tuple[float, float]:
    """(drafter, target) busy seconds so far; a replica without a drafter counts 0 for it."""
    drafter = float(await rep.drafter.busy_seconds.remote()) if rep.drafter is not None else 0.0
    return drafter, float(await rep.target.busy_seconds.remote())


def run_router_cells(cfg, systems: list[str], batch_sizes: list[int], steps: int, warmup: int, free: bool,
                     groups: int, drafts: str = "accepted") -> list[dict[str, Any]]:
    """Every (system, batch) cell through one Ray cluster per drafter kind; Ray is shut down after."""
    import ray

    from specd.bench.overhead import free_classes
    from specd.cluster import actors

    classes = free_classes(drafts) if free else (None, None)
    started = actors.init_ray(cfg)
    rows = []
    try:
        by_kind: dict[str, list[str]] = {}
        for system in systems:
            overrides, _ = system_setup(system, cfg.spec)
            by_kind.setdefault("model" if overrides else cfg.drafter.kind, []).append(system)
        for kind, names in by_kind.items():
            kcfg = replace(cfg, drafter=replace(cfg.drafter, kind=kind))
            cluster = actors.create_cluster(kcfg, cfg.target.model_path, *classes)
            try:
                for system in names:
                    for batch in batch_sizes:
                        rows.append(asyncio.run(_cell(cluster, kcfg, system, batch, steps, warmup, groups,
                                                      len(rows))))
            finally:
                actors.shutdown_cluster(cluster)
    finally:
        if started:
            ray.shutdown()
    return rows
