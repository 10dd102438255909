"""The gate (is a candidate drafter better than the serving one?) and the live rollback monitor.

Gate scores on held-out records, teacher-forced along the output the target produced:
    greedy_match          share of positions where the drafter's argmax is the target's argmax
    expected_acceptance   mean over positions of Σ_x min(p(x), q(x)), the probability that a token
                          drafted from q is accepted there, at the first γ draft positions of each step
    expected_accepted     per step, Σ_{i<γ} Π_{j<=i} α_j over its first γ positions (chain estimate)
A candidate is published only when its expected acceptance beats the serving version's by a margin.

LiveMonitor watches the acceptance that serving reports per drafter version (from the records' steps)
and says when a version must be rolled back to its parent.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specd.drafter_trainer.losses import dense_teacher
from specd.drafter_trainer.online_data import Example, Student


@dataclass
class GateScore:
    greedy_match: float
    expected_acceptance: float
    expected_accepted: float
    positions: int

    def as_dict(self) -> dict[str, float]:
        return {"greedy_match": round(self.greedy_match, 4),
                "expected_acceptance": round(self.expected_acceptance, 4),
                "expected_accepted": round(self.expected_accepted, 4), "positions": self.positions}


@torch.no_grad()
def score(student: Student, examples: Sequence[Example], gamma: int, batch: int = 4,
          cache: dict[str, tuple[float, ...]] | None = None) -> GateScore:
    """cache: entry id -> that example's partial sums for this student, read and filled. The trainer keeps
    one for the serving version, which each round would otherwise score again on the same held-out
    records (4 of 64 are new per round)."""
    student.train(False)
    parts = dict(cache or {})
    todo = [e for e in examples if e.entry_id not in parts]
    for start in range(0, len(todo), batch):
        chunk = todo[start : start + batch]
        logits = student.logits(chunk)  # [Σ n, V_sub]
        row = 0
        for e in chunk:
            parts[e.entry_id] = _partial_sums(student, e, logits[row : row + e.n_labels], gamma)
            row += e.n_labels
    if cache is not None:
        cache.update({e.entry_id: parts[e.entry_id] for e in todo})
    matched, acc_sum, steps_accepted, positions, steps = (sum(t) for t in zip(
        *(parts[e.entry_id] for e in examples), strict=True)) if examples else (0.0,) * 5
    denom = max(1, positions)
    return GateScore(matched / denom, acc_sum / denom, steps_accepted / max(1, steps), int(positions))


def _partial_sums(student: Student, e: Example, logits: torch.Tensor, gamma: int) -> tuple[float, ...]:
    """(greedy matches, Σ α, Σ expected accepted per step, positions, steps) of one example.
    logits: [n_labels, V_sub], the student's at the example's labels."""
    q = F.softmax(logits.float(), -1)
    p = dense_teacher(e.topk_logprobs, e.topk_ids, student.vocab_ids, student.vocab_size,
                      renormalise=False)  # [n, V_sub], the target's own probabilities
    alpha = torch.minimum(p, q).sum(-1)  # [n]
    greedy = student.vocab_ids[logits.argmax(-1)] == e.topk_ids[:, 0]
    sel = e.in_step & (e.step_position < gamma)
    steps_accepted, steps = 0.0, 0
    for s in (sel & (e.step_position == 0)).nonzero().flatten().tolist():
        run = alpha[s : s + gamma]
        run = run[: int((e.step_position[s : s + gamma] == torch.arange(run.numel())).sum())]
        steps_accepted += float(torch.cumprod(run, 0).sum())
        steps += 1
    return float(greedy[sel].sum()), float(alpha[sel].sum()), steps_accepted, int(sel.sum()), steps


def passes(candidate: GateScore, serving: GateScore, margin: float) -> bool:
    return candidate.positions > 0 and candidate.expected_acceptance >= serving.expected_acceptance + margin


class LiveMonitor:
    """Acceptance per drafter version from live steps; decides rollbacks.

    A version is rolled back to its parent when, over at least `window` of its steps, its acceptance
    rate is below what its parent achieved on the same traffic by more than `margin`; or at once after
    `collapse_steps` steps when its acceptance is below `collapse_alpha` (mean accepted length near 1:
    the drafter collapsed). "The same traffic": steps are kept per client domain tag, and the parent's
    acceptance is taken per domain and weighted by the version's own drafted tokens there; domains the
    parent never drafted are left out. Compared overall, a shift to harder traffic (GSM8K, then HumanEval
    at half its acceptance) rolled back the version that happened to serve when it came, and with it the
    trainer's progress (docs/decisions/rollback-per-domain.md)."""

    def __init__(self, window: int = 200, margin: float = 0.05, collapse_steps: int = 50,
                 collapse_alpha: float = 0.05):
        self.window = window
        self.margin = margin
        self.collapse_steps = collapse_steps
        self.collapse_alpha = collapse_alpha
        self._steps: dict[str, deque[tuple[int, int]]] = {}              # version -> (drafted, accepted)
        self._by_domain: dict[tuple[str, str], deque[tuple[int, int]]] = {}  # (version, domain) -> ...
        self.totals: dict[str, list[int]] = {}   # version -> [steps, drafted, accepted]

    def observe(self, version: str, drafted: int, accepted: int, domain: str = "") -> None:
        if drafted <= 0:
            return
        self._steps.setdefault(version, deque(maxlen=self.window)).append((drafted, accepted))
        self._by_domain.setdefault((version, domain), deque(maxlen=self.window)).append((drafted, accepted))
        t = self.totals.setdefault(version, [0, 0, 0])
        t[0] += 1
        t[1] += drafted
        t[2] += accepted

    def acceptance(self, version: str, domain: str | None = None) -> tuple[float, int]:
        """(accepted / drafted over the window, steps in the window), over all domains or one."""
        steps = self._steps.get(version) if domain is None else self._by_domain.get((version, domain))
        if not steps:
            return 0.0, 0
        drafted = sum(d for d, _ in steps)
        return sum(a for _, a in steps) / max(1, drafted), len(steps)

    def should_roll_back(self, version: str, parent: str | None) -> str | None:
        """A reason to roll `version` back to `parent`, or None."""
        if parent is None:
            return None
        alpha, n = self.acceptance(version)
        if n >= self.collapse_steps and alpha < self.collapse_alpha:
            return f"collapse: acceptance {alpha:.3f} over {n} steps"
        steps = drafted = accepted = 0
        expected = 0.0
        for (v, domain), window in self._by_domain.items():
            parent_alpha, parent_n = self.acceptance(parent, domain)
            if v != version or parent_n < min(self.window, self.collapse_steps):
                continue
            d = sum(x for x, _ in window)
            steps, drafted = steps + len(window), drafted + d
            accepted += sum(a for _, a in window)
            expected += d * parent_alpha
        if steps < self.window:
            return None
        alpha, parent_alpha = accepted / drafted, expected / drafted
        if alpha < parent_alpha - self.margin:
            return (f"acceptance {alpha:.3f} < parent's {parent_alpha:.3f} on the same domains "
                    f"- {self.margin} over {steps} steps")
        return None
