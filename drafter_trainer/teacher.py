"""Teachers for `specd bootstrap-drafter`: the target continues prompts and labels every position.

A teacher maps prompts (token ids) to TeacherSequences: the prompt, the target's continuation, and
the target's top-k log-probabilities at every generated position. Two implementations share that
signature:

    engine         specd's own ModelRunner with continuous batching (the default; several times
                   faster than transformers generate(): docs/decisions/bootstrap-drafter.md)
    transformers   AutoModelForCausalLM.generate, the reference implementation

Labels are the target's UNPROCESSED distribution (before temperature), since that is what a drafter
must match whatever sampling settings a request uses. Results are cached on disk per chunk of prompts
(run_teacher_cached), keyed by everything they depend on, so a re-run or an interrupted run skips
finished work.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from specd.drafter_trainer import data
from specd.drafter_trainer.distill import TeacherSequence

_Gen = torch.Generator | None
Teacher = Callable[[Sequence[list[int]], float, int], list[TeacherSequence]]
TEACHERS = ("engine", "transformers")


def cache_root() -> Path:
    return Path(os.environ.get("SPECD_CACHE") or Path.home() / ".cache" / "specd")


def _topk_of_logits(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    logprobs = F.log_softmax(logits.float(), dim=-1)  # [b, V]
    values, ids = logprobs.topk(k, dim=-1)  # sorted: column 0 is the target argmax
    return values, ids


@torch.no_grad()
def hf_generate_teacher(
    target: Any,
    prompts: Sequence[list[int]],
    temperature: float,
    max_new_tokens: int,
    top_k: int,
    batch_size: int,
    eos_ids: Sequence[int],
    pad_id: int,
    desc: str = "teacher",
    progress: bool = True,
) -> list[TeacherSequence]:
    """Continue each prompt with transformers `generate`, keeping the target's top-k logprobs.

    The labels are the target's UNPROCESSED distribution (output_logits, before temperature), since
    that is what a drafter must match whatever sampling settings a request uses. Prompts are batched
    in length order to keep left padding small; results come back in the input order.
    """
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results: list[TeacherSequence | None] = [None] * len(prompts)
    eos = torch.tensor(list(eos_ids))
    sample = temperature > 0
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt", disable=not progress, dynamic_ncols=True)
    generated_total, t0 = 0, time.perf_counter()
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        width = max(len(prompts[i]) for i in rows)
        input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):
            input_ids[r, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            attention_mask[r, width - len(prompts[i]) :] = 1
        out = target.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            do_sample=sample,
            temperature=temperature if sample else None,
            top_k=0 if sample else None,
            top_p=1.0 if sample else None,
            eos_token_id=list(eos_ids),
            pad_token_id=pad_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        # One [b, k] pair per generated step, reduced immediately: the raw logits are b x V per step.
        topk = [_topk_of_logits(step_logits, top_k) for step_logits in out.logits]
        values = torch.stack([v for v, _ in topk], dim=1)  # [b, G, k]
        ids = torch.stack([i for _, i in topk], dim=1)  # [b, G, k]
        new_tokens = out.sequences[:, width:]  # [b, G]
        for r, i in enumerate(rows):
            hits = torch.isin(new_tokens[r], eos).nonzero()
            n_new = (
                int(hits[0]) + 1 if hits.numel() else new_tokens.shape[1]
            )  # keep the EOS: it is drafted too
            results[i] = TeacherSequence(
                token_ids=torch.cat([torch.tensor(prompts[i]), new_tokens[r, :n_new]]),
                first_label=len(prompts[i]) - 1,
                topk_logprobs=values[r, :n_new].clone(),
                topk_ids=ids[r, :n_new].clone(),
            )
            generated_total += n_new
        bar.update(len(rows))
        bar.set_postfix(tok_s=f"{generated_total / (time.perf_counter() - t0):.1f}")
    bar.close()
    return [s for s in results if s is not None]


@torch.no_grad()
def engine_generate_teacher(
    runner: Any,
    prompts: Sequence[list[int]],
    temperature: float,
    max_new_tokens: int,
    top_k: int,
    eos_ids: Sequence[int],
    seed: int,
) -> list[TeacherSequence]:
    """Continue each prompt on a specd.workers.engine ModelRunner, as many at once as it has slots.

    Continuous batching: a finished sequence frees its slot and the next prompt is prefilled into
    it, so the batch stays full until the prompts run out. Sampling uses one generator per prompt
    seeded from (seed, prompt index), so the text does not depend on which prompts share a batch.
    """
    eos = set(eos_ids)
    sample = temperature > 0
    results: list[TeacherSequence | None] = [None] * len(prompts)
    pending = list(range(len(prompts)))[::-1]  # pop() takes them in order
    # slot -> (prompt index, generated tokens, [k] logprob rows, [k] id rows, generator)
    live: dict[int, tuple[int, list[int], list[torch.Tensor], list[torch.Tensor], _Gen]] = {}

    def choose(logits: torch.Tensor, gen: torch.Generator | None) -> int:  # logits [vocab]
        if not sample:
            return int(logits.argmax())
        probs = F.softmax(logits.float() / temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=gen))

    def take(slots: list[int], logits: torch.Tensor) -> None:  # logits [b, vocab], row i = slots[i]
        values, ids = _topk_of_logits(logits, top_k)  # [b, k] each
        for i, slot in enumerate(slots):
            index, new, lps, tids, gen = live[slot]
            token = choose(logits[i], gen)
            new.append(token)
            lps.append(values[i])
            tids.append(ids[i])
            if token in eos or len(new) >= max_new_tokens:
                results[index] = TeacherSequence(
                    token_ids=torch.tensor(list(prompts[index]) + new, dtype=torch.long),
                    first_label=len(prompts[index]) - 1,
                    topk_logprobs=torch.stack(lps),
                    topk_ids=torch.stack(tids),
                )
                del live[slot]
                runner.free(slot)

    while pending or live:
        fresh: list[int] = []
        while pending and runner.num_free > 0:
            index = pending.pop()
            slot = runner.allocate()
            gen = torch.Generator().manual_seed(seed * 1_000_003 + index) if sample else None
            live[slot] = (index, [], [], [], gen)
            fresh.append(slot)
        if fresh:
            take(fresh, runner.prefill(fresh, [list(prompts[live[s][0]]) for s in fresh]))
        decoding = [s for s in live if s not in fresh]
        if decoding:
            logits = runner.extend(decoding, [[live[s][1][-1]] for s in decoding])  # [b, 1, vocab]
            take(decoding, logits[:, 0])
    return [s for s in results if s is not None]


def _save_sequences(path: Path, sequences: Sequence[TeacherSequence]) -> None:
    lengths = torch.tensor([s.token_ids.numel() for s in sequences])
    tensors = {
        "token_ids": torch.cat([s.token_ids for s in sequences]),
        "lengths": lengths,
        "first_label": torch.tensor([s.first_label for s in sequences]),
        "n_labels": torch.tensor([s.n_labels for s in sequences]),
        "topk_logprobs": torch.cat([s.topk_logprobs for s in sequences]),
        "topk_ids": torch.cat([s.topk_ids for s in sequences]),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)


def _load_sequences(path: Path) -> list[TeacherSequence]:
    t = load_file(str(path))
    tokens = t["token_ids"].split(t["lengths"].tolist())
    logprobs = t["topk_logprobs"].split(t["n_labels"].tolist())
    ids = t["topk_ids"].split(t["n_labels"].tolist())
    return [
        TeacherSequence(tok.clone(), int(fl), lp.clone(), i.clone())
        for tok, fl, lp, i in zip(tokens, t["first_label"].tolist(), logprobs, ids, strict=True)
    ]


def _chunk_cache_path(target_dir: Path, what: dict[str, Any]) -> Path:
    weights = target_dir / "model.safetensors"
    key = {"target": target_dir.name, "weights_bytes": weights.stat().st_size, **what}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_root() / "bootstrap_data" / f"teacher-{digest}.safetensors"


def run_teacher_cached(
    cfg: Any,  # a BootstrapConfig
    target_dir: Path,
    name: str,
    prompts: Sequence[list[int]],
    temperature: float,
    teacher: Teacher,
) -> tuple[list[TeacherSequence], int]:
    """Teacher sequences for `prompts`, generated in chunks of gen_batch_size, each cached on disk.

    Chunks follow the prompt order, so a larger run reuses every chunk of a smaller one, and an
    interrupted run resumes where it stopped. Returns (sequences in prompt order, cached chunk count).
    """
    sequences: list[TeacherSequence] = []
    cached, generated, t0 = 0, 0, time.perf_counter()
    bar = tqdm(total=len(prompts), desc=f"teacher {name}", unit="prompt", disable=not cfg.progress)
    for c, start in enumerate(range(0, len(prompts), cfg.gen_batch_size)):
        chunk = list(prompts[start : start + cfg.gen_batch_size])
        seed = cfg.seed + c
        what = {
            "prompts": hashlib.sha256(json.dumps(chunk).encode()).hexdigest(),
            "temperature": temperature,
            "max_new_tokens": cfg.max_new_tokens,
            "top_k": cfg.top_k_logprobs,
            "seed": seed,
            "teacher": cfg.teacher,
        }
        path = _chunk_cache_path(target_dir, what)
        if cfg.reuse_teacher_data and path.is_file():
            sequences += _load_sequences(path)
            cached += 1
        else:
            fresh = teacher(chunk, temperature, seed)
            _save_sequences(path, fresh)
            sequences += fresh
            generated += sum(s.n_labels for s in fresh)
        bar.update(len(chunk))
        bar.set_postfix(new_tok_s=f"{generated / (time.perf_counter() - t0):.1f}", cached=cached)
    bar.close()
    return sequences, cached


# ------------------------------------------------------------------------ the bootstrap's data


def resolve_target_dir(target_dir: str | None) -> Path:
    """The target as a float32 safetensors HF directory (converted from the GGUF once, then cached)."""
    from specd.workers.models.loader import ensure_target_model  # lazy: conversion pulls in gguf/transformers

    return Path(ensure_target_model(target_dir))


@dataclass
class TeacherData:
    target_dir: Path
    tokenizer: Any
    vocab_size: int
    eos_ids: list[int]
    pad_id: int
    train_ids: list[list[int]]
    eval_ids: list[list[int]]
    sequences: dict[str, list[TeacherSequence]]  # train-greedy, train-sampled, eval-greedy
    cached_chunks: dict[str, int]

    @property
    def train(self) -> list[TeacherSequence]:
        return self.sequences["train-greedy"] + self.sequences["train-sampled"]

    @property
    def eval(self) -> list[TeacherSequence]:
        return self.sequences["eval-greedy"]


def collect_teacher_data(cfg: Any, teacher: Teacher | None = None, lap=None) -> TeacherData:
    """The target's continuations of a BootstrapConfig's train and eval prompts (cached chunks reused)."""
    from transformers import AutoModelForCausalLM

    from specd.workers.models.loader import load_tokenizer
    from specd.workers.models.runner import ModelRunner

    target_dir = resolve_target_dir(cfg.target_dir)
    tokenizer = load_tokenizer(target_dir)
    vocab_size = int(json.loads((target_dir / "config.json").read_text())["vocab_size"])
    eos_ids = sorted({tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")} - {None})
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]

    train_prompts = data.train_prompts(cfg.sources, limit=cfg.num_prompts)
    eval_prompts = data.heldout_prompts(cfg.sources, limit=cfg.num_eval_prompts)
    train_ids = data.encode_prompts(tokenizer, train_prompts)
    eval_ids = data.encode_prompts(tokenizer, eval_prompts)
    # Every 1/sample_fraction-th prompt (deterministic) is sampled, so the mix holds for any prefix.
    n_sampled = round(len(train_ids) * cfg.sample_fraction)
    sampled_rows = {round(j / cfg.sample_fraction) for j in range(n_sampled)} if n_sampled else set()
    groups = [
        ("train-greedy", [x for j, x in enumerate(train_ids) if j not in sampled_rows], 0.0),
        ("train-sampled", [x for j, x in enumerate(train_ids) if j in sampled_rows], cfg.temperature),
        ("eval-greedy", eval_ids, 0.0),
    ]

    target = None  # loaded on the first chunk that is not cached

    def default_teacher(prompts: Sequence[list[int]], temperature: float, seed: int) -> list[TeacherSequence]:
        nonlocal target
        if cfg.teacher == "engine":
            if target is None:
                longest = max(len(p) for p in train_ids + eval_ids) + cfg.max_new_tokens
                target = ModelRunner(
                    target_dir, max_slots=cfg.gen_batch_size, num_threads=cfg.threads, max_seq_len=longest
                )
            return engine_generate_teacher(
                target, prompts, temperature, cfg.max_new_tokens, cfg.top_k_logprobs, eos_ids, seed
            )
        if target is None:
            target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        torch.manual_seed(seed)
        return hf_generate_teacher(
            target,
            prompts,
            temperature,
            cfg.max_new_tokens,
            cfg.top_k_logprobs,
            cfg.gen_batch_size,
            eos_ids,
            pad_id,
            progress=False,  # run_teacher_cached shows progress per chunk
        )

    run_teacher = teacher or default_teacher
    sequences: dict[str, list[TeacherSequence]] = {}
    cached_chunks: dict[str, int] = {}
    for name, prompts, temperature in groups:
        sequences[name], cached_chunks[name] = run_teacher_cached(
            cfg, target_dir, name, prompts, temperature, run_teacher
        )
        if lap is not None:
            lap(f"teacher {name}")
    target = None  # free the 538 MB target before training
    return TeacherData(
        target_dir, tokenizer, vocab_size, eos_ids, pad_id, train_ids, eval_ids, sequences, cached_chunks
    )
