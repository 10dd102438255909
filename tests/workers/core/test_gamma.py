import math

import pytest
import torch

from specd.workers.core.gamma import (
    GAMMA_POLICIES,
    AdaptiveGamma,
    ConfidenceGamma,
    EntropyGamma,
    FixedGamma,
    GammaPolicy,
    build_gamma_policy,
    expected_tokens,
    normalized_entropy,
)

UNIFORM = torch.full((8,), 1 / 8)           # normalised entropy 1
ONE_HOT = torch.tensor([0.0, 1.0, 0.0, 0.0])  # normalised entropy 0


def all_policies() -> list[GammaPolicy]:
    return [
        FixedGamma(gamma=4, gamma_min=2),
        EntropyGamma(gamma_min=2, gamma_max=6),
        ConfidenceGamma(gamma_min=1, gamma_max=8),
        AdaptiveGamma(gamma_min=2, gamma_max=6, tree_width=3),
        AdaptiveGamma(gamma_min=0, gamma_max=5, acceptance_prior=0.05),
    ]


def test_expected_tokens() -> None:
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(0.7, 0) == 1.0
    assert expected_tokens(1.0 - 1e-12, 3) == pytest.approx(4.0)


def test_normalized_entropy() -> None:
    assert float(normalized_entropy(ONE_HOT)) == 0.0
    assert float(normalized_entropy(UNIFORM)) == pytest.approx(1.0)
    # Uniform over the 2 survivors of a truncation is maximally unsure: V_eff counts q > 0 only.
    assert float(normalized_entropy(torch.tensor([0.5, 0.0, 0.5, 0.0]))) == pytest.approx(1.0)
    q = torch.tensor([[0.9, 0.1, 0.0], [1 / 3, 1 / 3, 1 / 3]])  # [batch, vocab]
    h = normalized_entropy(q)
    expected = -(0.9 * math.log(0.9) + 0.1 * math.log(0.1)) / math.log(2)
    assert h.shape == (2,)
    assert h.tolist() == pytest.approx([expected, 1.0])


@pytest.mark.parametrize("policy", all_policies(), ids=lambda p: f"{p.name}-{p.gamma_min}-{p.gamma_max}")
@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_bounds_hold_including_end_of_sequence(policy: GammaPolicy, alpha: float) -> None:
    state = policy.new_state()
    state.ema_acceptance = alpha
    for remaining in range(0, 12):
        budget = max(0, remaining - 1)  # a step emits accepted + 1 tokens
        for gamma in (policy.plan(state, remaining), policy.plan_tree(state, remaining)[0]):
            assert 0 <= gamma <= policy.gamma_max
            assert gamma <= budget
            assert gamma >= min(policy.gamma_min, budget)
        depth, width = policy.plan_tree(state, remaining)
        assert 1 <= width <= policy.tree_width
        assert state.planned_gamma == depth


def test_fixed_plans_gamma_and_drafts_to_the_plan() -> None:
    policy = FixedGamma(gamma=3)
    state = policy.new_state()
    assert policy.gamma_max == 3
    assert policy.plan(state, 100) == 3
    assert [policy.keep_drafting(state, n, UNIFORM) for n in range(1, 4)] == [True, True, False]
    assert policy.plan(state, 3) == 2  # end of sequence: 2 drafts + 1 recovered/bonus = 3 tokens
    assert policy.plan(state, 1) == 0
    assert policy.plan_tree(state, 100) == (3, 1)


def test_fixed_defaults_follow_gamma_max() -> None:
    assert FixedGamma(gamma_max=6).gamma == 6
    with pytest.raises(ValueError):
        FixedGamma(gamma=5, gamma_max=4)


def test_egag_stops_on_high_entropy_but_never_below_gamma_min() -> None:
    policy = EntropyGamma(gamma_min=2, gamma_max=6, entropy_threshold=0.5, beta=0.0, threshold_adapt=0.0)
    state = policy.new_state()
    assert policy.plan(state, 100) == 6
    assert policy.keep_drafting(state, 1, UNIFORM)        # below gamma_min: keep going whatever q says
    assert not policy.keep_drafting(state, 2, UNIFORM)    # at gamma_min, unsure drafter: stop
    assert policy.keep_drafting(state, 2, ONE_HOT)        # confident drafter: continue
    assert policy.keep_drafting(state, 5, ONE_HOT)
    assert not policy.keep_drafting(state, 6, ONE_HOT)    # the plan is the hard limit


