"""A seed reproduces: a seeded sampled request's text is a function of its seed and prompt only.

Through the real engine on tiny models, the same seeded requests give the same tokens with speculation
off (target-only decoding, one request at a time) and on, with every drafter kind, fixed and measured γ
policies (goodput and adaptive plan from timings and acceptance), chains and trees, any γ, and in batches
with other requests (greedy, unseeded, other seeds) that come and go. Greedy stays the greedy text.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specd.configs import load_config
from specd.workers.core.sampling import SamplingParams
from specd.workers.engine.draft_worker import DraftWorker
from specd.workers.engine.spec_engine import SpecEngine
from specd.workers.engine.target_worker import TargetWorker
from specd.workers.engine.types import NewRequest, SpecParams

PROMPTS = [[5, 9, 13, 2], [7, 7, 7, 7, 7, 7, 30, 31], [40, 41], [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]]
TOKENS = 24
SEEDED = [
    SamplingParams(temperature=1.0, seed=7),
    SamplingParams(temperature=0.7, top_p=0.9, seed=2**64 - 1),
    SamplingParams(temperature=1.5, top_k=8, seed=123456789),
    SamplingParams(temperature=0.0),   # greedy beside them: the greedy text
]
OFF = SpecParams(enabled=False)


@pytest.fixture(scope="module")
def cfg(tiny_target_dir, tiny_drafter_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_config([
        f"target.model_path={tiny_target_dir}", f"drafter.path={tiny_drafter_dir}", "drafter.pack=none",
        "target.max_slots=8", "drafter.max_slots=8", "target.max_seq_len=128",
    ])
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target(cfg):
    return TargetWorker(cfg.target, seed=3)


@pytest.fixture(scope="module")
def plain(target) -> list[list[int]]:
    """Target-only decoding, each request alone."""
    engine = SpecEngine(target)
    return [engine.generate([NewRequest(f"plain{i}", p, s, TOKENS, OFF)], ignore_eos=True)[0].output
            for i, (p, s) in enumerate(zip(PROMPTS, SEEDED, strict=True))]


def _drafter(cfg, target, kind: str, seed: int) -> DraftWorker:
    drafter_cfg = dataclasses.replace(cfg.drafter, kind=kind)
    return DraftWorker(drafter_cfg, cfg.spec, str(target.model_dir), seed=seed)


def _fillers(tag: str) -> list[NewRequest]:
    """Other traffic in the batch: unseeded, another seed, greedy, with lengths that end early."""
    samplings = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, seed=99), SamplingParams()]
    return [NewRequest(f"{tag}-fill{j}", [11 + j, 12, 13], s, 5 + 6 * j, SpecParams(gamma=2))
            for j, s in enumerate(samplings)]


@pytest.mark.parametrize("kind, spec", [
    ("model", SpecParams(gamma=1)),
    ("model", SpecParams(gamma=4)),
    ("model", SpecParams(gamma=3, tree_width=3)),
    ("model", SpecParams(gamma=5, policy="goodput")),
    ("model", SpecParams(gamma=4, policy="adaptive")),
    ("ngram", SpecParams(gamma=3)),
    ("suffix", SpecParams(gamma=4, tree_width=2)),
    ("hybrid", SpecParams(gamma=3)),
])
def test_a_seed_gives_the_same_text_with_speculation_on_and_off(cfg, target, plain, kind, spec):
    drafter = _drafter(cfg, target, kind, seed=5)
    engine = SpecEngine(target, drafter)
    tag = f"{kind}-{spec.gamma}-{spec.tree_width}-{spec.policy}"
    # Alone, then in a batch with other traffic that finishes at other steps, then alone again (a suffix
    # index and the goodput policy's measurements have learnt from the batch by then).
    drafted = 0
    for round_ in ("alone", "batch", "again"):
        for i, (prompt, sampling) in enumerate(zip(PROMPTS, SEEDED, strict=True)):
            request = NewRequest(f"{tag}-{round_}-{i}", prompt, sampling, TOKENS, spec)
            others = _fillers(f"{tag}-{round_}-{i}") if round_ == "batch" else []
            seqs = engine.generate([*others[:2], request, *others[2:]], ignore_eos=True)
            assert seqs[len(others[:2])].output == plain[i], (round_, i)
            drafted += seqs[len(others[:2])].stats.drafted
    assert drafted > 0, "speculation must have drafted for the seeded requests"


def test_the_model_drafter_drafts_what_the_target_samples(cfg, target, tiny_target_dir):
    """The target as its own drafter (same weights, same noise): every sampled draft is accepted."""
    same = dataclasses.replace(cfg.drafter, kind="model", path=str(tiny_target_dir))
    drafter = DraftWorker(same, cfg.spec, str(target.model_dir), seed=5)
    engine = SpecEngine(target, drafter)
    reqs = [NewRequest(f"self-{i}", p, s, TOKENS, SpecParams(gamma=3)) for i, (p, s) in
            enumerate(zip(PROMPTS[:3], SEEDED[:3], strict=True))]
    seqs = engine.generate(reqs, ignore_eos=True)
    drafted = sum(s.stats.drafted for s in seqs)
    assert drafted > 0 and sum(s.stats.accepted for s in seqs) == drafted
    # A tree's first child at each level is the coupled draft: the whole depth is accepted every step, so
    # the tree takes the chain's steps.
    trees = [dataclasses.replace(r, request_id=f"{r.request_id}-tree", spec=SpecParams(gamma=3, tree_width=3))
             for r in reqs]
    tree_seqs = engine.generate(trees, ignore_eos=True)
    assert [s.output for s in tree_seqs] == [s.output for s in seqs]
    assert [s.stats.steps for s in tree_seqs] == [s.stats.steps for s in seqs]
