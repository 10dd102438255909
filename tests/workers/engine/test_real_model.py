"""Greedy speculative output on the real SmolLM2 target is token-identical to target-only decoding.

20 held-out GSM8K prompts x 128 tokens, batched. Where the two differ, the position must be a numerical
near-tie of the target's top two logits (a batched forward of several tokens sums in another order than
a one-token forward, and float32 rounding can flip an exact tie); such ties are counted and shown.
"""

from __future__ import annotations

import functools

import pytest
import torch

from specd.configs import load_config
from specd.workers.core.sampling import SamplingParams
from specd.workers.engine.draft_worker import DraftWorker
from specd.workers.engine.spec_engine import SpecEngine
from specd.workers.engine.target_worker import TargetWorker
from specd.workers.engine.types import NewRequest, SpecParams
from specd.workers.models.loader import load_tokenizer
from specd.workers.prompts import encode_prompt, load_prompts

NUM_PROMPTS, NEW_TOKENS = 20, 128
TIE_MARGIN = 1e-3  # logits differing by less than this are a tie under float32 reordering


@pytest.fixture(scope="module")
def target(real_target_dir):
    cfg = load_config([f"target.model_path={real_target_dir}", "target.max_slots=10"])
    return TargetWorker(cfg.target)


@pytest.fixture(scope="module")
def prompts(real_target_dir):
    tok = load_tokenizer(real_target_dir)
    return [encode_prompt(tok, p) for p in load_prompts("eval", sources=("gsm8k",), limit=NUM_PROMPTS)]


def _top2_margin(target: TargetWorker, tokens: list[int]) -> float:
    """Gap between the target's two largest next-token logits after `tokens`, from a fresh forward."""
    runner = target.runner
    slot = runner.allocate()
    try:
        logits = runner.prefill([slot], [tokens])[0]
    finally:
        runner.free(slot)
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def _check_identical_or_ties(target, prompts, base, spec) -> int:
    ties = 0
    for prompt, b, s in zip(prompts, base, spec, strict=True):
        if b == s:
            continue
        j = next(i for i, (x, y) in enumerate(zip(b, s, strict=True)) if x != y)
        margin = _top2_margin(target, prompt + b[:j])
        assert margin < TIE_MARGIN, f"divergence at token {j} is not a tie (top-2 logit gap {margin:.4g})"
        ties += 1
    return ties


def _requests(prompts, spec):
    return [NewRequest(f"p{i}", p, SamplingParams(), NEW_TOKENS, spec) for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def base(target, prompts):
    """Target-only greedy decoding on the same engine, computed once for both drafters."""
    seqs = SpecEngine(target, max_running=10).generate(
        _requests(prompts, SpecParams(enabled=False)), ignore_eos=True
    )
    return [s.output for s in seqs]


# 20 prompts x 128 tokens, three times: minutes on an idle 2-core machine, far more on a loaded one.
@pytest.mark.timeout(3000)
@pytest.mark.parametrize("drafter_kind", ["model-hidden", "model", "ngram"])
def test_greedy_identical_on_real_prompts(
    target, prompts, base, boot_drafter_dir, boot_hidden_drafter_dir, drafter_kind
):
    path = boot_hidden_drafter_dir if drafter_kind == "model-hidden" else boot_drafter_dir
    cfg = load_config([f"drafter.path={path}", f"drafter.kind={drafter_kind.split('-')[0]}",
                       "drafter.max_slots=10"])
    drafter = DraftWorker(cfg.drafter, cfg.spec, str(target.model_dir))
    reqs = functools.partial(_requests, prompts)
    seqs = SpecEngine(target, drafter, max_running=10).generate(reqs(SpecParams(gamma=4)), ignore_eos=True)
    spec = [s.output for s in seqs]
    assert all(len(x) == NEW_TOKENS for x in spec)
    ties = _check_identical_or_ties(target, prompts, base, spec)
    accepted = sum(s.stats.accepted for s in seqs)
    drafted = sum(s.stats.drafted for s in seqs)
    print(f"\n{drafter_kind}: {NUM_PROMPTS - ties}/{NUM_PROMPTS} identical, {ties} near-ties; "
          f"α = {accepted}/{drafted} = {accepted / max(drafted, 1):.2f}")
    assert ties <= 2
    assert drafted > 0
