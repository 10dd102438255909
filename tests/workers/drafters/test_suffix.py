"""Suffix index and suffix drafter (no model beside it): frequencies, matching, trees, memory bound."""

import random

import pytest

from specd.workers.core.sampling import SamplingParams
from specd.workers.drafters.base import SCRATCH_PREFIX
from specd.workers.drafters.registry import build_drafter
from specd.workers.drafters.suffix import SuffixDrafter
from specd.workers.drafters.suffix_index import ContextIndex, SuffixIndex

GREEDY = SamplingParams()


def brute_count(seqs: list[list[int]], pattern: list[int]) -> int:
    return sum(1 for s in seqs for i in range(len(s) - len(pattern) + 1) if s[i:i + len(pattern)] == pattern)


def all_counts(seqs: list[list[int]], max_depth: int) -> dict[tuple, int]:
    """Every substring of up to max_depth tokens and its occurrences: the plain trie, as a dict."""
    out: dict[tuple, int] = {}
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(i + max_depth, len(s)) + 1):
                out[tuple(s[i:j])] = out.get(tuple(s[i:j]), 0) + 1
    return out


def assert_is_the_plain_trie(index: SuffixIndex, seqs: list[list[int]], rng: random.Random) -> None:
    """Counts of every substring (and of absent ones), and what each node lists as its children, are
    the plain trie's; num_nodes is the nodes kept."""
    counts = all_counts(seqs, index.max_depth)
    for pattern, n in counts.items():
        assert index.count(list(pattern)) == n, pattern
        node, off = index.root, 0
        for token in pattern:
            node, off = index._step(node, off, token)
        listed = {t: c for t, _, c in index._children((node, off))}
        expected = {p[-1]: c for p, c in counts.items() if len(p) == len(pattern) + 1 and p[:-1] == pattern}
        assert listed == expected, pattern
    for _ in range(50):
        pattern = [rng.randrange(6) for _ in range(rng.randrange(1, index.max_depth + 2))]
        assert index.count(pattern) == counts.get(tuple(pattern), 0)
    assert index.num_nodes == len(index.trie.count) - 1 - len(index.trie.free)
    assert index.num_nodes <= len(counts)


@pytest.mark.parametrize("seed", range(8))
def test_the_compressed_trie_is_the_plain_trie_through_adds_and_removes(seed) -> None:
    """Random adds and removes of sequences with many repeats (a small vocabulary, copies, a sequence
    repeating itself), sequences grown in pieces: after each, counts and children are the plain trie's.
    Removing everything frees every node."""
    rng = random.Random(seed)
    index = SuffixIndex(max_depth=6)
    live: dict[int, list[int]] = {}
    pool: list[list[int]] = []
    for _ in range(30):
        if live and rng.random() < 0.4:
            seq_id = rng.choice(sorted(live))
            index.remove(seq_id)
            del live[seq_id]
        else:
            kind = rng.random()
            if pool and kind < 0.3:
                s = list(rng.choice(pool))                       # a copy of an earlier sequence
            elif kind < 0.5:
                unit = [rng.randrange(3) for _ in range(rng.randrange(1, 4))]
                s = unit * rng.randrange(2, 9)                    # a sequence repeating itself
            else:
                s = [rng.randrange(3 + seed % 3) for _ in range(rng.randrange(1, 40))]
            pool.append(s)
            state, cut = None, 0
            while cut < len(s):
                step = s[cut:cut + rng.randint(1, 5)]
                state = index.extend(step, state)
                cut += len(step)
            live[state.seq] = s
        assert_is_the_plain_trie(index, list(live.values()), rng)
    for seq_id in list(live):
        index.remove(seq_id)
    assert index.num_nodes == 0 and index.trie.kids[index.root] is None
    assert len(index.trie.free) == len(index.trie.count) - 1          # every id but the root's is free again


