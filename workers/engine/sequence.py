"""The life of one request between steps: what it has emitted, when it stops, what it asks for next.

Both the in-process engine (workers/engine/spec_engine.py) and the router's pipelined scheduler
(cluster/scheduler.py) drive requests through this one class, so stopping rules, γ caps and
statistics cannot drift apart between the benchmark and the server.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specd.workers.core.stats import RequestStats
from specd.workers.engine.types import DraftItem, FinishReason, NewRequest, VerifyResult


@dataclass
class Sequence:
    request: NewRequest
    eos_token_ids: tuple[int, ...] = ()
    output: list[int] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
    finish_reason: FinishReason | None = None
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    _last_accepted: int = 0
    _last_new: list[int] = field(default_factory=list)
    _last_hidden: object = None                  # [len(_last_new), hidden] tensor or None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.request.max_new_tokens - len(self.output)

    def gamma_cap(self) -> int:
        """Cap on this step's drafts: a step emits accepted + 1 tokens, so never draft past the end."""
        if not self.request.spec.enabled:
            return 0
        return max(0, min(self.request.spec.gamma, self.remaining - 1))

    def next_draft_item(self) -> DraftItem:
        """The drafter's next job; it carries the previous step's outcome so the drafter rolls back first."""
        item = DraftItem(
            self.request_id,
            gamma=self.gamma_cap(),
            commit_accepted=self._last_accepted,
            commit_new_tokens=list(self._last_new),
            commit_hidden=self._last_hidden,
        )
        self._last_accepted, self._last_new, self._last_hidden = 0, [], None
        return item

    def append(self, tokens: list[int]) -> list[int]:
        """Add target-approved tokens; returns the ones actually emitted (cut at EOS, stop ids or length)."""
        new_tokens = []
        now = time.perf_counter()
        for tok in tokens:
            if self.finished:
                break
            new_tokens.append(tok)
            self.output.append(tok)
            if tok in self.eos_token_ids or tok in self.request.stop_token_ids:
                self.finish_reason = FinishReason.EOS
            elif len(self.output) >= self.request.max_new_tokens:
                self.finish_reason = FinishReason.LENGTH
        if new_tokens and self.first_token_time is None:
            self.first_token_time = now
        if self.finished and self.finish_time is None:
            self.finish_time = now
        return new_tokens

    def start(self, first_tokens: list[int]) -> list[int]:
        """The prefill's first token: it is no step, so statistics do not count it."""
        return self.append(first_tokens)

    def apply(self, result: VerifyResult, drafter_version: str | None = None, drafter_skipped: bool = False
              ) -> list[int]:
        """Record one verified step and emit its tokens. drafter_skipped: the step did not ask the drafter
        (SpecStep's pause under load), so the outcome it has not taken yet grows by this step's tokens and
        reaches it, whole, with the next DraftItem."""
        self.stats.record_step(
            result.num_drafted,
            result.num_accepted,
            result.is_bonus,
            drafter_version=drafter_version,
            depth=result.depth,
        )
        if drafter_skipped and self._last_new:
            # nothing was drafted this step: the accepted count of the untaken outcome stays
            self._last_new = self._last_new + list(result.new_tokens)
            if self._last_hidden is not None and result.hidden is not None:
                self._last_hidden = torch.cat([self._last_hidden, result.hidden])
        else:
            self._last_accepted, self._last_new = result.num_accepted, list(result.new_tokens)
            self._last_hidden = result.hidden
        return self.append(result.new_tokens)

    def abort(self, reason: FinishReason = FinishReason.CANCELLED) -> None:
        if not self.finished:
            self.finish_reason = reason
            self.finish_time = time.perf_counter()

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival

    @property
    def latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival
