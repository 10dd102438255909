"""Goodput controller on synthetic costs: γ = 0 when drafting cannot pay, more when it can."""

import pytest

from specd.workers.core.gamma import GoodputGamma, build_gamma_policy
from specd.workers.core.goodput import (
    Acceptance,
    CostProfile,
    GoodputController,
    Slot,
    StepCostModel,
    interpolate,
)

BATCHES = (1, 4, 16)
N_MAX = 9


def flat_profile(draft: float = 0.002) -> CostProfile:
    """Batch 1 on a weight-bound device: 1..9 tokens per row cost about the same."""
    return CostProfile(verify={b: [0.03 + 0.0005 * n for n in range(N_MAX)] for b in BATCHES},
                       draft={b: draft for b in BATCHES})


def linear_profile(draft: float = 0.002) -> CostProfile:
    """High batch on a CPU: the forward is compute-bound, each extra token costs a full token's time."""
    return CostProfile(verify={b: [0.01 * b * (n + 1) for n in range(N_MAX)] for b in BATCHES},
                       draft={b: draft * b for b in BATCHES})


def slots(n: int, alpha: float, max_depth: int = 8, max_width: int = 1) -> list[Slot]:
    return [Slot(Acceptance([alpha], max_depth), max_depth=max_depth, max_width=max_width) for _ in range(n)]


def test_flat_verify_cost_drafts_deep_at_batch_1() -> None:
    plan = GoodputController(StepCostModel(flat_profile())).plan(slots(1, 0.8))
    assert plan.depths[0] >= 4
    baseline = 1 / StepCostModel(flat_profile()).verify_seconds(1, 1)
    assert plan.goodput > 2 * baseline


def test_linear_verify_cost_turns_drafting_off() -> None:
    costs = StepCostModel(linear_profile())
    plan = GoodputController(costs).plan(slots(16, 0.6))
    assert plan.depths == [0] * 16
    assert plan.goodput == pytest.approx(16 / costs.verify_seconds(16, 1))


def test_useless_drafter_drafts_nothing_even_when_verify_is_free() -> None:
    plan = GoodputController(StepCostModel(flat_profile(draft=0.01))).plan(slots(1, 0.0))
    assert plan.depths == [0]


def test_padded_rows_lift_the_whole_batch_together() -> None:
    # Each extra token per row costs 40% of a step: one request alone never pays, but a level shared by
    # every row does once acceptance is high; the "lift all" move must find it.
    profile = CostProfile(verify={b: [0.02 * b * (1 + 0.4 * n) for n in range(N_MAX)] for b in BATCHES},
                          draft={b: 0.0 for b in BATCHES})
    plan = GoodputController(StepCostModel(profile, padded=True)).plan(slots(4, 0.9))
    assert len(set(plan.depths)) == 1 and plan.depths[0] > 0


def test_ragged_cost_gives_more_to_the_better_request() -> None:
    profile = CostProfile(verify={b: [0.01 * (b + 0.3 * b * n) for n in range(N_MAX)] for b in BATCHES},
                          draft={b: 0.0 for b in BATCHES})
    good, poor = Acceptance([0.95], 8), Acceptance([0.2], 8)
    plan = GoodputController(StepCostModel(profile, padded=False)).plan(
        [Slot(good, max_depth=8), Slot(poor, max_depth=8)]
    )
    assert plan.depths[0] > plan.depths[1]


def test_pad_weight_prices_a_ragged_batch_between_its_mean_and_its_longest_row() -> None:
    profile = CostProfile(verify={4: [0.01 * n for n in range(1, N_MAX + 1)]}, pad_weight=0.25)
    rows = [5, 1, 1, 1]   # mean 2, longest 5: priced as 2 + 0.25 * 3 = 2.75 tokens per row
    assert StepCostModel(profile).step_seconds(rows, [4, 0, 0, 0]) == pytest.approx(0.0275)
    assert StepCostModel(profile, padded=True).step_seconds(rows, [4, 0, 0, 0]) == pytest.approx(0.05)
    assert StepCostModel(profile, padded=False).step_seconds(rows, [4, 0, 0, 0]) == pytest.approx(0.02)
    with pytest.raises(ValueError, match="pad_weight"):
        CostProfile(verify={1: [0.01]}, pad_weight=1.5)


