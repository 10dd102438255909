"""The suffix drafter through the in-process engine on tiny models: greedy identity, cross-request drafts
from finished requests, and the target's exact distribution at T > 0."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from specd.configs import load_config
from specd.workers.core import verify_chain, verify_tree
from specd.workers.core.sampling import SamplingParams
from specd.workers.engine import planner as planner_module
from specd.workers.engine.draft_worker import DraftWorker
from specd.workers.engine.spec_engine import SpecEngine
from specd.workers.engine.target_worker import TargetWorker
from specd.workers.engine.types import NewRequest, SpecParams
from tests.workers.engine.test_engine_exactness import DEPTH, PROMPT, chi_square_pvalue, exact_joint

GREEDY = SamplingParams()
PROMPTS = [[5, 9, 13, 2], [7, 7, 7, 7, 7, 7, 30, 31], [40], [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]]


@pytest.fixture(scope="module")
def cfg(tiny_target_dir, tiny_drafter_dir):
    return load_config([
        f"target.model_path={tiny_target_dir}", f"drafter.path={tiny_drafter_dir}",
        "target.max_slots=6", "drafter.max_slots=6", "target.max_seq_len=256", "drafter.kind=suffix",
    ])


@pytest.fixture(scope="module")
def target(cfg):
    return TargetWorker(cfg.target)


def _run(engine, spec, prefix="r", sampling=GREEDY, n=32):
    reqs = [NewRequest(f"{prefix}{i}", p, sampling, n, spec) for i, p in enumerate(PROMPTS)]
    return [s.output for s in engine.generate(reqs, ignore_eos=True)]


@pytest.mark.parametrize("with_model,spec", [
    (False, SpecParams(gamma=4)),
    (True, SpecParams(gamma=4)),
    (True, SpecParams(gamma=3, tree_width=2)),
    (False, SpecParams(gamma=4, policy="goodput", tree_width=2)),
])
def test_greedy_identity_and_repeats_draft_from_finished_requests(cfg, target, with_model, spec):
    base = _run(SpecEngine(target), SpecParams(enabled=False))
    cfg.drafter.suffix_with_model = with_model
    drafter = DraftWorker(cfg.drafter, cfg.spec, str(target.model_dir))
    engine = SpecEngine(target, drafter)
    assert _run(engine, spec, "first") == base
    # The same prompts again: every output is in the global index now, so the repeats draft from it.
    assert _run(engine, spec, "again") == base
    sources = drafter.drafter.stats()["sources"]
    assert sources["global"]["accepted"] > 0
    assert target.free_slots() == cfg.target.max_slots


def test_steps_are_recorded_under_the_source_that_drafted_them(cfg, target):
    """Acceptance per drafter version counts the model's weights only on the steps the model drafted."""
    cfg.drafter.suffix_with_model = True
    drafter = DraftWorker(cfg.drafter, cfg.spec, str(target.model_dir))
    engine = SpecEngine(target, drafter)
    reqs = [NewRequest(f"v{i}", p, GREEDY, 32, SpecParams(gamma=4)) for i, p in enumerate(PROMPTS)]
    seqs = engine.generate(reqs, ignore_eos=True)
    suffix, model = drafter.drafter.suffix_version, drafter.drafter.model.version
    by_version = {}
    for seq in seqs:
        for version, stats in seq.stats.by_version.items():
            by_version[version] = by_version.get(version, 0) + stats.steps
    counts = drafter.drafter.stats()["sources"]
    assert set(by_version) == {suffix, model}
    assert by_version[model] == counts["model"]["steps"]
    assert by_version[suffix] == counts["local"]["steps"] + counts["global"]["steps"]
    assert drafter.drafter.version == f"{model}+{suffix}" and drafter.drafter.weights_drafter.version == model


