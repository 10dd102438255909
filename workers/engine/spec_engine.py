"""In-process speculative engine: continuous batching over one TargetWorker and one DraftWorker.

It drives the speculative step (workers/engine/step.py) synchronously, unpipelined (draft, verify,
draft again), without Ray or gRPC: the engine benchmark and the demo run it. The router's scheduler
drives the same step through Ray actors and overlaps drafter and target across two groups.
Without a drafter, or for requests with `spec.enabled = False`, every step verifies an empty draft:
plain autoregressive decoding on the same engine, the baseline every speed-up is measured against.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from workers.core.guard import SpeculationGuard
from workers.engine.handles import DrafterHandle, TargetHandle, run_sync
from workers.engine.sequence import Sequence
from workers.engine.step import SpecStep
from workers.engine.types import NewRequest


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
        if drafter is not None and hasattr(drafter, "colocated"):
            drafter.colocated = True     # same device and thread as the target (see DraftWorker)
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
        eos = () if ignore_eos else self.eos_token_ids
        waiting = deque(Sequence(r, eos) for r in requests)
        done: dict[str, Sequence] = {}
        running: dict[str, Sequence] = {}
        while waiting or running:
            admitted = []
            while waiting and len(running) + len(admitted) < self.max_running:
                admitted.append(waiting.popleft())
            if admitted:
                new_tokens = run_sync(self.step.start(admitted))
                for seq, toks in zip(admitted, new_tokens, strict=True):
                    running[seq.request_id] = seq
                    if on_step:
                        on_step(seq, toks)
            for out in run_sync(self.step.step(list(running.values()))):
                if on_step:
                    on_step(out.seq, out.new_tokens)
            finished = [rid for rid, s in running.items() if s.finished]
            run_sync(self.step.release(finished))
            for rid in finished:
                done[rid] = running.pop(rid)
        return [done[r.request_id] for r in requests]