def test_bounds_hold() -> None:
    controller = GoodputController(StepCostModel(flat_profile(draft=0.0)))
    plan = controller.plan([Slot(Acceptance([0.99], 8), max_depth=3, max_width=2),
                            Slot(Acceptance([0.99], 8), max_depth=0),
                            Slot(Acceptance([0.0], 8), max_depth=5, min_depth=2)])
    assert plan.depths[0] <= 3 and plan.widths[0] <= 2
    assert plan.depths[1] == 0 and plan.widths[1] == 1
    assert 2 <= plan.depths[2] <= 5


def test_deterministic() -> None:
    def run():
        batch = [Slot(Acceptance([a, a / 2], 6), max_depth=6, max_width=3) for a in (0.9, 0.5, 0.7, 0.3)]
        return GoodputController(StepCostModel(flat_profile())).plan(batch)

    first = run()
    assert all(run().depths == first.depths and run().widths == first.widths for _ in range(3))


def test_trees_widen_when_first_candidates_often_miss() -> None:
    plan = GoodputController(StepCostModel(flat_profile(draft=0.0))).plan(slots(1, 0.4, 4, max_width=4))
    assert plan.widths[0] > 1


def test_acceptance_learns_per_position() -> None:
    acc = Acceptance([0.5, 0.5, 0.5], 3, beta=0.5)
    acc.observe(drafted_depth=3, accepted=1)  # position 0 hit, position 1 missed, position 2 never tried
    assert acc.alpha == pytest.approx([0.75, 0.25, 0.5])
    assert acc.expected_tokens(2) == pytest.approx(1 + 0.75 + 0.75 * 0.25)
    with pytest.raises(ValueError):
        acc.observe(2, 3)


def test_online_correction_moves_toward_measured() -> None:
    costs = StepCostModel(flat_profile(), beta=0.5)
    before = costs.verify_seconds(4, 3)
    for _ in range(20):
        costs.observe_verify([3, 3, 3, 3], 4 * before)
    assert costs.verify_seconds(4, 3) == pytest.approx(4 * before, rel=0.01)
    assert costs.verify_seconds(4, 1) == pytest.approx(flat_profile().verify[4][0])   # plain: as profiled
    costs.observe_draft(4, 2, 0.1)
    costs.observe_draft(4, 2, 0.1)   # twice in a row: see test_one_slow_draft_does_not_raise_the_drafter_cost
    assert costs.draft_seconds(4, 1) > flat_profile().draft[4]


def test_policy_falls_back_to_target_only_as_acceptance_drops() -> None:
    policy = build_gamma_policy("goodput", gamma_min=0, gamma_max=6,
                                controller=GoodputController(StepCostModel(flat_profile(draft=0.01))),
                                position_prior=[0.9])
    assert isinstance(policy, GoodputGamma)
    state = policy.new_state()
    assert policy.plan(state, remaining_tokens=100) > 0
    for _ in range(30):
        gamma = policy.plan(state, remaining_tokens=100)
        policy.observe(state, gamma, 0)
    assert policy.plan(state, remaining_tokens=100) == 0
    assert policy.plan(state, remaining_tokens=1) == 0  # a step never overshoots max_new_tokens


def test_plan_batch_hands_each_state_its_choice() -> None:
    controller = GoodputController(StepCostModel(flat_profile(draft=0.0)))
    policy = GoodputGamma(gamma_max=5, tree_width=2, controller=controller)
    states = [policy.new_state(), policy.new_state()]
    batch = [policy.slot(s, 100, cap=c) for s, c in zip(states, (5, 2), strict=True)]
    plan = GoodputGamma.plan_batch(controller, batch, states)
    assert policy.plan_tree(states[0], 100) == (plan.depths[0], plan.widths[0])
    assert policy.plan_tree(states[1], 100)[0] == plan.depths[1] <= 2


def test_free_drafts_pay_where_model_drafts_cannot() -> None:
    """A drafter forward costing more than a target step rules model drafts out; the same acceptance from a
    lookup (a suffix match, free) still drafts, and only that request does."""
    profile = flat_profile(draft=0.05)
    costs = StepCostModel(profile)
    model, free = slots(1, 0.8)[0], Slot(Acceptance([0.8], 8), max_depth=8, free=True)
    plan = GoodputController(costs).plan([model, free])
    assert plan.depths[0] == 0 and plan.depths[1] >= 4
    assert plan.seconds == pytest.approx(costs.verify_seconds(2, 1 + plan.depths[1]))   # no drafter time
    # each token verified costs 10% more: the likely first two drafts pay, the unlikely third does not
    steep = StepCostModel(CostProfile(verify={b: [0.03 * (1 + 0.1 * n) for n in range(N_MAX)]
                                              for b in BATCHES}))
    per_position = Slot(Acceptance([0.9, 0.9, 0.1], 3), max_depth=3, free=True)
    assert GoodputController(steep).plan([per_position]).depths == [2]


