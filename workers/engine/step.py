"""The speculative step, written once for the in-process engine and the router.

One step for a batch of running requests (`Sequence`s) of one replica, as gpt-fast's
speculative_decode reads:

    plan     the SpeculationPlanner (workers/engine/planner.py) picks each speculating request's γ or tree
             shape and stopping rule, or leaves the drafter alone this step (the guard, the pause)
    propose  the drafter drafts γ tokens or a token tree per speculating request, with q; the
             DraftItem also carries the previous step's outcome, so the drafter first rolls back
             to the verified prefix (one round trip per step). A plan of γ 0 for every request
             needs no draft: through Ray that call runs beside the verify
    verify   one target forward over [pending token, drafts] for the whole batch -> p; accepted
             drafts + one recovered or bonus token per request; the target's KV cache rolled back
    apply    each Sequence records the step (drafted, accepted, bonus, drafter version) and emits
             its new tokens, cut at EOS, stop tokens and max_new_tokens
    observe  the planner learns from the step's StepRecord (times, drafts, outcomes)

around which `start` (target prefill, then the drafter's start for requests that speculate) and
`release` (both workers free a finished request's slots) run as requests come and go.

Requests with speculation off, or a replica without a drafter, verify an empty draft: one token per
step, plain autoregressive decoding on the same target, the baseline every speed-up is measured
against. They never reach the drafter.

The step is async over TargetHandle / DrafterHandle (workers/engine/handles.py). SpecEngine runs it
synchronously with direct handles (`run_sync`: nothing ever suspends); the router's scheduler awaits
Ray actors, one SpecStep per pipeline group, so the drafter drafts group B while the target verifies
group A.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from specd.workers.core.guard import SpeculationGuard
from specd.workers.engine.handles import DrafterHandle, TargetHandle
from specd.workers.engine.planner import SpeculationPlanner, StepRecord
from specd.workers.engine.sequence import Sequence
from specd.workers.engine.trace import StepTrace
from specd.workers.engine.types import Draft, VerifyResult

log = logging.getLogger(__name__)
DRAFTER_RETRY_S = 2.0   # how often a step asks a failed drafter whether it is back
DRAFTER_PROBE_TIMEOUT_S = 0.5


@dataclass
class StepOutcome:
    seq: Sequence
    draft: Draft
    result: VerifyResult
    new_tokens: list[int]       # what the client gets from this step (cut at EOS, stop, length)


class SpecStep:
    """A failing drafter never fails a request: the requests it held finish by target-only decoding
    (exact, and not restarted), new requests are not drafted for until the drafter answers again (it
    is asked every DRAFTER_RETRY_S; a Ray actor restarts with empty caches), then `on_drafter_back`
    (the server's set-up of a fresh drafter: version store, cost profile) runs and speculation resumes."""

    def __init__(self, target: TargetHandle, drafter: DrafterHandle | None, planner: SpeculationPlanner, *,
                 hidden: bool = False, on_drafter_back: Callable[[], Awaitable[None]] | None = None):
        """planner: the drafter's SpeculationPlanner (the router's groups of one replica share one)."""
        self.target = target
        self.drafter = drafter
        self.planner = planner
        # The drafter reads the target's hidden states: start and verify return them with their tokens.
        self.hidden = hidden and drafter is not None
        self.on_drafter_back = on_drafter_back
        self.target_only: set[str] = set()       # requests whose drafter state was lost
        self.drafter_down_since: float | None = None
        # requests that finished while the drafter was down: a drafter whose process lived through the
        # failure (an error inside a call) still holds their slots, and is told once it answers again
        self.release_when_back: set[str] = set()
        self._last_probe = 0.0
        self.drafter_failures = 0                # drafter calls that raised
        self.fallback_requests = 0               # requests moved to target-only decoding by them
        self.trace = StepTrace.from_env()        # None unless SPECD_STEP_TRACE names a file (trace.py)

    @property
    def guard(self) -> SpeculationGuard | None:
        return self.planner.guard

    @property
    def guarded_steps(self) -> int:
        return self.planner.guarded_steps

    @property
    def paused_steps(self) -> int:
        return self.planner.pause.paused_steps

    @staticmethod
    async def create_planner(drafter: DrafterHandle | None,
                             guard: SpeculationGuard | None = None) -> SpeculationPlanner:
        """guard: measures decode throughput with speculation allowed and not, and turns drafting off while
        it loses (workers/core/guard.py). A drafter in the target's process and thread (a direct handle)
        costs the step its time: the plan prices its host work and catch-ups."""
        if drafter is None:
            return SpeculationPlanner()
        info = await drafter.planning_info()
        return SpeculationPlanner(info["spec"], colocated=drafter.mode == "direct", guard=guard,
                                  max_seq_len=info["max_seq_len"],
                                  held_out_acceptance=info["held_out_acceptance"])

    @classmethod
    async def create(cls, target: TargetHandle, drafter: DrafterHandle | None,
                     on_drafter_back: Callable[[], Awaitable[None]] | None = None,
                     guard: SpeculationGuard | None = None, planner: SpeculationPlanner | None = None
                     ) -> SpecStep:
        """planner None: a planner of this step's own (create_planner(drafter, guard))."""
        hidden = drafter is not None and await drafter.uses_target_hidden()
        if planner is None:
            planner = await cls.create_planner(drafter, guard)
        return cls(target, drafter, planner, hidden=hidden, on_drafter_back=on_drafter_back)

    async def profile(self) -> None:
        """The goodput policy's cost model starts from a timed sweep of this target's verify forward and of
        the drafter's forwards."""
        if self.drafter is None:
            return
        request = self.planner.cost_profile_request()
        if request is not None:
            verify = await self.target.profile_verify(**request)
            drafting = await self.drafter.profile_drafting()
            self.planner.set_cost_profile(verify["verify"], drafting["draft"],
                                          pad_weight=verify["pad_weight"], ragged=verify["ragged"],
                                          catch_up=drafting["catch_up"])

    def _speculates(self, seq: Sequence) -> bool:
        return (self.drafter is not None and seq.request.spec.enabled
                and seq.request_id not in self.target_only)

    def _drafter_failed(self, exc: Exception, request_ids: list[str]) -> None:
        if self.drafter_down_since is None:
            log.error("drafter failed (%s: %s): %d running requests go on by target-only decoding; "
                      "speculation resumes when it answers again", type(exc).__name__, exc, len(request_ids))
            self.drafter_down_since = time.monotonic()
        self._last_probe = time.monotonic()
        self.drafter_failures += 1
        self.target_only.update(request_ids)
        self.fallback_requests += len(request_ids)

    async def _drafter_up(self) -> bool:
        """False while a failed drafter has not answered again; asks it at most every DRAFTER_RETRY_S."""
        if self.drafter_down_since is None:
            return True
        if time.monotonic() - self._last_probe < DRAFTER_RETRY_S:
            return False
        self._last_probe = time.monotonic()
        try:
            probe = self.drafter.max_slots()
            if self.drafter.mode != "direct":
                # a restarting actor may hold the call until it is up: new requests must not wait for it
                probe = asyncio.wait_for(probe, DRAFTER_PROBE_TIMEOUT_S)
            await probe
            if self.on_drafter_back is not None:
                await self.on_drafter_back()
            if self.release_when_back:
                await self.drafter.release(sorted(self.release_when_back))
                self.release_when_back.clear()
        except Exception as exc:  # still down (or restarting): ask again later
            log.debug("drafter still unavailable: %r", exc)
            return False
        log.warning("drafter back after %.1f s: new requests speculate again",
                    time.monotonic() - self.drafter_down_since)
        self.drafter_down_since = None
        return True

    async def start(self, seqs: list[Sequence]) -> list[list[int]]:
        """Prefill newly admitted requests; returns the tokens each emitted (the first token)."""
        t0 = time.perf_counter()
        try:
            return await self._start(seqs)
        finally:
            if self.planner.guard is not None:
                self.planner.guard.prefill(t0, time.perf_counter())

    async def _start(self, seqs: list[Sequence]) -> list[list[int]]:
        first, hidden = await self.target.start([s.request for s in seqs], return_hidden=self.hidden)
        new_tokens = [seq.start(list(tokens)) for seq, tokens in zip(seqs, first, strict=True)]
        drafting = [i for i, s in enumerate(seqs) if self._speculates(s) and not s.finished]
        if drafting and not await self._drafter_up():
            self.target_only.update(seqs[i].request_id for i in drafting)
            self.fallback_requests += len(drafting)
        elif drafting:
            try:
                await self.drafter.start(
                    [seqs[i].request for i in drafting],
                    [list(first[i]) for i in drafting],
                    [hidden[i] for i in drafting] if hidden is not None else None,
                )
                self.planner.start([seqs[i].request for i in drafting], [list(first[i]) for i in drafting])
            except Exception as exc:
                self._drafter_failed(exc, [seqs[i].request_id for i in drafting])
        return new_tokens

    async def step(self, seqs: list[Sequence]) -> list[StepOutcome]:
        """One plan, propose, verify, apply, observe round for every unfinished request of `seqs`."""
        live = [s for s in seqs if not s.finished]
        if not live:
            return []
        sid = self.planner.step_began()
        try:
            outcomes, record = await self._step(live)
        finally:
            alone = self.planner.step_ended(sid)
        record.alone = alone
        self.planner.observe(record)
        if self.trace is not None:
            self.trace.write(record, sum(len(o.new_tokens) for o in outcomes))
        return outcomes

    async def _step(self, live: list[Sequence]) -> tuple[list[StepOutcome], StepRecord]:
        t0 = time.perf_counter()
        ids = [s.request_id for s in live]
        drafting = [s for s in live if self._speculates(s)]
        plan = self.planner.begin(drafting)
        proposed: list[Draft] = []
        propose_seconds = 0.0
        beside: asyncio.Future | None = None
        if plan.items:
            try:
                if self.drafter.mode == "direct":
                    # the drafter is in this process: it commits and hints first, so the plan reads
                    # this step's hints (through Ray they come with the drafts, one step old)
                    self.planner.take_hints(plan.items, await self.drafter.prepare(plan.items))
                self.planner.decide(plan.items)
                if self.drafter.mode != "direct" and not any(item.gamma for item in plan.items):
                    # Nothing to draft: the call only commits the last outcome and looks up the hints
                    # the next plan reads, which this verify does not need. It runs beside the verify
                    # (the drafter's own process), not before it (docs/decisions/propose-beside-verify.md).
                    beside = asyncio.ensure_future(self.drafter.propose(plan.items))
                else:
                    proposed = await self.drafter.propose(plan.items)
            except Exception as exc:
                self._drafter_failed(exc, [item.request_id for item in plan.items])
            propose_seconds = time.perf_counter() - t0
        asked = {d.request_id for d in proposed}
        plain = [Draft(s.request_id, []) for s in live if s.request_id not in asked]
        drafts = _in_order([*proposed, *plain], ids, "propose")
        try:
            results = _in_order(await self.target.verify(drafts, return_hidden=self.hidden), ids, "verify")
        finally:
            if beside is not None:
                waited = time.perf_counter()
                proposed = await self._hints_beside(beside, plan.items)
                propose_seconds += time.perf_counter() - waited
        outcomes = []
        for seq, draft, result in zip(live, drafts, results, strict=True):
            version = draft.drafter_version if result.num_drafted else None
            skipped = seq.request_id in plan.skipped
            emitted = seq.apply(result, drafter_version=version, drafter_skipped=skipped)
            outcomes.append(StepOutcome(seq, draft, result, emitted))
        t1 = time.perf_counter()
        record = StepRecord(
            batch=len(live), eligible=bool(drafting), allowed=plan.allowed, skipped=bool(plan.skipped),
            drafts=proposed, results=results, rows=[1 + len(d.tokens) for d in drafts],
            verify_seconds=results[0].verify_seconds, propose_seconds=propose_seconds,
            host_seconds=t1 - t0 - results[0].verify_seconds, started=t0, finished=t1)
        return outcomes, record

    async def _hints_beside(self, call: asyncio.Future, items) -> list[Draft]:
        """The drafts of a propose that ran beside the verify (a plan of γ 0 for every item): empty, so the
        verify lost nothing by not waiting; what they carry (hints, a hot swap) is for the next plan."""
        try:
            drafts = await call
        except Exception as exc:
            self._drafter_failed(exc, [item.request_id for item in items])
            return []
        for d in drafts:
            if d.tokens:
                # a drafter bug, not a request's: the verify saw none of these tokens, so none was drafted
                log.error("drafter %s drafted %d tokens for a plan of γ 0; dropped", d.drafter_version,
                          len(d.tokens))
                d.tokens, d.parents, d.probs = [], None, None
        return drafts

    async def release(self, request_ids: list[str]) -> None:
        """Free the requests' slots on both workers (ids a worker does not hold are ignored)."""
        if not request_ids:
            return
        self.target_only.difference_update(request_ids)
        self.planner.release(request_ids)
        await self.target.release(request_ids)
        if self.drafter is None:
            return
        if self.drafter_down_since is not None:
            self.release_when_back.update(request_ids)
            return
        try:
            await self.drafter.release(request_ids)
        except Exception as exc:
            self.release_when_back.update(request_ids)
            self._drafter_failed(exc, [])


def _in_order(records: list, ids: list[str], what: str) -> list:
    """The worker's records in the order of `ids`; a missing or extra record is a worker bug."""
    by_id = {r.request_id: r for r in records}
    if len(records) != len(ids) or set(by_id) != set(ids):
        raise RuntimeError(f"{what} returned records for {sorted(by_id)}, expected {sorted(ids)}")
    return [by_id[i] for i in ids]
