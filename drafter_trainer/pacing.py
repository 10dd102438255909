"""Holding the online trainer to a share of wall time, where it shares a host with serving.

Under SCHED_IDLE (cluster/trainer_actor.py) the trainer takes no CPU time that serving wants, yet on the
2-core CPU the stream still ran 6% slower with it training (docs/benchmarks.md, "Side by side with
207ad13"): what it shares besides CPU time, caches and memory bandwidth, it shares for as long as it
works. `trainer.max_busy_fraction` bounds that time: after each piece of work (labelling a record, one
optimizer step, one gate) that took t seconds, the trainer idles t * (1 - f) / f, so it works at most a
fraction f of the wall time and learns that much slower.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator


class Pacer:
    def __init__(self, fraction: float, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"max_busy_fraction {fraction}: must lie in (0, 1]")
        self.fraction, self.sleep, self.clock = fraction, sleep, clock
        self.busy_s = 0.0           # work timed so far
        self.idled_s = 0.0          # idle time it asked for

    @contextlib.contextmanager
    def work(self) -> Iterator[None]:
        """Time the block; afterwards idle so that it is at most `fraction` of the time since it began."""
        start = self.clock()
        try:
            yield
        finally:
            busy = self.clock() - start
            self.busy_s += busy
            if self.fraction < 1.0 and busy > 0:
                idle = busy * (1.0 - self.fraction) / self.fraction
                self.idled_s += idle
                self.sleep(idle)
