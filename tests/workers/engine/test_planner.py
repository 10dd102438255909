"""SpeculationPlanner alone (unit tests of one module): what the plan carries to the drafter, and what it
learns from the drafts and the step. The planner's end-to-end behaviour runs in the engine tests
(test_goodput_engine.py, test_suffix_engine.py) and the router's (tests/cluster)."""

from __future__ import annotations

import copy

import pytest

from specd.configs.schema import SpecConfig
from specd.workers.core.gamma import ACCEPTANCE_PRIOR, EntropyGamma
from specd.workers.core.goodput import CostProfile
from specd.workers.core.guard import SpeculationGuard
from specd.workers.core.sampling import SamplingParams
from specd.workers.drafters.base import DraftHint
from specd.workers.engine.planner import (
    PAUSE_MIN_BATCH,
    PAUSE_STEPS,
    RATIO_MIN_DRAFTS,
    SpeculationPlanner,
    StepRecord,
)
from specd.workers.engine.sequence import Sequence
from specd.workers.engine.types import Draft, NewRequest, SpecParams, VerifyResult


def _seqs(planner: SpeculationPlanner, n: int, spec: SpecParams, max_new: int = 32) -> list[Sequence]:
    reqs = [NewRequest(f"r{i}", [1, 2, 3], SamplingParams(), max_new, spec) for i in range(n)]
    planner.start(reqs, [[4]] * n)
    seqs = [Sequence(r) for r in reqs]
    for s in seqs:
        s.start([4])
    return seqs


def _step(planner: SpeculationPlanner, seqs: list[Sequence], drafts: list[Draft], accepted: int = 0) -> None:
    """Verify `drafts` as if `accepted` of each were accepted, apply and observe."""
    results = [VerifyResult(d.request_id, len(d.tokens), min(accepted, len(d.tokens)),
                            [*d.tokens[:accepted], 9], accepted >= len(d.tokens), verify_seconds=0.01)
               for d in drafts]
    for seq, result in zip(seqs, results, strict=True):
        seq.apply(result)
    planner.observe(StepRecord(
        batch=len(seqs), eligible=True, allowed=True, skipped=False, drafts=drafts, results=results,
        rows=[1 + len(d.tokens) for d in drafts], verify_seconds=0.01, propose_seconds=0.001,
        host_seconds=0.002, started=0.0, finished=0.02))


def test_fixed_plans_the_cap_and_egag_sends_its_stopping_rule() -> None:
    planner = SpeculationPlanner(SpecConfig(policy="fixed"))
    fixed = planner.plan(_seqs(planner, 1, SpecParams(gamma=3, policy="fixed"), max_new=3)).items[0]
    assert fixed.gamma == 1 and fixed.stop is None and fixed.hint_cap == 0   # 2 tokens left: 1 draft
    planner = SpeculationPlanner(SpecConfig(policy="egag"))
    seqs = _seqs(planner, 1, SpecParams(gamma=5, policy="egag"))
    item = planner.plan(seqs).items[0]
    assert item.gamma == 5 and isinstance(item.stop, EntropyGamma)
    assert item.stop_state is planner.requests["r0"].state
    # Through Ray the state travels as a copy: the drafter's entropy EMA comes back beside the draft
    remote = copy.deepcopy(item.stop_state)
    item.stop.keep_drafting(remote, 1, _peaked(0.5))
    assert remote.ema_entropy > 0 and planner.requests["r0"].state.ema_entropy == 0.0
    _step(planner, seqs, [Draft("r0", [7, 7], ema_entropy=remote.ema_entropy)])
    assert planner.requests["r0"].state.ema_entropy == remote.ema_entropy


def _peaked(top: float):
    import torch

    q = torch.full((8,), (1.0 - top) / 7)
    q[0] = top
    return q


def test_outcomes_reach_the_policy_with_the_next_plan_and_drafts_set_the_next_depth() -> None:
    planner = SpeculationPlanner(SpecConfig(policy="adaptive"))
    seqs = _seqs(planner, 1, SpecParams(gamma=4, policy="adaptive"))
    before = planner.requests["r0"].state.ema_acceptance
    planner.plan(seqs)
    _step(planner, seqs, [Draft("r0", [7, 7, 7, 7])], accepted=0)
    assert planner.requests["r0"].last_drafted == 4
    planner.plan(seqs)                                  # the commit of 0 of 4 reaches ρ now
    assert planner.requests["r0"].state.ema_acceptance < before
    assert planner.positions[True].drafted[0] == 1 and planner.positions[True].accepted[0] == 0


