"""Divergences between the target p and the drafter q for online distillation, and position weights.

The teacher arrives as the target's top-k (log-probability, token id) pairs per position, recomputed by
the trainer's teacher forward or carried by the record. Both sides are compared on the drafter's head
vocabulary (V_sub ids): p is the top-k renormalised over the ids the head can represent, q is the
drafter's softmax over its head. Divergences (per position, then a weighted mean):

    forward_kl   KL(p || q)          mass-covering: raises q where p is large (what min(1, p/q) pays)
    reverse_kl   KL(q || p)          mode-seeking; p is smoothed by SMOOTH so log p stays finite
    jsd          β KL(p || m) + (1-β) KL(q || m),  m = β p + (1-β) q
    tvd          ½ Σ |p - q|         = 1 - Σ min(p, q): one minus the acceptance probability itself
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd", "tvd")
POSITION_MODES = ("all", "rejected")
SMOOTH = 1e-6


def dense_teacher(
    topk_logprobs: torch.Tensor,  # [n, k]
    topk_ids: torch.Tensor,  # [n, k] target token ids
    draft_vocab_ids: torch.Tensor,  # [V_sub] target id of each head row
    vocab_size: int,
    renormalise: bool = True,
) -> torch.Tensor:
    """p over the head's vocabulary, [n, V_sub]: zeros outside the top-k. renormalise=False keeps the
    target's own probabilities (for Σ min(p, q), the acceptance probability of a draft from q)."""
    lookup = torch.full((vocab_size,), -1, dtype=torch.long)
    lookup[draft_vocab_ids] = torch.arange(draft_vocab_ids.numel())
    cols = lookup[topk_ids.long()]  # [n, k], -1 outside the head
    valid = cols >= 0
    probs = topk_logprobs.float().exp() * valid
    if renormalise:
        probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-12)
    out = torch.zeros(topk_ids.shape[0], draft_vocab_ids.numel())
    out.scatter_add_(1, cols.clamp(min=0), probs)
    return out


def divergence(
    student_logits: torch.Tensor,  # [n, V_sub]
    p: torch.Tensor,  # [n, V_sub] teacher over the head vocabulary, rows sum to 1 (or 0: no signal)
    kind: str,
    beta: float = 0.5,
) -> torch.Tensor:  # [n]
    if kind not in DIVERGENCES:
        raise ValueError(f"unknown divergence {kind!r}; choose from {DIVERGENCES}")
    log_q = F.log_softmax(student_logits.float(), dim=-1)
    q = log_q.exp()
    if kind == "forward_kl":
        return (torch.xlogy(p, p) - p * log_q).sum(-1)
    if kind == "reverse_kl":
        ps = (p + SMOOTH) / (1 + SMOOTH * p.shape[-1])
        return (q * (log_q - ps.log())).sum(-1)
    if kind == "tvd":
        return 0.5 * (p - q).abs().sum(-1)
    m = beta * p + (1 - beta) * q
    log_m = m.clamp_min(1e-30).log()
    kl_pm = (torch.xlogy(p, p) - p * log_m).sum(-1)
    kl_qm = (q * (log_q - log_m)).sum(-1)
    return beta * kl_pm + (1 - beta) * kl_qm


def weighted_loss(
    student_logits: torch.Tensor,  # [n, V_sub]
    p: torch.Tensor,  # [n, V_sub]
    weights: torch.Tensor,  # [n] >= 0
    kind: str,
    beta: float = 0.5,
) -> torch.Tensor:
    """Weighted mean divergence over positions with a teacher signal (rows of p with mass)."""
    w = weights.float() * (p.sum(-1) > 0)
    if float(w.sum()) <= 0:
        return student_logits.sum() * 0.0  # keeps the graph so backward() still works
    return (divergence(student_logits, p, kind, beta) * w).sum() / w.sum()


def position_weights(
    n_output: int,
    steps: list[tuple[int, int, int]],  # (output_offset, drafted, accepted) per step
    mode: str,
    accepted_weight: float = 0.2,
) -> torch.Tensor:  # [n_output]
    """Weight of each output position's label (the target distribution of that output token).

    all:       every verified position weighs 1.
    rejected:  OSD's emphasis: the position where a step's draft was rejected weighs 1, positions whose
               draft was accepted (and bonus / undrafted positions, the prefill's token) accepted_weight.
    """
    if mode not in POSITION_MODES:
        raise ValueError(f"unknown position mode {mode!r}; choose from {POSITION_MODES}")
    if mode == "all":
        return torch.ones(n_output)
    w = torch.full((n_output,), float(accepted_weight))
    for offset, drafted, accepted in steps:
        if accepted < drafted and offset + accepted < n_output:
            w[offset + accepted] = 1.0
    return w
