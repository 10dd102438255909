"""Continuous batching with a two-stage draft/verify pipeline across devices.

Each replica is a (TargetWorker, DraftWorker) pair. Its running requests are split into
`pipeline_groups` groups, and every group runs its own loop of the speculative step
(workers/engine/step.py, the same code the in-process engine runs):

    start the group's newly admitted requests (target prefill, then drafter start)
    step: propose on the drafter, verify on the target, apply to each request's Sequence
    emit tokens, retire finished and cancelled requests (release on both workers)

A worker runs one call at a time (a Ray actor, or one thread in-process), so with two groups the
loops interleave into a pipeline: the drafter drafts group B while the target verifies group A.
With one group the schedule is the plain unpipelined alternation. Requests join a group (the
smallest) and leave it between steps. The previous step's verify result travels in the next
DraftItem's commit fields, so the drafter rolls back to the verified prefix in the same call.

Each request's stopping rules, γ cap, commit fields and step statistics live in
specd.workers.engine.sequence.Sequence. No Ray or gRPC here: workers are reached through the typed handles of
workers/engine/handles.py, so tests drive the scheduler with in-process fakes (each on its own thread)
and the server with Ray actor handles.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from specd.cluster.admission import Admission
from specd.cluster.requests import (  # QueueFull and ServedStats: the scheduler's API, re-exported
    FinishEvent,
    QueueFull,  # noqa: F401
    RequestHandle,
    SchedulerObserver,
    ServedRequest,
    ServedStats,  # noqa: F401
    TokensEvent,
)
from specd.workers.core.guard import SpeculationGuard
from specd.workers.engine.handles import DrafterHandle, TargetHandle
from specd.workers.engine.sequence import Sequence
from specd.workers.engine.step import SpecStep, StepOutcome
from specd.workers.engine.types import FinishReason, NewRequest

log = logging.getLogger(__name__)
REPLICA_RETRY_S = 2.0     # how often a replica whose target died is asked whether it is back


@dataclass
class _Group:
    members: list[ServedRequest] = field(default_factory=list)
    pending: list[ServedRequest] = field(default_factory=list)   # admitted, started at the next step
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    step: SpecStep | None = None                             # set when the scheduler starts

    def size(self) -> int:
        return len(self.members) + len(self.pending)


class _Replica:
    def __init__(self, index: int, target: TargetHandle, drafter: DrafterHandle, capacity: int, groups: int):
        self.index = index
        self.target = target
        self.drafter = drafter
        self.capacity = capacity
        self.groups = [_Group() for _ in range(groups)]
        self.steps = 0
        self.drafter_version = ""
        self.hidden = False                # the drafter reads target hidden states (asked at start)
        self.down = False                  # its target died: out of dispatch until it answers again
        self.busy_base = (0.0, 0.0)        # workers' busy_seconds when the scheduler started
        self.active_seconds = 0.0          # wall time with at least one request on this replica
        self.active_since: float | None = None

    def size(self) -> int:
        return sum(g.size() for g in self.groups)

    def active_total(self, now: float) -> float:
        return self.active_seconds + (now - self.active_since if self.active_since is not None else 0.0)


class Scheduler(Admission):
    def __init__(
        self,
        replicas: list[tuple[Any, Any]],
        *,
        capacity: int | list[int],
        max_queue: int,
        max_running: int,
        pipeline_groups: int,
        eos_token_ids: list[int] | tuple[int, ...] = (),
        observer: SchedulerObserver | None = None,
        on_drafter_back: Callable[[int], Awaitable[None]] | None = None,
        guard_window_steps: int = 0,
    ):
        """on_drafter_back(replica): set up a replica's drafter again after it failed and answers again
        (a restarted actor has lost its version store and cost profile); SpecStep calls it.
        guard_window_steps > 0: each replica's groups share a SpeculationGuard with windows of that many
        steps (workers/core/guard.py)."""
        if not replicas:
            raise ValueError("a scheduler needs at least one (target, drafter) replica")
        if pipeline_groups < 1:
            raise ValueError(f"pipeline_groups must be >= 1, got {pipeline_groups}")
        caps = capacity if isinstance(capacity, list) else [capacity] * len(replicas)
        self.replicas = [
            _Replica(
                i,
                _as_handle(TargetHandle, t, f"target-{i}"),
                _as_handle(DrafterHandle, d, f"drafter-{i}"),
                caps[i],
                pipeline_groups,
            )
            for i, (t, d) in enumerate(replicas)
        ]
        self.max_queue = max_queue
        self.max_running = max_running
        self.pipeline_groups = pipeline_groups
        self.eos_token_ids = tuple(eos_token_ids)
        self.observer = observer or SchedulerObserver()
        self.on_drafter_back = on_drafter_back
        self.guard_window_steps = guard_window_steps
        self._waiting: deque[ServedRequest] = deque()
        self._requests: dict[str, ServedRequest] = {}
        self._tasks: list[asyncio.Task] = []
        self._closing = False
        self.finished = 0
        self.tokens_generated = 0
        self.drafted = 0        # totals over finished requests (plain counters: a server runs for weeks)
        self.accepted = 0

    # ---- life cycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        for rep in self.replicas:
            rep.busy_base = await self._busy_seconds(rep)
            guard = SpeculationGuard(self.guard_window_steps) if self.guard_window_steps > 0 else None
            # one planner per drafter worker, shared by its groups: one cost model, guard and pause
            planner = await SpecStep.create_planner(rep.drafter, guard)
            for group in rep.groups:
                group.step = await SpecStep.create(rep.target, rep.drafter, planner=planner,
                                                   on_drafter_back=partial(self._drafter_back, rep))
            rep.hidden = rep.groups[0].step.hidden
            await rep.groups[0].step.profile()
            self._tasks += [asyncio.create_task(self._run_group(rep, g)) for g in rep.groups]

    async def reset_stats(self) -> None:
        """Start counting afresh (after warm-up): totals, busy baselines, active time."""
        self.finished = 0
        self.tokens_generated = 0
        self.drafted = 0
        self.accepted = 0
        now = time.perf_counter()
        for rep in self.replicas:
            rep.busy_base = await self._busy_seconds(rep)
            rep.steps = 0
            rep.active_seconds = 0.0
            rep.active_since = now if rep.active_since is not None else None

    async def stop(self) -> None:
        """Cancel every request, stop the loops, free every slot."""
        self._closing = True
        for req in list(self._requests.values()):
            self._finish(req, FinishReason.CANCELLED)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for rep in self.replicas:
            for g in rep.groups:
                await self._release(rep, g, [r.id for r in g.members])
                g.members.clear()
                g.pending.clear()
            rep.target.close()
            rep.drafter.close()
        self._requests.clear()
        self._waiting.clear()

    # ---- admission (cluster/admission.py) ---------------------------------------------------
    def submit(self, new: NewRequest, *, ignore_eos: bool = False) -> RequestHandle:
        """Queue a request; raises QueueFull when every slot is taken and the queue is at max_queue."""
        req = self._admit(new, ignore_eos)
        self._dispatch()
        return RequestHandle(req)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> None:
        """Stop a request (client cancel, deadline, stop string). Its slots are freed at the next step
        boundary of its group; a queued request just leaves the queue."""
        req = self._requests.get(request_id)
        if req is None or req.done:
            return
        self._finish(req, reason)
        if req in self._waiting:
            self._waiting.remove(req)
            del self._requests[req.id]
        for rep in self.replicas:
            for g in rep.groups:
                if req in g.pending:
                    g.pending.remove(req)
                    del self._requests[req.id]
                    self._update_activity(rep)
        self._dispatch()

    def _dispatch(self) -> None:
        """Move waiting requests into the least loaded replica's smallest group."""
        while self._waiting and self.running() < self.max_running:
            free = [r for r in self.replicas if not r.down and r.size() < r.capacity]
            if not free:
                break
            rep = min(free, key=_Replica.size)
            req = self._waiting.popleft()
            req.stats.replica = rep.index
            group = min(rep.groups, key=_Group.size)
            group.pending.append(req)
            group.wake.set()
            self._update_activity(rep)
        self.observer.on_queue(len(self._waiting), self.running())

    def _update_activity(self, rep: _Replica) -> None:
        now = time.perf_counter()
        if rep.size() > 0 and rep.active_since is None:
            rep.active_since = now
        elif rep.size() == 0 and rep.active_since is not None:
            rep.active_seconds += now - rep.active_since
            rep.active_since = None

    # ---- the step loop -------------------------------------------------------------------------
    async def _run_group(self, rep: _Replica, group: _Group) -> None:
        while not self._closing:
            group.wake.clear()
            if not group.size():
                await group.wake.wait()
                continue
            try:
                await self._step(rep, group)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a worker failure must not take the router down with it
                if is_dead_actor(exc):
                    await self._target_died(rep, group, exc)
                    continue
                log.exception("replica %d: step failed", rep.index)
                for req in group.members + group.pending:
                    self._finish(req, FinishReason.ERROR, error=f"{type(exc).__name__}: {exc}")
                group.members += group.pending
                group.pending = []
                await self._retire(rep, group)

    async def _step(self, rep: _Replica, group: _Group) -> None:
        await self._retire(rep, group)
        if group.pending:
            new, group.pending = group.pending, []
            group.members += new
            await self._start(group, new)
            await self._retire(rep, group)
        by_id = {r.id: r for r in group.members if not r.done}
        if not by_id:
            return
        outcomes = await group.step.step([r.seq for r in by_id.values()])
        rep.steps += 1
        for out in outcomes:
            self._apply_step(rep, by_id[out.seq.request_id], out)
        await self._retire(rep, group)

    async def _start(self, group: _Group, new: list[ServedRequest]) -> None:
        todo = [r for r in new if not r.done]
        if not todo:
            return
        now = time.perf_counter()
        for req in todo:
            req.stats.started_at = now
        new_tokens = await group.step.start([r.seq for r in todo])
        for req, tokens in zip(todo, new_tokens, strict=True):
            if not req.done:
                self._deliver(req, tokens)

    def _apply_step(self, rep: _Replica, req: ServedRequest, out: StepOutcome) -> None:
        if out.draft.drafter_version:
            rep.drafter_version = out.draft.drafter_version
        result = out.result
        depth = result.depth if result.depth is not None else result.num_drafted
        self.observer.on_step(rep.index, out.draft, result, depth)
        if not req.done:          # cancelled while the step ran: its tokens are never shown
            self._deliver(req, out.new_tokens)

    def _deliver(self, req: ServedRequest, new_tokens: list[int]) -> None:
        """Hand a step's new tokens (already cut at EOS and max_new_tokens by Sequence) to the client."""
        if new_tokens:
            if req.stats.first_token_at is None:
                req.stats.first_token_at = req.seq.first_token_time
                self.observer.on_first_token(req.stats.time_to_first_token)
            req.stats.completion_tokens = len(req.seq.output)
            self.tokens_generated += len(new_tokens)
            req.events.put_nowait(TokensEvent(new_tokens))
        if req.seq.finished:
            self._finish(req, req.seq.finish_reason)

    def _finish(self, req: ServedRequest, reason: FinishReason, error: str = "",
                unavailable: bool = False) -> None:
        if req.done:
            return
        req.done = True
        req.seq.abort(reason)
        req.stats.finished_at = req.seq.finish_time
        self.finished += 1
        self.drafted += req.stats.spec.drafted
        self.accepted += req.stats.spec.accepted
        req.events.put_nowait(FinishEvent(reason, req.stats, error, unavailable))
        self.observer.on_finish(reason, req.stats)
        self.observer.on_request_done(req.seq, reason)

    async def _retire(self, rep: _Replica, group: _Group) -> None:
        """Release finished and cancelled members on both workers, then admit waiting requests."""
        done = [r for r in group.members if r.done]
        if not done:
            return
        await self._release(rep, group, [r.id for r in done])
        group.members = [r for r in group.members if not r.done]
        for req in done:
            self._requests.pop(req.id, None)
        self._update_activity(rep)
        self._dispatch()

    @staticmethod
    async def _release(rep: _Replica, group: _Group, ids: list[str]) -> None:
        if not ids or group.step is None:
            return
        try:
            await group.step.release(ids)
        except Exception as exc:  # a failed release leaks a slot, never the router
            log.error("replica %d: release of %s failed: %r", rep.index, ids, exc)

    async def _target_died(self, rep: _Replica, group: _Group, exc: Exception) -> None:
        """Its KV caches are gone: requests that streamed nothing yet start again on another replica
        (or wait for one), the others end UNAVAILABLE; the replica leaves dispatch until it answers."""
        if not rep.down:
            rep.down = True
            log.error("replica %d: target died (%s); out of dispatch until it is back", rep.index,
                      type(exc).__name__)
            self._tasks.append(asyncio.create_task(self._watch_replica(rep)))
        requests, group.members, group.pending = group.members + group.pending, [], []
        ids = [r.id for r in requests]
        for req in requests:
            if req.done:
                self._requests.pop(req.id, None)
            elif not req.seq.output:
                req.seq = Sequence(req.new, req.seq.eos_token_ids)
                req.stats.spec = req.seq.stats
                self._waiting.appendleft(req)
            else:
                self._finish(req, FinishReason.ERROR, error=f"replica {rep.index}'s target died mid-stream "
                             f"({type(exc).__name__}); retry the request", unavailable=True)
                self._requests.pop(req.id, None)
        try:
            await rep.drafter.release(ids)
        except Exception as release_exc:  # the drafter may be gone too; its slots go with it
            log.warning("replica %d: drafter release failed: %r", rep.index, release_exc)
        self._update_activity(rep)
        self._dispatch()

    async def _watch_replica(self, rep: _Replica) -> None:
        """Ask a dead replica's target every 2 s; Ray restarts it (target.max_restarts) empty."""
        while rep.down and not self._closing:
            await asyncio.sleep(REPLICA_RETRY_S)
            try:
                await asyncio.wait_for(rep.target.busy_seconds(), REPLICA_RETRY_S)
            except Exception:  # still down or restarting
                continue
            rep.down = False
            rep.busy_base = await self._busy_seconds(rep)
            log.warning("replica %d: target back; in dispatch again", rep.index)
            self._dispatch()

    def serving_replicas(self) -> int:
        return sum(not r.down for r in self.replicas)

    async def _drafter_back(self, rep: _Replica) -> None:
        if self.on_drafter_back is not None:
            await self.on_drafter_back(rep.index)
        await rep.groups[0].step.profile()

    # ---- statistics ----------------------------------------------------------------------------
    async def _busy_seconds(self, rep: _Replica) -> tuple[float, float]:
        t, d = await asyncio.gather(rep.target.busy_seconds(), rep.drafter.busy_seconds(),
                                    return_exceptions=True)
        # a failed (restarting) drafter reports nothing; its replica goes on target-only meanwhile
        return (0.0 if isinstance(t, BaseException) else t), (0.0 if isinstance(d, BaseException) else d)

    async def worker_stats(self) -> list[dict]:
        """Per replica: busy fractions of both workers over the time it had requests, and their overlap.

        overlap_fraction = max(0, target + drafter busy - active) / active is the least share of the
        active time in which both computed at once; an unpipelined schedule keeps it near 0.
        """
        now = time.perf_counter()
        out = []
        for rep in self.replicas:
            t, d = await self._busy_seconds(rep)
            steps = [g.step for g in rep.groups if g.step is not None]
            goodput = steps[0].planner.goodput_stats() if steps else {"predicted": 0.0, "measured": 0.0}
            t -= rep.busy_base[0]
            d -= rep.busy_base[1]
            active = rep.active_total(now)
            scale = 1.0 / active if active > 0 else 0.0
            out.append({
                "replica": rep.index,
                "drafter_version": rep.drafter_version,
                "target_busy_s": t,
                "drafter_busy_s": d,
                "active_s": active,
                "target_busy_fraction": t * scale,
                "drafter_busy_fraction": d * scale,
                "overlap_fraction": max(0.0, t + d - active) * scale,
                "running": rep.size(),
                "free_slots": rep.capacity - rep.size(),
                "steps": rep.steps,
                "goodput_predicted": goodput["predicted"],   # tokens/s the γ plans promised (EMA)
                "goodput_measured": goodput["measured"],     # tokens/s the steps delivered (EMA)
                "drafter_failures": sum(st.drafter_failures for st in steps),
                "drafter_fallback_requests": sum(st.fallback_requests for st in steps),
                "drafter_down": any(st.drafter_down_since is not None for st in steps),
                # calls a compiled graph carried (ray.compiled_calls; cluster/compiled_calls.py)
                "compiled_calls": {"target": _graph_calls(rep.target), "drafter": _graph_calls(rep.drafter)},
                "guarded_steps": steps[0].guarded_steps if steps else 0,   # the groups share one planner
                **(steps[0].guard.stats() if steps and steps[0].guard is not None else {}),
            })
        return out


def is_dead_actor(exc: BaseException) -> bool:
    """A Ray actor that died or cannot be reached (not an exception its method raised)."""
    try:
        from ray.exceptions import ActorUnavailableError, RayActorError
    except ImportError:
        return False
    return isinstance(exc, RayActorError | ActorUnavailableError)


def _graph_calls(handle: Any) -> int:
    return int(getattr(handle.transport, "compiled_calls", 0))


def _as_handle(cls: type, worker: Any, name: str) -> Any:
    """A handle of `cls` for a Ray actor or an in-process worker (which then runs on its own thread)."""
    return worker if isinstance(worker, cls) else cls(worker, name)
