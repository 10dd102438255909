"""The suffix drafter's choice between its lookup draft and the model drafter beside it (a fake model: this
module's unit tests). Both sides are priced from measured acceptance per draft position."""

import pytest

from specd.workers.core.sampling import SamplingParams
from specd.workers.drafters.base import DraftProposal
from specd.workers.drafters.suffix import MODEL_SHRINK, SuffixDrafter, expected_tokens
from specd.workers.drafters.suffix_index import SuffixDraft

GREEDY = SamplingParams()


class FakeModel:
    """What SuffixDrafter asks of a model drafter; drafts 100, 101, ... and records nothing else."""

    uses_target_hidden = False

    def __init__(self, held_out: float | None, version: str = "v1") -> None:
        self.held_out_acceptance, self.version = held_out, version

    def add_request(self, request_id, prompt_tokens, seed=None) -> None:
        pass

    def commit(self, request_id, num_accepted, new_tokens) -> None:
        pass

    def remove_request(self, request_id) -> None:
        pass

    def propose(self, request_ids, gammas, params, policy=None, states=None) -> DraftProposal:
        return DraftProposal([[100 + k for k in range(g)] for g in gammas], None, self.version)


def chain(probs: list[float], match: int = 3) -> SuffixDraft:
    """A suffix chain whose nodes have these path probabilities."""
    return SuffixDraft(list(range(len(probs))), list(range(len(probs))), sum(probs), match, probs)


def drafter(held_out: float | None = 0.6, cost: float = 0.1) -> SuffixDrafter:
    d = SuffixDrafter(FakeModel(held_out), max_depth=8, model_cost=cost)
    d.add_request("r", [1, 2, 3])
    return d


def test_expected_tokens_is_one_plus_the_sum_of_path_probabilities() -> None:
    assert expected_tokens([]) == 1.0
    assert expected_tokens([0.5, 0.5]) == pytest.approx(1.75)
    assert expected_tokens([1.0, 0.0, 1.0]) == pytest.approx(2.0)


def test_the_model_is_priced_at_its_best_length_not_the_plans_cap() -> None:
    d = drafter(held_out=0.6, cost=0.1)
    req = d.requests["r"]
    # flat 0.6: 1 draft 1.6/1.1, 2: 1.96/1.2, 3: 2.176/1.3 (the best), 4: 2.3056/1.4 ...
    assert d._model_value(req, 8) == pytest.approx(2.176 / 1.3)
    assert d._model_value(req, 1) == pytest.approx(1.6 / 1.1)
    # at the cap of 8 the model's value is 2.45/1.8 = 1.36: a suffix draft worth 1.5 tokens won there
    single = chain([1.0, 1.0], match=2)                 # calibrated by the prior: 0.5, then 0.8
    assert expected_tokens(d._suffix_alphas(single, True)) == pytest.approx(1.9)
    assert d._prefers_suffix(single, 8, req)
    rare = chain([0.3], match=3)                        # a continuation seen 3 times in 10: 0.15
    assert not d._prefers_suffix(rare, 8, req)
    # a model not worth a forward (0.05 a token) never beats even a weak lookup draft
    weak = drafter(held_out=0.05)
    assert weak._model_value(weak.requests["r"], 8) == 1.0
    assert weak._prefers_suffix(rare, 8, weak.requests["r"])
    assert not weak._prefers_suffix(SuffixDraft(), 8, weak.requests["r"])   # no draft: nothing to prefer


def test_the_models_measured_acceptance_per_position_moves_the_choice() -> None:
    d = drafter(held_out=0.6)
    for i in range(40):     # the model's first draft always accepted, the second never
        rid = f"m{i}"
        d.add_request(rid, [1, 2, 3])
        d.requests[rid].source, d.requests[rid].last_drafted = "model", 3
        d.commit(rid, 1, [100, 7])
        d.remove_request(rid)
    d.add_request("new", [1, 2, 3])
    alphas = d._model_alphas(d.requests["new"], 3)
    assert alphas[0] == pytest.approx((40 + 4 * 0.6) / 44)
    assert alphas[1] == pytest.approx((0 + 4 * 0.6) / 44)
    assert alphas[2] == pytest.approx(0.6)              # never reached: still the prior
    # this request's own outcomes shrink toward the measured figure: MODEL_SHRINK observations' worth
    d.requests["new"].source, d.requests["new"].last_drafted = "model", 2
    d.commit("new", 0, [9])
    measured = (40 + 4 * 0.6) / 45                    # all requests' first drafts, this one's rejection too
    first = d._model_alphas(d.requests["new"], 1)[0]
    assert first == pytest.approx((0 + MODEL_SHRINK * measured) / (1 + MODEL_SHRINK))
    # sampled requests are measured apart
    d.add_request("s", [1, 2, 3])
    d.requests["s"].greedy = False
    assert d._model_alphas(d.requests["s"], 1)[0] == pytest.approx(0.6)


def test_a_hot_swap_restarts_the_models_measured_acceptance_from_the_new_versions_figure() -> None:
    d = drafter(held_out=0.6)
    d.requests["r"].source, d.requests["r"].last_drafted = "model", 2
    d.commit("r", 0, [9])
    d.add_request("a", [1])
    assert d._model_alphas(d.requests["a"], 1)[0] < 0.6
    d.model.version, d.model.held_out_acceptance = "v2", 0.8
    d.add_request("b", [1])
    assert d._model_alphas(d.requests["b"], 2) == pytest.approx([0.8, 0.8])


def test_hints_offer_the_lookup_draft_as_a_fallback_where_the_model_is_preferred() -> None:
    d = SuffixDrafter(FakeModel(0.9), max_depth=8)
    d.add_request("r", [1, 2, 3, 4, 1, 2, 3])      # own context: 1 2 3 -> 4 1 2 3 (one occurrence)
    hint = d.draft_hints(["r"], [4], [GREEDY])[0]
    assert hint.fallback                            # a 0.9 model beats a one-occurrence match of 3
    assert d.propose(["r"], [2], [GREEDY]).tokens == [[100, 101]]
    strong = SuffixDrafter(FakeModel(0.2), max_depth=8)
    strong.add_request("r", [1, 2, 3, 4, 1, 2, 3])
    assert not strong.draft_hints(["r"], [4], [GREEDY])[0].fallback
    assert strong.propose(["r"], [2], [GREEDY]).tokens == [[4, 1]]


def test_a_fallback_planned_from_an_older_hint_never_fails_the_step() -> None:
    """Through Ray the plan reads the previous step's hints while the drafter has just looked up this
    step's: a fallback the plan chose may be gone. The index's own draft stays where it drafts; where it has
    none, nothing is drafted (the plan priced no model forward). It raised before, failing the whole call."""
    d = SuffixDrafter(FakeModel(0.2), max_depth=8)
    d.add_request("r", [1, 2, 3, 4, 1, 2, 3])
    assert not d.draft_hints(["r"], [4], [GREEDY])[0].fallback      # the index drafts: no fallback now
    d.use_fallback(["r"])
    assert d.propose(["r"], [2], [GREEDY]).tokens == [[4, 1]]
    d.add_request("none", [7, 8])
    assert d.draft_hints(["none"], [4], [GREEDY]) == [None]           # no lookup draft at all
    d.use_fallback(["none"])
    assert d.propose(["none"], [2], [GREEDY]).tokens == [[]]
