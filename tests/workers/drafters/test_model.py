"""ModelDrafter on a tiny random Llama: seeds at the edge of the 64-bit range."""

from __future__ import annotations

import pytest
import torch

from specd.workers.core.sampling import SamplingParams
from specd.workers.drafters.model import ModelDrafter


@pytest.fixture(scope="module")
def drafter(tiny_llama_dir):
    return ModelDrafter(tiny_llama_dir, max_slots=4, max_seq_len=64, pack="none")


def test_seed_at_the_top_of_the_uint64_range_drafts(drafter):
    # The API accepts any uint64 seed; the drafter derives its own stream from it without overflow.
    sampled = SamplingParams(temperature=1.0, seed=2**64 - 1)
    runs = []
    for rid in ("a", "b"):
        drafter.add_request(rid, [3, 4, 5], seed=sampled.seed)
        runs.append(drafter.propose([rid], [4], [sampled]).tokens[0])
        drafter.remove_request(rid)
    assert len(runs[0]) == 4 and runs[0] == runs[1]  # seeded: reproducible


def test_catch_up_batches_feeds_of_alike_length(tiny_llama_dir, monkeypatch):
    """Feeds a drafter has not taken in go in prefills of alike lengths when long (requests that stopped
    drafting together come back together), never one per request; a short one goes in with the first
    drafting forward (eager forwards)."""
    drafter = ModelDrafter(tiny_llama_dir, max_slots=4, max_seq_len=64, pack="none")
    calls = []
    prefill = drafter.runner.prefill

    def counted(slots, prompts, **kwargs):
        calls.append(sorted(len(p) for p in prompts))
        return prefill(slots, prompts, **kwargs)

    monkeypatch.setattr(drafter.runner, "prefill", counted)
    committed = {"short": 2, "a": 17, "b": 19, "long": 47}   # feeds of 5, 20, 22 and 50 tokens
    for rid, n in committed.items():
        drafter.add_request(rid, [3, 4, 5], seed=0)
        drafter.commit(rid, 0, [6 + k % 7 for k in range(n)])
        assert drafter.pending_context(rid) == 3 + n - 1
    out = drafter.propose(list(committed), [2] * 4, [SamplingParams()] * 4)
    assert sorted(calls) == [[19, 21], [49]]
    assert [len(t) for t in out.tokens] == [2] * 4


def _count_calls(obj, name: str, monkeypatch) -> list[int]:
    calls: list[int] = []
    method = getattr(obj, name)
    monkeypatch.setattr(obj, name, lambda *args, **kwargs: calls.append(1) or method(*args, **kwargs))
    return calls


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_a_short_feed_drafts_in_its_own_forward_what_a_catch_up_first_drafts(tiny_llama_dir, decode,
                                                                             monkeypatch):
    """Taking the feed in with the first drafting forward (one forward less a step) drafts the tokens that
    a catch-up prefill then a one-token forward draft, step after step. On the static (CUDA-graph) path
    too, where the catch-up is an eager prefill, not a graph."""
    drafts = {}
    for merged in (True, False):
        drafter = ModelDrafter(tiny_llama_dir, max_slots=2, max_seq_len=64, pack="none", decode=decode)
        if not merged:
            catch_up = drafter._catch_up
            monkeypatch.setattr(drafter, "_catch_up", lambda seqs, f=catch_up: f(seqs, short_feeds=True))
        extends = _count_calls(drafter.runner, "extend", monkeypatch)
        prefills = _count_calls(drafter.runner, "prefill", monkeypatch)
        out = []
        for rid, prompt in (("a", [3, 4, 5, 9]), ("b", [7, 8])):
            drafter.add_request(rid, prompt, seed=0)
        for step in range(4):
            proposal = drafter.propose(["a", "b"], [3, 2], [SamplingParams()] * 2)
            out.append(proposal.tokens)
            for rid, toks in zip(["a", "b"], proposal.tokens, strict=True):
                kept = len(toks) if step % 2 == 0 else step % 3    # all drafts accepted, or some
                drafter.commit(rid, kept, [*toks[:kept], 11 + step])
        drafts[merged] = (out, len(extends), len(prefills))
    assert drafts[True][0] == drafts[False][0]
    assert drafts[True][1] == drafts[False][1]          # the same drafting forwards
    # and no catch-up prefill: for the prompts, and after each step whose drafts were all accepted
    assert drafts[True][2] == 0 and drafts[False][2] == 3


def test_a_versions_own_held_out_acceptance_wins_over_its_bootstrap_record():
    from specd.workers.drafters.versions import held_out_acceptance

    boot = {"train": {"eval_after": {"greedy_match": 0.1}}}
    assert held_out_acceptance(boot) == 0.1
    assert held_out_acceptance({**boot, "held_out_acceptance": 0.25}) == 0.25   # an online version's gate
    assert held_out_acceptance({}) is None
    assert held_out_acceptance({"held_out_acceptance": 1.5}) is None            # not a probability


def test_a_gated_versions_record_names_its_parents_score_on_the_same_records():
    from specd.workers.drafters.versions import parent_held_out_acceptance

    gated = {"held_out_acceptance": 0.258, "gate": {"candidate": {"greedy_match": 0.258},
                                                   "serving": {"greedy_match": 0.1886}}}
    assert parent_held_out_acceptance(gated) == 0.1886
    assert parent_held_out_acceptance({"train": {"eval_after": {"greedy_match": 0.1}}}) is None
    assert parent_held_out_acceptance({"gate": {"serving": {"greedy_match": 0.0}}}) is None   # no ratio by 0