def test_egag_deterministic_drafts_run_to_the_plan() -> None:
    policy = EntropyGamma(gamma_min=1, gamma_max=4)
    state = policy.new_state()
    policy.plan(state, 100)
    assert [policy.keep_drafting(state, n, None) for n in range(1, 5)] == [True, True, True, False]


def test_egag_plan_at_end_of_sequence_wins_over_gamma_min() -> None:
    policy = EntropyGamma(gamma_min=3, gamma_max=6)
    state = policy.new_state()
    assert policy.plan(state, 3) == 2
    assert policy.keep_drafting(state, 1, ONE_HOT)
    assert not policy.keep_drafting(state, 2, ONE_HOT)


def test_egag_smoothing_ignores_a_single_spike() -> None:
    policy = EntropyGamma(gamma_min=1, gamma_max=8, entropy_threshold=0.6, beta=0.5, threshold_adapt=0.0)
    state = policy.new_state()
    policy.plan(state, 100)
    assert policy.keep_drafting(state, 1, ONE_HOT)
    assert policy.keep_drafting(state, 2, UNIFORM)        # smoothed 0.5 <= 0.6
    assert not policy.keep_drafting(state, 3, UNIFORM)    # smoothed 0.75 > 0.6
    assert state.ema_entropy == pytest.approx(0.75)


def test_egag_threshold_follows_acceptance() -> None:
    policy = EntropyGamma(gamma_min=1, entropy_threshold=0.5, beta=0.0, threshold_adapt=0.5,
                          acceptance_prior=0.5, acceptance_beta=0.0)
    q = torch.tensor([0.8, 0.1, 0.1])  # normalised entropy about 0.58
    state = policy.new_state()
    policy.plan(state, 100)
    assert not policy.keep_drafting(state, 1, q)
    policy.observe(state, drafted=4, accepted=4)  # acceptance 1.0 -> threshold 0.75
    assert policy.threshold(state) == pytest.approx(0.75)
    assert policy.keep_drafting(state, 1, q)
    policy.observe(state, drafted=4, accepted=0)  # acceptance 0.0 -> threshold 0.25
    assert policy.threshold(state) == pytest.approx(0.25)


def test_confidence_drafts_while_top1_clears_the_threshold() -> None:
    policy = ConfidenceGamma(threshold=0.4, gamma_min=1, gamma_max=5)
    state = policy.new_state()
    assert policy.plan(state, 100) == 5
    sure, unsure = torch.tensor([0.05, 0.9, 0.05]), torch.tensor([0.3, 0.35, 0.35])
    assert policy.keep_drafting(state, 1, sure)
    assert not policy.keep_drafting(state, 1, unsure)           # top-1 0.35 < 0.4: stop here
    assert policy.keep_drafting(state, 1, torch.tensor([0.4, 0.3, 0.3]))  # exactly at the threshold
    assert not policy.keep_drafting(state, 5, sure)             # the plan is the hard limit
    assert [policy.keep_drafting(state, n, None) for n in range(1, 6)] == [True] * 4 + [False]
    floor = ConfidenceGamma(threshold=0.4, gamma_min=3, gamma_max=5)
    floor.plan(floor.new_state(), 100)
    assert floor.keep_drafting(floor.new_state(), 2, unsure)   # below gamma_min: keep going
    with pytest.raises(ValueError, match="threshold"):
        ConfidenceGamma(threshold=1.5)


