"""Second bootstrap stage: teach the token drafter to read the target's hidden states.

Each drafter input token x_p gets, added to its embedding, proj(h) + staleness[s], where h is the
target's final hidden state that predicted x_p (h_{p-1}), or, for a drafted token the target has not
scored yet, the newest state there is, s steps older (h_{p-1-s}). At serving time the target hands over
those states with every verify result anyway (workers/drafters/model.py), and the drafter's k-th
draft of a step reads a state k steps stale; training mixes fresh and stale states the same way.

proj and the staleness table start at zero, so the stage starts from the token drafter exactly and can
only learn to use the extra input. Same teacher data as the first stage (cached), same top-k forward KL.
The states come from specd's own engine (ModelRunner.prefill(return_hidden=True)), i.e. the very
numbers serving feeds the drafter.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from specd.drafter_trainer.distill import (
    DrafterLM,
    TeacherSequence,
    greedy_matches,
    topk_forward_kl,
    warmup_cosine,
)
from specd.drafter_trainer.drafter_format import load_drafter, save_drafter
from specd.drafter_trainer.teacher import TeacherData, collect_teacher_data


class HiddenDrafterLM(nn.Module):
    """A DrafterLM plus the feature input; state_dict() names are the drafter directory's tensor names
    (model.feature_proj.weight, model.feature_staleness: see workers/models/llama.py)."""

    def __init__(self, base: DrafterLM, staleness: int):
        super().__init__()
        self.base = base
        hidden = base.model.config.hidden_size
        base.model.feature_proj = nn.Linear(hidden, hidden, bias=False)
        nn.init.zeros_(base.model.feature_proj.weight)
        base.model.feature_staleness = nn.Parameter(torch.zeros(staleness, hidden))
        self.config = {**base.config, "specd_feature_staleness": staleness}
        self.draft_vocab_ids = base.draft_vocab_ids

    @property
    def staleness(self) -> int:
        return self.base.model.feature_staleness.shape[0]

    def hidden_states(
        self,
        input_ids: torch.Tensor,  # [b, t]
        features: torch.Tensor,  # [b, t, H] the target state each token reads
        staleness: torch.Tensor,  # [b, t] int
    ) -> torch.Tensor:  # [b, t, H]
        m = self.base.model
        x = m.embed_tokens(input_ids) + m.feature_proj(features) + m.feature_staleness[staleness]
        return m(inputs_embeds=x, use_cache=False).last_hidden_state

    def forward(self, input_ids, features, staleness) -> torch.Tensor:  # -> [b, t, V_sub]
        return self.base.lm_head(self.hidden_states(input_ids, features, staleness))

    def state_dict(self, *args, **kwargs):
        return self.base.state_dict(*args, **kwargs)


@torch.inference_mode()
def target_states(runner, sequences: Sequence[TeacherSequence], batch: int = 8, progress: bool = True):
    """[L, H] float32 per sequence: row p is the target's final hidden state after token p."""
    out: list[torch.Tensor] = []
    bar = tqdm(total=len(sequences), desc="target states", unit="seq", disable=not progress)
    for start in range(0, len(sequences), batch):
        chunk = sequences[start : start + batch]
        slots = [runner.allocate() for _ in chunk]
        try:
            _, hidden = runner.prefill(slots, [s.token_ids.tolist() for s in chunk], return_hidden=True)
        finally:
            for slot in slots:
                runner.free(slot)
        out += [h.float().cpu() for h in hidden]
        bar.update(len(chunk))
    bar.close()
    return out


def input_features(states: torch.Tensor, staleness: torch.Tensor) -> torch.Tensor:
    """Token p reads states[p - 1 - staleness[p]] (zeros before the first token): [len(staleness), H]."""
    src = torch.arange(staleness.shape[0]) - 1 - staleness
    feats = states[src.clamp(min=0)].clone()
    feats[src < 0] = 0.0
    return feats


@dataclass
class FeatureBatch:
    input_ids: torch.Tensor  # [b, t]
    features: torch.Tensor  # [b, t, H]
    staleness: torch.Tensor  # [b, t]
    label_mask: torch.Tensor  # [b, t]
    topk_logprobs: torch.Tensor  # [n, k]
    topk_ids: torch.Tensor  # [n, k]


