"""The client over several routers (fake workers, real gRPC): calls are spread round robin, a call that
fails UNAVAILABLE before any response is tried again on another router, and a stream that has sent a
token is never retried (its failure reaches the caller, with no token twice)."""

from __future__ import annotations

import grpc
import pytest
from fake_workers import EOS, FakeDrafter, FakeTarget, target_only
from test_router import BOUNDS, LoopThread, ToyCodec

from specd.cluster.client import Security, SpecdClient, service_config
from specd.cluster.router import Backend, GrpcServer, SpecdServicer
from specd.cluster.scheduler import Scheduler


class Router:
    """One router (its own scheduler and fake workers) on a port it bound itself."""

    def __init__(self, lt: LoopThread, attach: bool, delay: float = 0.0):
        self.lt = lt
        self.target = FakeTarget(max_slots=4, delay=delay)

        async def up():
            sched = Scheduler([(self.target, FakeDrafter(self.target))], capacity=4, max_queue=8,
                              max_running=4, pipeline_groups=1, eos_token_ids=[EOS])
            await sched.start()
            srv = GrpcServer(SpecdServicer(), port=0)
            await srv.start()
            if attach:          # else it stays loading: every call is UNAVAILABLE
                await srv.attach(Backend(sched, ToyCodec(), BOUNDS, "fake", (EOS,), 1, 1, 8))
            return sched, srv

        self.sched, self.srv = lt.run(up())
        self.stopped = False

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.lt.run(self.srv.stop(0))
            self.lt.run(self.sched.stop())


@pytest.fixture
def loop():
    lt = LoopThread()
    yield lt
    lt.close()


def both(a: Router, b: Router) -> str:
    return f"ipv4:127.0.0.1:{a.srv.port},127.0.0.1:{b.srv.port}"


def test_calls_on_a_loading_router_are_retried_on_the_serving_one(loop) -> None:
    loading, serving = Router(loop, attach=False), Router(loop, attach=True)
    try:
        with SpecdClient(both(loading, serving), timeout=30) as c:
            outs = [c.generate(text="A", max_new_tokens=6, ignore_eos=True) for _ in range(12)]
            streams = [[t for ch in c.stream(text="A", max_new_tokens=6, ignore_eos=True)
                        for t in ch.token_ids] for _ in range(6)]
        assert all(o.token_ids == target_only([33], 6) for o in outs)
        assert all(s == target_only([33], 6) for s in streams)
        # the power of the check: without retries, round robin sends some calls to the loading router
        with SpecdClient(both(loading, serving), timeout=30, security=Security(attempts=1)) as c:
            codes = []
            for _ in range(12):
                try:
                    c.generate(text="A", max_new_tokens=6)
                except grpc.RpcError as err:
                    codes.append(err.code())
        assert codes and set(codes) == {grpc.StatusCode.UNAVAILABLE}
    finally:
        loading.stop()
        serving.stop()


def test_a_router_gone_is_skipped_and_a_stream_cut_after_a_token_is_not_retried(loop) -> None:
    first, second = Router(loop, attach=True, delay=0.02), Router(loop, attach=True, delay=0.02)
    try:
        with SpecdClient(both(first, second), timeout=30) as c:
            stream = c.stream(text="A", max_new_tokens=30, ignore_eos=True, gamma=0)
            got = list(next(stream).token_ids)
            serving = first if first.target.running else second
            other = second if serving is first else first
            serving.stop()                    # the router that streams this request goes away
            with pytest.raises(grpc.RpcError):
                for chunk in stream:
                    got += chunk.token_ids
            # what arrived is a prefix of the answer, each token once: the call was not started again
            assert got == target_only([33], 30)[: len(got)] and len(got) < 30
            assert not other.target.released, "the cut stream was retried on the other router"
            # later calls go to the router that is left, through the retry of their first attempt
            outs = [c.generate(text="A", max_new_tokens=5, ignore_eos=True) for _ in range(6)]
        assert all(o.token_ids == target_only([33], 5) for o in outs)
    finally:
        first.stop()
        second.stop()


def test_service_config_bounds_the_attempts() -> None:
    assert '"maxAttempts": 5' in service_config(5) and "retryPolicy" not in service_config(1)
    with pytest.raises(ValueError, match="attempts must be in"):
        service_config(6)
