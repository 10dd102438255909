"""The hybrid drafter (n-gram copy where the context repeats, the model elsewhere) on tiny models."""

from __future__ import annotations

import pytest

from specd.configs import load_config
from specd.workers.core.sampling import SamplingParams
from specd.workers.engine.draft_worker import DraftWorker
from specd.workers.engine.spec_engine import SpecEngine
from specd.workers.engine.target_worker import TargetWorker
from specd.workers.engine.types import NewRequest, SpecParams

# Repetitive prompts make the n-gram side copy; the others leave it to the model.
PROMPTS = [[5, 9, 13, 2, 5, 9, 13, 2, 5, 9], [40], [3, 4, 5, 6, 3, 4, 5, 6, 3, 4], [7, 30, 31, 8]]


@pytest.fixture(scope="module")
def cfg(tiny_target_dir, tiny_drafter_dir):
    return load_config([
        f"target.model_path={tiny_target_dir}", f"drafter.path={tiny_drafter_dir}", "drafter.kind=hybrid",
        "target.max_slots=6", "drafter.max_slots=6", "target.max_seq_len=256", "drafter.hybrid_min_match=2",
    ])


@pytest.fixture(scope="module")
def target(cfg):
    return TargetWorker(cfg.target)


def _run(target, drafter, sampling, spec):
    reqs = [NewRequest(f"r{i}", p, sampling, 40, spec) for i, p in enumerate(PROMPTS)]
    return SpecEngine(target, drafter).generate(reqs, ignore_eos=True)


def test_greedy_output_equals_target_only_and_both_sides_draft(cfg, target):
    base = [s.output for s in _run(target, None, SamplingParams(), SpecParams(enabled=False))]
    worker = DraftWorker(cfg.drafter, cfg.spec, str(target.model_dir))
    hybrid = worker.drafter
    calls = {"model": 0, "copied": 0}
    model_propose = hybrid.model.propose

    def counting(request_ids, gammas, *args, **kwargs):
        calls["model"] += sum(1 for g in gammas if g > 0)
        calls["copied"] += sum(1 for g in gammas if g == 0)
        return model_propose(request_ids, gammas, *args, **kwargs)

    hybrid.model.propose = counting
    seqs = _run(target, worker, SamplingParams(), SpecParams(gamma=4))
    assert [s.output for s in seqs] == base
    assert calls["model"] > 0 and calls["copied"] > 0, calls
    assert worker.version().endswith("+ngram-1-4")
    assert target.free_slots() == cfg.target.max_slots


def test_sampled_mix_is_seeded_and_complete(cfg, target):
    sampling = SamplingParams(temperature=0.9, seed=11)
    runs = [
        [s.output for s in _run(target, DraftWorker(cfg.drafter, cfg.spec, str(target.model_dir)), sampling,
                                SpecParams(gamma=4))]
        for _ in range(2)
    ]
    assert runs[0] == runs[1] and all(len(o) == 40 for o in runs[0])