def test_unique_text_keeps_about_one_node_per_token_and_only_the_last_sequence_grows() -> None:
    """Text seen once costs a head per token, not max_depth nodes; a second copy materialises the shared
    paths; removing it folds them back. Extending a sequence after another was started is refused."""
    rng = random.Random(0)
    text = rng.sample(range(10_000), 300)          # no token twice
    index = SuffixIndex(max_depth=24)
    first = index.add(text)
    assert index.num_nodes == len(text)
    second = index.add(text)
    assert index.count(text[100:124]) == 2 and index.num_nodes > 20 * len(text)
    index.remove(first)                   # the oldest goes first, as the suffix drafter evicts
    assert index.num_nodes == len(text) and index.count(text[100:124]) == 1
    state = index.extend([1, 2])
    index.extend([3])
    with pytest.raises(ValueError, match="closed"):
        index.extend([4], state)
    index.remove(second)
    assert index.count(text[:3]) == 0


@pytest.mark.parametrize("seed", range(6))
def test_context_index_drafts_what_a_suffix_index_of_the_sequence_drafts(seed) -> None:
    """The lazy per-request index is the SuffixIndex over the same tokens, draft for draft, as the sequence
    grows, over match lengths, depths, widths and node budgets (a small vocabulary: many repeats)."""
    rng = random.Random(seed)
    seq = [rng.randrange(4 if seed % 2 else 9) for _ in range(160)]
    lazy, full, state = ContextIndex(max_depth=10), SuffixIndex(max_depth=10), None
    cut = 0
    while cut < len(seq):
        step = seq[cut:cut + rng.randint(1, 7)]
        lazy.extend(step)
        state = full.extend(step, state)
        cut += len(step)
        context = seq[:cut]
        for depth, width, max_nodes, max_match, min_match in (
            (4, 1, None, 12, 1), (8, 1, None, 3, 2), (5, 3, 9, 12, 1), (3, 2, None, 6, 3), (0, 1, None, 12, 1)
        ):
            kw = dict(width=width, max_nodes=max_nodes, max_match=max_match, min_match=min_match,
                      min_prob=0.05)
            assert lazy.draft(context, depth, **kw) == full.draft(context, depth, **kw)


def test_context_index_reads_the_newest_occurrences_of_a_repeated_token() -> None:
    """Past max_occurrences occurrences of the last token, a match reads the newest ones only: a draft's cost
    is bounded on a request that repeats itself, and it follows the request's recent text."""
    old, recent = [3, 1] * 50, [3, 2] * 8
    index = ContextIndex(max_depth=10, max_occurrences=8)
    index.extend(old + recent + [3])
    # 58 earlier occurrences of 3: the 50 oldest go on with 1, the 8 newest with 2
    assert index.draft([3], depth=1, min_prob=0.0).tokens == [2]
    unbounded = ContextIndex(max_depth=10, max_occurrences=1000)
    unbounded.extend(old + recent + [3])
    assert unbounded.draft([3], depth=1, min_prob=0.0).tokens == [1]
    with pytest.raises(ValueError, match="max_occurrences"):
        ContextIndex(max_occurrences=0)


def test_drafts_the_most_frequent_continuation() -> None:
    index = SuffixIndex(max_depth=8)
    for tail in ([7, 8, 9], [7, 8, 9], [7, 5, 5], [6, 1, 1]):
        index.add([1, 2, 3, *tail])
    draft = index.draft([4, 2, 3], depth=3, min_prob=0.0)
    assert draft.tokens == [7, 8, 9] and draft.parents == [0, 1, 2] and draft.match == 2
    # path frequencies: P(7) = 3/4, P(7 8) = 3/4 * 2/3, P(7 8 9) = P(7 8) * 1
    assert draft.score == pytest.approx(0.75 + 0.5 + 0.5)
    # min_prob cuts the tail when the path's frequency drops below it
    assert index.draft([4, 2, 3], depth=3, min_prob=0.6).tokens == [7]


def test_longest_match_wins() -> None:
    index = SuffixIndex(max_depth=8)
    index.add([9, 1, 2, 5, 5])
    index.add([1, 2, 6, 6])
    index.add([1, 2, 6, 6])
    assert index.draft([9, 1, 2], depth=2, min_prob=0.0).tokens == [5, 5]
    assert index.draft([8, 1, 2], depth=2, min_prob=0.0).tokens == [6, 6]