def test_goodput_plans_from_the_hint_the_drafter_returned_with_its_last_draft() -> None:
    planner = SpeculationPlanner(SpecConfig(policy="goodput", gamma_max=4))
    planner.set_cost_profile({1: [0.01 * (1 + 0.05 * n) for n in range(5)]}, {1: 0.004})
    seqs = _seqs(planner, 1, SpecParams(gamma=4, policy="goodput"))
    item = planner.plan(seqs).items[0]
    assert item.hint_cap == 4 and not planner.requests["r0"].hinted      # no hint yet: planned from ρ
    assert not item.fallback                                             # the model may draft it
    sure = DraftHint([0.99, 0.99, 0.99, 0.99], free=True)
    _step(planner, seqs, [Draft("r0", [7] * item.gamma, hint=sure)], accepted=item.gamma)
    item = planner.plan(seqs).items[0]
    assert planner.requests["r0"].hinted and item.gamma == 4              # a free, sure draft: all of it
    # planned as a lookup draft: the drafter drafts this step's lookup or nothing, never the model in its
    # place (through Ray the hint is a step old)
    assert item.fallback
    _step(planner, seqs, [Draft("r0", [7] * 4, hint=DraftHint([0.01], free=True))], accepted=0)
    assert planner.requests["r0"].last_hinted and planner.requests["r0"].hint.alpha == [0.01]
    positions = list(planner.positions[True].drafted)
    planner.plan(seqs)
    # the hinted step's outcome is the hinting drafter's to learn, not the model drafter's counts
    assert planner.positions[True].drafted == positions


def test_in_process_the_plan_reads_the_hint_of_this_step_after_the_commit() -> None:
    planner = SpeculationPlanner(SpecConfig(policy="goodput", gamma_max=4), colocated=True)
    planner.set_cost_profile({1: [0.01 * (1 + 0.05 * n) for n in range(5)]}, {1: 0.004})
    seqs = _seqs(planner, 1, SpecParams(gamma=4, policy="goodput"))
    seen = []

    def prepare(items):      # DraftWorker.prepare: commit first, then hint the context after it
        seen.append((list(items[0].commit_new_tokens), items[0].hint_cap))
        return {"r0": (DraftHint([0.99] * 4, free=True), 0)}

    item = seqs[0].next_draft_item()
    planner.plan_items([item], prepare=prepare)
    # the first step is planned from a hint already (through Ray it would have none), and the drafter
    # is not asked to commit or hint again in propose
    assert planner.requests["r0"].hinted and item.gamma == 4
    assert item.hint_cap == 0 and item.commit_new_tokens == []
    _step(planner, seqs, [Draft("r0", [7] * 4)], accepted=2)
    item = seqs[0].next_draft_item()
    planner.plan_items([item], prepare=prepare)
    assert seen == [([], 4), ([7, 7, 9], 4)]                       # the outcome reached prepare's commit
    assert planner.requests["r0"].generated == 1 + 3               # and the planner learned it first


def test_a_version_change_restarts_the_per_position_counts_from_its_held_out_figure() -> None:
    planner = SpeculationPlanner(SpecConfig(policy="fixed"), held_out_acceptance=0.3)
    assert planner.positions[True].alpha()[0] == pytest.approx(0.3)
    planner.positions[True].observe(3, 0)
    low = planner.positions[True].alpha()[0]
    seqs = _seqs(planner, 1, SpecParams(gamma=3))
    planner.plan(seqs)
    _step(planner, seqs, [Draft("r0", [7])])
    assert planner.positions[True].alpha()[0] == low
    planner.plan(seqs)
    _step(planner, seqs, [Draft("r0", [7], version_changed=True, held_out_acceptance=None)])
    assert planner.positions[True].alpha()[0] == ACCEPTANCE_PRIOR


def test_a_colocated_drafter_that_drafts_nothing_is_paused_and_the_guard_skips() -> None:
    planner = SpeculationPlanner(SpecConfig(policy="fixed"), colocated=True)
    seqs = _seqs(planner, PAUSE_MIN_BATCH, SpecParams(gamma=3))
    plan = planner.plan(seqs)
    _step(planner, seqs, [Draft(item.request_id, []) for item in plan.items])
    for _ in range(PAUSE_STEPS):
        plan = planner.plan(seqs)
        assert not plan.items and plan.skipped == {s.request_id for s in seqs}
    assert planner.plan(seqs).items and planner.pause.paused_steps == PAUSE_STEPS
    guarded = SpeculationPlanner(SpecConfig(policy="fixed"), guard=SpeculationGuard(4))
    guarded.guard.window.mode = "off"
    seqs = _seqs(guarded, 2, SpecParams(gamma=3))
    plan = guarded.plan(seqs)
    assert not plan.allowed and not plan.items and guarded.guarded_steps == 1


