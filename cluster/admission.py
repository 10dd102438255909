"""Admission control shared by the router's schedulers (cluster/scheduler.py for the torch backend,
cluster/vllm_scheduler.py for vLLM): a request takes a free slot or waits in a bounded queue, else it is
refused with QueueFull (RESOURCE_EXHAUSTED at the API).

A subclass sets `replicas` (each with size() and capacity), `max_queue`, `max_running`,
`eos_token_ids`, `_requests` (id -> ServedRequest), `_waiting` (a deque), `_tasks` (its loops) and
`_closing`, and define submit()."""

from __future__ import annotations

from specd.cluster.requests import FinishEvent, QueueFull, ServedRequest, ServedStats, TokensEvent
from specd.workers.engine.sequence import Sequence
from specd.workers.engine.types import NewRequest


class Admission:
    def running(self) -> int:
        return sum(rep.size() for rep in self.replicas)

    def waiting(self) -> int:
        return len(self._waiting)

    def loops_alive(self) -> bool:
        """False once a loop has ended other than by stop(): the router can no longer serve."""
        return self._closing or not any(t.done() for t in self._tasks)

    def can_admit(self) -> bool:
        """submit() would take a request now (a free slot or room in the queue)."""
        return not self._closing and (self._has_free_slot() or len(self._waiting) < self.max_queue)

    def _has_free_slot(self) -> bool:
        return self.running() < self.max_running and any(r.size() < r.capacity for r in self.replicas)

    def _admit(self, new: NewRequest, ignore_eos: bool) -> ServedRequest:
        """Queue a request; raises QueueFull when every slot is taken and the queue is at max_queue."""
        if self._closing:
            raise QueueFull("the server is shutting down")
        if new.request_id in self._requests:
            raise ValueError(f"request id {new.request_id!r} is already in use")
        if not self._has_free_slot() and len(self._waiting) >= self.max_queue:
            raise QueueFull(f"server is at capacity: {self.running()} running, {len(self._waiting)} waiting "
                            f"(server.max_queue={self.max_queue})")
        seq = Sequence(new, () if ignore_eos else self.eos_token_ids)
        req = ServedRequest(seq, ServedStats(len(new.prompt_token_ids), arrival=seq.arrival, spec=seq.stats))
        self._requests[req.id] = req
        self._waiting.append(req)
        return req

    async def generate(self, new: NewRequest, *, ignore_eos: bool = False) -> tuple[list[int], FinishEvent]:
        """Run one request to the end (warm-up, tests)."""
        tokens: list[int] = []
        async for event in self.submit(new, ignore_eos=ignore_eos):
            if isinstance(event, TokensEvent):
                tokens += event.tokens
            else:
                return tokens, event
        raise RuntimeError("request stream ended without a FinishEvent")
