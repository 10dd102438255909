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


@pytest.fixture
def busy_server():
    """Slow steps (50 ms), two slots, a queue of four; the prober checks every 0.1 s and gives up
    after 1 s, less than one request takes (32 steps)."""
    lt = LoopThread()
    target = FakeTarget(max_slots=2, delay=0.05)

    async def up():
        sched = Scheduler([(target, FakeDrafter(target, delay=0.0))], capacity=2, max_queue=4,
                          max_running=2, pipeline_groups=1, eos_token_ids=[EOS])
        await sched.start()
        srv = GrpcServer(SpecdServicer(), port=0)
        await srv.start()
        await srv.attach(Backend(sched, ToyCodec(), BOUNDS, "fake", (EOS,), 1, 1, 4))
        prober = HealthProber(sched, [33], SpecParams(gamma=2), srv.set_serving, PERIOD_S, timeout_s=1.0)
        return sched, srv, prober, asyncio.ensure_future(prober.run())

    sched, srv, prober, task = lt.run(up())
    client = SpecdClient(srv.address, timeout=60)
    yield client, sched, prober
    client.close()
    lt.loop.call_soon_threadsafe(task.cancel)
    lt.run(srv.stop(0))
    lt.run(sched.stop())
    lt.close()


def test_probe_never_queues_behind_clients_and_readiness_follows_the_queue(busy_server) -> None:
    from concurrent.futures import ThreadPoolExecutor

    client, sched, prober = busy_server
    health_becomes(client, "SERVING")
    assert client.health("liveness") == "SERVING" and client.health("readiness") == "SERVING"
    slow = dict(text="A", max_new_tokens=32, ignore_eos=True, gamma=0)
    failures, probes = prober.failures, prober.probes
    with ThreadPoolExecutor(8) as pool:
        calls = [pool.submit(client.generate, **slow) for _ in range(6)]    # 2 running, 4 waiting
        end = time.monotonic() + 10
        while sched.waiting() < 4:
            assert time.monotonic() < end, "the queue did not fill"
            time.sleep(0.01)
        assert client.health("readiness") == "NOT_SERVING"        # cannot take more ...
        assert client.health("liveness") == "SERVING"             # ... but works
        # while the queue drains (three rounds of ~1.6 s), a probe queued behind it would wait longer
        # than its 1 s timeout: serving must stay SERVING throughout
        while not all(c.done() for c in calls):
            assert client.health() == "SERVING", prober.last_error
            assert client.health("liveness") == "SERVING"
            time.sleep(0.05)
        assert all(len(c.result().token_ids) == 32 for c in calls)
    assert prober.probes > probes and prober.failures == failures, prober.last_error
    assert client.health("readiness") == "SERVING"


def test_liveness_serves_while_loading_and_readiness_does_not() -> None:
    lt = LoopThread()

    async def up():
        srv = GrpcServer(SpecdServicer(), port=0)      # no backend attached: still loading
        await srv.start()
        return srv

    try:
        srv = lt.run(up())
        with SpecdClient(srv.address, timeout=10) as c:
            assert c.health("liveness") == "SERVING"
            assert c.health("readiness") == "NOT_SERVING" and c.health() == "NOT_SERVING"
        lt.run(srv.stop(0))
    finally:
        lt.close()


def test_a_probe_leaves_no_replay_record() -> None:
    """Probes of an idle server are not traffic: the trainer must never learn from them."""
    from test_replay_serving import ListWriter

    from specd.cluster.replay import ReplayRecorder

    async def main():
        target = FakeTarget(max_slots=2)
        recorder = ReplayRecorder(ListWriter())
        sched = Scheduler([(target, FakeDrafter(target))], capacity=2, max_queue=4, max_running=2,
                          pipeline_groups=1, eos_token_ids=[EOS], observer=recorder)
        await sched.start()

        async def set_serving(_on: bool) -> None:
            return None

        try:
            prober = HealthProber(sched, [1, 2, 3], SpecParams(), set_serving, period_s=1.0, timeout_s=10.0)
            assert await prober.probe() is True
        finally:
            await sched.stop()
        return recorder

    recorder = asyncio.run(main())
    assert recorder.writer.records == [] and recorder.running() == 0
