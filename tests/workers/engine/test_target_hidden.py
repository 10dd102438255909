"""A drafter that reads the target's hidden states, on tiny random models.

The target hands over the state that predicted each token it emits; the drafter adds proj(state) +
staleness[s] to its inputs. Checked here: the states are the ones a plain forward computes, a zero
adapter is the token drafter exactly, greedy output stays the target's, and after every commit the
drafter's cache is what a fresh drafter given the whole verified context would hold.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specd.configs import load_config
from specd.workers.core.sampling import SamplingParams
from specd.workers.drafters.model import ModelDrafter
from specd.workers.engine.draft_worker import DraftWorker
from specd.workers.engine.spec_engine import SpecEngine
from specd.workers.engine.target_worker import TargetWorker
from specd.workers.engine.types import NewRequest, SpecParams
from specd.workers.models.llama import FEATURE_PROJ, FEATURE_STALENESS
from specd.workers.models.runner import ModelRunner

PROMPTS = [[5, 9, 13, 2], [7, 7, 7, 7, 7, 7, 30, 31], [40], [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]]
HIDDEN = 64  # tiny models' hidden size (conftest)


def _hidden_state_drafter(src, dst, scale: float, seed: int = 3):
    """A copy of the tiny drafter with a feature adapter: random (scale > 0) or zero."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    tensors[FEATURE_PROJ] = torch.randn(HIDDEN, HIDDEN, generator=gen) * scale
    tensors[FEATURE_STALENESS] = torch.randn(4, HIDDEN, generator=gen) * scale
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "specd_drafter.json").write_text(json.dumps({"version": f"tiny-hidden-{scale}"}))
    return dst


@pytest.fixture(scope="module")
def hidden_drafter_dir(tiny_target_dir, tmp_path_factory):
    """The target itself plus a small random adapter: it agrees with the target often, not always,
    so steps accept, reject and roll back."""
    return _hidden_state_drafter(tiny_target_dir, tmp_path_factory.mktemp("fd") / "near", scale=0.06)


@pytest.fixture(scope="module")
def far_drafter_dir(tiny_drafter_dir, tmp_path_factory):
    """Another random model, reduced head, large adapter: nearly every draft is rejected."""
    return _hidden_state_drafter(tiny_drafter_dir, tmp_path_factory.mktemp("fd") / "far", scale=0.5)


@pytest.fixture(scope="module")
def cfg(tiny_target_dir, hidden_drafter_dir):
    return load_config(
        [
            f"target.model_path={tiny_target_dir}",
            f"drafter.path={hidden_drafter_dir}",
            "target.max_slots=6",
            "drafter.max_slots=6",
            "target.max_seq_len=256",
            "drafter.dtype=float32",
        ]
    )


@pytest.fixture(scope="module")
def target(cfg):
    return TargetWorker(cfg.target)


def test_runner_hidden_states_match_a_plain_prefill(tiny_target_dir):
    runner = ModelRunner(tiny_target_dir, max_slots=2, max_seq_len=64)
    tokens = [5, 9, 13, 2, 40, 41, 7]
    a = runner.allocate()
    _, whole = runner.prefill([a], [tokens], return_hidden=True)  # [len, H] per row
    b = runner.allocate()
    runner.prefill([b], [tokens[:3]])
    logits, part = runner.extend([b], [tokens[3:]], return_hidden=True)  # [1, 4, V], [1, 4, H]
    assert whole[0].shape == (len(tokens), HIDDEN)
    torch.testing.assert_close(part[0], whole[0][3:], rtol=1e-4, atol=1e-4)
    plain = ModelRunner(tiny_target_dir, max_slots=1, max_seq_len=64)
    torch.testing.assert_close(
        logits, plain.extend([plain.allocate()], [tokens])[:, 3:], rtol=1e-4, atol=1e-4
    )


