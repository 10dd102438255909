"""`specd bench engine --continuous`: a cell's prompts as one queue on specd's engine, timed at full load.

A server under load admits the next request as soon as one finishes. Static groups of `batch` prompts
do not: a group's early finishers leave the rest running at a smaller batch until the slowest one ends,
which only speculation pays for (its requests finish at different steps; target-only's, with EOS
ignored and the same length, all at once). Here each batch (the system's, and with --lockstep its
target-only twin) takes the prompts from one queue, at most `batch` running, and is timed over its
steady span: from the first step until a batch's queue has run dry and it runs below `batch`, the point
where a loaded server would have taken the next request (that last round of steps left out). The drain
after it runs untimed, so every request still finishes (its tokens are compared with target-only's).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Span:
    """Tokens emitted by and seconds spent in each watched batch (a specd.workers.engine.spec_engine.Batch of at
    most `size` running) until the first of them is no longer full; `timed` keeps the figures of that
    moment."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.batches: dict[str, object] = {}
        self.tokens: dict[str, int] = {}
        self.ended: dict[str, tuple[float, int]] | None = None
        self.last: dict[str, tuple[float, int]] | None = None     # at the latest check that found all full

    def counter(self, name: str, then: Callable | None = None) -> Callable:
        """The on_step callback of batch `name`: counts its emitted tokens, then calls `then`."""
        self.tokens[name] = 0

        def count(seq, new_tokens: list[int]) -> None:
            self.tokens[name] += len(new_tokens)
            if then is not None:
                then(seq, new_tokens)
        return count

    def watch(self, name: str, batch):
        """Time `batch` (made with counter(name)) as `name`; returns it."""
        self.batches[name] = batch
        return batch

    def full(self, batch) -> bool:
        return bool(batch.waiting) or len(batch.running) >= self.size

    def check(self) -> bool:
        """After a step of every batch: False once the span has ended. It ends at the first such check
        that finds a batch not full, with the figures of the check before: the round that emptied a batch
        (or admitted a queue's last, smaller group, a prefill of seconds whose tokens would all fall
        after the span) is left out for every batch alike."""
        if self.ended is not None:
            return False
        now = {k: (b.seconds, self.tokens[k]) for k, b in self.batches.items()}
        if all(self.full(b) for b in self.batches.values()):
            self.last = now
        else:
            self.ended = self.last if self.last is not None else now
        return self.ended is None

    def timed(self, name: str) -> tuple[float, int]:
        """(seconds, tokens) of `name` in the span."""
        if self.ended is not None:
            return self.ended[name]
        return self.batches[name].seconds, self.tokens[name]


def drive(batches, admitted: dict[str, float] | None = None, once: bool = False,
          span: Span | None = None) -> None:
    """Advance each unfinished batch in turn, to the end (once: one step each). admitted: request id ->
    when the step that prefilled it began (Sequence.latency counts a queued request's wait from the
    batch's creation). span: checked after every round of steps."""
    while True:
        for batch in batches:
            if batch.finished:
                continue
            t0, waiting = time.perf_counter(), len(batch.waiting)
            batch.advance()
            if admitted is not None and len(batch.waiting) < waiting:
                for rid in (*batch.running, *batch.done):
                    admitted.setdefault(rid, t0)
        if span is not None:
            span.check()
        if once or all(b.finished for b in batches):
            return


def latency_from_admission(seq, admitted: dict[str, float]) -> float | None:
    """Seconds from a request's admission to its last token (its Sequence.latency where not recorded)."""
    start = admitted.get(seq.request_id)
    return seq.latency if start is None or seq.finish_time is None else seq.finish_time - start
