"""The seed drafter: what a first start serves with when the cache holds no trained drafter.

It is the bootstrap's student before any training (bootstrap.init_student): the target's first layers,
its frozen embeddings and a reduced head at the tokens the train split's texts use most (every shipped
source's questions and reference answers: tokenizing them is all it costs), and for the hidden-state
drafter the zero feature projection the hidden stage starts from (it then drafts what the token
drafter would). Seconds to build, so `specd serve` is up at once; online distillation then trains it
on the traffic that arrives and the gate swaps each better version in.

Its held-out figure is measured, never assumed: the target continues a few held-out general prompts
greedily and the seed's greedy match on them is recorded as `eval_after` (what
workers/drafters/versions.held_out_acceptance reads). The planner prices model drafts from that figure,
so a seed that matches a few percent drafts almost nothing and the suffix index serves alone until a
trained version earns its drafts (docs/decisions/first-start.md says what the quick drafter it replaces
cost and gave).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from specd.drafter_trainer import data
from specd.drafter_trainer.bootstrap import build_head_vocab, init_student, train_corpus
from specd.drafter_trainer.distill import evaluate
from specd.drafter_trainer.drafter_format import save_drafter
from specd.drafter_trainer.hidden_stage import HiddenDrafterLM
from specd.drafter_trainer.teacher import engine_generate_teacher
from specd.workers.prompts import GENERAL_SOURCES, SOURCES

SEED_NAME = "boot-seed"
HEAD_SOURCES = SOURCES + GENERAL_SOURCES     # train splits only: the benchmarks measure on eval splits


def build_seed_drafter(
    target_dir: str | Path,
    out_dir: str | Path,
    hidden_out_dir: str | Path | None = None,
    *,
    num_layers: int = 2,
    head_vocab: int = 4096,
    staleness: int = 4,
    eval_prompts: int = 8,
    eval_tokens: int = 32,
    threads: int = 2,
) -> tuple[Path, Path | None]:
    """Write the seed token drafter to out_dir and, when hidden_out_dir is given, its hidden-state form
    there; returns both paths. The two share the held-out figure (a zero projection reads no state)."""
    from specd.workers.models.loader import load_tokenizer
    from specd.workers.models.runner import ModelRunner

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    target_dir = Path(target_dir)
    tokenizer = load_tokenizer(target_dir)
    vocab_size = int(json.loads((target_dir / "config.json").read_text())["vocab_size"])
    eos_ids = sorted({tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")} - {None})
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    vocab_ids = build_head_vocab([], head_vocab, vocab_size, eos_ids,
                                 corpus=train_corpus(tokenizer, HEAD_SOURCES), corpus_weight=1.0)
    student = init_student(target_dir, num_layers, vocab_ids)

    prompts = data.encode_prompts(tokenizer, data.heldout_prompts(GENERAL_SOURCES, limit=eval_prompts))
    runner = ModelRunner(target_dir, max_slots=len(prompts), num_threads=threads,
                         max_seq_len=max(len(p) for p in prompts) + eval_tokens)
    held_out = engine_generate_teacher(runner, prompts, 0.0, eval_tokens, 1, eos_ids, seed=0)
    del runner
    stats = evaluate(student, held_out, pad_id=pad_id)
    meta = {
        "parent_version": None,
        "target": target_dir.name,
        "train": {
            "recipe": "seed: first layers, frozen target embeddings, frequent-token head; not trained",
            "prompts": {"train": 0, "eval": len(prompts), "sources": list(GENERAL_SOURCES),
                        "head_sources": list(HEAD_SOURCES), "splits": data.split_table(HEAD_SOURCES)},
            "num_layers": num_layers,
            "head_vocab": int(vocab_ids.numel()),
            "steps": 0,
            "eval_after": stats.as_dict(),
            "greedy_match_after": round(stats.greedy_match, 4),
            "timings_s": {"build": round(time.perf_counter() - t0, 1)},
        },
    }
    token_dir = save_drafter(out_dir, student.state_dict(), student.config, meta, tokenizer_dir=target_dir,
                             version_prefix="seed")
    if hidden_out_dir is None:
        return token_dir, None
    hidden = HiddenDrafterLM(student, staleness)
    parent = json.loads((token_dir / "specd_drafter.json").read_text())["version"]
    hidden_meta = {**meta, "parent_version": parent}
    hidden_dir = save_drafter(hidden_out_dir, hidden.state_dict(), hidden.config, hidden_meta,
                              tokenizer_dir=target_dir, version_prefix="seed-hidden")
    return token_dir, hidden_dir