@pytest.fixture(scope="module")
def exact_workers(tiny_target_dir, tiny_drafter_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = load_config([
        f"target.model_path={tiny_target_dir}", f"drafter.path={tiny_drafter_dir}", "drafter.pack=none",
        "target.max_slots=128", "drafter.max_slots=128", "target.max_seq_len=16", "drafter.kind=suffix",
        # no start-up cost profile: the goodput requests plan on the prior costs, which let them draft
        # (this test is about exactness; what a measured profile on a tiny model prefers is not)
        "spec.policy=fixed",
    ])
    target = TargetWorker(cfg.target, seed=21)
    yield cfg, target
    torch.set_num_threads(threads)


def _sampled_pvalue(exact_workers, tree_width: int, samples: int, policy: str = "fixed") -> float:
    cfg, target = exact_workers
    cfg.drafter.suffix_with_model = False
    drafter = DraftWorker(cfg.drafter, cfg.spec, str(target.model_dir), seed=22)
    index = drafter.drafter
    for k, tail in enumerate(([1, 2, 3, 4], [1, 5, 6, 7], [8, 2, 3, 4], [1, 2, 9, 9])):
        index.add_request(f"seed{k}", PROMPT + tail)
        index.remove_request(f"seed{k}")
    sampling = SamplingParams(temperature=3.0, top_k=5)
    spec = SpecParams(gamma=3, tree_width=tree_width, policy=policy)
    reqs = [NewRequest(f"x{i}", PROMPT, sampling, DEPTH + 1, spec) for i in range(samples)]
    seqs = SpecEngine(target, drafter).generate(reqs, ignore_eos=True)
    assert sum(s.stats.drafted for s in seqs) > samples // 2, "the suffix drafter must have drafted"
    counts = Counter(tuple(s.output[:DEPTH]) for s in seqs)
    return chi_square_pvalue(counts, exact_joint(target, sampling))


# (1, "goodput"): chains planned from the suffix drafter's own hints (DraftHint), the default path
@pytest.mark.parametrize("tree_width,policy", [(1, "fixed"), (2, "fixed"), (1, "goodput"), (2, "goodput")])
def test_sampled_output_has_the_target_distribution(exact_workers, tree_width, policy, monkeypatch):
    """Seed the global index with several continuations of the prompt, then sample: drafts come from the
    index (and from the outputs of earlier samples, indexed as they finish), one-hot q, exact output."""
    # 1000 requests in one batch: a step that drafts nothing must not pause the drafter for the rest
    monkeypatch.setattr(planner_module, "PAUSE_STEPS", 0)
    pvalue = _sampled_pvalue(exact_workers, tree_width, 1000, policy)
    assert pvalue > 1e-3, f"p-value {pvalue:.2e}: the engine's tokens are not target-distributed"


def test_the_same_test_fails_on_a_broken_verifier(exact_workers, monkeypatch):
    """Recovering from p instead of norm(max(0, p - q)) over-weights the drafted tokens: detected."""
    monkeypatch.setattr(planner_module, "PAUSE_STEPS", 0)
    for module in (verify_chain, verify_tree):
        monkeypatch.setattr(module, "residual_weights", lambda p, q: p)
    pvalue = _sampled_pvalue(exact_workers, 1, 500)
    assert pvalue < 1e-6, f"the broken verifier passed (p-value {pvalue:.2e})"


def test_a_lookup_draft_stands_in_where_the_preferred_model_draft_does_not_pay(cfg, target, monkeypatch):
    """The suffix drafter prefers its model everywhere here, and model drafts are priced out (10 s a level):
    the goodput plan drafts nothing for the model and takes each request's lookup draft instead, so the
    repeats still draft from the finished requests; the output stays the target's."""
    from specd.workers.core.goodput import StepCostModel
    from specd.workers.drafters.suffix import SuffixDrafter

    base = _run(SpecEngine(target), SpecParams(enabled=False))
    cfg.drafter.suffix_with_model = True
    drafter = DraftWorker(cfg.drafter, cfg.spec, str(target.model_dir))
    engine = SpecEngine(target, drafter)
    monkeypatch.setattr(SuffixDrafter, "_prefers_suffix", lambda self, draft, depth, req: False)
    monkeypatch.setattr(StepCostModel, "draft_seconds", lambda self, b, depth: 10.0 * depth if b else 0.0)
    spec = SpecParams(gamma=4, policy="goodput")
    assert _run(engine, spec, "first") == base
    assert _run(engine, spec, "again") == base
    sources = drafter.drafter.stats()["sources"]
    assert sources["model"]["steps"] == 0
    assert sources["global"]["accepted"] > 0 and sources["local"]["steps"] + sources["global"]["steps"] > 0
    assert target.free_slots() == cfg.target.max_slots
