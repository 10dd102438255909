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

from dataclasses import dataclass

from workers.engine.handles import DrafterHandle, TargetHandle
from workers.engine.sequence import Sequence
from workers.engine.types import Draft, VerifyResult


@dataclass
class StepOutcome:
    seq: Sequence
    draft: Draft
    result: VerifyResult
    new_tokens: list[int]       # what the client gets from this step (cut at EOS, stop, length)


class SpecStep:
    def __init__(self, target: TargetHandle, drafter: DrafterHandle | None, *, hidden: bool = False):
        self.target = target
        self.drafter = drafter
        # The drafter reads the target's hidden states: start and verify return them with their tokens.
        self.hidden = hidden and drafter is not None
        # (tokens per row, seconds, tokens emitted) of this batch's previous verify: the goodput
        # policy's cost model follows measured steps.
        self._last_verify: tuple[list[int], float, int] | None = None

    @classmethod
    async def create(cls, target: TargetHandle, drafter: DrafterHandle | None) -> SpecStep:
        hidden = drafter is not None and await drafter.uses_target_hidden()
        return cls(target, drafter, hidden=hidden)

    async def profile(self) -> None:
        """The goodput policy's cost model starts from a timed sweep of this target's verify forward."""
        if self.drafter is None:
            return
        request = await self.drafter.cost_profile_request()
        if request is not None:
            await self.drafter.set_cost_profile(await self.target.profile_verify(**request))

    def _speculates(self, seq: Sequence) -> bool:
        return self.drafter is not None and seq.request.spec.enabled

    async def start(self, seqs: list[Sequence]) -> list[list[int]]:
        """Prefill newly admitted requests; returns the tokens each emitted (the first token)."""
        first, hidden = await self.target.start([s.request for s in seqs], return_hidden=self.hidden)
        new_tokens = [seq.start(list(tokens)) for seq, tokens in zip(seqs, first, strict=True)]
        drafting = [i for i, s in enumerate(seqs) if self._speculates(s) and not s.finished]
        if drafting:
            await self.drafter.start(
                [seqs[i].request for i in drafting],
                [list(first[i]) for i in drafting],
                [hidden[i] for i in drafting] if hidden is not None else None,
            )
        return new_tokens

    async def step(self, seqs: list[Sequence]) -> list[StepOutcome]:
        """One draft + verify round for every unfinished request of `seqs`."""
        live = [s for s in seqs if not s.finished]
        if not live:
            return []
        ids = [s.request_id for s in live]
        drafting = [s for s in live if self._speculates(s)]
        proposed = []
        if drafting:
            items = [s.next_draft_item() for s in drafting]
            proposed = await self.drafter.propose(items, last_verify=self._last_verify)
        plain = [Draft(s.request_id, []) for s in live if not self._speculates(s)]
        drafts = _in_order([*proposed, *plain], ids, "propose")
        results = _in_order(await self.target.verify(drafts, return_hidden=self.hidden), ids, "verify")
        if drafting:
            rows = [1 + len(d.tokens) for d in drafts]
            emitted = sum(len(r.new_tokens) for r in results)
            self._last_verify = (rows, results[0].verify_seconds, emitted)
        outcomes = []
        for seq, draft, result in zip(live, drafts, results, strict=True):
            version = draft.drafter_version if result.num_drafted else None
            outcomes.append(StepOutcome(seq, draft, result, seq.apply(result, drafter_version=version)))
        return outcomes

    async def release(self, request_ids: list[str]) -> None:
        """Free the requests' slots on both workers (ids a worker does not hold are ignored)."""
        if not request_ids:
            return
        await self.target.release(request_ids)
        if self.drafter is not None:
            await self.drafter.release(request_ids)


def _in_order(records: list, ids: list[str], what: str) -> list:
    """The worker's records in the order of `ids`; a missing or extra record is a worker bug."""
    by_id = {r.request_id: r for r in records}
    if len(records) != len(ids) or set(by_id) != set(ids):
        raise RuntimeError(f"{what} returned records for {sorted(by_id)}, expected {sorted(ids)}")
    return [by_id[i] for i in ids]
