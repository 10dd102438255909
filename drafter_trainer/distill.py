"""Distilling a drafter q from the target p: loss, batches, one training step, loop and evaluation.

Shared by the bootstrap (teacher = target generations on the train prompts) and online distillation
(teacher = the target's logprobs recorded by verification steps). Both reduce to TeacherSequence:
a token sequence plus, for some of its positions, the target's top-k next-token log-probabilities.

The student is a small Llama (HF LlamaModel body) with a reduced-vocabulary head: lm_head has one row
per id in draft_vocab_ids, so its logits live in "draft index" space [V_sub], and the target token
of draft index j is draft_vocab_ids[j].
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModel


@dataclass
class TeacherSequence:
    """A token sequence with target labels on positions first_label .. first_label + n_labels - 1.

    The label at position i is the target's distribution of token i+1 given tokens[: i+1], kept as
    its top-k (log-probability, token id) pairs sorted by descending probability.
    """

    token_ids: torch.Tensor  # [L] int64: prompt then continuation
    first_label: int  # = prompt length - 1 for a generated continuation
    topk_logprobs: torch.Tensor  # [n_labels, k] float32, descending
    topk_ids: torch.Tensor  # [n_labels, k] int64 target token ids

    @property
    def n_labels(self) -> int:
        return self.topk_ids.shape[0]


@dataclass
class DistillBatch:
    """Right-padded sequences; labels flattened in row-major order of label_mask."""

    input_ids: torch.Tensor  # [b, t] int64
    label_mask: torch.Tensor  # [b, t] bool: True where a teacher label exists
    topk_logprobs: torch.Tensor  # [n, k] n = label_mask.sum()
    topk_ids: torch.Tensor  # [n, k]


@dataclass
class StepStats:
    loss: float
    matched: int  # drafter argmax == target argmax
    labelled: int


@dataclass
class EvalStats:
    loss: float
    greedy_match: float  # fraction of labelled positions where drafter argmax == target argmax
    head_coverage: float  # fraction where the target argmax is in draft_vocab_ids at all (upper bound)
    labelled: int

    def as_dict(self) -> dict[str, float]:
        return {
            "loss": round(self.loss, 4),
            "greedy_match": round(self.greedy_match, 4),
            "head_coverage": round(self.head_coverage, 4),
            "labelled": self.labelled,
        }


def collate(sequences: Sequence[TeacherSequence], pad_id: int = 0) -> DistillBatch:
    """Right padding needs no attention mask: with causal attention no labelled position ever sees a pad."""
    t = max(int(s.token_ids.numel()) for s in sequences)
    input_ids = torch.full((len(sequences), t), pad_id, dtype=torch.long)
    label_mask = torch.zeros((len(sequences), t), dtype=torch.bool)
    for row, s in enumerate(sequences):
        if s.first_label + s.n_labels > s.token_ids.numel():
            raise ValueError("labels run past the end of the sequence")
        input_ids[row, : s.token_ids.numel()] = s.token_ids
        label_mask[row, s.first_label : s.first_label + s.n_labels] = True
    return DistillBatch(
        input_ids=input_ids,
        label_mask=label_mask,
        topk_logprobs=torch.cat([s.topk_logprobs for s in sequences]).float(),
        topk_ids=torch.cat([s.topk_ids for s in sequences]).long(),
    )


def draft_index(draft_vocab_ids: torch.Tensor, size: int) -> torch.Tensor:
    """[size] map target token id -> row of the reduced head, -1 where the drafter cannot propose it."""
    lookup = torch.full((size,), -1, dtype=torch.long, device=draft_vocab_ids.device)
    lookup[draft_vocab_ids] = torch.arange(draft_vocab_ids.numel(), device=draft_vocab_ids.device)
    return lookup


def topk_forward_kl(
    student_logits: torch.Tensor,  # [n, V_sub] (or [n, V] when draft_vocab_ids is None)
    teacher_topk_logprobs: torch.Tensor,  # [n, k]
    teacher_topk_ids: torch.Tensor,  # [n, k] target token ids
    draft_vocab_ids: torch.Tensor | None = None,  # [V_sub] target id of each student logit column
) -> torch.Tensor:
    """Mean over rows of KL(p_k || q): forward KL from the teacher's top-k to the drafter.

    p_k is the teacher's top-k renormalised over the entries the drafter can represent (top-k ids
    inside draft_vocab_ids); q is the drafter's softmax over its whole head. It is a true KL, so it is
    >= 0 and 0 exactly when q puts p_k's mass on p_k's tokens and nothing elsewhere. Forward KL
    (mass-covering) is the direction that raises q where p is large, which is what acceptance
    min(1, p/q) rewards. Rows with no representable top-k id carry no signal and are skipped.
    """
    log_q = F.log_softmax(student_logits.float(), dim=-1)  # [n, V_sub]
    if draft_vocab_ids is None:
        cols = teacher_topk_ids
    else:
        size = max(int(draft_vocab_ids.max()), int(teacher_topk_ids.max())) + 1
        cols = draft_index(draft_vocab_ids, size)[teacher_topk_ids]  # [n, k], -1 outside the head
    valid = cols >= 0  # [n, k]
    teacher = teacher_topk_logprobs.float().masked_fill(~valid, float("-inf"))
    log_p = teacher - torch.logsumexp(teacher, dim=-1, keepdim=True)
    # where(): rows with nothing valid give -inf - -inf = nan above; the teacher carries no gradient.
    log_p = torch.where(valid, log_p, torch.zeros_like(log_p))
    p = torch.where(valid, log_p.exp(), torch.zeros_like(log_p))
    log_q_k = log_q.gather(-1, cols.clamp(min=0))  # [n, k]
    kl = (p * (log_p - log_q_k)).sum(-1)  # [n]
    row_ok = valid.any(-1)
    if not bool(row_ok.any()):
        return student_logits.sum() * 0.0  # keeps the graph so backward() still works
    return kl[row_ok].mean()


def greedy_matches(
    student_logits: torch.Tensor,  # [n, V_sub]
    teacher_topk_ids: torch.Tensor,  # [n, k], column 0 is the target argmax
    draft_vocab_ids: torch.Tensor | None = None,  # [V_sub]
) -> torch.Tensor:
    """[n] bool: the drafter's greedy token equals the target's greedy token."""
    top = student_logits.argmax(-1)
    drafted = top if draft_vocab_ids is None else draft_vocab_ids[top]
    return drafted == teacher_topk_ids[:, 0]


class DrafterLM(nn.Module):
    """The trainable drafter: a few Llama layers over the target's embeddings, plus a reduced head.

    state_dict() names are exactly the drafter directory's tensor names (drafter_format.py).
    """

    def __init__(self, config: Mapping[str, Any], draft_vocab_ids: torch.Tensor):
        super().__init__()
        self.config = dict(config)
        # the target's family's own body (LlamaModel, Qwen3Model, ...), as drafter_format.make_drafter_config
        # keeps the target's model_type
        fields = {k: v for k, v in self.config.items() if k not in ("architectures", "model_type")}
        hf_config = AutoConfig.for_model(self.config.get("model_type", "llama"), **fields)
        self.model = AutoModel.from_config(hf_config)
        self.lm_head = nn.Linear(hf_config.hidden_size, draft_vocab_ids.numel(), bias=False)
        self.register_buffer("draft_vocab_ids", draft_vocab_ids.clone().long())

    @classmethod
    def from_state_dict(cls, config: Mapping[str, Any], state_dict: Mapping[str, torch.Tensor]) -> DrafterLM:
        model = cls(config, state_dict["draft_vocab_ids"])
        model.load_state_dict(dict(state_dict), strict=True)
        return model

    def freeze_embeddings(self) -> None:
        # The embedding is the target's and is shared with it at serving time: training it would let
        # the drafter drift from the token representation it was cut from.
        self.model.embed_tokens.weight.requires_grad_(False)

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:  # [b, t] -> [b, t, H]
        return self.model(input_ids=input_ids, use_cache=False).last_hidden_state

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [b, t] -> [b, t, V_sub]
        return self.lm_head(self.hidden_states(input_ids))


def make_optimizer(model: nn.Module, lr: float, weight_decay: float = 0.01) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup: int, total: int, floor: float = 0.1):
    """Linear warm-up, then cosine decay to floor * lr."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def distill_step(
    model: DrafterLM, optimizer: torch.optim.Optimizer, batch: DistillBatch, max_grad_norm: float = 1.0
) -> StepStats:
    """One optimizer step on one batch; the head runs on labelled positions only (saves most of it)."""
    model.train()
    hidden = model.hidden_states(batch.input_ids)[batch.label_mask]  # [n, H]
    logits = model.lm_head(hidden)  # [n, V_sub]
    loss = topk_forward_kl(logits, batch.topk_logprobs, batch.topk_ids, model.draft_vocab_ids)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_grad_norm)
    optimizer.step()
    with torch.no_grad():
        matched = int(greedy_matches(logits, batch.topk_ids, model.draft_vocab_ids).sum())
    return StepStats(loss=float(loss.detach()), matched=matched, labelled=int(batch.topk_ids.shape[0]))