def test_a_ragged_batch_pays_the_fixed_cost_of_going_ragged() -> None:
    verify = {4: [0.01 + 0.001 * n for n in range(N_MAX)]}
    model = StepCostModel(CostProfile(verify=verify, pad_weight=0.0, ragged={4: 0.005}))
    assert model.step_seconds([2, 2, 2, 2], [1, 1, 1, 1]) == pytest.approx(0.011)             # uniform: none
    assert model.step_seconds([2, 1, 1, 1], [1, 0, 0, 0]) == pytest.approx(0.01025 + 0.005)   # mean 1.25
    # one lone draft token at batch 4: nearly free as priced tokens, not once going ragged is charged
    lone = [Slot(Acceptance([0.3], 8), max_depth=1)] + [Slot(Acceptance([0.0], 8), max_depth=0)] * 3
    free_ragged = StepCostModel(CostProfile(verify=verify, pad_weight=0.0))
    assert GoodputController(free_ragged).plan(lone).depths[0] == 1
    assert GoodputController(model).plan(lone).depths == [0, 0, 0, 0]


def gpu_like_profile() -> CostProfile:
    """A short step whose forward barely grows with drafted tokens (an H100 at batch 8: ~6 ms)."""
    return CostProfile(verify={b: [0.006 + 0.0002 * n for n in range(N_MAX)] for b in BATCHES},
                       draft={b: 0.0 for b in BATCHES})


def test_host_work_of_drafting_steps_turns_drafting_off() -> None:
    costs = StepCostModel(gpu_like_profile())
    free = [Slot(Acceptance([0.6], 8), max_depth=8, free=True) for _ in range(4)]
    assert GoodputController(costs).plan(free).depths != [0] * 4       # drafting looks free
    for _ in range(5):
        costs.observe_host(4, 0.014, drafted=True)                       # measured: +14 ms per drafting step
    costs.observe_host(4, 0.001, drafted=False)
    assert costs.host_seconds(4) == pytest.approx(0.013, abs=0.002)
    plan = GoodputController(costs).plan(free)
    assert plan.depths == [0] * 4
    assert plan.goodput == pytest.approx(4 / costs.verify_seconds(4, 1))


def test_a_fixed_host_cost_is_paid_by_a_deep_draft_that_one_token_could_not_pay() -> None:
    # One more token (+0.9) never pays 6 ms of host work on a 6 ms step; eight likely tokens do.
    costs = StepCostModel(gpu_like_profile())
    for _ in range(2):
        costs.observe_host(4, 0.006, drafted=True)
    sure = Slot(Acceptance([0.97], 8), max_depth=8, free=True)
    unsure = [Slot(Acceptance([0.05], 8), max_depth=8, free=True) for _ in range(3)]
    controller, plain = GoodputController(costs), 4 / costs.verify_seconds(4, 1)
    assert controller.evaluate([sure, *unsure], [1, 0, 0, 0], [1] * 4).goodput < plain
    plan = controller.plan([sure, *unsure])
    assert plan.depths[0] >= 6
    assert plan.goodput > plain


def test_host_figure_ignores_one_slow_moment_drifts_back_when_nothing_drafts_climbs_when_retried() -> None:
    costs = StepCostModel(gpu_like_profile())
    costs.observe_host(4, 0.002, drafted=True)
    costs.observe_host(4, 0.030, drafted=True)          # one slow moment: the lesser of two in a row counts
    costs.observe_host(4, 0.002, drafted=True)
    assert costs.host_seconds(4) == pytest.approx(0.002)
    costs.observe_host(4, 0.020, drafted=True)          # slow twice in a row: it is real
    costs.observe_host(4, 0.020, drafted=True)
    costs.observe_host(4, 0.001, drafted=False)
    slow = costs.host_seconds(4)
    assert slow > 0.008
    for _ in range(400):
        costs.observe_host(4, 0.001, drafted=False)
    assert costs.host_seconds(4) < slow / 4              # drafting gets tried again
    retried = costs.host_seconds(4)
    costs.observe_host(4, 0.020, drafted=True)           # and was slow again: most of the way back
    assert costs.host_seconds(4) > retried + 0.4 * (0.019 - retried)
    assert StepCostModel(gpu_like_profile()).host_seconds(4) == 0.0   # nothing measured: nothing charged