def test_tree_branches_where_continuations_compete() -> None:
    index = SuffixIndex(max_depth=8)
    for tail in ([7, 8], [7, 8], [5, 4], [5, 4], [3, 3]):
        index.add([1, 2, *tail])
    draft = index.draft([1, 2], depth=2, width=2, min_prob=0.0)
    # best first: both 0.4 branches, then their continuations; the 0.2 branch is past width 2
    assert draft.tokens == [5, 7, 4, 8] and draft.parents == [0, 0, 1, 2]
    assert draft.score == pytest.approx(1.6)


def test_memory_bound_holds_with_lru_eviction() -> None:
    rng = random.Random(1)
    drafter = SuffixDrafter(max_depth=8, max_nodes=2000)
    sizes = []
    for i in range(60):
        drafter.add_request(f"r{i}", [rng.randrange(50) for _ in range(40)])
        drafter.commit(f"r{i}", 0, [rng.randrange(50) for _ in range(20)])
        drafter.remove_request(f"r{i}")
        drafter.flush()
        sizes.append(drafter.global_index.num_nodes)
    assert max(sizes) <= 2000
    assert 0 < drafter.stats()["indexed_requests"] < 60
    # the oldest went first: the index is the plain trie of the ones it kept
    kept = [drafter.global_index.seqs[seq_id] for seq_id in drafter.indexed]
    assert len(kept) == len(drafter.global_index.seqs)
    assert_is_the_plain_trie(drafter.global_index, kept, rng)


def test_cross_request_matching_drafts_from_a_finished_request() -> None:
    drafter = build_drafter("suffix", max_depth=16)
    first = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    drafter.add_request("a", [1, 2, 3])
    drafter.commit("a", 0, first)
    drafter.remove_request("a")
    drafter.add_request("b", [4, 5, *first[:3]])
    out = drafter.propose(["b"], [4], [GREEDY])
    assert out.tokens == [first[3:7]] and out.probs is None
    assert drafter.stats()["sources"]["global"]["steps"] == 1
    drafter.commit("b", 4, first[3:8])
    assert drafter.stats()["sources"]["global"]["accepted"] == 4


def test_own_context_matches_and_scratch_requests_are_not_learned() -> None:
    drafter = SuffixDrafter()
    drafter.add_request("r", [1, 2, 3, 4, 9, 1, 2, 3])
    assert drafter.propose(["r"], [2], [GREEDY]).tokens == [[4, 9]]
    assert drafter.stats()["sources"]["local"]["steps"] == 1
    drafter.add_request(f"{SCRATCH_PREFIX}x", [5, 6, 7, 8])
    drafter.remove_request(f"{SCRATCH_PREFIX}x")
    drafter.flush()
    assert drafter.stats()["indexed_requests"] == 0


def test_no_match_no_draft_and_gamma_zero() -> None:
    drafter = SuffixDrafter()
    drafter.add_request("r", [1, 2, 3])
    assert drafter.propose(["r"], [3], [GREEDY]).tokens == [[]]
    drafter.add_request("s", [1, 2, 1, 2])
    assert drafter.propose(["s"], [0], [GREEDY]).tokens == [[]]
    tree = drafter.propose_tree(["s"], [3], [2], [GREEDY])
    assert tree.tokens == [[1, 2]] and tree.parents == [[0, 1]]


def test_deterministic() -> None:
    def run():
        rng = random.Random(5)
        drafter = SuffixDrafter(max_depth=10)
        for i in range(5):
            drafter.add_request(f"r{i}", [rng.randrange(6) for _ in range(30)])
            drafter.remove_request(f"r{i}")
        drafter.flush()
        drafter.add_request("q", [rng.randrange(6) for _ in range(10)])
        return drafter.propose_tree(["q"], [4], [3], [GREEDY]).tokens

    assert run() == run()