def iterate_batches(
    sequences: Sequence[TeacherSequence], batch_size: int, seed: int, pad_id: int = 0
) -> Iterator[DistillBatch]:
    """Endless shuffled batches; each epoch is a fresh permutation from a seeded generator."""
    rng = random.Random(seed)
    order = list(range(len(sequences)))
    while True:
        rng.shuffle(order)
        for start in range(0, len(order), batch_size):
            yield collate([sequences[i] for i in order[start : start + batch_size]], pad_id)


@torch.no_grad()
def evaluate(
    model: DrafterLM, sequences: Sequence[TeacherSequence], batch_size: int = 8, pad_id: int = 0
) -> EvalStats:
    """Teacher-forced loss and greedy match of the drafter against the target on `sequences`."""
    model.eval()
    loss_sum, matched, covered, labelled = 0.0, 0, 0, 0
    for start in range(0, len(sequences), batch_size):
        batch = collate(sequences[start : start + batch_size], pad_id)
        logits = model.lm_head(model.hidden_states(batch.input_ids)[batch.label_mask])  # [n, V_sub]
        n = batch.topk_ids.shape[0]
        loss_sum += (
            float(topk_forward_kl(logits, batch.topk_logprobs, batch.topk_ids, model.draft_vocab_ids)) * n
        )
        matched += int(greedy_matches(logits, batch.topk_ids, model.draft_vocab_ids).sum())
        covered += int(torch.isin(batch.topk_ids[:, 0], model.draft_vocab_ids).sum())
        labelled += n
    denom = max(1, labelled)
    return EvalStats(loss_sum / denom, matched / denom, covered / denom, labelled)


def train_drafter(
    model: DrafterLM,
    sequences: Sequence[TeacherSequence],
    steps: int,
    batch_size: int = 4,
    lr: float = 3e-4,
    weight_decay: float = 0.01,
    warmup_steps: int = 10,
    seed: int = 0,
    pad_id: int = 0,
    progress: bool = True,
) -> list[StepStats]:
    """`steps` distillation steps over shuffled batches of `sequences`; returns per-step stats."""
    torch.manual_seed(seed)
    optimizer = make_optimizer(model, lr, weight_decay)
    scheduler = warmup_cosine(optimizer, warmup_steps, steps)
    batches = iterate_batches(sequences, batch_size, seed, pad_id)
    history: list[StepStats] = []
    bar = tqdm(range(steps), desc="distill", disable=not progress, dynamic_ncols=True)
    for _ in bar:
        stats = distill_step(model, optimizer, next(batches))
        scheduler.step()
        history.append(stats)
        recent = history[-20:]
        bar.set_postfix(
            loss=f"{sum(s.loss for s in recent) / len(recent):.3f}",
            match=f"{sum(s.matched for s in recent) / max(1, sum(s.labelled for s in recent)):.3f}",
        )
    return history
