"""What the scheduler hands its callers: a request's events (tokens, then its end), the statistics the
client sees, and the observer hooks metrics and the replay recorder implement."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from specd.workers.core.stats import RequestStats
from specd.workers.engine.sequence import Sequence
from specd.workers.engine.types import Draft, FinishReason, NewRequest, VerifyResult


class QueueFull(RuntimeError):
    """Admission control: every slot is taken and the waiting queue is at its bound."""


@dataclass
class ServedStats:
    """What the client learns about its request: sizes, speculation counts and timings."""

    prompt_tokens: int
    arrival: float
    completion_tokens: int = 0
    spec: RequestStats = field(default_factory=RequestStats)
    started_at: float | None = None       # prefill began
    first_token_at: float | None = None
    finished_at: float | None = None
    replica: int = -1

    @property
    def queue_time(self) -> float:
        return (self.started_at or self.finished_at or self.arrival) - self.arrival

    @property
    def time_to_first_token(self) -> float:
        return self.first_token_at - self.arrival if self.first_token_at is not None else 0.0

    @property
    def total_time(self) -> float:
        return (self.finished_at or self.arrival) - self.arrival


@dataclass
class TokensEvent:
    tokens: list[int]


@dataclass
class FinishEvent:
    reason: FinishReason
    stats: ServedStats
    error: str = ""
    unavailable: bool = False        # ERROR because its replica's target died (gRPC UNAVAILABLE)


class SchedulerObserver:
    """Hooks for metrics; every method is a no-op here."""

    def on_queue(self, waiting: int, running: int) -> None: ...
    def on_first_token(self, seconds: float) -> None: ...
    def on_step(self, replica: int, draft: Draft, result: VerifyResult, depth: int) -> None: ...
    def on_finish(self, reason: FinishReason, stats: ServedStats) -> None: ...
    def on_request_done(self, seq: Sequence, reason: FinishReason) -> None: ...


@dataclass
class ServedRequest:
    seq: Sequence                          # output, stopping rules, γ cap, commit fields, step stats
    stats: ServedStats
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    done: bool = False                     # finished or cancelled; released at the next step boundary

    @property
    def id(self) -> str:
        return self.seq.request_id

    @property
    def new(self) -> NewRequest:
        return self.seq.request


class RequestHandle:
    """Async iterator over a request's TokensEvents, ending with (and including) its FinishEvent."""

    def __init__(self, request: ServedRequest):
        self.request_id = request.id
        self._events = request.events
        self._finished = False

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> TokensEvent | FinishEvent:
        if self._finished:
            raise StopAsyncIteration
        event = await self._events.get()
        self._finished = isinstance(event, FinishEvent)
        return event
