"""The prompts benchmarks measure on: the eval split of GSM8K and HumanEval, in the target's chat template.

Parsing and the split table are in workers/prompts.py, shared with the drafter trainer, which learns
from the train split only (drafter_trainer/data.py): a benchmark never measures a drafter on a prompt
it was trained on. The files are the repository's data/ (SPECD_DATA_DIR overrides it).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from specd.workers.prompts import (
    EVAL_ONLY_SOURCES,
    SOURCES,
    chat_messages,
    encode_prompt,
    load_prompts,
    load_split,
)

WORKLOADS = SOURCES
# Workloads run only when asked for by name (not in the full plan): repeat = bench/repetition.py; chat =
# open-ended chat turns no drafter was trained on (data/chat_prompts.jsonl)
EXTRA_WORKLOADS = ("repeat", *EVAL_ONLY_SOURCES)


def workload_prompts(workload: str, num_prompts: int, tokenizer: Any) -> list[tuple[int, list[int]]]:
    """(row index, chat-templated token ids) of the first `num_prompts` eval-split prompts of one workload."""
    if workload == "repeat":
        from specd.bench.repetition import repetition_prompts

        return repetition_prompts(num_prompts, tokenizer)
    return [(p.index, encode_prompt(tokenizer, p)) for p in load_split(workload, "eval")[:num_prompts]]


def mixed_prompts(
    workloads: Sequence[str], num_prompts: int, tokenizer: Any
) -> tuple[list[list[dict[str, str]]], list[list[int]]]:
    """The first `num_prompts` eval-split prompts of several workloads, evenly interleaved: as chat
    messages (what gRPC clients send) and as token ids (what an in-process engine gets)."""
    prompts = load_prompts("eval", workloads, limit=num_prompts)
    return [chat_messages(p) for p in prompts], [encode_prompt(tokenizer, p) for p in prompts]


def request_lengths(count: int, max_new_tokens: int, mode: str = "fixed", seed: int = 0) -> list[int]:
    """max_new_tokens of each request: all alike ("fixed"), or ("mixed") drawn uniformly from
    [max_new_tokens / 2, 3 max_new_tokens / 2] (mean max_new_tokens), seeded: every phase sends the same."""
    if mode == "fixed":
        return [max_new_tokens] * count
    if mode != "mixed":
        raise ValueError(f"unknown --lengths {mode!r}; choose fixed or mixed")
    rng = random.Random(seed)
    low, high = max(2, max_new_tokens // 2), max(2, max_new_tokens + max_new_tokens // 2)
    return [rng.randint(low, high) for _ in range(count)]
