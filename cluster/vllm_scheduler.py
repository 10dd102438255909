"""The router's scheduler for target.backend=vllm: the same interface as cluster/scheduler.py's Scheduler
(submit/abort/generate, admission, worker_stats, observer hooks), over VllmTarget actors
(cluster/vllm_actor.py) instead of stepping TargetWorker/DraftWorker actors itself.

Each replica's actor steps its own vLLM engine; a pump task per replica long-polls its events and hands
them to the request's RequestHandle, so the router's gRPC layer (validation, auth, streaming, stop
strings, deadlines) is unchanged. A cancelled or expired request finishes here at once and is aborted in
vLLM (its slot and KV blocks freed); tokens that still arrive for it are dropped.

What vLLM's interface cannot do is said at start (`vllm_limits`), not silently dropped: its rejection
sampler takes drafts as one-hot, so drafts are greedy (no sampled drafts with q) and chains only (no
trees); the γ policy is engine-wide. A request's speculation on/off and γ cap reach specd's proposer
(workers/engine/vllm_link.py); a tree width, another γ policy, or settings the engine cannot hear are
refused with INVALID_ARGUMENT at the router (cluster/vllm_serve.py: vllm_bounds).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from specd.cluster.admission import Admission
from specd.cluster.requests import (
    FinishEvent,
    RequestHandle,
    SchedulerObserver,
    ServedRequest,
    TokensEvent,
)
from specd.cluster.vllm_actor import FinishOut, TokensOut
from specd.workers.engine.types import FinishReason, NewRequest

log = logging.getLogger(__name__)
POLL_S = 0.5
MAX_ABORTING = 256    # aborted requests per replica whose steps may still come back from its actor


def vllm_limits(cfg) -> list[str]:
    """The configured features a vLLM target does not apply, each with its reason (logged at start)."""
    out = []
    if cfg.spec.tree_width > 1 or getattr(cfg.spec, "tree_width_max", 1) > 1:
        out.append("token trees (spec.tree_width/tree_width_max > 1): vLLM verifies chains only")
    out.append("sampled drafts with q: vLLM verifies drafts as one-hot, so specd's proposer drafts greedily "
               "(lossless at every temperature)")
    out.append(f"per-request gamma_policy and tree_width: vLLM's speculative config is engine-wide "
               f"(spec.policy={cfg.spec.policy}; requests are refused otherwise)")
    if cfg.server.pipeline_groups > 1:
        out.append("server.pipeline_groups: vLLM runs the drafter in line with the target")
    if cfg.target.vllm_speculation == "vllm-draft-model":
        out.append(f"spec.policy={cfg.spec.policy}, the suffix index and per-request speculation settings: "
                   f"vLLM's own draft_model proposer drafts spec.gamma={cfg.spec.gamma} tokens every step "
                   "(requests that set speculation.enabled or gamma are refused)")
    return out


class _VllmReplica:
    def __init__(self, index: int, actor, capacity: int):
        self.index = index
        self.actor = actor
        self.capacity = capacity
        self.members: dict[str, ServedRequest] = {}
        # aborted here, their records not yet written: the actor's FinishOut brings their steps
        self.aborting: dict[str, tuple[ServedRequest, FinishReason]] = {}
        self.steps = 0                  # read by the health prober
        self.drafter_version: str | None = None
        self.busy_base = 0.0
        self.active_since: float | None = None
        self.active_seconds = 0.0

    def size(self) -> int:
        return len(self.members)

    def update_activity(self, now: float) -> None:
        if self.members and self.active_since is None:
            self.active_since = now
        elif not self.members and self.active_since is not None:
            self.active_seconds += now - self.active_since
            self.active_since = None

    def active_total(self, now: float) -> float:
        return self.active_seconds + (now - self.active_since if self.active_since is not None else 0.0)


class VllmScheduler(Admission):
    def __init__(self, actors: list, *, capacity: list[int], max_queue: int, max_running: int,
                 eos_token_ids=(), observer: SchedulerObserver | None = None):
        if not actors:
            raise ValueError("a scheduler needs at least one vLLM replica")
        self.replicas = [_VllmReplica(i, a, c) for i, (a, c) in enumerate(zip(actors, capacity, strict=True))]
        self.max_queue = max_queue
        self.max_running = max_running
        self.eos_token_ids = tuple(eos_token_ids)
        self.observer = observer or SchedulerObserver()
        self._waiting: deque[ServedRequest] = deque()
        self._requests: dict[str, ServedRequest] = {}
        self._tasks: list[asyncio.Task] = []
        self._closing = False
        self._ignore_eos: dict[str, bool] = {}
        self.finished = 0
        self.tokens_generated = 0
        self.drafted = 0
        self.accepted = 0

    # ---- life cycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._pump(rep)) for rep in self.replicas]

    async def reset_stats(self) -> None:
        self.finished = self.tokens_generated = self.drafted = self.accepted = 0
        now = time.perf_counter()
        for rep in self.replicas:
            rep.busy_base = (await rep.actor.stats.remote())["busy_s"]
            rep.steps = 0
            rep.active_seconds = 0.0
            rep.active_since = now if rep.active_since is not None else None

    async def stop(self) -> None:
        self._closing = True
        for req in list(self._requests.values()):
            self._finish(req, FinishReason.CANCELLED)
        for rep in self.replicas:
            if rep.members:
                await rep.actor.abort.remote(list(rep.members))
                rep.members.clear()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self._requests.clear()
        self._waiting.clear()
        for rep in self.replicas:
            try:
                await rep.actor.close.remote()
            except Exception as exc:  # a dead actor has nothing left to close
                log.warning("replica %d: close failed: %r", rep.index, exc)

    # ---- admission (cluster/admission.py) ---------------------------------------------------
    def submit(self, new: NewRequest, *, ignore_eos: bool = False) -> RequestHandle:
        req = self._admit(new, ignore_eos)
        self._ignore_eos[req.id] = ignore_eos
        self._dispatch()
        return RequestHandle(req)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> None:
        """Finish a request now (client cancel, deadline, stop string) and abort it in vLLM."""
        req = self._requests.pop(request_id, None)
        if req is None or req.done:
            return
        running = next((rep for rep in self.replicas if rep.members.pop(request_id, None) is not None), None)
        # a running request's record waits for the steps its actor still holds (_end writes it)
        self._finish(req, reason, record=running is None)
        if req in self._waiting:
            self._waiting.remove(req)
            self._ignore_eos.pop(request_id, None)
        if running is not None:
            if len(running.aborting) >= MAX_ABORTING:   # an actor that never answered: record the oldest
                oldest, oldest_reason = running.aborting.pop(next(iter(running.aborting)))
                self.observer.on_request_done(oldest.seq, oldest_reason)
            running.aborting[request_id] = (req, reason)
            running.actor.abort.remote([request_id])
            running.update_activity(time.perf_counter())
        self._dispatch()

    def _dispatch(self) -> None:
        while self._waiting and self.running() < self.max_running:
            free = [r for r in self.replicas if r.size() < r.capacity]
            if not free:
                break
            rep = min(free, key=_VllmReplica.size)
            req = self._waiting.popleft()
            req.stats.started_at = time.perf_counter()
            req.stats.replica = rep.index
            rep.members[req.id] = req
            rep.update_activity(req.stats.started_at)
            rep.actor.submit.remote([req.new], self._ignore_eos.pop(req.id, False))
        self.observer.on_queue(len(self._waiting), self.running())


    # ---- events --------------------------------------------------------------------------------
    async def _pump(self, rep: _VllmReplica) -> None:
        while not self._closing:
            for event in await rep.actor.poll.remote(POLL_S):
                req = rep.members.get(event.request_id)
                if isinstance(event, TokensOut):
                    rep.steps += 1
                    if req is not None and not req.done:
                        self._deliver(req, event.tokens)
                elif isinstance(event, FinishOut):
                    self._end(rep, req, event)

    def _deliver(self, req: ServedRequest, tokens: list[int]) -> None:
        seq = req.seq
        new_tokens = seq.start(tokens) if not seq.output else seq.append(tokens)
        if new_tokens:
            if req.stats.first_token_at is None:
                req.stats.first_token_at = seq.first_token_time
                self.observer.on_first_token(req.stats.time_to_first_token)
            req.stats.completion_tokens = len(seq.output)
            self.tokens_generated += len(new_tokens)
            req.events.put_nowait(TokensEvent(new_tokens))

    def _end(self, rep: _VllmReplica, req: ServedRequest | None, event: FinishOut) -> None:
        if event.drafter_version:
            rep.drafter_version = event.drafter_version
        for draft, result in event.steps:
            # where the proposer filed no ids, draft.tokens is the accepted prefix: the replay recorder
            # counts the rest as unseen (result.num_drafted says how many)
            self.observer.on_step(rep.index, draft, result, result.num_drafted)
        aborted = rep.aborting.pop(event.request_id, None)
        if aborted is not None:          # its client got its answer already; now its record, steps and all
            self.observer.on_request_done(aborted[0].seq, aborted[1])
        if req is None:
            return
        rep.members.pop(req.id, None)
        self._requests.pop(req.id, None)
        rep.update_activity(time.perf_counter())
        if not req.done:
            req.seq.stats.__dict__.update(event.stats.__dict__)
            reason = req.seq.finish_reason if req.seq.finished else FinishReason(event.reason)
            self._finish(req, reason, event.error)
        self._dispatch()

    def _finish(self, req: ServedRequest, reason: FinishReason, error: str = "", record: bool = True) -> None:
        """record=False: the request's replay record is written later, when its actor's steps arrive."""
        if req.done:
            return
        req.done = True
        req.seq.abort(reason)
        req.stats.finished_at = req.seq.finish_time
        self.finished += 1
        self.drafted += req.stats.spec.drafted
        self.accepted += req.stats.spec.accepted
        req.events.put_nowait(FinishEvent(reason, req.stats, error))
        self.observer.on_finish(reason, req.stats)
        if record:
            self.observer.on_request_done(req.seq, reason)

    # ---- statistics ----------------------------------------------------------------------------
    def serving_replicas(self) -> int:
        return len(self.replicas)

    async def worker_stats(self) -> list[dict]:
        now = time.perf_counter()
        out = []
        for rep in self.replicas:
            s = await rep.actor.stats.remote()
            active = rep.active_total(now)
            busy = s["busy_s"] - rep.busy_base
            scale = 1.0 / active if active > 0 else 0.0
            out.append({
                "replica": rep.index, "drafter_version": s["drafter_version"] or rep.drafter_version,
                "target_busy_s": busy, "drafter_busy_s": 0.0, "active_s": active,
                "target_busy_fraction": busy * scale, "drafter_busy_fraction": 0.0, "overlap_fraction": 0.0,
                "running": rep.size(), "free_slots": rep.capacity - rep.size(), "steps": rep.steps,
                "goodput_predicted": 0.0, "goodput_measured": 0.0, "drafter_failures": 0,
                "drafter_fallback_requests": 0, "drafter_down": False, "guarded_steps": 0,
                "vllm_running": s["running"], "vllm_unfinished": s["vllm_unfinished"],
            })
        return out

