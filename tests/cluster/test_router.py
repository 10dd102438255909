"""The gRPC router on a free port with fake workers: statuses for every bad input, health, reflection,
unary and streaming generation, stop strings, cancellation and deadlines freeing slots, admission."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from fake_workers import EOS, FakeDrafter, FakeTarget, target_only
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from specd.cluster.client import SpecdClient, build_request
from specd.cluster.router import Backend, GrpcServer, SpecdServicer
from specd.cluster.scheduler import Scheduler
from specd.cluster.validation import Bounds
from specd.proto.specd.v1 import serving_pb2_grpc


class ToyCodec:
    """Token i < 95 is the character chr(32 + i); ids 95..99 are special and decode to nothing."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 32 if 32 <= ord(c) < 127 else 31 for c in text]

    def render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>")

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(32 + i) for i in token_ids if i < 95)


BOUNDS = Bounds(vocab_size=100, max_seq_len=64, max_new_tokens_default=8, max_new_tokens_cap=32,
                temperature_max=2.0, gamma_default=3, gamma_min=0, gamma_max=6, tree_width_max=2)


class LoopThread:
    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def server():
    lt = LoopThread()
    target = FakeTarget(max_slots=2, delay=0.003)
    drafter = FakeDrafter(target, delay=0.003)

    async def up():
        sched = Scheduler([(target, drafter)], capacity=2, max_queue=1, max_running=2, pipeline_groups=2,
                          eos_token_ids=[EOS])
        await sched.start()
        srv = GrpcServer(SpecdServicer(), port=0)
        await srv.start()
        return sched, srv

    sched, srv = lt.run(up())
    client = SpecdClient(srv.address, timeout=30)
    status_before = client.health()
    lt.run(srv.attach(Backend(sched, ToyCodec(), BOUNDS, "fake", (EOS,), 1, 2, 1)))
    yield {"client": client, "target": target, "drafter": drafter, "sched": sched, "loop": lt,
           "status_before": status_before, "address": srv.address}
    client.close()
    lt.run(srv.stop(0))
    lt.run(sched.stop())
    lt.close()


def wait_for(condition, what: str) -> None:
    for _ in range(3000):
        if condition():
            return
        threading.Event().wait(0.005)
    raise AssertionError(f"never happened: {what}")


