"""In-process speculative engine: continuous batching over one TargetWorker and one DraftWorker.

It drives the speculative step (workers/engine/step.py) synchronously, unpipelined (draft, verify,
draft again), without Ray or gRPC: the engine benchmark and the demo run it. The router's scheduler
drives the same step through Ray actors and overlaps drafter and target across two groups.
Without a drafter, or for requests with `spec.enabled = False`, every step verifies an empty draft:
plain autoregressive decoding on the same engine, the baseline every speed-up is measured against.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from specd.workers.core.guard import SpeculationGuard
from specd.workers.engine.handles import DrafterHandle, TargetHandle, run_sync
from specd.workers.engine.sequence import Sequence
from specd.workers.engine.step import SpecStep
from specd.workers.engine.types import NewRequest


class SpecEngine:
    def __init__(self, target, drafter=None, max_running: int | None = None, guard_window_steps: int = 0):
        """guard_window_steps > 0: a SpeculationGuard with windows of that many steps (see step.py)."""
        self.target = target
        self.drafter = drafter
        info = target.info()
        self.eos_token_ids = tuple(info["eos_token_ids"])
        self.max_running = max_running or info["max_slots"]
        if drafter is not None:
            self.max_running = min(self.max_running, drafter.max_slots())
        handle = DrafterHandle(drafter, "drafter", "direct") if drafter is not None else None
        guard = SpeculationGuard(guard_window_steps) if guard_window_steps > 0 else None
        self.step = run_sync(SpecStep.create(TargetHandle(target, "target", "direct"), handle, guard=guard))
        run_sync(self.step.profile())

    @property
    def hidden(self) -> bool:
        return self.step.hidden

    def generate(
        self,
        requests: list[NewRequest],
        on_step: Callable[[Sequence, list[int]], None] | None = None,
        ignore_eos: bool = False,
    ) -> list[Sequence]:
        """Run every request to completion; `on_step(seq, new_tokens)` sees each emitted chunk."""
        batch = self.batch(requests, on_step=on_step, ignore_eos=ignore_eos)
        while not batch.finished:
            batch.advance()
        return batch.sequences()

    def batch(self, requests: list[NewRequest], max_running: int | None = None,
              on_step: Callable[[Sequence, list[int]], None] | None = None,
              ignore_eos: bool = False) -> Batch:
        """The requests as a Batch on this engine's step, to advance a step at a time."""
        eos = () if ignore_eos else self.eos_token_ids
        return Batch(self.step, requests, eos, max_running or self.max_running, on_step)


class Batch:
    """Requests run to completion, at most `max_running` at a time, one step per `advance()`: admission
    (the target's prefill), a speculative step of everything running, release of what finished. generate()
    loops over one; the engine benchmark's step-paired baseline advances two in turn on one engine."""

    def __init__(self, step: SpecStep, requests: list[NewRequest], eos: tuple[int, ...], max_running: int,
                 on_step: Callable[[Sequence, list[int]], None] | None = None):
        self.step, self.max_running, self.on_step = step, max_running, on_step
        self.order = [r.request_id for r in requests]
        self.waiting = deque(Sequence(r, eos) for r in requests)
        self.running: dict[str, Sequence] = {}
        self.done: dict[str, Sequence] = {}
        self.seconds = 0.0      # spent in advance(): this batch's own wall time when several interleave

    @property
    def finished(self) -> bool:
        return not self.waiting and not self.running

    def advance(self) -> None:
        t0 = time.perf_counter()
        admitted = []
        while self.waiting and len(self.running) + len(admitted) < self.max_running:
            admitted.append(self.waiting.popleft())
        if admitted:
            new_tokens = run_sync(self.step.start(admitted))
            for seq, toks in zip(admitted, new_tokens, strict=True):
                self.running[seq.request_id] = seq
                if self.on_step:
                    self.on_step(seq, toks)
        for out in run_sync(self.step.step(list(self.running.values()))):
            if self.on_step:
                self.on_step(out.seq, out.new_tokens)
        finished = [rid for rid, s in self.running.items() if s.finished]
        run_sync(self.step.release(finished))
        for rid in finished:
            self.done[rid] = self.running.pop(rid)
        self.seconds += time.perf_counter() - t0

    def sequences(self) -> list[Sequence]:
        """The finished requests, in the order they were given."""
        return [self.done[rid] for rid in self.order]
