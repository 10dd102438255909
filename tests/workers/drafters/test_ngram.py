import random

import pytest

from specd.workers.core.gamma import FixedGamma
from specd.workers.drafters.base import DraftProposal, DraftTree
from specd.workers.drafters.ngram import NGramDrafter


def drafter_with(tokens: list[int], **cfg) -> NGramDrafter:
    drafter = NGramDrafter(**cfg)
    drafter.add_request("r", tokens)
    return drafter


def reference_lookup(tokens: list[int], gamma: int, min_n: int, max_n: int) -> list[int]:
    """Brute force: scan back for the most recent earlier occurrence of the longest suffix, then copy."""
    length = len(tokens)
    for n in range(min(max_n, length), min_n - 1, -1):
        suffix = tokens[length - n:]
        for end in range(length - 1, n - 1, -1):
            if tokens[end - n:end] == suffix:
                extended = list(tokens)
                for k in range(gamma):
                    extended.append(extended[end + k])
                return extended[length:]
    return []


def test_copies_what_followed_the_suffix() -> None:
    drafter = drafter_with([1, 2, 3, 4, 1, 2])
    assert drafter.lookup("r", 3) == [3, 4, 1]


def test_most_recent_occurrence_wins() -> None:
    drafter = drafter_with([5, 6, 7, 5, 6, 8, 5, 6])
    assert drafter.lookup("r", 3) == [8, 5, 6]


def test_longest_suffix_wins() -> None:
    tokens = [3, 1, 2, 7, 1, 2, 9, 3, 1, 2]
    assert drafter_with(tokens, min_ngram=1, max_ngram=3).lookup("r", 1) == [7]  # [3, 1, 2] matched
    assert drafter_with(tokens, min_ngram=1, max_ngram=2).lookup("r", 1) == [9]  # only [1, 2]: latest


def test_no_match_and_min_ngram() -> None:
    assert drafter_with([1, 2, 3, 4]).lookup("r", 4) == []
    assert drafter_with([1, 2, 3, 1], min_ngram=2).lookup("r", 2) == []  # only the 1-gram [1] repeats
    assert drafter_with([1, 2, 3, 1], min_ngram=1).lookup("r", 2) == [2, 3]
    assert drafter_with([]).lookup("r", 2) == []


def test_repeating_pattern_continues_past_the_end_of_context() -> None:
    assert drafter_with([7, 8, 7, 8]).lookup("r", 5) == [7, 8, 7, 8, 7]
    assert drafter_with([4, 4, 4], min_ngram=1).lookup("r", 3) == [4, 4, 4]


def test_propose_batch_respects_gammas() -> None:
    drafter = NGramDrafter()
    drafter.add_request("a", [1, 2, 3, 1, 2])
    drafter.add_request("b", [9, 8, 7])
    drafter.add_request("c", [5, 6, 5, 6])
    proposal = drafter.propose(["a", "b", "c"], [2, 4, 0], params=[None, None, None])
    assert isinstance(proposal, DraftProposal)
    assert proposal.tokens == [[3, 1], [], []]
    assert proposal.num_drafted == [2, 0, 0]
    assert proposal.probs is None
    assert proposal.drafter_version == drafter.version == "ngram-2-4"


def test_propose_stops_at_the_policy_plan() -> None:
    drafter = drafter_with([1, 2, 3, 4, 5, 1, 2])
    policy = FixedGamma(gamma=4)
    state = policy.new_state()
    assert policy.plan(state, remaining_tokens=3) == 2
    proposal = drafter.propose(["r"], [4], [None], policy=policy, states=[state])
    assert proposal.tokens == [[3, 4]]


def test_commit_rolls_back_to_the_verified_prefix() -> None:
    drafter = drafter_with([1, 2, 3, 1, 2])
    assert drafter.propose(["r"], [3], [None]).tokens == [[3, 1, 2]]
    # Target accepts draft 3, rejects draft 1 and recovers 9: the rejected drafts [1, 2] never enter.
    drafter.commit("r", num_accepted=1, new_tokens=[3, 9])
    assert drafter.context("r") == [1, 2, 3, 1, 2, 3, 9]
    assert drafter.lookup("r", 3) == []  # [3, 9] and [2, 3, 9] never occurred before
    drafter.commit("r", 0, [1])
    drafter.commit("r", 0, [2])
    # The latest [1, 2] is now the committed one at positions 3-4, followed by the target's 3, 9.
    assert drafter.lookup("r", 3) == [3, 9, 1]
    with pytest.raises(ValueError):
        drafter.commit("r", num_accepted=2, new_tokens=[4])


def test_incremental_index_matches_brute_force() -> None:
    rng = random.Random(0)
    for trial in range(30):
        min_n, max_n = rng.choice([(1, 1), (1, 3), (2, 4), (3, 5)])
        prompt = [rng.randrange(4) for _ in range(rng.randrange(0, 12))]
        drafter = drafter_with(prompt, min_ngram=min_n, max_ngram=max_n)
        context = list(prompt)
        for _ in range(15):
            gamma = rng.randrange(0, 6)
            assert drafter.lookup("r", gamma) == reference_lookup(context, gamma, min_n, max_n), trial
            new_tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 4))]
            drafter.commit("r", len(new_tokens) - 1, new_tokens)
            context += new_tokens
        assert drafter.context("r") == context


def test_default_tree_is_a_chain() -> None:
    drafter = drafter_with([1, 2, 3, 4, 1, 2])
    tree = drafter.propose_tree(["r"], depths=[3], widths=[4], params=[None])
    assert isinstance(tree, DraftTree)
    assert tree.tokens == [[3, 4, 1]]
    assert tree.parents == [[0, 1, 2]]  # draft n hangs under tree node n: the root, then draft n - 1
    assert tree.probs is None


def test_request_lifecycle_errors() -> None:
    drafter = drafter_with([1, 2])
    with pytest.raises(ValueError):
        drafter.add_request("r", [3])
    with pytest.raises(KeyError):
        drafter.lookup("missing", 2)
    with pytest.raises(ValueError):
        drafter.propose(["r"], [1, 2], [None])
    with pytest.raises(ValueError):
        drafter.propose(["r"], [-1], [None])
    drafter.remove_request("r")
    assert not drafter.has_request("r")
    drafter.remove_request("r")  # removing twice is harmless (aborts may race with completion)
    with pytest.raises(ValueError):
        NGramDrafter(min_ngram=3, max_ngram=2)


def test_a_tree_request_runs_as_a_chain_and_says_so_once(caplog) -> None:
    drafter = drafter_with([1, 2, 3, 1, 2])
    params = [None]
    with caplog.at_level("WARNING", logger="specd.workers.drafters.base"):
        for _ in range(2):
            tree = drafter.propose_tree(["r"], [2], [3], params)
    assert tree.parents == [list(range(len(tree.tokens[0])))]
    said = [r for r in caplog.records if "cannot branch" in r.getMessage()]
    assert len(said) == 1 and "ngram" in said[0].getMessage()