BAD_INPUTS = [
    (dict(text=""), "empty prompt"),
    (dict(messages=[]), "empty prompt"),
    (dict(token_ids=[]), "empty prompt"),
    (dict(text="x" * 64), "prompt has 64 tokens"),
    (dict(text="hi", max_new_tokens=0), "max_new_tokens must be >= 1"),
    (dict(text="hi", max_new_tokens=-5), "max_new_tokens must be >= 1"),
    (dict(text="hi", max_new_tokens=33), "max_new_tokens must be <= 32"),
    (dict(text="hi", temperature=-0.1), "temperature must be >= 0"),
    (dict(text="hi", temperature=float("nan")), "temperature must be >= 0"),
    (dict(text="hi", temperature=2.5), "temperature must be <= 2.0"),
    (dict(text="hi", top_p=0.0), "top_p must be in (0, 1]"),
    (dict(text="hi", top_p=1.5), "top_p must be in (0, 1]"),
    (dict(text="hi", top_k=-1), "top_k must be >= 0"),
    (dict(text="hi", gamma=7), "gamma must be in [0, 6]"),
    (dict(text="hi", gamma=-1), "gamma must be in [0, 6]"),
    (dict(text="hi", tree_width=3), "tree_width must be in [1, 2]"),
    (dict(text="hi", gamma_policy="bogus"), "gamma_policy 'bogus'"),
    (dict(token_ids=[5, 100]), "token_ids[1]=100 is not a token id"),
    (dict(token_ids=[-3]), "token_ids[0]=-3 is not a token id"),
    (dict(messages=[{"role": "robot", "content": "hi"}]), "chat.messages[0].role='robot'"),
    (dict(text="hi", stop=[""]), "stop[0] is empty"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_input_is_invalid_argument(server, kwargs, message) -> None:
    with pytest.raises(grpc.RpcError) as err:
        server["client"].generate(**kwargs)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        list(server["client"].stream(**kwargs))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_request_without_input_is_invalid(server) -> None:
    stub = serving_pb2_grpc.SpecdStub(server["client"].channel)
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(build_request(text="x").__class__())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no input" in err.value.details()


def test_unary_greedy_output_equals_target_only(server) -> None:
    c = server["client"]
    out = c.generate(text="A", max_new_tokens=12, gamma=4)
    plain = c.generate(text="A", max_new_tokens=12, speculation=False)
    expected = target_only([ord("A") - 32], 12)
    assert out.token_ids == expected == plain.token_ids
    assert out.text == "BCDEFGHIJKLM" == plain.text
    assert out.finish_reason == "length"
    u = out.usage
    assert u["prompt_tokens"] == 1 and u["completion_tokens"] == 12
    assert u["drafted"] > u["accepted"] > 0 and u["drafter_versions"] == ["v1"]
    assert u["accepted"] + u["recovered"] + u["bonus"] == 11     # the first token comes from prefill
    assert plain.usage["drafted"] == 0 and plain.usage["bonus"] == plain.usage["steps"] == 11


def test_stream_matches_unary_and_ends_with_usage(server) -> None:
    c = server["client"]
    chunks = list(c.stream(messages=[{"role": "user", "content": "hi"}], max_new_tokens=20))
    unary = c.generate(messages=[{"role": "user", "content": "hi"}], max_new_tokens=20)
    assert len(chunks) > 2 and chunks[-1].finish_reason == "length"
    assert [t for ch in chunks for t in ch.token_ids] == unary.token_ids
    assert "".join(ch.text for ch in chunks) == unary.text
    assert chunks[-1].usage["completion_tokens"] == 20
    assert all(ch.finish_reason is None for ch in chunks[:-1])


def test_stop_string_and_eos(server) -> None:
    c = server["client"]
    out = c.generate(text="A", max_new_tokens=30, stop=["GHI"])
    assert out.text == "BCDEF" and out.finish_reason == "stop"
    streamed = list(c.stream(text="A", max_new_tokens=30, stop=["GHI"]))
    assert "".join(ch.text for ch in streamed) == "BCDEF" and streamed[-1].finish_reason == "stop"
    eos = c.generate(token_ids=[90], max_new_tokens=30)
    assert eos.token_ids == [91, 92, 93, 94, 95, 96, 97, 98, 99] and eos.finish_reason == "eos"
    assert eos.text == "{|}~"    # 91..94; 95..99 are special tokens and decode to nothing


def test_cancelled_stream_and_deadline_free_slots(server) -> None:
    c, target, drafter = server["client"], server["target"], server["drafter"]
    stream = c.stream(text="A", max_new_tokens=32, gamma=0)
    first = next(stream)
    assert first.token_ids
    stream.close()                      # the generator's finally cancels the call
    wait_for(lambda: not target.running and not drafter.running, "slots freed after cancel")
    with pytest.raises(grpc.RpcError) as err:
        c.generate(text="A", max_new_tokens=32, gamma=0, timeout=0.05)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: not target.running and not drafter.running, "slots freed after deadline")
    assert c.generate(text="A", max_new_tokens=3).token_ids == target_only([33], 3)


def test_full_queue_is_resource_exhausted(server) -> None:
    c, target, sched = server["client"], server["target"], server["sched"]
    target.gate.clear()
    try:
        futures = [c.stub.Generate.future(build_request(text=ch, max_new_tokens=4)) for ch in "ABC"]
        wait_for(lambda: sched.running() == 2 and sched.waiting() == 1, "two running, one queued")
        with pytest.raises(grpc.RpcError) as err:
            c.generate(text="D", max_new_tokens=4)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_queue=1" in err.value.details()
    finally:
        target.gate.set()
    texts = sorted(f.result(timeout=30).text for f in futures)
    assert texts == ["BCDE", "CDEF", "DEFG"]


def test_worker_failure_is_internal_and_server_survives(server) -> None:
    c, target = server["client"], server["target"]
    original = target.verify

    def failing_verify(drafts, return_hidden=False):
        raise ValueError("fake worker bug")

    target.verify = failing_verify
    try:
        with pytest.raises(grpc.RpcError) as err:
            c.generate(text="A", max_new_tokens=5)
        assert err.value.code() == grpc.StatusCode.INTERNAL and "fake worker bug" in err.value.details()
    finally:
        target.verify = original
    assert c.generate(text="A", max_new_tokens=3).text == "BCD"


def test_health_reflection_and_server_info(server) -> None:
    assert server["status_before"] == "NOT_SERVING"
    c = server["client"]
    assert c.health() == "SERVING" and c.health("specd.v1.Specd") == "SERVING"
    db = ProtoReflectionDescriptorDatabase(c.channel)
    services = set(db.get_services())
    assert {"specd.v1.Specd", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
    pool = descriptor_pool.DescriptorPool(db)
    methods = {m.name for m in pool.FindServiceByName("specd.v1.Specd").methods}
    assert methods == {"Generate", "GenerateStream", "ServerInfo"}
    assert pool.FindMessageTypeByName("specd.v1.Usage").fields_by_name["tokens_per_step"]
    info = c.server_info()
    assert info["model"] == "fake" and info["gamma_max"] == 6 and info["max_new_tokens_cap"] == 32
    assert info["workers"][0]["steps"] > 0 and info["workers"][0]["drafter_version"] == "v1"
    assert "fixed" in info["gamma_policies"]


def test_not_serving_before_the_backend_is_attached() -> None:
    lt = LoopThread()

    async def up():
        srv = GrpcServer(SpecdServicer(), port=0)
        await srv.start()
        return srv

    srv = lt.run(up())
    try:
        channel = grpc.insecure_channel(srv.address)
        health = health_pb2_grpc.HealthStub(channel)
        resp = health.Check(health_pb2.HealthCheckRequest(service="specd.v1.Specd"), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as err:
            serving_pb2_grpc.SpecdStub(channel).Generate(build_request(text="x"), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        channel.close()
    finally:
        lt.run(srv.stop(0))
        lt.close()


def test_async_client_generates_streams_and_reads_server_info(server) -> None:
    from specd.cluster.client import AsyncSpecdClient

    async def run():
        client = AsyncSpecdClient(server["address"], timeout=30)
        try:
            outs = await asyncio.gather(*[client.generate(text=ch, max_new_tokens=4) for ch in "AB"])
            chunks = [c async for c in client.stream(text="C", max_new_tokens=5)]
            info = await client.server_info()
            return outs, chunks, info
        finally:
            await client.close()

    outs, chunks, info = asyncio.run(run())
    assert [o.token_ids for o in outs] == [target_only([33], 4), target_only([34], 4)]
    assert [t for c in chunks for t in c.token_ids] == target_only([35], 5)
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage["completion_tokens"] == 5
    assert info["model"] == "fake"