def test_zero_adapter_is_the_token_drafter(tiny_drafter_dir, tmp_path):
    zero = _hidden_state_drafter(tiny_drafter_dir, tmp_path / "zero", scale=0.0)
    plain, feat = ModelRunner(tiny_drafter_dir, max_seq_len=64), ModelRunner(zero, max_seq_len=64)
    tokens = [[5, 9, 13, 2, 40], [7, 7]]
    states = [torch.randn(len(t), HIDDEN) for t in tokens]
    want = plain.extend([plain.allocate(), plain.allocate()], tokens)
    got = feat.extend(
        [feat.allocate(), feat.allocate()], tokens, features=states, staleness=[[0] * 5, [1, 2]]
    )
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="hidden states"):
        feat.extend([feat.allocate()], [[1, 2]])


def test_target_returns_the_state_that_predicted_each_token(cfg, target, tiny_target_dir):
    req = NewRequest("h0", PROMPTS[1], SamplingParams(), 8, SpecParams(gamma=3))
    first, hidden = target.start([req], return_hidden=True)
    assert hidden[0].shape == (len(PROMPTS[1]), HIDDEN)
    from specd.workers.engine.types import Draft

    res = target.verify([Draft("h0", [3, 4, 5])], return_hidden=True)[0]
    assert res.hidden.shape == (len(res.new_tokens), HIDDEN)
    # Replay the committed text in one forward: row j of the result is the state before new token j.
    text = PROMPTS[1] + first[0] + res.new_tokens
    runner = ModelRunner(tiny_target_dir, max_slots=1, max_seq_len=64)
    _, states = runner.prefill([runner.allocate()], [text], return_hidden=True)
    start = len(PROMPTS[1])  # the state after the first token predicted new token 0
    torch.testing.assert_close(
        res.hidden, states[0][start : start + len(res.new_tokens)], rtol=1e-4, atol=1e-4
    )
    torch.testing.assert_close(hidden[0], states[0][: len(PROMPTS[1])], rtol=1e-4, atol=1e-4)
    target.release(["h0"])


def test_a_request_with_speculation_off_carries_no_hidden_states(target):
    """No drafter reads them, so neither its prompt's states nor its steps' come back (through Ray they
    would cross two processes for nothing); a speculating request's in the same batch still do."""
    from specd.workers.engine.types import Draft

    reqs = [NewRequest("on", PROMPTS[0], SamplingParams(), 8, SpecParams(gamma=3)),
            NewRequest("off", PROMPTS[1], SamplingParams(), 8, SpecParams(enabled=False))]
    _, hidden = target.start(reqs, return_hidden=True)
    assert hidden[0].shape == (len(PROMPTS[0]), HIDDEN) and hidden[1] is None
    on, off = target.verify([Draft("on", [3, 4]), Draft("off", [])], return_hidden=True)
    assert on.hidden.shape == (len(on.new_tokens), HIDDEN) and off.hidden is None
    target.release(["on", "off"])


@pytest.mark.parametrize(
    "spec", [SpecParams(gamma=4), SpecParams(gamma=6, policy="egag"), SpecParams(gamma=3, tree_width=2)]
)
@pytest.mark.parametrize("which", ["near", "far"])
def test_greedy_output_equals_target_only(cfg, target, spec, which, hidden_drafter_dir, far_drafter_dir):
    base = SpecEngine(target).generate(
        [
            NewRequest(f"b{i}", p, SamplingParams(), 48, SpecParams(enabled=False))
            for i, p in enumerate(PROMPTS)
        ],
        ignore_eos=True,
    )
    path = str(hidden_drafter_dir if which == "near" else far_drafter_dir)
    drafter = DraftWorker(dataclasses.replace(cfg.drafter, path=path), cfg.spec, str(target.model_dir))
    assert drafter.uses_target_hidden()
    engine = SpecEngine(target, drafter)
    seqs = engine.generate(
        [NewRequest(f"s{i}", p, SamplingParams(), 48, spec) for i, p in enumerate(PROMPTS)], ignore_eos=True
    )
    assert [s.output for s in seqs] == [s.output for s in base]
    accepted, drafted = sum(s.stats.accepted for s in seqs), sum(s.stats.drafted for s in seqs)
    assert drafted > 0
    if which == "near":
        assert 0 < accepted < drafted, "steps that accept and steps that reject"
    assert target.free_slots() == cfg.target.max_slots


