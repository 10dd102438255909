"""vLLM's per-request output read back as specd's steps: which output delta each drafted step was, and the
target's top-k log-probabilities per emitted position (vllm_engine.VllmEngine._finish builds the replay
records from both)."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def align_steps(deltas: list[list[int]], drafted_steps: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(drafted, accepted) for every step after the prefill's delta.

    vLLM lists only the steps that carried drafts, in order; a step emits accepted + 1 tokens (the last may
    be cut by max_tokens or a stop token), and one without drafts emits one. An entry with 0 accepted and a
    draftless step both emit one token; taking the entry at the first fitting delta is always consistent
    (swapping two one-token steps changes nothing), so a greedy walk recovers the steps.
    """
    steps: list[tuple[int, int]] = []
    j = 0
    body = deltas[1:]
    for k, tokens in enumerate(body):
        last = k == len(body) - 1
        if j < len(drafted_steps):
            num_drafted, num_accepted = drafted_steps[j]
            emits = num_accepted + 1
            if emits == len(tokens) or (last and emits > len(tokens)):
                steps.append((num_drafted, num_accepted))
                j += 1
                continue
        if len(tokens) != 1:
            log.warning("step of %d tokens matches no drafted step; counting its drafts as accepted",
                        len(tokens))
            steps.append((len(tokens) - 1, len(tokens) - 1))
            continue
        steps.append((0, 0))
    if j != len(drafted_steps):
        log.warning("%d drafted steps of vLLM were not matched to output deltas", len(drafted_steps) - j)
    return steps


def topk_lists(position_logprobs: list, k: int) -> tuple[list[list[int]] | None, list[list[float]] | None]:
    """vLLM's per-position {token: Logprob} dicts -> top-k ids and logprobs, descending (None when k = 0)."""
    if k <= 0 or not position_logprobs:
        return None, None
    ids, values = [], []
    for entry in position_logprobs:
        ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:k] if entry else []
        ids.append([int(t) for t, _ in ranked])
        values.append([float(lp.logprob) for _, lp in ranked])
    return ids, values
