"""Speculative decoding over every family the torch backend takes: greedy output token-identical to
target-only decoding with the chain, tree, suffix, hybrid and hidden-state drafters (sliding windows,
biases, q/k norms and scaled RoPE in both target and drafter), and Qwen3's sampled output carrying the
target's exact distribution."""

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
from tests.families import FAMILIES, mark_drafter, write_family
from tests.workers.engine.test_engine_exactness import (
    CASES,
    _hidden_state_drafter,
    chi_square_pvalue,
    engine_counts,
    exact_joint,
)

# 20 prompt tokens and 32 new ones: past the 8-position sliding windows; repeats for the suffix drafter
PROMPTS = [[(7 * i + 3 + r) % 96 for i in range(20)] for r in range(2)] + [[5, 9, 13, 2] * 5]
RUNS = {
    "chain": ("model", SpecParams(gamma=4)),
    "tree": ("model", SpecParams(gamma=3, tree_width=3)),
    "hidden-chain": ("hidden", SpecParams(gamma=4)),
    "hidden-tree": ("hidden", SpecParams(gamma=3, tree_width=2)),
    "suffix": ("suffix", SpecParams(gamma=5)),
    "hybrid": ("hybrid", SpecParams(gamma=5)),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_workers(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    target_dir = write_family(root / "target", request.param)
    drafter_dir = mark_drafter(write_family(root / "drafter", request.param, num_layers=1, seed=1), "tiny-1")
    hidden_dir = _hidden_state_drafter(drafter_dir, root / "hidden")
    cfg = load_config([f"target.model_path={target_dir}", f"drafter.path={drafter_dir}", "drafter.pack=none",
                       "target.max_slots=4", "drafter.max_slots=4", "target.max_seq_len=128",
                       "drafter.hybrid_min_match=2"])
    target = TargetWorker(cfg.target)
    drafters = {}
    for kind in ("model", "suffix", "hybrid"):
        drafters[kind] = DraftWorker(dataclasses.replace(cfg.drafter, kind=kind), cfg.spec, str(target_dir))
    drafters["hidden"] = DraftWorker(dataclasses.replace(cfg.drafter, path=str(hidden_dir)), cfg.spec,
                                     str(target_dir))
    assert drafters["hidden"].uses_target_hidden()
    reference = [s.output for s in _generate(target, None, SpecParams(enabled=False))]
    return target, drafters, reference, cfg


def _generate(target, drafter, spec):
    reqs = [NewRequest(f"r{i}", p, SamplingParams(), 32, spec) for i, p in enumerate(PROMPTS)]
    return SpecEngine(target, drafter).generate(reqs, ignore_eos=True)


@pytest.mark.parametrize("run", sorted(RUNS))
def test_greedy_speculation_is_token_identical_to_target_only(family_workers, run):
    target, drafters, reference, _ = family_workers
    kind, spec = RUNS[run]
    seqs = _generate(target, drafters[kind], spec)
    assert [s.output for s in seqs] == reference
    assert sum(s.stats.drafted for s in seqs) > 0, "the drafter must have drafted"


def test_static_decode_verifies_trees_token_identically(family_workers):
    """The GPU path's static shapes (its own masks, sliding windows included), run eagerly on the CPU."""
    _, _, reference, cfg = family_workers
    target_cfg = dataclasses.replace(cfg.target, decode="static")
    target = TargetWorker(target_cfg)
    drafter = DraftWorker(dataclasses.replace(cfg.drafter, decode="static"), cfg.spec, str(target.model_dir))
    seqs = _generate(target, drafter, SpecParams(gamma=3, tree_width=3))
    assert [s.output for s in seqs] == reference and sum(s.stats.drafted for s in seqs) > 0


@pytest.mark.parametrize("case", ["chain", "hidden-tree"])
def test_qwen3_sampled_output_has_the_target_distribution(tmp_path_factory, case):
    """The exactness chi-square of test_engine_exactness on a family besides Llama."""
    root = tmp_path_factory.mktemp("qwen3-sampled")
    target_dir = write_family(root / "target", "qwen3")
    drafter_dir = mark_drafter(write_family(root / "drafter", "qwen3", num_layers=1, seed=1), "tiny-1")
    if case.startswith("hidden"):
        drafter_dir = _hidden_state_drafter(drafter_dir, root / "hidden")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = load_config([f"target.model_path={target_dir}", f"drafter.path={drafter_dir}",
                           "drafter.pack=none", "target.max_slots=128", "drafter.max_slots=128",
                           "target.max_seq_len=16"])
        target = TargetWorker(cfg.target, seed=11)
        drafter = DraftWorker(cfg.drafter, cfg.spec, str(target_dir), seed=12)
        sampling, spec = CASES[case]
        counts = engine_counts(target, drafter, sampling, spec)
        pvalue = chi_square_pvalue(counts, exact_joint(target, sampling))
    finally:
        torch.set_num_threads(threads)
    assert pvalue > 1e-3, f"qwen3 {case}: p-value {pvalue:.2e}: the tokens are not target-distributed"