def test_cost_profile_request_and_profile() -> None:
    assert SpeculationPlanner(SpecConfig(policy="fixed")).cost_profile_request() is None
    spec = SpecConfig(policy="goodput", gamma_max=4, goodput_profile_batch_sizes=[1, 4])
    planner = SpeculationPlanner(spec)
    assert planner.cost_profile_request() == {"batch_sizes": [1, 4], "max_tokens": 5, "budget_s": 60.0}
    planner.set_cost_profile({1: [0.01] * 5, 4: [0.02] * 5}, {1: 0.001, 4: 0.002}, catch_up=0.0001)
    assert planner.controller.costs is planner.costs and planner.costs.profile == CostProfile(
        verify={1: [0.01] * 5, 4: [0.02] * 5}, draft={1: 0.001, 4: 0.002}, catch_up=0.0001)


def _catch_up_plan(colocated: bool, pending: int, max_new: int) -> int:
    """γ planned for a greedy request whose model drafter has `pending` context tokens to take in first,
    on this CPU's measured costs (a 38 ms step, 1.6 ms a drafted level, 0.2 ms a catch-up token)."""
    planner = SpeculationPlanner(SpecConfig(policy="goodput", gamma_max=4), colocated=colocated,
                                 held_out_acceptance=0.45)
    planner.set_cost_profile({1: [0.038, 0.0392, 0.0416, 0.0433, 0.0451]}, {1: 0.0016}, catch_up=0.0002)
    seqs = _seqs(planner, 1, SpecParams(gamma=4, policy="goodput"), max_new=max_new)
    planner.plan(seqs)
    _step(planner, seqs, [Draft("r0", [], pending=pending)])
    return planner.plan(seqs).items[0].gamma


def test_a_colocated_catch_up_is_spread_over_the_steps_it_serves() -> None:
    # A prompt's catch-up (120 tokens, 24 ms) charged to one step outweighed the draft's gain and the model
    # never drafted in-process; spread over the request's steps left it drafts, as it does through Ray.
    assert _catch_up_plan(colocated=True, pending=120, max_new=64) > 0
    assert _catch_up_plan(colocated=False, pending=120, max_new=64) > 0
    # with too few tokens left for the catch-up to pay back, still none
    assert _catch_up_plan(colocated=True, pending=120, max_new=4) == 0


def test_steps_in_flight_together_are_not_alone() -> None:
    planner = SpeculationPlanner(SpecConfig(policy="goodput"))
    a = planner.step_began()
    assert planner.step_ended(a) is True                   # nothing beside it
    a = planner.step_began()
    b = planner.step_began()                               # a second pipeline group's step
    assert planner.step_ended(a) is False
    c = planner.step_began()                               # b still runs
    assert planner.step_ended(b) is False and planner.step_ended(c) is False
    assert planner.step_ended(planner.step_began()) is True


def _ray_planner_after(host_drafting: float) -> tuple[SpeculationPlanner, list[Sequence]]:
    """A planner whose drafter is an actor of its own, on this CPU's costs (a 25 ms step, 2 ms a drafted
    level), after two lone drafting steps whose host work was `host_drafting` and two that drafted nothing
    with none."""
    planner = SpeculationPlanner(SpecConfig(policy="goodput", gamma_max=4), held_out_acceptance=0.2)
    planner.set_cost_profile({1: [0.025, 0.0264, 0.0278, 0.0292, 0.0306]}, {1: 0.002})
    seqs = _seqs(planner, 1, SpecParams(gamma=4, policy="goodput"), max_new=64)
    for drafted, host in ((True, host_drafting), (False, 0.0), (True, host_drafting), (False, 0.0)):
        draft = Draft("r0", [7] if drafted else [])
        result = VerifyResult("r0", len(draft.tokens), 0, [9], not draft.tokens, verify_seconds=0.025)
        seqs[0].apply(result)
        planner.observe(StepRecord(
            batch=1, eligible=True, allowed=True, skipped=False, drafts=[draft], results=[result],
            rows=[1 + len(draft.tokens)], verify_seconds=0.025, propose_seconds=host, host_seconds=host,
            started=0.0, finished=0.025 + host))
    planner.requests["r0"].state.acceptance.alpha = [0.2] * 4     # this request's model drafts: α 0.2
    return planner, seqs


