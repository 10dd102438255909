"""Prompt data the project ships (GSM8K test, HumanEval): parsing, the fixed train/eval splits, the chat turn.

Shared by the drafter trainer (drafter_trainer/data.py: the train split it learns from) and the
benchmarks (bench/datasets.py: the eval split they measure on). The splits are fixed by row index so
both agree on them without coordination: "train" prompts feed the drafter bootstrap and the online
traffic a benchmark streams, "eval" prompts are held out for benchmarks and held-out acceptance. A
drafter never trains on an eval prompt.

    gsm8k      rows [0, 1000) train, [1000, 1319) eval
    humaneval  rows [0, 120)  train, [120, 164)   eval
    general    rows [0, 144)  train, [144, 160) eval (general chat turns, the quick drafter's start)
    chat       no train rows,        [0, 32)      eval (open chat turns no drafter saw)
    openchat   rows [0, 200) stream, [200, 240) eval (open chat for online-distillation streams)

The files live in <repo>/data (copied from ../shared with their licences); SPECD_DATA_DIR overrides that
(a file it lacks is read from <repo>/data).
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from specd.workers.models.chat import ChatCodec

SOURCES = ("gsm8k", "humaneval")
# General-purpose chat turns written for specd (data/general_prompts.jsonl): what a drafter made before
# any traffic arrives learns from, so that the domains traffic brings are new to it, as a user's are.
GENERAL_SOURCES = ("general",)
# Sources with an eval split only, measured when named, never trained on: open-ended chat turns that no
# drafter saw (the traffic nobody trained for; data/chat_prompts.jsonl, written for specd).
EVAL_ONLY_SOURCES = ("chat",)
# Open chat a benchmark streams through a server for online distillation ("train" rows) and evaluates
# on ("eval" rows): written for specd apart from the general and chat turns, so neither the quick
# drafter nor the chat evaluation has seen any of it (data/openchat_prompts.jsonl).
STREAM_SOURCES = ("openchat",)
SPLIT_NAMES = ("train", "eval")

# source -> split -> [start, stop) row range. Changing these silently leaks eval prompts into
# training data of drafters built before the change, so treat them as frozen.
SPLITS: dict[str, dict[str, tuple[int, int]]] = {
    "gsm8k": {"train": (0, 1000), "eval": (1000, 1319)},
    "humaneval": {"train": (0, 120), "eval": (120, 164)},
    "general": {"train": (0, 144), "eval": (144, 160)},
    "chat": {"train": (0, 0), "eval": (0, 32)},
    "openchat": {"train": (0, 200), "eval": (200, 240)},
}

_FILES = {
    "gsm8k": "gsm8k_test.jsonl",
    "humaneval": "humaneval.jsonl.gz",
    "general": "general_prompts.jsonl",
    "chat": "chat_prompts.jsonl",
    "openchat": "openchat_prompts.jsonl",
}

HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n{code}```"


@dataclass(frozen=True)
class Prompt:
    """One prompt of a source file; `text` is the raw question or code stub, before any template."""

    source: str  # "gsm8k" | "humaneval" | "general" | "chat" | "openchat"
    index: int  # row in the source file
    text: str
    reference: str  # the dataset's answer / canonical solution (never shown to the model)

    @property
    def id(self) -> str:
        return f"{self.source}/{self.index}"


REPO_DATA = Path(__file__).resolve().parents[1] / "data"


def data_dir() -> Path:
    env = os.environ.get("SPECD_DATA_DIR")
    return Path(env) if env else REPO_DATA


def _read_rows(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_source(source: str, directory: str | Path | None = None) -> tuple[Prompt, ...]:
    """Every row of one source file, in file order."""
    if source not in _FILES:
        known = SOURCES + GENERAL_SOURCES + EVAL_ONLY_SOURCES + STREAM_SOURCES
        raise ValueError(f"unknown prompt source {source!r}; known: {known}")
    return _load_source(source, str(directory or data_dir()))


@cache
def _load_source(source: str, directory: str) -> tuple[Prompt, ...]:
    path = Path(directory) / _FILES[source]
    if not path.exists() and (REPO_DATA / _FILES[source]).exists():
        # A directory holding only the public datasets (SPECD_DATA_DIR=../shared/data) lacks the files
        # written for specd (general and chat prompts): those come from the repository's data/.
        path = REPO_DATA / _FILES[source]
    rows = _read_rows(path)
    if source == "gsm8k":
        return tuple(Prompt(source, i, r["question"], r["answer"]) for i, r in enumerate(rows))
    if source in ("general", "chat", "openchat"):
        return tuple(Prompt(source, i, r["prompt"], "") for i, r in enumerate(rows))
    return tuple(Prompt(source, i, r["prompt"], r["canonical_solution"]) for i, r in enumerate(rows))


def split_indices(source: str, split: str) -> range:
    if split not in SPLIT_NAMES:
        raise ValueError(f"unknown split {split!r}; known: {SPLIT_NAMES}")
    start, stop = SPLITS[source][split]
    return range(start, stop)


def load_split(source: str, split: str, directory: str | Path | None = None) -> list[Prompt]:
    rows = load_source(source, directory)
    indices = split_indices(source, split)
    if indices.stop > len(rows):
        raise ValueError(f"{source} has {len(rows)} rows, split {split} needs {indices.stop}")
    return [rows[i] for i in indices]


def load_prompts(
    split: str,
    sources: Sequence[str] = SOURCES,
    limit: int | None = None,
    directory: str | Path | None = None,
) -> list[Prompt]:
    """Prompts of one split from several sources, evenly interleaved in proportion to source size.

    Any prefix of the result is a proportional mix (e.g. the first 112 train prompts are about 100
    GSM8K and 12 HumanEval), so `limit` keeps the mix instead of taking one source only. The order is
    a pure function of the split table: deterministic, no random seed involved.
    """
    keyed = []
    for s_rank, source in enumerate(sources):
        prompts = load_split(source, split, directory)
        for i, p in enumerate(prompts):
            # Position of the prompt along its own source, in [0, 1); ties broken by source order.
            keyed.append(((i + 0.5) / len(prompts), s_rank, p))
    keyed.sort(key=lambda item: (item[0], item[1]))
    mixed = [p for _, _, p in keyed]
    return mixed if limit is None else mixed[:limit]


def user_message(prompt: Prompt) -> str:
    """The user turn the model sees: GSM8K questions verbatim, HumanEval stubs with an instruction."""
    if prompt.source == "humaneval":
        return HUMANEVAL_INSTRUCTION.format(code=prompt.text)
    return prompt.text


def chat_messages(prompt: Prompt) -> list[dict[str, str]]:
    # No system turn: the target's own template inserts its default system prompt.
    return [{"role": "user", "content": user_message(prompt)}]


def encode_prompt(tokenizer: Any, prompt: Prompt) -> list[int]:
    """Token ids of the prompt's chat turn in the target's template (workers/models/chat.py)."""
    return ChatCodec(tokenizer).render_chat(chat_messages(prompt))
