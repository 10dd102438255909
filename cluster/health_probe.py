"""A health check that proves serving works, not only that the process is up.

Every `period_s` seconds the prober runs one short generation (a two-token greedy request, so one
draft + verify step runs after prefill) through the scheduler, like a client's. If it fails or takes
longer than `timeout_s`, grpc.health.v1 turns NOT_SERVING (load balancers and kubelet readiness take the
replica out); the next successful probe turns it SERVING again. A full admission queue is a busy server,
not a broken one: that probe is skipped and health left as it is.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable

from specd.cluster.scheduler import QueueFull, Scheduler
from specd.workers.core.sampling import SamplingParams
from specd.workers.engine.types import FinishReason, NewRequest, SpecParams

log = logging.getLogger(__name__)


class HealthProber:
    def __init__(self, scheduler: Scheduler, prompt: list[int], spec: SpecParams,
                 set_serving: Callable[[bool], Awaitable[None]], period_s: float, timeout_s: float):
        self.scheduler = scheduler
        self.prompt = prompt
        self.spec = spec
        self.set_serving = set_serving
        self.period_s = period_s
        self.timeout_s = timeout_s
        self.serving = True
        self.probes = 0
        self.failures = 0
        self.last_error = ""

    async def probe(self) -> bool | None:
        """One generation: True = it worked, False = it failed, None = skipped (queue full)."""
        new = NewRequest(f"health-{uuid.uuid4().hex}", self.prompt, SamplingParams(), 2, self.spec)
        try:
            _, fin = await asyncio.wait_for(self.scheduler.generate(new, ignore_eos=True), self.timeout_s)
        except QueueFull:
            return None
        except TimeoutError:
            self.scheduler.abort(new.request_id)
            self.last_error = f"no answer within {self.timeout_s} s"
            return False
        if fin.reason == FinishReason.ERROR:
            self.last_error = str(fin.error)
            return False
        return True

    async def check_once(self) -> None:
        ok = await self.probe()
        if ok is None:
            return
        self.probes += 1
        if not ok:
            self.failures += 1
        if ok != self.serving:
            log.warning("health probe %s: %s", "passed" if ok else "failed",
                        "SERVING again" if ok else f"NOT_SERVING ({self.last_error})")
            self.serving = ok
            await self.set_serving(ok)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            try:
                await self.check_once()
            except Exception:  # the prober must outlive any one failure it reports
                log.warning("health probe raised", exc_info=True)
