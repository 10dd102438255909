"""Health: liveness (the process works), readiness (it can take more) and serving (generation works).

grpc.health.v1 answers for four service names; none of them ever waits in the clients' queue.

    "liveness"             SERVING while the event loop answers and the scheduler's step loops run,
                           from the first moment (loading included) until the process ends. A kubelet
                           liveness probe restarts the router only when this fails: load never does.
    "readiness"            SERVING when the models are loaded, the last serving verdict passed and the
                           admission queue has room (computed at each Check): a full queue takes the
                           replica out of a load balancer until it drains, without restarting it.
    "" / "specd.v1.Specd"  the serving verdict: loaded, and the HealthProber's last check passed.

The HealthProber proves serving works every `period_s` seconds. On an idle server it runs one short
generation (two greedy tokens, so one draft + verify step runs after prefill), which gets a free slot
at once. On a busy server it never submits anything: the clients' own requests are the probe, and it
passes when a decode step finishes within `timeout_s`. A failure (an error, no answer, no step)
turns the serving verdict NOT_SERVING; the next check that passes turns it SERVING again.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable

from grpc_health.v1 import health, health_pb2

from specd.cluster.scheduler import QueueFull, Scheduler
from specd.workers.core.sampling import SamplingParams
from specd.workers.engine.types import FinishReason, NewRequest, SpecParams

log = logging.getLogger(__name__)
LIVENESS = "liveness"
READINESS = "readiness"
_STATUS = health_pb2.HealthCheckResponse


class SpecdHealth(health.aio.HealthServicer):
    """grpc.health.v1 with LIVENESS and READINESS computed at each Check from `alive()` and `ready()`
    (cheap, non-blocking callables), so a probe sees the state of that moment. Watch streams get the
    values last pushed with refresh(). Liveness stays SERVING during a graceful shutdown: the process
    still works while in-flight requests finish."""

    def __init__(self, alive: Callable[[], bool], ready: Callable[[], bool]):
        super().__init__()
        self._computed = {LIVENESS: alive, READINESS: ready}

    async def Check(self, request, context):
        compute = self._computed.get(request.service)
        if compute is None or (self._gracefully_shutting_down and request.service != LIVENESS):
            return await super().Check(request, context)
        return _STATUS(status=_STATUS.SERVING if compute() else _STATUS.NOT_SERVING)

    async def refresh(self) -> None:
        """Push the computed statuses to Watch streams."""
        for service, compute in self._computed.items():
            await self.set(service, _STATUS.SERVING if compute() else _STATUS.NOT_SERVING)


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

    def _steps(self) -> int:
        return sum(rep.steps for rep in self.scheduler.replicas)

    async def probe(self) -> bool | None:
        """True = serving works, False = it failed, None = no verdict (queue full or went idle)."""
        if self.scheduler.running() or self.scheduler.waiting():
            return await self._progress()
        # a probe is not traffic: it leaves no replay record for the trainer to learn from
        new = NewRequest(f"health-{uuid.uuid4().hex}", self.prompt, SamplingParams(), 2, self.spec,
                         replay=False)
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

    async def _progress(self) -> bool | None:
        """A busy server works if one of its decode steps finishes within timeout_s."""
        loop = asyncio.get_running_loop()
        before, end = self._steps(), loop.time() + self.timeout_s
        while loop.time() < end:
            await asyncio.sleep(min(0.05, self.timeout_s / 4))
            if self._steps() != before:
                return True
            if not (self.scheduler.running() or self.scheduler.waiting()):
                return None          # finished without a step (errors show on the next idle probe)
        self.last_error = (f"no decode step within {self.timeout_s} s with {self.scheduler.running()} "
                           f"request(s) running")
        return False

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
