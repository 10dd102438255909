"""In-process speculative engine: continuous batching over one TargetWorker and one DraftWorker.

This is the unpipelined reference schedule (draft, then verify, then draft again) that the engine
benchmark and the demo run without Ray or gRPC. The router's scheduler runs the same steps through
Ray actors and overlaps the drafter and the target across two groups of requests.
With `spec.enabled = False` (or no drafter) every step verifies an empty draft: that is plain
autoregressive decoding on the same engine, the baseline every speed-up is measured against.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from workers.engine.sequence import Sequence
from workers.engine.types import Draft, NewRequest


class SpecEngine:
    def __init__(self, target, drafter=None, max_running: int | None = None):
        self.target = target
        self.drafter = drafter
        info = target.info()
        self.eos_token_ids = tuple(info["eos_token_ids"])
        self.max_running = max_running or info["max_slots"]
        # A feature drafter reads the target's hidden states: the target returns them with each result.
        self.hidden = drafter is not None and drafter.uses_target_hidden()
        if drafter is not None:
            self.max_running = min(self.max_running, drafter.max_slots())
            # The goodput policy's cost model starts from a timed sweep on this device.
            request = drafter.cost_profile_request()
            if request is not None:
                drafter.set_cost_profile(target.profile_verify(**request))
        self._last_verify = None  # (tokens per row, seconds, emitted) of the previous verify

    def generate(
        self,
        requests: list[NewRequest],
        on_step: Callable[[Sequence, list[int]], None] | None = None,
        ignore_eos: bool = False,
    ) -> list[Sequence]:
        """Run every request to completion; `on_step(seq, emitted)` sees each emitted chunk."""
        eos = () if ignore_eos else self.eos_token_ids
        waiting = deque(Sequence(r, eos) for r in requests)
        done: dict[str, Sequence] = {}
        running: dict[str, Sequence] = {}
        while waiting or running:
            admitted = []
            while waiting and len(running) + len(admitted) < self.max_running:
                admitted.append(waiting.popleft())
            if admitted:
                self._start(admitted, running, on_step)
            self._step(running, on_step)
            for rid in [rid for rid, s in running.items() if s.finished]:
                done[rid] = running.pop(rid)
                self.target.release([rid])
                if self.drafter is not None:
                    self.drafter.release([rid])
        return [done[r.request_id] for r in requests]

    def _start(self, admitted: list[Sequence], running: dict[str, Sequence], on_step) -> None:
        reqs = [s.request for s in admitted]
        if self.hidden:
            first, hidden = self.target.start(reqs, return_hidden=True)
            self.drafter.start(reqs, first, hidden)
        else:
            first = self.target.start(reqs)
            if self.drafter is not None:
                self.drafter.start(reqs, first)
        for seq, toks in zip(admitted, first, strict=True):
            running[seq.request_id] = seq
            emitted = seq.start(toks)
            if on_step:
                on_step(seq, emitted)

    def _step(self, running: dict[str, Sequence], on_step) -> None:
        active = [s for s in running.values() if not s.finished]
        if not active:
            return
        items = [s.next_draft_item() for s in active]
        if self.drafter is not None:
            drafts = self.drafter.propose(items, last_verify=self._last_verify)
            version = self.drafter.version()
        else:
            drafts = [Draft(s.request_id, []) for s in active]
            version = None
        t0 = time.perf_counter()
        if self.hidden:
            results = self.target.verify(drafts, return_hidden=True)
        else:
            results = self.target.verify(drafts)
        rows = [1 + len(d.tokens) for d in drafts]
        self._last_verify = (rows, time.perf_counter() - t0, sum(len(r.new_tokens) for r in results))
        for seq, res in zip(active, results, strict=True):
            emitted = seq.apply(res, drafter_version=version if res.num_drafted else None)
            if on_step:
                on_step(seq, emitted)