def test_commit_leaves_the_cache_a_fresh_drafter_would_build(cfg, target, hidden_drafter_dir):
    """After each verified step, the next proposal equals that of a new drafter given the whole text."""
    drafter = ModelDrafter(hidden_drafter_dir, max_slots=4, max_seq_len=256)
    greedy = SamplingParams()
    req = NewRequest("c0", PROMPTS[3], greedy, 40, SpecParams(gamma=4))
    first, hidden = target.start([req], return_hidden=True)
    text, states = PROMPTS[3] + first[0], hidden[0]  # states[j] predicted text[j + 1]
    drafter.add_request("c0", text, hidden=states)
    from specd.workers.engine.types import Draft

    for step in range(6):
        out = drafter.propose(["c0"], [4], [greedy])
        fresh = ModelDrafter(hidden_drafter_dir, max_slots=1, max_seq_len=256)
        fresh.add_request("f", text, hidden=states)
        assert fresh.propose(["f"], [4], [greedy]).tokens == out.tokens, f"step {step}"
        res = target.verify([Draft("c0", out.tokens[0])], return_hidden=True)[0]
        drafter.commit("c0", res.num_accepted, res.new_tokens, hidden=res.hidden)
        text, states = text + res.new_tokens, torch.cat([states, res.hidden])
    target.release(["c0"])


def test_sampled_runs_are_seeded_and_lossless_in_shape(cfg, target):
    sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    runs = []
    for _ in range(2):
        engine = SpecEngine(target, DraftWorker(cfg.drafter, cfg.spec, str(target.model_dir)))
        seqs = engine.generate(
            [NewRequest(f"t{i}", p, sampling, 32, SpecParams(gamma=4)) for i, p in enumerate(PROMPTS)],
            ignore_eos=True,
        )
        runs.append([s.output for s in seqs])
        assert all(len(s.output) == 32 for s in seqs)
    assert runs[0] == runs[1]


def test_hidden_state_drafter_drafts_real_trees_from_a_fresh_cache(cfg, target, hidden_drafter_dir):
    """Trees, not chains; each tree equals the one a new drafter given the whole verified text drafts,
    and its first branch is the greedy chain (same states, same staleness per depth)."""
    drafter = ModelDrafter(hidden_drafter_dir, max_slots=2, max_seq_len=256)
    greedy = SamplingParams()
    req = NewRequest("t0", PROMPTS[1], greedy, 40, SpecParams(gamma=3, tree_width=2))
    first, hidden = target.start([req], return_hidden=True)
    text, states = PROMPTS[1] + first[0], hidden[0]
    drafter.add_request("t0", text, hidden=states)
    from specd.workers.engine.types import Draft

    for step in range(5):
        tree = drafter.propose_tree(["t0"], [3], [2], [greedy])
        assert len(tree.tokens[0]) == 6, "width 2 x depth 3 nodes"
        fresh = ModelDrafter(hidden_drafter_dir, max_slots=2, max_seq_len=256)
        fresh.add_request("f", text, hidden=states)
        assert fresh.propose_tree(["f"], [3], [2], [greedy]).tokens == tree.tokens, f"step {step}"
        fresh.add_request("c", text, hidden=states)
        branch = [tree.tokens[0][n] for n in (0, 2, 4)]  # first child, then its descendants
        assert fresh.propose(["c"], [3], [greedy]).tokens[0] == branch
        draft = Draft("t0", tree.tokens[0], None, [-1, *tree.parents[0]])
        res = target.verify([draft], return_hidden=True)[0]
        drafter.commit("t0", res.num_accepted, res.new_tokens, hidden=res.hidden)
        text, states = text + res.new_tokens, torch.cat([states, res.hidden])
    target.release(["t0"])


def _record_drafter_input(drafter, monkeypatch) -> dict[str, list[int]]:
    """request id -> the text its drafter was given (prompt, then every commit), filled as it runs."""
    seen: dict[str, list[int]] = {}
    add, commit = drafter.drafter.add_request, drafter.drafter.commit

    def recorded_add(rid, tokens, **kw):
        seen[rid] = list(tokens)
        return add(rid, tokens, **kw)

    def recorded_commit(rid, accepted, new_tokens, **kw):
        seen[rid] += list(new_tokens)
        return commit(rid, accepted, new_tokens, **kw)

    monkeypatch.setattr(drafter.drafter, "add_request", recorded_add)
    monkeypatch.setattr(drafter.drafter, "commit", recorded_commit)
    return seen