def collate_features(
    sequences: Sequence[TeacherSequence],
    states: Sequence[torch.Tensor],
    staleness_size: int,
    fresh_fraction: float,
    gen: torch.Generator | None,
) -> FeatureBatch:
    """gen None: every state fresh (evaluation); else a position is stale (1..S-1) w.p. 1 - fresh_fraction."""
    t = max(int(s.token_ids.numel()) for s in sequences)
    hidden = states[0].shape[-1]
    ids = torch.zeros(len(sequences), t, dtype=torch.long)
    feats = torch.zeros(len(sequences), t, hidden)
    stale = torch.zeros(len(sequences), t, dtype=torch.long)
    mask = torch.zeros(len(sequences), t, dtype=torch.bool)
    for b, (seq, st) in enumerate(zip(sequences, states, strict=True)):
        n = int(seq.token_ids.numel())
        ids[b, :n] = seq.token_ids
        if gen is not None and staleness_size > 1:
            drawn = torch.randint(1, staleness_size, (n,), generator=gen)
            stale[b, :n] = torch.where(torch.rand(n, generator=gen) < fresh_fraction, 0, drawn)
        feats[b, :n] = input_features(st, stale[b, :n])
        mask[b, seq.first_label : seq.first_label + seq.n_labels] = True
    return FeatureBatch(
        ids,
        feats,
        stale,
        mask,
        torch.cat([s.topk_logprobs for s in sequences]),
        torch.cat([s.topk_ids for s in sequences]),
    )