def _fresh_states(gen, reads_hidden: bool):
    """states(n): the keyword arguments that hand a hidden-state drafter n fresh target states [n, 64]
    (add_request, commit); nothing for a token drafter."""
    def states(n):
        return {"hidden": torch.randn(n, 64, generator=gen)} if reads_hidden else {}
    return states


def _small_drafter(token_dir, hidden_dir, reads_hidden: bool, decode: str) -> ModelDrafter:
    """Two slots of the tiny token drafter, or of the tiny hidden-state one."""
    path = hidden_dir if reads_hidden else token_dir
    drafter = ModelDrafter(path, max_slots=2, max_seq_len=64, pack="none", decode=decode)
    assert drafter.uses_target_hidden == reads_hidden
    return drafter


@pytest.mark.parametrize("decode", ["eager", "static"])
@pytest.mark.parametrize("reads_hidden", [False, True], ids=["tokens", "hidden-states"])
def test_a_tree_takes_a_short_feed_in_its_first_level(tiny_llama_dir, tiny_hidden_llama_dir, reads_hidden,
                                                      decode, monkeypatch):
    """A tree's first level takes the feed in with its root (one drafter forward a step fewer): the same
    trees as a catch-up prefill then the root alone, step after step, and no catch-up prefill."""
    gen = torch.Generator()
    states = _fresh_states(gen, reads_hidden)
    trees = {}
    for merged in (True, False):
        gen.manual_seed(0)
        drafter = _small_drafter(tiny_llama_dir, tiny_hidden_llama_dir, reads_hidden, decode)
        if not merged:
            catch_up = drafter._catch_up
            monkeypatch.setattr(drafter, "_catch_up", lambda seqs, f=catch_up: f(seqs, short_feeds=True))
        prefills = _count_calls(drafter.runner, "prefill", monkeypatch)
        out = []
        for rid, prompt in (("a", [3, 4, 5, 9]), ("b", [7, 8])):
            drafter.add_request(rid, prompt, seed=0, **states(len(prompt) - 1))
        for step in range(4):
            tree = drafter.propose_tree(["a", "b"], [3, 2], [2, 3], [SamplingParams()] * 2)
            out.append((tree.tokens, tree.parents))
            for rid, toks, parents in zip(["a", "b"], tree.tokens, tree.parents, strict=True):
                # accepted: the first child of the root, then (odd steps) its first child; a target token
                path = [1] + ([parents.index(1) + 1] if step % 2 else [])
                accepted = [toks[node - 1] for node in path]
                drafter.commit(rid, len(path), [*accepted, 11 + step], **states(len(path) + 1))
        trees[merged] = (out, len(prefills))
    assert trees[True][0] == trees[False][0]
    assert all(len(tokens[0]) == 2 + 2 + 2 and len(tokens[1]) == 3 + 3 for (tokens, _) in trees[True][0])
    assert trees[True][1] == 0 and trees[False][1] > 0


@pytest.mark.parametrize("reads_hidden", [False, True], ids=["tokens", "hidden-states"])
def test_a_greedy_chain_in_one_static_run_drafts_what_token_by_token_drafts(
        tiny_llama_dir, tiny_hidden_llama_dir, reads_hidden, monkeypatch):
    """On the static (CUDA-graph) path a greedy chain is one run of the static decoder: the same drafts,
    and the same cache (lengths and entries), as drafting token by token, step after step, where rows plan
    different γ and commit different numbers of drafts."""
    gen = torch.Generator()
    states = _fresh_states(gen, reads_hidden)
    runs = {}
    for one_run in (True, False):
        gen.manual_seed(1)
        drafter = _small_drafter(tiny_llama_dir, tiny_hidden_llama_dir, reads_hidden, "static")
        drafter.chain_in_one_run = one_run
        chains = _count_calls(drafter.runner, "extend_chain", monkeypatch)
        for rid, prompt in (("a", [3, 4, 5, 9]), ("b", [7, 8])):
            drafter.add_request(rid, prompt, seed=0, **states(len(prompt) - 1))
        out = []
        for step in range(5):
            gammas = [3, 1] if step % 2 else [2, 4]
            proposal = drafter.propose(["a", "b"], gammas, [SamplingParams()] * 2)
            out.append(proposal.tokens)
            for rid, toks in zip(["a", "b"], proposal.tokens, strict=True):
                kept = len(toks) if step % 3 == 0 else min(step % 2, len(toks))
                drafter.commit(rid, kept, [*toks[:kept], 11 + step], **states(kept + 1))
        cache = drafter.runner.cache
        slots = [drafter.seqs[r].slot for r in ("a", "b")]
        lengths = cache.lengths_of(slots)
        entries = [cache.k[:, slot, :, :length].clone() for slot, length in zip(slots, lengths, strict=True)]
        runs[one_run] = (out, lengths, entries, len(chains))
    assert runs[True][0] == runs[False][0]
    assert all(len(toks) == g for toks, g in zip(runs[True][0][0], [2, 4], strict=True))
    assert runs[True][1] == runs[False][1]
    for a, b in zip(runs[True][2], runs[False][2], strict=True):
        torch.testing.assert_close(a, b)
    assert runs[True][3] == 5 and runs[False][3] == 0      # one run a step, or none
