"""Exactness through the whole engine: the first sampled tokens of SpecEngine (tiny target, tiny drafter,
chain and tree, T > 0 with top-k / top-p) against target-only sampling's exact distribution.

The verifier tests (tests/workers/core) prove each verification rule on toy distributions; this test
proves the pieces still compose: the drafter's q and the target's p get the same processing, rollback
and the pending token line up, and no step leaks a token that target-only sampling would not draw.
The exact joint of the first three tokens is computed from the tiny target's probabilities; a
chi-square test compares it with the engine's draws. A verifier broken on purpose (recovering from p
instead of norm(max(0, p - q))) must fail the same test.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file
from scipy.stats import chisquare

from specd.configs import load_config
from specd.workers.core import verify_chain, verify_tree
from specd.workers.core.sampling import SamplingParams, logits_to_probs, params_to_tensors
from specd.workers.engine.draft_worker import DraftWorker
from specd.workers.engine.spec_engine import SpecEngine
from specd.workers.engine.target_worker import TargetWorker
from specd.workers.engine.types import NewRequest, SpecParams
from specd.workers.models.llama import FEATURE_PROJ, FEATURE_STALENESS

PROMPT = [17, 60, 33]
DEPTH = 3          # tokens compared: the prefill's first token and the first step's drafts, bonus or not
SAMPLES = 800
MIN_EXPECTED = 5.0  # cells expected less often are pooled, as the chi-square approximation needs

CASES = {
    # max_new_tokens 4: the first step drafts γ = 2 (the cap is remaining - 1), so tokens 2 and 3 come
    # from accepted drafts, a recovered token or the bonus
    "chain": (SamplingParams(temperature=3.0, top_k=5), SpecParams(gamma=3)),
    "tree": (SamplingParams(temperature=4.0, top_k=6, top_p=0.9), SpecParams(gamma=3, tree_width=2)),
    # the same tree drafted by a drafter that reads the target's hidden states
    "hidden-tree": (SamplingParams(temperature=4.0, top_k=6, top_p=0.9), SpecParams(gamma=3, tree_width=2)),
}


def _hidden_state_drafter(src, dst):
    """The tiny drafter plus a random adapter for the target's hidden states."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    gen = torch.Generator().manual_seed(3)
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    tensors[FEATURE_PROJ] = torch.randn(hidden, hidden, generator=gen) * 0.3
    tensors[FEATURE_STALENESS] = torch.randn(4, hidden, generator=gen) * 0.3
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def workers(tiny_target_dir, tiny_drafter_dir, tmp_path_factory):
    # One thread: tiny matmuls gain nothing from two, and on a busy machine the second one's waits cost
    # ten times the work.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = load_config([
        f"target.model_path={tiny_target_dir}", f"drafter.path={tiny_drafter_dir}", "drafter.pack=none",
        "target.max_slots=128", "drafter.max_slots=128", "target.max_seq_len=16",
    ])
    target = TargetWorker(cfg.target, seed=11)
    hidden_dir = _hidden_state_drafter(tiny_drafter_dir, tmp_path_factory.mktemp("exact") / "hidden")
    hidden_cfg = dataclasses.replace(cfg.drafter, path=str(hidden_dir))
    yield target, {
        "token": DraftWorker(cfg.drafter, cfg.spec, str(target.model_dir), seed=12),
        "hidden": DraftWorker(hidden_cfg, cfg.spec, str(target.model_dir), seed=13),
    }
    torch.set_num_threads(threads)


def _drafter(drafters: dict, case: str) -> DraftWorker:
    drafter = drafters["hidden" if case.startswith("hidden") else "token"]
    assert drafter.uses_target_hidden() == case.startswith("hidden")
    return drafter


def _next_probs(target: TargetWorker, context: list[int], sampling: SamplingParams) -> torch.Tensor:
    runner = target.runner
    slot = runner.allocate()
    try:
        logits = runner.extend([slot], [context])[:, -1:]                              # [1, 1, vocab]
    finally:
        runner.free(slot)
    return logits_to_probs(logits.double(), *params_to_tensors([sampling], "cpu"))[0, 0]  # [vocab]


def exact_joint(target: TargetWorker, sampling: SamplingParams) -> dict[tuple[int, ...], float]:
    """Target-only sampling's probability of each sequence of the first DEPTH tokens."""
    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(DEPTH):
        longer = {}
        for prefix, mass in joint.items():
            probs = _next_probs(target, PROMPT + list(prefix), sampling)
            for tok in probs.nonzero()[:, 0].tolist():
                longer[(*prefix, tok)] = mass * float(probs[tok])
        joint = longer
    return joint


