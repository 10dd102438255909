"""vLLM's spec-decode counters, translated into our glossary (no vLLM engine is started)."""

from __future__ import annotations

from specd.bench.vllm_runner import speculation_counts


def test_speculation_counts_include_steps_without_drafts():
    # 2 requests, 20 generated tokens: 2 from prefill, 18 from steps. 3 drafting steps proposed 12 tokens
    # and 6 were accepted, so steps = 18 - 6 = 12 (3 drafting steps + 9 steps without a draft).
    before = {"drafts": 5, "draft_tokens": 10, "accepted_tokens": 4}
    after = {"drafts": 8, "draft_tokens": 22, "accepted_tokens": 10}
    counts = speculation_counts(before, after, generated=20, requests=2)
    assert counts == {"drafted": 12, "accepted": 6, "emitted": 18, "steps": 12}
    assert counts["emitted"] / counts["steps"] == 1.5