def test_through_ray_a_lone_step_pays_the_drafter_call_and_a_pipelined_one_does_not() -> None:
    # Without host work a model draft at α 0.2 pays on these costs (2 ms + 1.4 ms for 0.2 tokens of 25 ms).
    planner, seqs = _ray_planner_after(host_drafting=0.0)
    assert planner.plan(seqs).items[0].gamma > 0
    # The drafter call's round trip (2.5 ms a drafting step more, measured on steps that ran alone) makes it
    # a loss for a step that runs alone...
    planner, seqs = _ray_planner_after(host_drafting=0.0025)
    assert planner.costs.host_seconds(1) == pytest.approx(0.0025, rel=0.01)
    sid = planner.step_began()
    assert planner.plan(seqs).items[0].gamma == 0
    # ...and not for one planned while another group's step is in flight: its verify hides the call.
    other = planner.step_began()
    assert planner.plan(seqs).items[0].gamma > 0
    planner.step_ended(other)
    planner.step_ended(sid)


def test_through_ray_a_step_beside_another_does_not_teach_the_host_figure() -> None:
    planner, _ = _ray_planner_after(host_drafting=0.0025)
    learned = planner.costs.host_seconds(1)
    draft = Draft("r0", [7])
    result = VerifyResult("r0", 1, 0, [9], False, verify_seconds=0.025)
    planner.requests["r0"].generated += 1
    for _ in range(3):
        planner.observe(StepRecord(
            batch=1, eligible=True, allowed=True, skipped=False, drafts=[draft], results=[result], rows=[2],
            verify_seconds=0.025, propose_seconds=0.03, host_seconds=0.03, started=0.0, finished=0.055,
            alone=False))
    assert planner.costs.host_seconds(1) == learned


def test_a_new_version_starts_from_its_figure_scaled_by_what_traffic_made_of_the_last_ones() -> None:
    """The gate's held-out figure is a greedy match over every position; served, the model drafts where no
    lookup pays. What the outgoing version got over its own figure scales the next one's prior."""
    planner = SpeculationPlanner(SpecConfig(policy="fixed"), held_out_acceptance=0.25)
    seqs = _seqs(planner, 1, SpecParams(gamma=3))

    def swap(figure: float) -> None:
        planner.plan(seqs)
        _step(planner, seqs, [Draft("r0", [7], version_changed=True, held_out_acceptance=figure)])

    for k in range(RATIO_MIN_DRAFTS - 1):               # too few drafts to say: the figure is taken as is
        planner.positions[True].observe(1, int(k % 8 == 0))
    swap(0.26)
    assert planner.positions[True].alpha()[0] == pytest.approx(0.26)
    for k in range(40):                                  # 10 of 40 first drafts accepted against 0.26
        planner.positions[True].observe(1, int(k % 4 == 0))
    swap(0.30)                                           # (and the swap step's own draft, rejected: 10 of 41)
    assert planner.positions[True].alpha()[0] == pytest.approx(0.30 * (10 / 41) / 0.26)
    assert planner.positions[False].alpha()[0] == pytest.approx(0.30)   # sampled requests drafted none
    swap(0.32)                                           # the last version drafted nothing: the ratio stays
    assert planner.positions[True].alpha()[0] == pytest.approx(0.32 * (10 / 41) / 0.26)


def test_the_outgoing_versions_figure_is_the_gates_score_of_it_beside_the_new_one() -> None:
    """The first-start drafter's figure comes from its bootstrap's evaluation (0.10 on chat prompts); the
    gate scored it 0.19 on the held-out records it scored its successor 0.26 on: the ratio uses the latter."""
    planner = SpeculationPlanner(SpecConfig(policy="fixed"), held_out_acceptance=0.10)
    seqs = _seqs(planner, 1, SpecParams(gamma=3))
    for k in range(40):                                  # served: 10 of 40
        planner.positions[True].observe(1, int(k % 4 == 0))
    planner.plan(seqs)
    _step(planner, seqs, [Draft("r0", [7], version_changed=True, held_out_acceptance=0.26,
                                held_out_parent=0.19)])
    assert planner.positions[True].alpha()[0] == pytest.approx(0.26 * (10 / 40) / 0.19)
