"""The prompts a drafter learns from: the train split of the shipped prompt files, and the held-out
prompts its training is checked on.

Parsing, the split table and the chat turn are in workers/prompts.py, shared with the benchmarks
(bench/datasets.py), which measure on the eval split only: the table keeps the two disjoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specd.workers.prompts import SOURCES, SPLITS, Prompt, encode_prompt, load_prompts


def train_prompts(sources: Sequence[str] = SOURCES, limit: int | None = None) -> list[Prompt]:
    """Train-split prompts, the sources evenly interleaved (any prefix keeps the mix)."""
    return load_prompts("train", sources, limit=limit)


def heldout_prompts(sources: Sequence[str] = SOURCES, limit: int | None = None) -> list[Prompt]:
    """Eval-split prompts: never trained on, so a drafter's greedy match on them is an honest check."""
    return load_prompts("eval", sources, limit=limit)


def encode_prompts(tokenizer: Any, prompts: Sequence[Prompt]) -> list[list[int]]:
    """Token ids of each prompt's chat turn in the target's template."""
    return [encode_prompt(tokenizer, p) for p in prompts]


def split_table(sources: Sequence[str]) -> dict[str, dict[str, tuple[int, int]]]:
    """The row ranges of each source's splits, recorded in a drafter's metadata."""
    return {s: SPLITS[s] for s in sources}
