"""The health prober against the gRPC router with fake workers: a worker that fails, or one that hangs,
turns grpc.health.v1 NOT_SERVING within a probe period; recovery turns it SERVING again."""

from __future__ import annotations

import asyncio
import time

import pytest
from fake_workers import EOS, FakeDrafter, FakeTarget
from test_router import BOUNDS, LoopThread, ToyCodec

from specd.cluster.client import SpecdClient
from specd.cluster.health_probe import HealthProber
from specd.cluster.router import Backend, GrpcServer, SpecdServicer
from specd.cluster.scheduler import Scheduler
from specd.workers.engine.types import SpecParams

PERIOD_S = 0.1


@pytest.fixture
def server():
    lt = LoopThread()
    target = FakeTarget(max_slots=2, delay=0.002)

    async def up():
        sched = Scheduler([(target, FakeDrafter(target, delay=0.002))], capacity=2, max_queue=4,
                          max_running=2, pipeline_groups=2, eos_token_ids=[EOS])
        await sched.start()
        srv = GrpcServer(SpecdServicer(), port=0)
        await srv.start()
        await srv.attach(Backend(sched, ToyCodec(), BOUNDS, "fake", (EOS,), 1, 2, 4))
        prober = HealthProber(sched, [33], SpecParams(gamma=2), srv.set_serving, PERIOD_S, timeout_s=PERIOD_S)
        return sched, srv, prober, asyncio.ensure_future(prober.run())

    sched, srv, prober, task = lt.run(up())
    client = SpecdClient(srv.address, timeout=10)
    yield client, target, prober
    client.close()
    lt.loop.call_soon_threadsafe(task.cancel)
    target.gate.set()
    lt.run(srv.stop(0))
    lt.run(sched.stop())
    lt.close()


def health_becomes(client: SpecdClient, status: str) -> None:
    end = time.monotonic() + 10
    while client.health() != status:
        assert time.monotonic() < end, f"health never became {status}"
        time.sleep(0.02)


def test_failing_worker_turns_health_not_serving_and_recovery_back(server) -> None:
    client, target, prober = server
    health_becomes(client, "SERVING")
    end = time.monotonic() + 10
    while prober.probes == 0:            # a probe has passed: SERVING is its verdict, not the default
        assert time.monotonic() < end, "no probe ran"
        time.sleep(0.02)
    original = target.verify

    def failing_verify(drafts, **kw):
        raise ValueError("fake worker bug")

    target.verify = failing_verify
    try:
        health_becomes(client, "NOT_SERVING")
        assert "fake worker bug" in prober.last_error and prober.failures >= 1
    finally:
        target.verify = original
    health_becomes(client, "SERVING")
    assert client.generate(text="A", max_new_tokens=3).text == "BCD"


def test_hung_worker_turns_health_not_serving(server) -> None:
    client, target, prober = server
    health_becomes(client, "SERVING")
    target.gate.clear()                  # start() blocks: a generation never gets its first token
    try:
        health_becomes(client, "NOT_SERVING")
        assert "no answer within" in prober.last_error
    finally:
        target.gate.set()
    health_becomes(client, "SERVING")