def test_steps_that_pause_the_drafter_reach_it_whole(cfg, target, hidden_drafter_dir, monkeypatch):
    """A batch that drafted nothing pauses the drafter (workers/engine/planner.py); the outcomes of the paused
    steps, tokens and the target states that predicted them, reach it together with the next DraftItem (a
    hidden-state drafter checks that their counts agree), and output stays target-only's."""
    from specd.workers.engine import planner as planner_module

    monkeypatch.setattr(planner_module, "PAUSE_MIN_BATCH", 1)
    off = SpecParams(enabled=False)
    base = SpecEngine(target).generate(
        [NewRequest(f"pb{i}", p, SamplingParams(), 40, off) for i, p in enumerate(PROMPTS)], ignore_eos=True
    )
    drafter = DraftWorker(dataclasses.replace(cfg.drafter, path=str(hidden_drafter_dir), kind="model"),
                          cfg.spec, str(target.model_dir))
    inner, calls = drafter.drafter.propose, []

    def every_third_drafts_nothing(rids, gammas, params, **kw):
        calls.append(1)
        return inner(rids, gammas if len(calls) % 3 else [0] * len(gammas), params, **kw)

    seen = _record_drafter_input(drafter, monkeypatch)
    monkeypatch.setattr(drafter.drafter, "propose", every_third_drafts_nothing)
    engine = SpecEngine(target, drafter)
    seqs = engine.generate(
        [NewRequest(f"ps{i}", p, SamplingParams(), 40, SpecParams(gamma=3)) for i, p in enumerate(PROMPTS)],
        ignore_eos=True,
    )
    assert [s.output for s in seqs] == [s.output for s in base]
    assert engine.step.paused_steps > 0 and sum(s.stats.drafted for s in seqs) > 0
    for i, seq in enumerate(seqs):   # no paused step's tokens went missing on the way to the drafter
        untaken = seq.next_draft_item().commit_new_tokens      # what the drafter would get next
        assert seen[f"ps{i}"] + untaken == PROMPTS[i] + seq.output
    assert target.free_slots() == cfg.target.max_slots


def test_steps_the_guard_keeps_from_drafting_reach_the_drafter_whole(cfg, target, hidden_drafter_dir,
                                                                     monkeypatch):
    """The speculation guard (workers/core/guard.py) turns drafting off window by window; the steps it
    kept from the drafter reach it whole, as paused ones do, and output stays target-only's."""
    off = SpecParams(enabled=False)
    base = SpecEngine(target).generate(
        [NewRequest(f"gb{i}", p, SamplingParams(), 40, off) for i, p in enumerate(PROMPTS)], ignore_eos=True
    )
    drafter = DraftWorker(dataclasses.replace(cfg.drafter, path=str(hidden_drafter_dir), kind="model"),
                          cfg.spec, str(target.model_dir))
    seen = _record_drafter_input(drafter, monkeypatch)
    engine = SpecEngine(target, drafter, guard_window_steps=1)   # on, off, then the faster with probes
    seqs = engine.generate(
        [NewRequest(f"gs{i}", p, SamplingParams(), 40, SpecParams(gamma=3)) for i, p in enumerate(PROMPTS)],
        ignore_eos=True,
    )
    assert [s.output for s in seqs] == [s.output for s in base]
    guard = engine.step.guard
    assert guard.windows["on"] >= 1 and guard.windows["off"] >= 1 and engine.step.guarded_steps > 0
    assert sum(s.stats.drafted for s in seqs) > 0
    for i, seq in enumerate(seqs):   # no guarded step's tokens went missing on the way to the drafter
        untaken = seq.next_draft_item().commit_new_tokens
        assert seen[f"gs{i}"] + untaken == PROMPTS[i] + seq.output
    assert target.free_slots() == cfg.target.max_slots