def test_one_slow_verify_does_not_price_a_shape_out_two_in_a_row_do() -> None:
    costs = StepCostModel(flat_profile(), beta=0.5)
    before = costs.verify_seconds(4, 4)
    costs.observe_verify([4, 4, 4, 4], 10 * before)  # one slow moment
    assert costs.verify_seconds(4, 4) == pytest.approx(before)
    costs.observe_verify([4, 4, 4, 4], before)  # then as profiled: nothing to undo
    assert costs.verify_seconds(4, 4) == pytest.approx(before)
    costs.observe_verify([4, 4, 4, 4], 3 * before)
    costs.observe_verify([4, 4, 4, 4], 3 * before)  # slower twice in a row: real
    assert costs.verify_seconds(4, 4) == pytest.approx(2 * before)  # EMA 0.5 of the lesser ratio (3)
    costs.observe_verify([4, 4, 4, 4], 0.5 * costs.verify_seconds(4, 4))  # faster counts at once
    assert costs.verify_seconds(4, 4) == pytest.approx(1.5 * before)


def test_shapes_no_plan_picks_drift_back_once_a_slow_spell_passes() -> None:
    # a slow spell (another process busy beside serving): drafting shapes and the drafter measured 3x
    costs = StepCostModel(flat_profile(), beta=0.5)
    base4, base1, draft = costs.verify_seconds(4, 4), costs.verify_seconds(4, 1), costs.draft_seconds(4, 1)
    for _ in range(10):
        costs.observe_verify([4, 4, 4, 4], 3 * base4)
        costs.observe_draft(4, 1, 3 * draft)
    assert costs.verify_seconds(4, 4) > 2.5 * base4 and costs.draft_seconds(4, 1) > 2.5 * draft
    # it passes; the controller now drafts nothing, so only one-token forwards are measured, as profiled
    for _ in range(600):
        costs.observe_verify([1, 1, 1, 1], base1)
    assert costs.verify_seconds(4, 1) == pytest.approx(base1, rel=0.01)
    assert costs.verify_seconds(4, 4) == pytest.approx(base4, rel=0.1)
    assert costs.draft_seconds(4, 1) == pytest.approx(draft, rel=0.1)


def test_one_slow_draft_does_not_raise_the_drafter_cost() -> None:
    costs = StepCostModel(flat_profile(), beta=0.5)
    draft = costs.draft_seconds(4, 1)
    costs.observe_draft(4, 1, 10 * draft)
    costs.observe_draft(4, 1, draft)
    assert costs.draft_seconds(4, 1) == pytest.approx(draft)
    costs.observe_draft(4, 2, 6 * draft)
    costs.observe_draft(4, 2, 6 * draft)  # 3x per level, twice in a row
    assert costs.draft_seconds(4, 1) == pytest.approx(2 * draft)


def test_catching_up_on_a_long_context_is_priced_per_token() -> None:
    """A request that did not draft for a while must first feed the drafter what it missed: at a measured
    cost per context token, a short catch-up still pays for a good draft and a long one does not."""
    profile = CostProfile(verify=flat_profile().verify, draft=flat_profile().draft, catch_up=0.001)
    costs = StepCostModel(profile)
    assert costs.catch_up_seconds(40) == pytest.approx(0.04)
    assert costs.catch_up_seconds(0) == 0.0
    controller = GoodputController(costs)
    short = Slot(Acceptance([0.8], 8), max_depth=8, setup_seconds=costs.catch_up_seconds(2))
    long = Slot(Acceptance([0.8], 8), max_depth=8, setup_seconds=costs.catch_up_seconds(400))
    assert controller.plan([short]).depths[0] >= 4
    assert controller.plan([long]).depths == [0]
    with pytest.raises(ValueError):
        CostProfile(verify=flat_profile().verify, catch_up=-0.001)