def engine_counts(target, drafter, sampling, spec, samples: int = SAMPLES, seeded: bool = False) -> Counter:
    """seeded: request i carries seed i (keyed sampling, workers/core/keyed.py); else unseeded (the
    residual rule)."""
    reqs = [NewRequest(f"x{i}", PROMPT, dataclasses.replace(sampling, seed=i) if seeded else sampling,
                       DEPTH + 1, spec) for i in range(samples)]
    seqs = SpecEngine(target, drafter).generate(reqs, ignore_eos=True)
    assert sum(s.stats.drafted for s in seqs) > samples, "the engine must have drafted"
    return Counter(tuple(s.output[:DEPTH]) for s in seqs)


def chi_square_pvalue(counts: Counter, joint: dict[tuple[int, ...], float]) -> float:
    """Pearson's test over the cells expected at least MIN_EXPECTED times, the rest pooled in one cell
    (which also holds any sequence target-only sampling can never draw)."""
    total = sum(counts.values())
    big = [cell for cell, prob in joint.items() if prob * total >= MIN_EXPECTED]
    observed = [counts[c] for c in big]
    expected = [joint[c] * total for c in big]
    observed.append(total - sum(observed))
    expected.append(total - sum(expected))
    assert len(big) >= 4, "too few cells for a meaningful test"
    return float(chisquare(observed, expected).pvalue)


@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_output_has_the_target_distribution(workers, case):
    target, drafter = workers[0], _drafter(workers[1], case)
    sampling, spec = CASES[case]
    pvalue = chi_square_pvalue(engine_counts(target, drafter, sampling, spec), exact_joint(target, sampling))
    print(f"{case}: p-value {pvalue:.3g}")
    assert pvalue > 1e-3, f"{case}: p-value {pvalue:.2e}: the engine's tokens are not target-distributed"


@pytest.mark.parametrize("case", ["chain", "tree"])
def test_the_same_test_fails_on_a_broken_verifier(workers, case, monkeypatch):
    """Recover from p itself instead of the residual: drafted tokens get too much mass. Half the
    samples are plenty to see it."""
    for module in (verify_chain, verify_tree):
        monkeypatch.setattr(module, "residual_weights", lambda p, q: p)
    target, drafter = workers[0], _drafter(workers[1], case)
    sampling, spec = CASES[case]
    counts = engine_counts(target, drafter, sampling, spec, SAMPLES // 2)
    pvalue = chi_square_pvalue(counts, exact_joint(target, sampling))
    print(f"{case}, broken verifier: p-value {pvalue:.3g}")
    assert pvalue < 1e-6, f"{case}: the broken verifier passed (p-value {pvalue:.2e})"


@pytest.mark.parametrize("case", ["chain", "hidden-tree"])
def test_seeded_output_has_the_target_distribution(workers, case):
    """Over seeds, keyed sampling (accept a draft iff it is the target's keyed sample) is target sampling."""
    target, drafter = workers[0], _drafter(workers[1], case)
    sampling, spec = CASES[case]
    counts = engine_counts(target, drafter, sampling, spec, seeded=True)
    pvalue = chi_square_pvalue(counts, exact_joint(target, sampling))
    print(f"{case}, seeded: p-value {pvalue:.3g}")
    assert pvalue > 1e-3, f"{case}: p-value {pvalue:.2e}: seeded tokens are not target-distributed"


def test_the_seeded_test_fails_when_positions_share_their_noise(workers, monkeypatch):
    """An off-by-position key (every position of a request raced with the same noise) correlates a
    request's tokens: the same test must reject it."""
    from specd.workers.core.keyed import keyed_sample
    from specd.workers.engine import target_worker

    monkeypatch.setattr(target_worker, "keyed_sample",
                        lambda probs, seeds, positions, vocab_ids=None: keyed_sample(
                            probs, seeds, [0] * len(positions), vocab_ids))
    target, drafter = workers[0], _drafter(workers[1], "chain")
    sampling, spec = CASES["chain"]
    counts = engine_counts(target, drafter, sampling, spec, SAMPLES // 2, seeded=True)
    pvalue = chi_square_pvalue(counts, exact_joint(target, sampling))
    print(f"chain, noise shared by positions: p-value {pvalue:.3g}")
    assert pvalue < 1e-6, f"the shared-noise verifier passed (p-value {pvalue:.2e})"
