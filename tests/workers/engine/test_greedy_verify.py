"""Greedy rows verify from the argmax of their logits alone: the same results as the general path
(p over the vocabulary, verify_chain / verify_trees), without computing p."""

from __future__ import annotations

import random

import pytest
import torch

from specd.configs import load_config
from specd.workers.core.sampling import SamplingParams
from specd.workers.engine.target_worker import TargetWorker
from specd.workers.engine.types import Draft, NewRequest

VOCAB = 96    # tests/workers/engine/conftest.py


class GeneralPath(TargetWorker):
    """Greedy rows through the general path, as every row went before the argmax shortcut."""

    def _verify_greedy(self, rows, drafts, runs, starts, logits, hidden):
        p = self._probs(logits, [r.sampling for r in runs])
        chains = [i for i in rows if drafts[i].parents is None]
        trees = [i for i in rows if drafts[i].parents is not None]
        out = {}
        if chains:
            out.update(self._verify_chains(chains, drafts, runs, starts, p, hidden))
        if trees:
            out.update(self._verify_trees(trees, drafts, runs, starts, p, hidden))
        return out


@pytest.fixture(scope="module")
def cfg(tiny_target_dir):
    return load_config([f"target.model_path={tiny_target_dir}", "target.max_slots=4",
                        "target.max_seq_len=256", "target.decode=eager"])


def _draft(rid: str, rng: random.Random, kind: str, guess: list[int]) -> Draft:
    """A chain or tree whose first nodes are often the target's greedy tokens (`guess`), so steps see
    accepted prefixes, rejections and bonus tokens."""
    if kind == "none":
        return Draft(rid, [])
    pick = [g if rng.random() < 0.7 else rng.randrange(2, VOCAB) for g in guess]
    if kind == "chain":
        return Draft(rid, pick[: rng.randint(1, 4)])
    # tree: a wrong sibling first, then the guessed path below the root's second child
    tokens = [rng.randrange(2, VOCAB), pick[0], pick[1], rng.randrange(2, VOCAB), pick[2]]
    return Draft(rid, tokens, parents=[-1, 0, 0, 2, 2, 3])


def test_greedy_rows_match_the_general_path_without_computing_p(cfg, monkeypatch):
    fast, general, oracle = TargetWorker(cfg.target), GeneralPath(cfg.target), TargetWorker(cfg.target)
    prompts = [[5, 9, 13, 2], [7, 7, 7, 30, 31], [40, 41], [3, 4, 5, 6, 3, 4]]
    reqs = [NewRequest(f"r{i}", p, SamplingParams(), 120) for i, p in enumerate(prompts)]
    for worker in (fast, general):
        worker.start(reqs, return_hidden=True)
    # the greedy continuation of each prompt, by plain decoding: good guesses for the drafts
    truth = {r.request_id: toks for r, toks in zip(reqs, oracle.start(reqs), strict=True)}
    for _ in range(100):
        for res in oracle.verify([Draft(r.request_id, []) for r in reqs]):
            truth[res.request_id] += res.new_tokens
    emitted = {r.request_id: 1 for r in reqs}

    def no_probs(*_args, **_kwargs):
        raise AssertionError("an all-greedy batch computed p over the vocabulary")

    monkeypatch.setattr(fast, "_probs", no_probs)
    rng = random.Random(0)
    kinds = ["chain", "tree", "none", "chain"]
    outcomes = set()
    for step in range(12):
        guesses = [truth[r.request_id][emitted[r.request_id]:][:4] for r in reqs]
        drafts = [_draft(r.request_id, rng, kinds[(i + step) % 4], g)
                  for i, (r, g) in enumerate(zip(reqs, guesses, strict=True))]
        got = fast.verify(drafts, return_hidden=True)
        want = general.verify(drafts, return_hidden=True)
        for a, b in zip(got, want, strict=True):
            assert a.new_tokens == truth[a.request_id][emitted[a.request_id]:][:len(a.new_tokens)]
            emitted[a.request_id] += len(a.new_tokens)
            outcomes.add((a.accepted_nodes is not None, a.num_accepted > 0, a.is_bonus))
            assert (a.new_tokens, a.num_accepted, a.is_bonus, a.accepted_nodes, a.depth) == (
                b.new_tokens, b.num_accepted, b.is_bonus, b.accepted_nodes, b.depth)
            assert torch.equal(a.hidden, b.hidden)
        for r in reqs:
            assert fast.running[r.request_id].pending == general.running[r.request_id].pending
            slot_a, slot_b = fast.running[r.request_id].slot, general.running[r.request_id].slot
            assert fast.runner.length(slot_a) == general.runner.length(slot_b)
    # chains and trees each saw rejections, accepted prefixes and bonus tokens
    assert {(False, True, True), (False, True, False), (True, True, True), (True, False, False)} <= outcomes


def test_sampled_rows_still_take_the_general_path(cfg):
    worker = TargetWorker(cfg.target)
    reqs = [NewRequest("g", [5, 6, 7], SamplingParams(), 8),
            NewRequest("s", [5, 6, 7], SamplingParams(temperature=0.8, seed=3), 8)]
    worker.start(reqs)
    calls = []
    probs = worker._probs
    worker._probs = lambda logits, params: calls.append(len(params)) or probs(logits, params)
    out = worker.verify([Draft("g", [9, 9]), Draft("s", [9], parents=None)])
    assert calls == [2] and [len(r.new_tokens) >= 1 for r in out] == [True, True]


def test_a_tree_rows_argmax_is_taken_only_at_the_nodes_its_walk_reads():
    from specd.workers.engine.target_worker import _ArgmaxByNode

    torch.manual_seed(0)
    logits = torch.randn(7, VOCAB)
    logits[3, 5] = logits[3, 9] = logits[3].max() + 1      # a tie: the first index wins, as torch.argmax
    choice = _ArgmaxByNode(logits)
    assert [choice[k] for k in (0, 3, 6)] == logits.argmax(-1)[[0, 3, 6]].tolist()
    assert choice[3] == 5 and sorted(choice.done) == [0, 3, 6]
