"""One prompt cannot stall every stream (real gRPC router, fake workers): a 4 MiB text is refused by
its length before any tokenizer sees it, and a slow tokenization runs off the event loop while another
request streams on."""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from fake_workers import EOS, FakeDrafter, FakeTarget
from test_router import BOUNDS, LoopThread, ToyCodec

from specd.cluster.client import SpecdClient
from specd.cluster.router import Backend, GrpcServer, SpecdServicer
from specd.cluster.scheduler import Scheduler

SLOW_S = 3.0


class SlowCodec(ToyCodec):
    """A tokenizer that takes SLOW_S on a prompt containing 'SLOW' (as a real one does on megabytes);
    it records the longest text it was given and the threads it ran on."""

    def __init__(self):
        self.longest = 0
        self.threads: set[int] = set()
        self.slow_started = threading.Event()

    def encode(self, text: str) -> list[int]:
        self.longest = max(self.longest, len(text))
        self.threads.add(threading.get_ident())
        if "SLOW" in text:
            self.slow_started.set()
            time.sleep(SLOW_S)
        return super().encode(text)


@pytest.fixture(scope="module")
def server():
    lt = LoopThread()
    target = FakeTarget(max_slots=4, delay=0.002)
    codec = SlowCodec()

    async def up():
        sched = Scheduler([(target, FakeDrafter(target, delay=0.002))], capacity=4, max_queue=4,
                          max_running=4, pipeline_groups=1, eos_token_ids=[EOS])
        await sched.start()
        srv = GrpcServer(SpecdServicer(), port=0, max_message_bytes=16 << 20)
        await srv.start()
        await srv.attach(Backend(sched, codec, dataclasses.replace(BOUNDS, max_prompt_chars=1024), "fake",
                                 (EOS,), 1, 1, 4))
        return sched, srv

    sched, srv = lt.run(up())
    yield srv.address, codec, lt
    lt.run(srv.stop(0))
    lt.run(sched.stop())
    lt.close()


def test_a_4_mib_prompt_is_refused_before_tokenizing(server) -> None:
    address, codec, _ = server
    with SpecdClient(address, timeout=30) as c:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            c.generate(text="x" * (4 << 20), max_new_tokens=4)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "4194304 characters; at most 1024 (server.max_prompt_chars)" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            c.generate(messages=[{"role": "user", "content": "y" * (2 << 20)}], max_new_tokens=4)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "chat prompt" in err.value.details()
        assert time.monotonic() - t0 < 5
        assert codec.longest <= 1024          # the tokenizer never saw either text
        assert c.generate(text="A", max_new_tokens=3, ignore_eos=True).text == "BCD"


def test_a_slow_tokenization_does_not_stall_other_streams(server) -> None:
    address, codec, lt = server
    with SpecdClient(address, timeout=30) as c, ThreadPoolExecutor(1) as pool:
        slow = pool.submit(c.generate, text="SLOW prompt", max_new_tokens=2)
        assert codec.slow_started.wait(10)
        t0 = time.monotonic()
        chunks = list(c.stream(text="A", max_new_tokens=8, ignore_eos=True))
        took = time.monotonic() - t0
        assert "".join(ch.text for ch in chunks) == "BCDEFGHI"
        assert not slow.done() and took < SLOW_S / 2, f"a stream waited {took:.2f} s behind a tokenizer"
        assert slow.result(30).token_ids
    assert lt.thread.ident not in codec.threads          # never tokenized on the event loop