def test_drafting_verifies_never_raise_the_plain_one_token_price() -> None:
    """Rows averaging under 1.5 tokens (one request of four drafting one token) round to the one-token
    cell; what drafting cost beyond the table must land on a drafting cell, or plain decoding looks
    dearer and drafting cheaper than they are."""
    costs = StepCostModel(flat_profile(), beta=0.5)
    plain, one_draft = costs.verify_seconds(4, 1), costs.step_seconds([2, 1, 1, 1], [1, 0, 0, 0])
    for _ in range(20):
        costs.observe_verify([2, 1, 1, 1], 2 * costs.verify_seconds(4, costs._tokens_per_row([2, 1, 1, 1])))
        costs.observe_verify([2, 1, 1, 1], 2 * one_draft)
    assert costs.verify_seconds(4, 1) == pytest.approx(plain)
    assert costs.step_seconds([2, 1, 1, 1], [1, 0, 0, 0]) > 1.5 * one_draft


def test_a_plans_frozen_batch_prices_match_the_model_at_every_shape() -> None:
    """BatchCosts (the prices a plan freezes for its batch size) against the tables interpolated directly:
    batch sizes between and past the profiled ones, fractional and past-the-table tokens per row, rows of
    different lengths per batch size, a ragged table, a drafting factor and host figures."""
    profile = CostProfile(verify={1: [0.030, 0.031, 0.033], 4: [0.040, 0.050, 0.061, 0.075, 0.090],
                                  16: [0.070, 0.100, 0.140, 0.170]},
                          draft={1: 0.002, 8: 0.005}, pad_weight=0.3, ragged={4: 0.002, 16: 0.004})
    costs = StepCostModel(profile)
    costs.draft_factor[4] = 1.15
    costs.host_draft[4], costs.host_plain[4] = 0.004, 0.001

    def table(b: float, n: float) -> float:
        per_b = [interpolate(range(1, len(row) + 1), row, n) for row in profile.verify.values()]
        return max(interpolate([1, 4, 16], per_b, b), 0.0)

    for b in (1, 2, 3, 5, 9, 16, 24):
        frozen = costs.at(b)
        for n in (1, 1.4, 2, 3.7, 5, 6.5, 9):
            assert frozen.verify_seconds(n) == pytest.approx(table(b, n), rel=1e-12)
        rows = [1] * (b - 1) + [4]
        depths = [0] * (b - 1) + [3]
        mean = sum(rows) / b
        ragged = 0.0 if b == 1 else interpolate([4, 16], [0.002, 0.004], b)
        expected = ((table(b, mean + 0.3 * (4 - mean)) + max(ragged, 0.0)) * costs.drafting_factor(b)
                    + costs.draft_seconds(1, 3))
        assert frozen.step_seconds(rows, depths) == pytest.approx(expected, rel=1e-12)
        assert costs.step_seconds(rows, depths) == pytest.approx(expected, rel=1e-12)
        free = frozen.step_seconds(rows, depths, free=[True] * b)
        assert free == pytest.approx(expected - costs.draft_seconds(1, 3), rel=1e-12)
        assert frozen.step_seconds([1] * b, [0] * b) == pytest.approx(table(b, 1), rel=1e-12)
        assert frozen.host == costs.host_seconds(b)


def test_one_request_plans_as_it_did_with_the_lift_move_it_no_longer_prices() -> None:
    """At batch 1 lifting every request's depth is the one request's own depth move: the climb no longer
    prices it twice, and plans exactly as a controller that still offers it (ties go to the earlier move)."""
    import random

    class WithLift(GoodputController):
        def _moves(self, slots, depths, widths):
            yield from super()._moves(slots, depths, widths)
            if len(slots) == 1 and depths[0] < slots[0].max_depth:
                yield None, [depths[0] + 1], widths

    rng = random.Random(7)
    for _ in range(200):
        profile = rng.choice([flat_profile(draft=rng.uniform(0.0, 0.01)),
                              linear_profile(draft=rng.uniform(0.0, 0.01))])
        prior = [rng.uniform(0.0, 1.0) for _ in range(rng.randint(1, 8))]
        depth, width = rng.randint(0, 8), rng.randint(1, 3)
        one = [Slot(Acceptance(prior, max(depth, 1)), max_depth=depth, max_width=width,
                    free=rng.random() < 0.3, setup_seconds=rng.uniform(0.0, 0.002))]
        host = rng.random() < 0.5
        mine = GoodputController(StepCostModel(profile)).plan(one, host)
        theirs = WithLift(StepCostModel(profile)).plan(one, host)
        assert (mine.depths, mine.widths) == (theirs.depths, theirs.widths)
        assert mine.goodput == pytest.approx(theirs.goodput)