def train_hidden_drafter(
    model: HiddenDrafterLM,
    sequences: Sequence[TeacherSequence],
    states: Sequence[torch.Tensor],
    steps: int,
    batch_size: int = 4,
    lr: float = 3e-4,
    fresh_fraction: float = 0.5,
    seed: int = 0,
    progress: bool = True,
) -> list[float]:
    """`steps` optimizer steps on shuffled batches; returns the loss of each step."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    scheduler = warmup_cosine(optimizer, 10, steps)
    rng, order, losses = random.Random(seed), [], []
    bar = tqdm(range(steps), desc="distill (hidden)", disable=not progress, dynamic_ncols=True)
    model.train()
    for _ in bar:
        if len(order) < batch_size:
            order += rng.sample(range(len(sequences)), len(sequences))
        pick = [order.pop() for _ in range(batch_size)]
        batch = collate_features(
            [sequences[i] for i in pick], [states[i] for i in pick], model.staleness, fresh_fraction, gen
        )
        hidden = model.hidden_states(batch.input_ids, batch.features, batch.staleness)[batch.label_mask]
        logits = model.base.lm_head(hidden)  # [n, V_sub]
        loss = topk_forward_kl(logits, batch.topk_logprobs, batch.topk_ids, model.draft_vocab_ids)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
    model.eval()
    return losses


@torch.no_grad()
def fresh_greedy_match(model: HiddenDrafterLM, sequences, states) -> float:
    """Teacher-forced share of positions where the drafter's greedy token is the target's (fresh states)."""
    model.eval()
    matched = labelled = 0
    for seq, st in zip(sequences, states, strict=True):
        batch = collate_features([seq], [st], model.staleness, 0.0, None)
        logits = model(batch.input_ids, batch.features, batch.staleness)[batch.label_mask]
        matched += int(greedy_matches(logits, batch.topk_ids, model.draft_vocab_ids).sum())
        labelled += batch.topk_ids.shape[0]
    return matched / max(1, labelled)


@torch.no_grad()
def simulate_chain(model, sequences, states, gamma: int = 4, stride: int = 3) -> dict[str, float]:
    """Greedy chain drafting replayed on the target's own greedy text, as serving does it.

    From every `stride`-th generated position: draft up to γ tokens (the k-th reading the newest
    state, k stale) and count how many the target's greedy text accepts (before training, with proj
    and staleness at zero, that is the token drafter's figure). Returns mean accepted per step,
    α = accepted / drafted and MAL = accepted + 1 per step. Without a KV cache (it recomputes the
    prefix): an estimate for the bootstrap report; the engine benchmark measures the real thing.
    """
    accepted_total = steps = 0
    for seq, st in zip(sequences, states, strict=True):
        x = seq.token_ids
        for t in range(seq.first_label + 1, x.numel() - gamma, stride):
            ids, stale, accepted = x[: t + 1].clone(), torch.zeros(t + 1, dtype=torch.long), 0
            for k in range(gamma):
                feats = input_features(st, stale)
                logits = model(ids[None], feats[None], stale[None])[0, -1]
                token = int(model.draft_vocab_ids[logits.argmax()])
                if token != int(x[t + 1 + k]):
                    break
                accepted += 1
                ids = torch.cat([ids, torch.tensor([token])])
                stale = torch.cat([stale, torch.tensor([k + 1])])
            accepted_total += accepted
            steps += 1
    mean = accepted_total / max(1, steps)
    return {
        "steps": steps,
        "mean_accepted": round(mean, 4),
        "acceptance_rate": round(mean / gamma, 4),
        "mean_accepted_length": round(mean + 1, 4),
    }


# ------------------------------------------------------------------------------------------- driver


def bootstrap_hidden_drafter(cfg: Any, base_dir: Path, td: TeacherData | None = None) -> Path:
    """Second stage: the token drafter at base_dir (a BootstrapConfig's first stage), fine-tuned to read
    target hidden states on the same data; written to cfg.resolved_hidden_out_dir()."""
    from specd.workers.models.runner import ModelRunner

    torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    n_prompts = cfg.hidden_num_prompts or cfg.num_prompts
    if td is None or len(td.train_ids) != n_prompts:
        td = collect_teacher_data(dataclasses.replace(cfg, num_prompts=n_prompts))
    train_seqs, eval_seqs = td.train, td.eval
    longest = max(int(s.token_ids.numel()) for s in train_seqs + eval_seqs)
    runner = ModelRunner(td.target_dir, max_slots=8, num_threads=cfg.threads, max_seq_len=longest)
    states = target_states(runner, train_seqs + eval_seqs, progress=cfg.progress)
    del runner
    train_states, eval_states = states[: len(train_seqs)], states[len(train_seqs) :]
    t_states = time.perf_counter() - t0

    base_state, base_config, base_meta = load_drafter(base_dir)
    if any(name.startswith("model.feature_") for name in base_state):
        raise ValueError(f"{base_dir} already reads target hidden states: give the token drafter")
    base = DrafterLM.from_state_dict(base_config, base_state)
    base.freeze_embeddings()
    model = HiddenDrafterLM(base, cfg.hidden_staleness)
    before = {"greedy_match": round(fresh_greedy_match(model, eval_seqs, eval_states), 4),
              "chain_gamma4": simulate_chain(model, eval_seqs, eval_states)}
    steps = max(1, round(cfg.hidden_epochs * len(train_seqs) / cfg.batch_size))
    t1 = time.perf_counter()
    losses = train_hidden_drafter(
        model, train_seqs, train_states, steps, cfg.batch_size, cfg.hidden_lr, cfg.hidden_fresh_fraction,
        cfg.seed, cfg.progress,
    )
    t_train = time.perf_counter() - t1
    after = {"greedy_match": round(fresh_greedy_match(model, eval_seqs, eval_states), 4),
             "chain_gamma4": simulate_chain(model, eval_seqs, eval_states)}
    tail = losses[-max(1, len(losses) // 10) :]
    meta = {
        "parent_version": base_meta.get("version"),
        "target": td.target_dir.name,
        "train": {
            **base_meta.get("train", {}),
            "recipe": "token drafter + proj(target hidden state) + staleness embedding, top-k forward KL",
            "hidden_stage": {
                "train_prompts": len(td.train_ids),
                "steps": steps,
                "lr": cfg.hidden_lr,
                "staleness": cfg.hidden_staleness,
                "fresh_fraction": cfg.hidden_fresh_fraction,
                "final_train_loss": round(sum(tail) / len(tail), 4),
                "eval_before": before,
                "eval_after": after,
                "timings_s": {"target_states": round(t_states, 1), "distill": round(t_train, 1)},
            },
            "greedy_match_after": after["greedy_match"],
        },
    }
    out_dir = save_drafter(
        cfg.resolved_hidden_out_dir(), model.state_dict(), model.config, meta,
        tokenizer_dir=td.target_dir, version_prefix="boot-hidden",
    )
    if cfg.progress:
        b, a = before["chain_gamma4"], after["chain_gamma4"]
        print(
            f"[bootstrap] hidden stage: greedy match {before['greedy_match']:.1%} -> "
            f"{after['greedy_match']:.1%}; "
            f"replayed greedy chain (γ=4) α {b['acceptance_rate']:.3f} -> {a['acceptance_rate']:.3f}, "
            f"MAL {b['mean_accepted_length']:.2f} -> {a['mean_accepted_length']:.2f}\n"
            f"[bootstrap] drafter {json.loads((out_dir / 'specd_drafter.json').read_text())['version']} "
            f"written to {out_dir} ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    if after["greedy_match"] < before["greedy_match"]:
        print(
            f"[bootstrap] WARNING: the hidden-state drafter matches the target less often than the token "
            f"drafter it started from ({after['greedy_match']:.1%} < {before['greedy_match']:.1%}): train "
            "longer (--hidden-epochs) or serve the token drafter (drafter.target_hidden=false)",
            flush=True,
        )
    return out_dir
