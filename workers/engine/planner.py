"""SpeculationPlanner: every decision about what a step drafts, on the scheduler's side.

One planner per drafter (the in-process engine's, or a router replica's, shared by its pipeline groups)
owns each request's γ policy and state (fixed, egag, confidence, adaptive, goodput: workers/core/gamma.py),
the goodput controller and its step cost model (workers/core/goodput.py), the drafter's measured
acceptance per position, the speculation guard (workers/core/guard.py) and the drafter pause. A step asks
it twice:

    plan(seqs)         which requests ask the drafter, and their DraftItems: γ (a tree's depth and width),
                       EGAG / confidence's stopping rule, whether to report a hint or draft a fallback
                       (begin, then decide; with the drafter in this process, take_hints in between)
    observe(record)    the step's StepRecord: verify, propose and host times, the drafts (with what the
                       drafter reported beside them) and each request's outcome

The drafter itself learns nothing of costs. What the plan reads of the drafter: the suffix drafter's
DraftHint for a request (its predicted acceptance) and the context a model draft would take in first.
Where the drafter shares the planner's process (the in-process engine, the vLLM proposer) it commits the
previous outcome and returns both before the plan (DraftWorker.prepare, direct calls, no extra round
trip); through Ray they arrive with the drafts, one step old. EGAG's entropy EMA and a hot swap of the
drafter's weights (its per-position counts then start again from the new version's held-out acceptance)
arrive with the drafts either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specd.workers.core.gamma import ACCEPTANCE_PRIOR, PRIOR_PROFILE, GammaPolicy, GammaState, GoodputGamma
from specd.workers.core.goodput import Acceptance, CostProfile, GoodputController, Slot, StepCostModel
from specd.workers.core.guard import SpeculationGuard
from specd.workers.core.planning import PositionCounts, build_policy, fit_tree, hinted_slot, tree_depth
from specd.workers.engine.sequence import Sequence
from specd.workers.engine.types import Draft, DraftItem, NewRequest, VerifyResult

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
# first-position model drafts a version must have had measured before its served / held-out ratio seeds
# the next version's counts
RATIO_MIN_DRAFTS = 30


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
class StepRecord:
    """One step as the planner learns from it (SpecStep fills it in after apply)."""

    batch: int                          # unfinished requests the step verified
    eligible: bool                      # some of them speculate (guard and pause aside)
    allowed: bool                       # the guard let them draft
    skipped: bool                       # the guard or the pause kept the drafter from being asked
    drafts: list[Draft]                 # what the drafter returned (empty: not asked, or it failed)
    results: list[VerifyResult]         # the verify results of the step, in batch order
    rows: list[int]                     # tokens per verified row: 1 + its draft's tokens
    verify_seconds: float               # the target's verify call
    propose_seconds: float              # the drafter's propose call as the step waited for it
    host_seconds: float                 # the step's wall time less its verify
    started: float                      # time.perf_counter() at the step's start and end (the guard)
    finished: float
    alone: bool = True                  # no other step of this planner was in flight while it ran

    @property
    def emitted(self) -> int:
        return sum(len(r.new_tokens) for r in self.results)


@dataclass
class StepPlan:
    """What plan() decided: the DraftItems of the requests that ask the drafter, and the ones kept from it."""

    items: list[DraftItem] = field(default_factory=list)
    skipped: set[str] = field(default_factory=set)
    allowed: bool = True


@dataclass
class _Request:
    request: NewRequest
    policy: GammaPolicy
    state: GammaState
    generated: int                  # tokens the target emitted so far (the prefill's first included)
    last_drafted: int = 0
    last_depth: int | None = None
    hinted: bool = False            # this step is planned from the drafter's DraftHint (a lookup draft)
    last_hinted: bool = False
    hint: object | None = None      # the drafter's latest DraftHint (one step old through Ray)
    pending: int = 0                # context a model draft would take in first, after the latest draft


class SpeculationPlanner:
    def __init__(self, spec=None, *, colocated: bool = False, max_seq_len: int | None = None,
                 held_out_acceptance: float | None = None, guard: SpeculationGuard | None = None) -> None:
        """spec: the operator's speculation config (configs/schema.py SpecConfig; None: a planner for a
        replica without a drafter). colocated: the drafter shares the target's device and thread (the
        in-process engine), so its work adds to the step's time. max_seq_len: the caches' context."""
        self.spec, self.colocated, self.max_seq_len = spec, colocated, max_seq_len
        self.guard = guard
        self.pause = DrafterPause()
        self.guarded_steps = 0
        self.held_out_acceptance = held_out_acceptance
        # served first-draft acceptance over the held-out figure of the versions before (see
        # _measure_served_ratio), greedy and sampled apart; 1 until a version drafted enough
        self.served_ratio = {True: 1.0, False: 1.0}
        self.costs = StepCostModel(PRIOR_PROFILE)
        self.controller = GoodputController(self.costs)
        self.requests: dict[str, _Request] = {}
        # greedy and sampled requests apart: the same drafter's drafts are accepted less under sampling, and
        # sampled requests seeded from greedy figures overdrafted (GSM8K, batch 16, T = 0.7: first-position
        # estimates of 0.5-0.7, 28 of 99 drafts accepted)
        self.positions = self._fresh_positions()
        self.last_plan = None              # the latest goodput plan (None: nobody on it)
        self.goodput_ema = {"predicted": 0.0, "measured": 0.0}
        # steps in flight (the pipeline groups of a router replica share this planner): id -> whether
        # another step ran beside it at any moment
        self._in_flight: dict[int, bool] = {}
        self._next_step = 0

    # ---- start-up and the cost model ------------------------------------------------------------------
    def cost_profile_request(self) -> dict | None:
        """What the target should sweep for set_cost_profile (TargetWorker.profile_verify kwargs), or None
        when no request can use the goodput policy's cost model (another default policy)."""
        if self.spec is None or self.spec.policy != GoodputGamma.name:
            return None
        return {"batch_sizes": list(self.spec.goodput_profile_batch_sizes),
                "max_tokens": 1 + max(self.spec.gamma_max, 1), "budget_s": self.spec.goodput_profile_budget_s}

    def set_cost_profile(self, verify: dict[int, list[float]], draft: dict[int, float],
                         pad_weight: float = 1.0, ragged: dict[int, float] | None = None,
                         catch_up: float | None = None) -> None:
        """The target's measured verify sweep and pad weight, the drafter's levels (workers/engine/profile.py)
        and its catch-up per context token (None: the prior's)."""
        profile = CostProfile(verify={int(b): list(v) for b, v in verify.items()},
                              draft={int(b): float(t) for b, t in draft.items()}, pad_weight=pad_weight,
                              ragged={int(b): float(t) for b, t in (ragged or {}).items()},
                              catch_up=PRIOR_PROFILE.catch_up if catch_up is None else catch_up)
        self.costs = StepCostModel(profile)
        self.controller.costs = self.costs

    def goodput_stats(self) -> dict:
        """Predicted vs measured tokens/s of the steps (EMAs), and the latest plan's γ."""
        plan = self.last_plan
        return {**self.goodput_ema, "depths": list(plan.depths) if plan else [],
                "widths": list(plan.widths) if plan else []}

    def _fresh_positions(self) -> dict[bool, PositionCounts]:
        prior = None if self.spec is None else self.spec.goodput_prior
        depth = max(self.spec.gamma_max, 1) if self.spec is not None else 16
        if prior is not None:
            return {greedy: PositionCounts(depth, prior=prior) for greedy in (True, False)}
        # what the drafter's first drafts got accepted on held-out prompts when it was trained: a general
        # drafter on GSM8K accepts ~0.1, and a flat prior had the plan try ~20 model drafts a worker
        # before its counts said so; scaled by what this traffic made of an earlier version's figure
        recorded = self.held_out_acceptance
        return {greedy: PositionCounts(depth, prior=ACCEPTANCE_PRIOR if recorded is None else
                                       min(1.0, recorded * self.served_ratio[greedy]))
                for greedy in (True, False)}

    def _measure_served_ratio(self, parent: float | None) -> None:
        """Before a version's counts go: what its first drafts achieved here over its held-out figure, per
        sampling mode, where it drafted enough to say (else the earlier ratio stays). parent: the outgoing
        version's figure as the gate scored it beside the incoming one, on the same records (else its own
        recorded figure; the first-start drafter's comes from its bootstrap's evaluation, another basis).
        The gate's figure is a greedy match over every position of held-out records; served, the model
        drafts where no lookup pays, harder positions, and the ratio carries over from version to version
        (docs/decisions/version-acceptance-prior.md)."""
        recorded = parent if parent is not None else self.held_out_acceptance
        if recorded is None or recorded <= 0:
            return
        for greedy, counts in self.positions.items():
            if counts.drafted[0] >= RATIO_MIN_DRAFTS:
                served = counts.accepted[0] / counts.drafted[0]
                self.served_ratio[greedy] = min(served, 1.0) / recorded

    # ---- requests -------------------------------------------------------------------------------------
    def start(self, requests: list[NewRequest], first_tokens: list[list[int]]) -> None:
        """Requests the drafter started: each gets its γ policy, seeded with the drafter's measured
        acceptance per position."""
        for req, first in zip(requests, first_tokens, strict=True):
            goodput = {"controller": self.controller,
                       "position_prior": self.positions[req.sampling.is_greedy].alpha()}
            policy = build_policy(req.spec.policy, self.spec, req.spec.gamma, req.spec.tree_width, **goodput)
            self.requests[req.request_id] = _Request(req, policy, policy.new_state(), len(first))

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.requests.pop(rid, None)

    # ---- steps in flight -------------------------------------------------------------------------------
    def step_began(self) -> int:
        """A step of this planner starts (SpecStep.step); returns its id for step_ended."""
        sid, self._next_step = self._next_step, self._next_step + 1
        for other in self._in_flight:
            self._in_flight[other] = True
        self._in_flight[sid] = bool(self._in_flight)
        return sid

    def step_ended(self, sid: int) -> bool:
        """The step is over (or failed): whether it ran alone, no other step in flight beside it."""
        return not self._in_flight.pop(sid, True)

    def _charges_host(self) -> bool:
        """Whether this plan pays the fixed host work of drafting. In-process, always (the drafter shares
        the target's thread). Through Ray, only a step that runs alone: beside another group's step the
        drafter call overlaps that step's verify and the target waits for nothing."""
        return self.colocated or len(self._in_flight) <= 1

    # ---- plan -----------------------------------------------------------------------------------------
    def plan(self, drafting: list[Sequence]) -> StepPlan:
        """The step's plan from the hints the drafter returned with its previous drafts (begin, then
        decide): how a planner whose drafter is in another process plans."""
        out = self.begin(drafting)
        self.decide(out.items)
        return out

    def begin(self, drafting: list[Sequence]) -> StepPlan:
        """The step's DraftItems, undecided: none asks the drafter while the guard has speculation off or the
        pause holds; otherwise one each, with its previous outcome learned (learn). A drafter in this
        process may now commit and hint (take_hints) before decide fills in the plan."""
        out = StepPlan(allowed=self.guard is None or self.guard.allowed)
        if drafting and not out.allowed:
            self.guarded_steps += 1
            out.skipped = {s.request_id for s in drafting}
            return out
        if drafting and self.pause.skip(len(drafting)):
            out.skipped = {s.request_id for s in drafting}
            return out
        out.items = [s.next_draft_item() for s in drafting]
        self.learn(out.items)
        return out

    def plan_items(self, items: list[DraftItem], prepare=None) -> None:
        """Fill in the plan of DraftItems whose gamma is the request's γ cap (Sequence.next_draft_item).
        prepare: the drafter's DraftWorker.prepare when it runs in this process (fresh hints), else None.
        The vLLM proposer plans with this alone."""
        self.learn(items)
        if prepare is not None and items:
            self.take_hints(items, prepare(items))
        self.decide(items)

    def learn(self, items: list[DraftItem]) -> None:
        """Learn each item's previous outcome from its commit, and ask for the hints goodput plans from."""
        for item in items:
            r = self.requests[item.request_id]
            if item.commit_new_tokens:
                if not r.last_hinted:
                    # ρ and the per-position counts describe the model drafter; a hinted step's outcome is
                    # the hinting drafter's to learn (the suffix drafter's measured acceptance)
                    r.policy.observe(r.state, r.last_drafted, item.commit_accepted, depth=r.last_depth)
                    self.positions[r.request.sampling.is_greedy].observe(r.last_depth or r.last_drafted,
                                                                         item.commit_accepted)
                r.generated += len(item.commit_new_tokens)
            if isinstance(r.policy, GoodputGamma) and r.request.spec.tree_width == 1:
                item.hint_cap = max(0, min(r.request.spec.gamma, r.request.max_new_tokens - r.generated - 1))

    def take_hints(self, items: list[DraftItem], fresh: dict[str, tuple[object | None, int]]) -> None:
        """What DraftWorker.prepare returned (request id -> (DraftHint or None, pending context)): the
        drafter has committed the items' outcomes and looked up this step's hints, so the items no longer
        carry either, and decide plans from hints of this step rather than the previous one."""
        for item in items:
            if item.request_id in fresh:
                r = self.requests[item.request_id]
                r.hint, r.pending = fresh[item.request_id]
                item.commit_accepted, item.commit_new_tokens, item.commit_hidden = 0, [], None
                item.hint_cap = 0

    def decide(self, items: list[DraftItem]) -> None:
        """Fill in each item's γ (a tree's depth and width) and stopping rule: one goodput plan for the
        requests on that policy, each other policy on its own."""
        planned = [(item, self.requests[item.request_id]) for item in items]
        planned = [(item, r, r.request.max_new_tokens - r.generated) for item, r in planned]
        self._plan_goodput(planned)
        for item, r, remaining in planned:
            room = self._kv_room(r, remaining)
            if r.request.spec.tree_width > 1:
                depth, width = r.policy.plan_tree(r.state, remaining)
                item.gamma, item.width = fit_tree(min(depth, item.gamma), width, room)
            else:
                item.gamma = min(r.policy.plan(r.state, remaining), item.gamma, room)
            if type(r.policy).keep_drafting is not GammaPolicy.keep_drafting:
                item.stop, item.stop_state = r.policy, r.state

    def _kv_room(self, r: _Request, remaining: int) -> int:
        """Draft nodes this step may add: the target writes 1 + nodes positions after the committed
        context (prompt + generated - 1). At least `remaining`, since every request is admitted with
        prompt + max_new_tokens <= max_seq_len; more when the context is known to leave more."""
        if self.max_seq_len is None:
            return remaining
        context = len(r.request.prompt_token_ids) + r.generated
        return max(remaining, self.max_seq_len - context)

    def _plan_goodput(self, planned: list[tuple[DraftItem, _Request, int]]) -> None:
        """One goodput plan for the requests on that policy; the others enter it at their γ cap."""
        if not any(isinstance(r.policy, GoodputGamma) for _, r, _ in planned):
            self.last_plan = None
            return
        slots, states, fallbacks = [], [], {}
        for i, (item, r, remaining) in enumerate(planned):
            if isinstance(r.policy, GoodputGamma):
                slot = r.policy.slot(r.state, remaining, cap=item.gamma)
                hint = r.hint if r.request.spec.tree_width == 1 else None
                if hint is not None and not hint.fallback:
                    # the drafter said what its draft is worth: plan it from its own acceptance and cost.
                    # The plan prices a lookup draft, so the drafter drafts a lookup or nothing (fallback):
                    # through Ray the hint is a step old, and a model draft in place of a lookup that has
                    # gone would be unpriced (docs/benchmarks.md, held-out chat)
                    slot = hinted_slot(slot, hint)
                    r.hinted = item.fallback = True
                else:
                    if hint is not None:
                        fallbacks[i] = hinted_slot(slot, hint)
                    slot.setup_seconds = self._catch_up_share(item, r, remaining)
                slots.append(slot)
                states.append(r.state)
            else:
                cap = max(0, min(item.gamma, remaining - 1))
                slots.append(Slot(Acceptance([r.state.ema_acceptance], cap), cap, min_depth=cap))
                states.append(None)
        host_work = self._charges_host()
        plan = self.controller.plan(slots, host_work)
        # Where the plan drafts nothing for a request the drafter would rather have had its model draft
        # for, its lookup draft may still pay: plan those with it, and keep what plans better.
        idle = [i for i in fallbacks if plan.depths[i] == 0]
        if idle:
            alternative = [fallbacks[i] if i in idle else slot for i, slot in enumerate(slots)]
            other = self.controller.plan(alternative, host_work)
            if other.goodput > plan.goodput:
                plan = other
                for i in idle:
                    if other.depths[i] > 0:
                        planned[i][1].hinted = True
                        planned[i][0].fallback = True
        self.last_plan = GoodputGamma.assign(plan, states)
        g = self.goodput_ema
        g["predicted"] = self.last_plan.goodput if not g["predicted"] else (
            0.8 * g["predicted"] + 0.2 * self.last_plan.goodput)

    def _catch_up_share(self, item: DraftItem, r: _Request, remaining: int) -> float:
        """The share of a colocated model drafter's catch-up (the context it has not taken in yet) that
        this step's model draft is charged. A catch-up is paid once and serves every later model draft of
        the request, so it is spread over the fewest steps the request has left (each emitting 1 + γ cap
        tokens at most). Charged whole to one step, a prompt's catch-up (0.2 ms a token on the 2-core CPU)
        outweighed any single draft's gain; refused, the context grew by each step's tokens, and the
        in-process engine's model drafter never drafted at all (docs/decisions/goodput-pricing.md).
        Through Ray (not colocated) the drafter catches up in its own process: nothing is charged."""
        if not self.colocated:
            return 0.0
        pending = r.pending + len(item.commit_new_tokens)
        steps_left = max(1, remaining // (1 + max(item.gamma, 1)))
        return self.costs.catch_up_seconds(pending) / steps_left

    # ---- observe --------------------------------------------------------------------------------------
    def observe(self, record: StepRecord) -> None:
        """Learn from a finished step: what was drafted, the cost model's times, the pause and the guard."""
        drafted = any(d.tokens for d in record.drafts)
        modelled = self.observe_drafts(record.drafts)
        priced = 0.0
        if record.drafts:
            self.pause.asked(len(record.drafts), drafted, self.colocated)
            self.costs.observe_verify(record.rows, record.verify_seconds)
            draft_seconds = record.drafts[0].draft_seconds
            depths = [x for x in modelled if x > 0]
            if depths:
                # the drafter's cost model follows the measured time of the drafts a model drafted
                self.costs.observe_draft(len(depths), max(depths), draft_seconds)
                priced = draft_seconds
            if record.verify_seconds > 0:
                measured = record.emitted / (record.verify_seconds + draft_seconds)
                g = self.goodput_ema
                g["measured"] = measured if not g["measured"] else 0.8 * g["measured"] + 0.2 * measured
        elif record.skipped:
            # the cost model's one-token price follows the steps that did not ask the drafter too: the
            # profile runs at short contexts and prices a step at real ones low; observed by only the few
            # steps that asked, that made drafting look relatively cheaper (docs/decisions/goodput-pricing.md)
            self.costs.observe_verify([1] * record.batch, record.verify_seconds)
        # Only steps with a speculating request teach the plan what host work drafting adds: a step of
        # target-only requests alone (the engine bench's step-paired twin batch, or traffic with speculation
        # off) has no drafter work at all, and counted as a plain step it made drafting look dearer
        # (docs/decisions/bench-method.md). Through Ray only a step that ran alone does: beside another
        # group's step its time includes waiting for that step's forward.
        if record.eligible and (self.colocated or record.alone):
            self.costs.observe_host(record.batch, max(record.host_seconds - priced, 0.0), drafted)
        if self.guard is not None and record.eligible:
            self.guard.step(record.started, record.finished, record.emitted, record.batch, record.allowed)

    def observe_drafts(self, drafts: list[Draft]) -> list[int]:
        """What the drafter reported beside its drafts (the hint, pending context, EGAG's entropy EMA, a hot
        swap); returns the depths of the drafts a model drafted (not planned from a hint), for its costs."""
        modelled = []
        for d in drafts:
            r = self.requests.get(d.request_id)
            if r is None:
                continue
            depth = tree_depth(d.parents[1:]) if d.parents else None
            r.last_drafted, r.last_depth = len(d.tokens), depth
            r.last_hinted, r.hinted = r.hinted and bool(d.tokens), False
            r.hint, r.pending = d.hint, d.pending
            if d.ema_entropy is not None:
                r.state.ema_entropy = d.ema_entropy
            if not r.last_hinted:
                modelled.append(depth if depth is not None else len(d.tokens))
        if any(d.version_changed for d in drafts):
            # The counts measured the old weights. Kept, they seeded new requests with what the old version
            # achieved, and where that was too little to draft (HumanEval after GSM8K in `specd bench osd`)
            # nothing drafted again, so no version's improvement was ever tried: measure the new one afresh.
            swapped = next(d for d in drafts if d.version_changed)
            self._measure_served_ratio(swapped.held_out_parent)
            self.held_out_acceptance = swapped.held_out_acceptance
            self.positions = self._fresh_positions()
        return modelled