def test_observe_estimates_per_token_acceptance() -> None:
    policy = FixedGamma(gamma=4, acceptance_beta=0.0)
    state = policy.new_state()
    policy.observe(state, drafted=4, accepted=2)   # 2 accepted, then 1 rejected; drafts 4 never tried
    assert state.ema_acceptance == pytest.approx(2 / 3)
    policy.observe(state, drafted=4, accepted=4)
    assert state.ema_acceptance == 1.0
    policy.observe(state, drafted=0, accepted=0)   # nothing drafted: no evidence
    assert state.ema_acceptance == 1.0
    policy.observe(state, drafted=10, accepted=3, depth=3)  # tree of depth 3 fully accepted
    assert state.ema_acceptance == 1.0
    assert state.steps == 4
    with pytest.raises(ValueError):
        policy.observe(state, drafted=2, accepted=3)


def test_observe_ema_factor() -> None:
    policy = FixedGamma(gamma=4, acceptance_prior=0.5, acceptance_beta=0.75)
    state = policy.new_state()
    policy.observe(state, drafted=4, accepted=4)
    assert state.ema_acceptance == pytest.approx(0.75 * 0.5 + 0.25 * 1.0)


def test_adaptive_gamma_rises_with_acceptance_and_falls_without() -> None:
    policy = AdaptiveGamma(gamma_min=1, gamma_max=8, acceptance_prior=0.6)
    state = policy.new_state()
    initial = policy.plan(state, 1000)
    for _ in range(30):
        policy.observe(state, drafted=policy.plan(state, 1000), accepted=state.planned_gamma)
    high = policy.plan(state, 1000)
    for _ in range(30):
        policy.observe(state, drafted=policy.plan(state, 1000), accepted=0)
    low = policy.plan(state, 1000)
    assert 1 < initial < high == 8
    assert low == 1


def test_adaptive_picks_the_best_tokens_per_cost() -> None:
    policy = AdaptiveGamma(gamma_min=0, gamma_max=6, draft_cost_ratio=0.2, verify_slope=0.1)
    state = policy.new_state()
    state.ema_acceptance = 0.8
    gamma = policy.plan(state, 100)
    scores = {g: expected_tokens(0.8, g) / (0.2 * g + 1 + 0.1 * g) for g in range(7)}
    assert gamma == max(scores, key=scores.get)
    state.ema_acceptance = 0.0  # drafting only costs: plain decoding
    assert policy.plan(state, 100) == 0


def test_adaptive_verify_cost_table() -> None:
    # Expensive verification past 2 drafts: the table caps γ at 2 even at high acceptance.
    policy = AdaptiveGamma(gamma_min=1, gamma_max=6, draft_cost_ratio=0.0, verify_cost=[1.0, 1.05, 1.1, 4.0])
    state = policy.new_state()
    state.ema_acceptance = 0.9
    assert policy.plan(state, 100) == 2
    assert policy.verify_cost(5) == pytest.approx(4.0 + 2 * 2.9)  # linear past the table


def test_adaptive_tree_widens_when_acceptance_is_middling() -> None:
    policy = AdaptiveGamma(gamma_min=1, gamma_max=8, tree_width=4)
    state = policy.new_state()
    state.ema_acceptance = 0.5
    assert policy.plan_tree(state, 100)[1] > 1
    state.ema_acceptance = 1.0  # a sure drafter gains nothing from siblings
    assert policy.plan_tree(state, 100) == (8, 1)
    capped = AdaptiveGamma(gamma_min=1, gamma_max=8, tree_width=4, max_tree_nodes=6)
    state = capped.new_state()
    state.ema_acceptance = 0.5
    depth, width = capped.plan_tree(state, 100)
    assert width == 1 or depth * width <= 6


def test_build_gamma_policy() -> None:
    assert set(GAMMA_POLICIES) == {"fixed", "egag", "confidence", "adaptive", "goodput"}
    for name, cls in GAMMA_POLICIES.items():
        policy = build_gamma_policy(name, gamma_max=5)
        assert isinstance(policy, cls) and policy.gamma_max == 5 and policy.name == name
    with pytest.raises(ValueError, match="unknown gamma policy"):
        build_gamma_policy("nope")
    with pytest.raises(TypeError):
        build_gamma_policy("fixed", entropy_threshold=0.3)
    with pytest.raises(ValueError):
        build_gamma_policy("egag", gamma_min=5, gamma_max=4)