def test_indexing_is_spread_over_steps() -> None:
    drafter = SuffixDrafter(index_tokens_per_step=4)
    drafter.add_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    drafter.remove_request("a")
    drafter.add_request("b", [7, 1, 2])
    assert drafter.stats()["pending_tokens"] == 10
    assert drafter.propose(["b"], [3], [GREEDY]).tokens == [[3, 4]]   # only 1..4 indexed so far
    for _ in range(2):
        drafter.propose(["b"], [0], [GREEDY])
    assert drafter.stats()["pending_tokens"] == 0 and drafter.stats()["indexed_requests"] == 1
    assert drafter.propose(["b"], [3], [GREEDY]).tokens == [[3, 4, 5]]


def test_hints_predict_per_position_acceptance_and_the_planned_draft_is_drafted() -> None:
    drafter = SuffixDrafter(max_depth=16)
    drafter.add_request("r", [1, 2, 3, 4, 5, 6, 9, 1, 2, 3])          # own context: 1 2 3 -> 4 5 6 9 ...
    drafter.add_request("none", [7, 8])
    hint, nothing = drafter.draft_hints(["r", "none"], [4, 4], [GREEDY, GREEDY])
    assert nothing is None and hint.free and len(hint.alpha) == 4
    # one occurrence: frequency 1 everywhere; the prior of a 3-token match: 0.5 first, 0.8 after
    assert hint.alpha == pytest.approx([0.5, 0.8, 0.8, 0.8])
    # the controller planned 2 of the 4: exactly those are drafted
    assert drafter.propose(["r"], [2], [GREEDY]).tokens == [[4, 5]]
    drafter.commit("r", 0, [7])                                          # both rejected
    for _ in range(20):                                                 # matches of 3 keep failing
        drafter.add_request("x", [21, 22, 23, 24, 25, 21, 22, 23])
        drafter.draft_hints(["x"], [2], [GREEDY])
        drafter.propose(["x"], [2], [GREEDY])
        drafter.commit("x", 0, [29])
        drafter.remove_request("x")
    drafter.add_request("s", [1, 2, 3, 4, 5, 6, 9, 1, 2, 3])
    assert drafter.draft_hints(["s"], [4], [GREEDY])[0].alpha[0] < 0.1   # 2 of 24 with the prior
    # sampled requests are measured apart: still the prior
    sampled = drafter.draft_hints(["s"], [4], [SamplingParams(temperature=0.7)])[0]
    assert sampled.alpha[0] == pytest.approx(0.5)


def tracked_inside(obj) -> int:
    """Objects the garbage collector tracks among those reachable from obj (not through types, modules or
    functions: the class and its module are not the index's)."""
    import gc
    import types

    seen, stack, tracked = set(), [obj], 0
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, type | types.ModuleType | types.FunctionType):
            continue
        seen.add(id(o))
        tracked += gc.is_tracked(o)
        stack.extend(gc.get_referents(o))
    return tracked


def test_reused_ids_keep_counts_exact_and_the_collector_never_walks_the_nodes() -> None:
    """Removed nodes' ids are reused; counts stay the substring occurrences of what is indexed. No node is
    an object the garbage collector tracks (a full collection walked every node before: 0.2-0.6 s): what
    it tracks of the index is a handful of containers and one list per sequence kept."""
    rng = random.Random(1)
    seqs = [[rng.randrange(6) for _ in range(rng.randrange(300, 600))] for _ in range(5)]
    index = SuffixIndex(max_depth=6)
    first = [index.add(s) for s in seqs[:3]]
    index.remove(first[0])
    for s in seqs[3:]:
        index.add(s)
    live = seqs[1:]
    for s in live:
        for i in range(len(s)):
            pattern = s[i:i + rng.randrange(1, 7)]
            assert index.count(pattern) == brute_count(live, pattern)
    assert index.num_nodes == len(index.trie.count) - 1 - len(index.trie.free)
    assert index.num_nodes > 1000
    assert tracked_inside(index) < 10 + len(index.seqs)     # thousands of nodes, none of them tracked
