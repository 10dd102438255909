"""`specd bootstrap-drafter`: the default drafter, distilled from the target model on its own text.

Recipe (what worked on this machine): the target's first `num_layers` layers, its
embedding (frozen), and a `head_vocab`-row head cut from the target head at the tokens the target
itself emits most often; distilled with forward KL on the target's top-k log-probabilities.

Phases:
  1. teacher     the target generates continuations of the chat-templated TRAIN prompts (greedy and
                 some at T=0.7) and of a few EVAL prompts (greedy); every generated position keeps
                 the target's top-k log-probabilities. Cached on disk per chunk of prompts, keyed by
                 everything it depends on, so re-runs and interrupted runs skip finished work.
  2. head vocab  token frequencies of the generated train text (plus the train split's dataset text)
                 choose the reduced head.
  3. distill     AdamW on the top-k forward KL; greedy match on the eval sequences before and after.

  4. publish     an atomically written drafter directory (drafter_format.py).

The teacher (drafter_trainer/teacher.py) runs on specd's own engine by default; `--teacher
transformers` selects the reference implementation.

What each preset reaches and how long it takes: docs/decisions/bootstrap-drafter.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from specd.drafter_trainer import data
from specd.drafter_trainer.distill import DrafterLM, TeacherSequence, evaluate, train_drafter
from specd.drafter_trainer.drafter_format import make_drafter_config, save_drafter
from specd.drafter_trainer.hidden_stage import bootstrap_hidden_drafter
from specd.drafter_trainer.teacher import (
    TEACHERS,
    Teacher,
    cache_root,
    collect_teacher_data,
)
from specd.workers.models.llama import safetensors_files
from specd.workers.prompts import GENERAL_SOURCES, SOURCES


@dataclass
class BootstrapConfig:
    target_dir: str | None = None  # None: specd.workers.models.loader.ensure_target_model()
    out_dir: str | None = None  # None: <cache_root>/drafters/boot-default
    sources: tuple[str, ...] = SOURCES
    num_prompts: int = 480  # train prompts the target continues
    num_eval_prompts: int = 24  # held-out eval prompts for the greedy match
    max_new_tokens: int = 160
    sample_fraction: float = 0.25  # share of train prompts continued at `temperature` instead of greedy
    temperature: float = 0.7
    teacher: str = "engine"  # one of teacher.TEACHERS
    gen_batch_size: int = 16  # prompts per cached chunk; the engine teacher runs them all at once
    num_layers: int = 2
    head_vocab: int = 4096
    prompt_count_weight: float = 0.25  # prompt tokens count this much toward the head vocabulary
    corpus_count_weight: float = 0.25  # ... and the train split's questions + reference answers this much
    top_k_logprobs: int = 32
    lr: float = 3e-4
    weight_decay: float = 0.01
    epochs: float = 5.0  # passes over the train sequences, unless max_steps is set
    max_steps: int | None = None
    batch_size: int = 4  # sequences per optimizer step
    warmup_steps: int = 10
    seed: int = 0
    threads: int = 2
    reuse_teacher_data: bool = True
    progress: bool = True
    # Second stage: fine-tune the drafter to also read the target's hidden states (hidden_stage.py).
    target_hidden: bool = True
    hidden_out_dir: str | None = None  # None: boot-hidden, or <out_dir>-hidden when out_dir is set
    # The second stage gets every train prompt: it has more to learn (reading states) from the same
    # kind of text, and its teacher chunks extend the first stage's cached ones.
    hidden_num_prompts: int | None = 1120  # None: num_prompts
    hidden_epochs: float = 5.0
    hidden_lr: float = 5e-4
    hidden_staleness: int = 4  # staleness embeddings: 0 (fresh) .. 3 (the 4th draft of a step, and on)
    hidden_fresh_fraction: float = 0.5  # share of training positions that read a fresh state
    extra_meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.teacher not in TEACHERS:
            raise ValueError(f"unknown teacher {self.teacher!r}; choose from {', '.join(TEACHERS)}")

    @classmethod
    def quick(cls, **overrides: Any) -> BootstrapConfig:
        """Small enough for a first start on 2 CPU cores (a couple of minutes) and still a valid drafter.

        It learns from general chat turns, not from the benchmark domains: a fresh install does not know
        what its traffic will be, and online distillation adapts it to whatever arrives."""
        base = dict(
            sources=GENERAL_SOURCES, num_prompts=48, num_eval_prompts=8, max_new_tokens=64, epochs=4.0,
            hidden_num_prompts=None, hidden_epochs=8.0,
        )
        return cls(**{**base, **overrides})

    def resolved_out_dir(self) -> Path:
        return Path(self.out_dir) if self.out_dir else cache_root() / "drafters" / "boot-default"

    def resolved_hidden_out_dir(self) -> Path:
        if self.hidden_out_dir:
            return Path(self.hidden_out_dir)
        if self.out_dir:
            return Path(f"{self.out_dir}-hidden")
        return cache_root() / "drafters" / "boot-hidden"


# ------------------------------------------------------------------------------------- drafter init


def build_head_vocab(
    sequences: Sequence[TeacherSequence],
    head_vocab: int,
    vocab_size: int,
    always_include: Sequence[int] = (),
    prompt_weight: float = 0.25,
    corpus: Sequence[torch.Tensor] = (),
    corpus_weight: float = 0.25,
) -> torch.Tensor:
    """[head_vocab] sorted target ids: the tokens the target emits most often on the train prompts.

    Generated tokens count 1, their prompt tokens `prompt_weight`, and `corpus` tokens (the train
    split's questions and reference answers: no generation needed, so all of them) `corpus_weight`:
    a few hundred target generations use only ~1.5k distinct tokens, and the corpus ranks the rest
    of the head far better than chance (docs/decisions/bootstrap-drafter.md).
    Tokens never seen are ranked by id: byte-level BPE ids follow merge order, which roughly follows
    corpus frequency. `always_include` (EOS) is forced in.
    """
    counts = torch.zeros(vocab_size, dtype=torch.float64)

    def add(ids: torch.Tensor, weight: float) -> None:
        counts.index_add_(0, ids, torch.full((ids.numel(),), weight, dtype=torch.float64))

    for s in sequences:
        add(s.token_ids[s.first_label + 1 :], 1.0)
        add(s.token_ids[: s.first_label + 1], prompt_weight)
    for ids in corpus:
        add(ids, corpus_weight)
    forced = torch.tensor(sorted(set(always_include)), dtype=torch.long)
    # Tie-break by id: a tiny bonus decreasing with id, far below the smallest real count.
    score = counts + (vocab_size - torch.arange(vocab_size, dtype=torch.float64)) / vocab_size * 1e-3
    score[forced] = float("inf")
    return score.topk(min(head_vocab, vocab_size)).indices.sort().values


def train_corpus(tokenizer: Any, sources: Sequence[str]) -> list[torch.Tensor]:
    """Token ids of every train-split prompt with its reference answer (never the eval split)."""
    texts = [p.text + "\n" + p.reference for p in data.train_prompts(sources)]
    return [torch.tensor(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def init_student(target_dir: Path, num_layers: int, draft_vocab_ids: torch.Tensor) -> DrafterLM:
    """The target's first `num_layers` layers, final norm and embedding; head rows of draft_vocab_ids."""
    target_config = json.loads((target_dir / "config.json").read_text())
    config = make_drafter_config(target_config, num_layers, draft_vocab_ids.numel())
    keep = ("model.embed_tokens.", "model.norm.", *(f"model.layers.{i}." for i in range(num_layers)))
    state: dict[str, torch.Tensor] = {}
    head = None
    for path in safetensors_files(target_dir):   # one file or a sharded checkpoint's shards
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                if name.startswith(keep):
                    state[name] = f.get_tensor(name).float()
                elif name == "lm_head.weight":
                    head = f.get_tensor(name).float()
    # Tied embeddings (SmolLM2) store no lm_head: the head is the embedding matrix.
    head = state["model.embed_tokens.weight"] if head is None else head
    state["lm_head.weight"] = head[draft_vocab_ids].clone()
    state["draft_vocab_ids"] = draft_vocab_ids
    model = DrafterLM.from_state_dict(config, state)
    model.freeze_embeddings()
    return model


# ------------------------------------------------------------------------------------------- driver


def bootstrap_drafter(cfg: BootstrapConfig, teacher: Teacher | None = None) -> Path:
    """Build the default drafter from the target and write it to cfg's output dir; returns that dir.

    With cfg.target_hidden the second stage (bootstrap_hidden_drafter) follows on the same data.
    """
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    timings: dict[str, float] = {}
    t = time.perf_counter()

    def lap(phase: str) -> None:
        nonlocal t
        now = time.perf_counter()
        timings[phase] = round(now - t, 1)
        t = now
        if cfg.progress:
            print(f"[bootstrap] {phase}: {timings[phase]:.1f} s", flush=True)

    td = collect_teacher_data(cfg, teacher, lap)
    target_dir, tokenizer, vocab_size, eos_ids, pad_id = (
        td.target_dir, td.tokenizer, td.vocab_size, td.eos_ids, td.pad_id
    )
    sequences = td.sequences
    train_seqs = sequences["train-greedy"] + sequences["train-sampled"]
    eval_seqs = sequences["eval-greedy"]

    corpus = train_corpus(tokenizer, cfg.sources) if cfg.corpus_count_weight > 0 else []
    draft_vocab_ids = build_head_vocab(
        train_seqs,
        cfg.head_vocab,
        vocab_size,
        eos_ids,
        cfg.prompt_count_weight,
        corpus,
        cfg.corpus_count_weight,
    )
    student = init_student(target_dir, cfg.num_layers, draft_vocab_ids)
    lap("init student")

    before = evaluate(student, eval_seqs, pad_id=pad_id)
    lap("eval before")
    steps = cfg.max_steps or max(1, round(cfg.epochs * len(train_seqs) / cfg.batch_size))
    history = train_drafter(
        student,
        train_seqs,
        steps=steps,
        batch_size=cfg.batch_size,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        warmup_steps=cfg.warmup_steps,
        seed=cfg.seed,
        pad_id=pad_id,
        progress=cfg.progress,
    )
    lap("distill")
    after = evaluate(student, eval_seqs, pad_id=pad_id)
    lap("eval after")

    meta = _bootstrap_meta(cfg, td, draft_vocab_ids, steps, history, before, after, timings)
    out_dir = save_drafter(
        cfg.resolved_out_dir(),
        student.state_dict(),
        student.config,
        meta,
        tokenizer_dir=target_dir,
        version_prefix="boot",
    )
    lap("save")
    if cfg.progress:
        size_mb = (out_dir / "model.safetensors").stat().st_size / 1e6
        print(
            f"[bootstrap] greedy match on {after.labelled} held-out eval tokens: "
            f"{before.greedy_match:.1%} -> {after.greedy_match:.1%} (head covers {after.head_coverage:.1%})\n"
            f"[bootstrap] drafter {json.loads((out_dir / 'specd_drafter.json').read_text())['version']} "
            f"({size_mb:.0f} MB) written to {out_dir}",
            flush=True,
        )
    if cfg.target_hidden:
        bootstrap_hidden_drafter(cfg, out_dir, td)
    return out_dir


def _bootstrap_meta(cfg, td, draft_vocab_ids, steps, history, before, after, timings) -> dict:
    """What specd_drafter.json records about a first-stage drafter: recipe, data, training, scores."""
    sequences, target_dir = td.sequences, td.target_dir
    tail = history[-max(1, len(history) // 10) :]
    n_generated = {name: sum(s.n_labels for s in seqs) for name, seqs in sequences.items()}
    return {
        "parent_version": None,
        "target": target_dir.name,
        "train": {
            "recipe": "first layers, frozen target embeddings, frequent-token head, top-k forward KL",
            "prompts": {
                "train": len(td.train_ids),
                "eval": len(td.eval_ids),
                "sources": list(cfg.sources),
                "splits": data.split_table(cfg.sources),
            },
            "teacher": {
                "implementation": cfg.teacher,
                "generated_tokens": n_generated,
                "max_new_tokens": cfg.max_new_tokens,
                "temperature_sampled": cfg.temperature,
                "sample_fraction": cfg.sample_fraction,
                "top_k_logprobs": cfg.top_k_logprobs,
                "cached_chunks": td.cached_chunks,
            },
            "num_layers": cfg.num_layers,
            "head_vocab": int(draft_vocab_ids.numel()),
            "steps": steps,
            "batch_size": cfg.batch_size,
            "lr": cfg.lr,
            "seed": cfg.seed,
            "final_train_loss": round(sum(s.loss for s in tail) / len(tail), 4),
            "eval_before": before.as_dict(),
            "eval_after": after.as_dict(),
            "greedy_match_before": round(before.greedy_match, 4),
            "greedy_match_after": round(after.greedy_match, 4),
            "timings_s": timings,
            **cfg.extra_meta,
        },
    }


def build_arg_parser(add_help: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specd bootstrap-drafter", description=__doc__.split("\n")[0], add_help=add_help
    )
    p.add_argument("--quick", action="store_true",
                   help="the first start's small preset on general chat turns (a minute or two)")
    p.add_argument("--sources", type=_source_list,
                   help="comma-separated prompt sources to learn from (default: gsm8k,humaneval; "
                        "--quick: general)")
    p.add_argument("--out", dest="out_dir", help="output drafter directory")
    p.add_argument("--target-dir", help="target model directory (default: the converted SmolLM2 cache)")
    p.add_argument("--num-prompts", type=int)
    p.add_argument("--num-eval-prompts", type=int)
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--sample-fraction", type=float)
    p.add_argument("--teacher", choices=TEACHERS, help="who generates the training text (default: engine)")
    p.add_argument("--gen-batch-size", type=int)
    p.add_argument("--num-layers", type=int)
    p.add_argument("--head-vocab", type=int)
    p.add_argument("--top-k-logprobs", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--epochs", type=float)
    p.add_argument("--max-steps", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--threads", type=int)
    p.add_argument(
        "--no-cache",
        dest="reuse_teacher_data",
        action="store_false",
        default=None,
        help="regenerate the teacher data even if cached",
    )
    p.add_argument("--no-progress", dest="progress", action="store_false", default=None)
    p.add_argument(
        "--no-target-hidden",
        dest="target_hidden",
        action="store_false",
        default=None,
        help="skip the second stage (the drafter that reads the target's hidden states)",
    )
    p.add_argument("--hidden-num-prompts", type=int, help="train prompts of the second stage")
    p.add_argument("--hidden-epochs", type=float)
    p.add_argument("--hidden-out", dest="hidden_out_dir", help="output directory of the second stage")
    return p


def _source_list(text: str) -> tuple[str, ...]:
    from specd.workers.prompts import SPLITS, split_indices

    sources = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in sources if s not in SPLITS]
    if not sources or unknown:
        known = ", ".join(SPLITS)
        raise argparse.ArgumentTypeError(f"unknown prompt sources {unknown or text!r}; known: {known}")
    if not any(len(split_indices(s, "train")) for s in sources):
        raise argparse.ArgumentTypeError(f"{text!r} has no train prompts")
    return sources


def config_from_args(argv: Sequence[str] | None = None) -> BootstrapConfig:
    return config_from_options(vars(build_arg_parser().parse_args(argv)))


def config_from_options(args: dict[str, Any]) -> BootstrapConfig:
    """BootstrapConfig from parsed options (unset ones are None); keys that are no field are ignored."""
    args = dict(args)
    quick = args.pop("quick", False)
    names = {f.name for f in dataclasses.fields(BootstrapConfig)}
    overrides = {k: v for k, v in args.items() if v is not None and k in names}
    return BootstrapConfig.quick(**overrides) if quick else BootstrapConfig(**overrides)


def main(argv: Sequence[str] | None = None) -> int:
    bootstrap_drafter(config_from_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
