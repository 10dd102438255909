"""The speculative step, written once for the in-process engine and the router.

One step for a batch of running requests (`Sequence`s) of one replica:

    propose  the drafter drafts γ tokens or a token tree per speculating request, with q; the
             DraftItem also carries the previous step's outcome, so the drafter first rolls back
             to the verified prefix (one round trip per step)
    verify   one target forward over [pending token, drafts] for the whole batch -> p; accepted
             drafts + one recovered or bonus token per request; the target's KV cache rolled back
    apply    each Sequence records the step (drafted, accepted, bonus, drafter version) and emits
             its new tokens, cut at EOS, stop tokens and max_new_tokens

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
from specd.workers.engine.sequence import Sequence
from specd.workers.engine.types import Draft, VerifyResult

log = logging.getLogger(__name__)
DRAFTER_RETRY_S = 2.0   # how often a step asks a failed drafter whether it is back
DRAFTER_PROBE_TIMEOUT_S = 0.5
# When a batch of at least PAUSE_MIN_BATCH speculating requests got no draft at all (the γ policy found
# nothing worth drafting: high load, or traffic no drafter knows), and the drafter runs in the target's
# process (the in-process engine; not the router's actors), the next steps do not ask the drafter:
# its per-step work (commits, suffix lookups, the plan) is a share of every step, paid for nothing.
# The pause starts at PAUSE_STEPS and doubles while the drafter keeps drafting nothing, up to
# PAUSE_MAX_STEPS; a step that drafts ends it, and so does a smaller batch (what drafting costs and gains
# turns on the batch: with fewer requests it may pay again). The paused steps' outcomes reach the drafter
# together with the next DraftItem. Invariant: a paused step changes no output, only whether the
# drafter is asked. Why the cap is 32 and the smallest paused batch 8: docs/decisions/drafter-pause.md.
PAUSE_STEPS = 2
PAUSE_MAX_STEPS = 32
PAUSE_MIN_BATCH = 8
STEP_TIMES_MAX = 64   # step timings kept for the drafter while it is not asked (more add nothing)


class DrafterPause:
    """When not to ask a colocated drafter (see PAUSE_STEPS): plain logic, kept apart to be tested alone."""

    def __init__(self) -> None:
        self.remaining = 0                  # steps left that do not ask the drafter
        self.next = PAUSE_STEPS             # the next pause's length (doubles while nothing drafts)
        self.batch = 0                      # speculating requests when the pause began
        self.paused_steps = 0

    def skip(self, speculating: int) -> bool:
        """Whether this step, with `speculating` requests that would draft, leaves the drafter alone."""
        if self.remaining > 0 and speculating < self.batch:
            # The load fell: ask the drafter again now. The backoff stays: if it still drafts nothing,
            # the next pause is as long as this one would have grown.
            self.remaining = 0
        if self.remaining == 0:
            return False
        self.remaining -= 1
        self.paused_steps += 1
        return True

    def asked(self, proposed: int, drafted: bool, colocated: bool) -> None:
        """After the drafter was asked for `proposed` requests: a draft ends the backoff; nothing drafted
        for a batch of at least PAUSE_MIN_BATCH pauses a drafter that shares the target's device."""
        if drafted:
            self.next = PAUSE_STEPS
        elif proposed >= PAUSE_MIN_BATCH and colocated:
            self.remaining = min(self.next, PAUSE_MAX_STEPS)
            self.next = min(2 * self.remaining, PAUSE_MAX_STEPS)
            self.batch = proposed


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

    def __init__(self, target: TargetHandle, drafter: DrafterHandle | None, *, hidden: bool = False,
                 on_drafter_back: Callable[[], Awaitable[None]] | None = None,
                 guard: SpeculationGuard | None = None):
        """guard: measures decode throughput with speculation allowed and not, and turns drafting off while
        it loses (workers/core/guard.py); the router's groups of one replica share one."""
        self.target = target
        self.drafter = drafter
        self.guard = guard if drafter is not None else None
        self.guarded_steps = 0                   # steps the guard kept from drafting
        # The drafter reads the target's hidden states: start and verify return them with their tokens.
        self.hidden = hidden and drafter is not None
        # (tokens per row, seconds, tokens emitted) of this batch's previous verify: the goodput
        # policy's cost model follows measured steps.
        self._last_verify: tuple[list[int], float, int] | None = None
        self.on_drafter_back = on_drafter_back
        self.target_only: set[str] = set()       # requests whose drafter state was lost
        self.drafter_down_since: float | None = None
        self._last_probe = 0.0
        self.drafter_failures = 0                # drafter calls that raised
        self.fallback_requests = 0               # requests moved to target-only decoding by them
        # (requests, drafted, asked the drafter, wall less verify seconds) of the steps since the last
        # propose, for the goodput policy's host cost (DraftWorker.observe_steps); in-process only
        self._step_times: list[tuple[int, bool, bool, float]] = []
        # (requests, verify seconds) of plain steps that did not ask the drafter (paused, guarded): the
        # cost model's one-token price follows them too, not only the steps that asked. The profile runs
        # at short contexts and prices a step at real ones low; observed by only the few steps that
        # asked, that made drafting look relatively cheaper (docs/decisions/goodput-pricing.md).
        self._plain_verifies: list[tuple[int, float]] = []
        self.pause = DrafterPause()

    @property
    def paused_steps(self) -> int:
        return self.pause.paused_steps

    @classmethod
    async def create(cls, target: TargetHandle, drafter: DrafterHandle | None,
                     on_drafter_back: Callable[[], Awaitable[None]] | None = None,
                     guard: SpeculationGuard | None = None) -> SpecStep:
        hidden = drafter is not None and await drafter.uses_target_hidden()
        return cls(target, drafter, hidden=hidden, on_drafter_back=on_drafter_back, guard=guard)

    async def profile(self) -> None:
        """The goodput policy's cost model starts from a timed sweep of this target's verify forward."""
        if self.drafter is None:
            return
        request = await self.drafter.cost_profile_request()
        if request is not None:
            profile = await self.target.profile_verify(**request)
            await self.drafter.set_cost_profile(profile["verify"], pad_weight=profile["pad_weight"],
                                                ragged=profile["ragged"])

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
            if self.guard is not None:
                self.guard.prefill(t0, time.perf_counter())

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
            except Exception as exc:
                self._drafter_failed(exc, [seqs[i].request_id for i in drafting])
        return new_tokens

    async def step(self, seqs: list[Sequence]) -> list[StepOutcome]:
        """One draft + verify round for every unfinished request of `seqs`."""
        live = [s for s in seqs if not s.finished]
        if not live:
            return []
        t0 = time.perf_counter()
        ids = [s.request_id for s in live]
        drafting = [s for s in live if self._speculates(s)]
        eligible = bool(drafting)
        allowed = self.guard is None or self.guard.allowed
        skipped: set[str] = set()
        if drafting and not allowed:
            self.guarded_steps += 1
            skipped = {s.request_id for s in drafting}
            drafting = []
        elif drafting and self.pause.skip(len(drafting)):
            skipped = {s.request_id for s in drafting}
            drafting = []
        proposed = []
        if drafting:
            items = [s.next_draft_item() for s in drafting]
            try:
                proposed = await self.drafter.propose(items, last_verify=self._last_verify,
                                                      step_times=self._step_times or None,
                                                      plain_verifies=self._plain_verifies or None)
                self._step_times, self._plain_verifies = [], []
            except Exception as exc:
                self._drafter_failed(exc, [s.request_id for s in drafting])
                drafting = []
            # only a drafter that shares the target's device and thread costs the step its time; an
            # actor of its own (the router's) works while the target verifies
            self.pause.asked(len(proposed), any(d.tokens for d in proposed), self.drafter.mode == "direct")
        asked = {d.request_id for d in proposed}
        plain = [Draft(s.request_id, []) for s in live if s.request_id not in asked]
        drafts = _in_order([*proposed, *plain], ids, "propose")
        results = _in_order(await self.target.verify(drafts, return_hidden=self.hidden), ids, "verify")
        if drafting:
            rows = [1 + len(d.tokens) for d in drafts]
            emitted = sum(len(r.new_tokens) for r in results)
            self._last_verify = (rows, results[0].verify_seconds, emitted)
        elif skipped and len(self._plain_verifies) < STEP_TIMES_MAX:
            self._plain_verifies.append((len(live), results[0].verify_seconds))
        outcomes = []
        for seq, draft, result in zip(live, drafts, results, strict=True):
            version = draft.drafter_version if result.num_drafted else None
            emitted = seq.apply(result, drafter_version=version, drafter_skipped=seq.request_id in skipped)
            outcomes.append(StepOutcome(seq, draft, result, emitted))
        colocated = self.drafter is not None and self.drafter.mode == "direct"
        # Only steps with a speculating request teach the drafter what host work drafting adds: a step of
        # target-only requests alone (the engine bench's step-paired twin batch, or traffic with speculation
        # off) has no drafter work at all, and counted as a plain step it made drafting look dearer
        # (docs/decisions/bench-method.md).
        if colocated and eligible and len(self._step_times) < STEP_TIMES_MAX:
            seconds = time.perf_counter() - t0 - results[0].verify_seconds
            self._step_times.append((len(live), any(d.tokens for d in drafts), bool(proposed), seconds))
        if self.guard is not None and eligible:
            emitted = sum(len(o.new_tokens) for o in outcomes)
            self.guard.step(t0, time.perf_counter(), emitted, len(live), allowed)
        return outcomes

    async def release(self, request_ids: list[str]) -> None:
        """Free the requests' slots on both workers (ids a worker does not hold are ignored)."""
        if not request_ids:
            return
        self.target_only.difference_update(request_ids)
        await self.target.release(request_ids)
        if self.drafter is not None and self.drafter_down_since is None:
            try:
                await self.drafter.release(request_ids)
            except Exception as exc:
                self._drafter_failed(exc, [])


def _in_order(records: list, ids: list[str], what: str) -> list:
    """The worker's records in the order of `ids`; a missing or extra record is a worker bug."""
    by_id = {r.request_id: r for r in records}
    if len(records) != len(ids) or set(by_id) != set(ids):
        raise RuntimeError(f"{what} returned records for {sorted(by_id)}, expected {sorted(ids)}")
    return [by_id[i] for i in ids]
