"""The OpenAI-compatible HTTP API with fake workers, through the real `openai` client (sync and async),
curl and raw HTTP: chat and completions, streamed and not, the same output as gRPC from the same serving
core, the error mapping, cancellation freeing slots, a full queue, tokens and TLS."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import subprocess
import threading
import urllib.error
import urllib.request

import openai
import pytest
from fake_workers import EOS, FakeDrafter, FakeTarget, target_only
from test_auth import self_signed
from test_router import BOUNDS, LoopThread, ToyCodec, wait_for

from specd.cluster.auth import ServerSecurity
from specd.cluster.client import SpecdClient
from specd.cluster.http_api import HttpApi, HttpServer
from specd.cluster.metrics import SpecdMetrics
from specd.cluster.router import GrpcServer, SpecdServicer
from specd.cluster.scheduler import Scheduler
from specd.cluster.serving import Backend, ServingCore
from specd.configs.schema import ServerConfig

TOKEN = "http-test-token"


def start_stack(lt: LoopThread, target: FakeTarget, drafter: FakeDrafter,
                server_cfg: ServerConfig | None = None, max_body_bytes: int = 4 << 20, attach: bool = True):
    """A scheduler, the gRPC server and the HTTP server over one serving core, as `specd serve` wires them."""
    server_cfg = server_cfg or ServerConfig()
    security = ServerSecurity.from_config(server_cfg)

    async def up():
        sched = Scheduler([(target, drafter)], capacity=2, max_queue=1, max_running=2, pipeline_groups=2,
                          eos_token_ids=[EOS])
        await sched.start()
        core = ServingCore()
        grpc_srv = GrpcServer(SpecdServicer(core), port=0, security=security)
        await grpc_srv.start()
        api = HttpApi(core, authorize=security.authorize, serving=grpc_srv.serving,
                      max_body_bytes=max_body_bytes)
        http = HttpServer(api, "127.0.0.1", 0, server_cfg, grace_s=1.0)
        await http.start()
        if attach:
            await grpc_srv.attach(Backend(sched, ToyCodec(), BOUNDS, "fake", (EOS,), 1, 2, 1,
                                          metrics=SpecdMetrics()))
        return sched, grpc_srv, http

    return lt.run(up())


def stop_stack(lt: LoopThread, sched, grpc_srv, http) -> None:
    lt.run(http.stop())
    lt.run(grpc_srv.stop(0))
    lt.run(sched.stop())


@pytest.fixture(scope="module")
def server():
    lt = LoopThread()
    target = FakeTarget(max_slots=2, delay=0.003)
    drafter = FakeDrafter(target, delay=0.003)
    sched, grpc_srv, http = start_stack(lt, target, drafter)
    client = openai.OpenAI(base_url=f"{http.url}/v1", api_key="unused", max_retries=0, timeout=30)
    yield {"client": client, "url": http.url, "grpc": grpc_srv.address, "target": target, "drafter": drafter,
           "sched": sched, "loop": lt, "http": http, "metrics": grpc_srv.servicer.backend.metrics}
    client.close()
    stop_stack(lt, sched, grpc_srv, http)
    lt.close()


def chat_prompt(text: str) -> list[int]:
    return ToyCodec().render_chat([{"role": "user", "content": text}])


def decode(ids: list[int]) -> str:
    return ToyCodec().decode(ids)


def post(url: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_chat_completion_greedy_equals_target_only_with_speculation_usage(server) -> None:
    out = server["client"].chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "A"}], max_tokens=6, temperature=0)
    want = decode(target_only(chat_prompt("A"), 6))
    assert out.object == "chat.completion" and out.model == "fake" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == want
    assert out.choices[0].finish_reason == "length"
    u = out.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (len(chat_prompt("A")), 6,
                                                                      len(chat_prompt("A")) + 6)
    spec = u.model_extra["speculation"]
    assert spec["drafted"] > 0 and spec["accepted"] <= spec["drafted"]
    assert spec["mean_accepted_length"] == pytest.approx(1 + spec["accepted"] / spec["drafting_steps"])
    assert spec["drafter_versions"] == ["v1"] and spec["time_to_first_token_s"] > 0


def test_http_and_grpc_give_the_same_greedy_output(server) -> None:
    with SpecdClient(server["grpc"], timeout=30) as grpc_client:
        for text in ("A", "Hello", "xyz"):
            via_grpc = grpc_client.generate(text, max_new_tokens=9)
            via_http = server["client"].chat.completions.create(
                model="fake", messages=[{"role": "user", "content": text}], max_tokens=9, temperature=0)
            assert via_http.choices[0].message.content == via_grpc.text
            assert via_http.usage.completion_tokens == len(via_grpc.token_ids)


def test_chat_stream_with_usage_matches_the_unary_answer(server) -> None:
    chunks = list(server["client"].chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "B"}], max_tokens=7, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == decode(target_only(chat_prompt("B"), 7))
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].usage.model_extra["speculation"]["steps"] > 0
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)


def test_completions_text_and_token_ids_streamed_and_not(server) -> None:
    c = server["client"]
    out = c.completions.create(model="fake", prompt="AB", max_tokens=5, temperature=0)
    want = decode(target_only(ToyCodec().encode("AB"), 5))
    assert out.object == "text_completion" and out.choices[0].text == want
    assert out.choices[0].finish_reason == "length" and out.usage.prompt_tokens == 2
    ids = c.completions.create(model="fake", prompt=[33, 34], max_tokens=5, temperature=0)
    assert ids.choices[0].text == want
    streamed = list(c.completions.create(model="fake", prompt=["AB"], max_tokens=5, temperature=0,
                                         stream=True))
    assert "".join(s.choices[0].text for s in streamed) == want
    assert streamed[-1].choices[0].finish_reason == "length"


def test_stop_strings_and_eos_are_stop(server) -> None:
    c = server["client"]
    out = c.completions.create(model="fake", prompt="A", max_tokens=20, temperature=0, stop=["F"])
    assert out.choices[0].text == "BCDE" and out.choices[0].finish_reason == "stop"
    eos = c.completions.create(model="fake", prompt=[90], max_tokens=20, temperature=0)
    assert eos.choices[0].text == "{|}~" and eos.choices[0].finish_reason == "stop"


def test_async_client_streams_and_answers(server) -> None:
    async def run() -> tuple[str, str]:
        client = openai.AsyncOpenAI(base_url=f"{server['url']}/v1", api_key="unused", max_retries=0)
        try:
            whole = await client.chat.completions.create(
                model="fake", messages=[{"role": "user", "content": "C"}], max_tokens=6, temperature=0)
            stream = await client.chat.completions.create(
                model="fake", messages=[{"role": "user", "content": "C"}], max_tokens=6, temperature=0,
                stream=True)
            parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
            return whole.choices[0].message.content, "".join(parts)
        finally:
            await client.close()

    whole, streamed = asyncio.run(run())
    assert whole == streamed == decode(target_only(chat_prompt("C"), 6))


def test_speculation_object_steers_the_request(server) -> None:
    c = server["client"]
    off = c.chat.completions.create(model="fake", messages=[{"role": "user", "content": "D"}], max_tokens=6,
                                    temperature=0, extra_body={"speculation": {"enabled": False}})
    assert off.usage.model_extra["speculation"]["drafted"] == 0
    two = c.chat.completions.create(model="fake", messages=[{"role": "user", "content": "D"}], max_tokens=6,
                                    temperature=0, extra_body={"speculation": {"gamma_max": 2,
                                                                               "policy": "fixed"}})
    per_position = two.usage.model_extra["speculation"]["drafted_per_position"]
    assert 0 < len(per_position) <= 2
    assert off.choices[0].message.content == two.choices[0].message.content


BAD = [
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be in [1, 32]"),
    ({"max_tokens": 33}, "max_tokens", "max_tokens must be in [1, 32]"),
    ({"max_completion_tokens": 40}, "max_completion_tokens", "max_completion_tokens must be in [1, 32]"),
    ({"temperature": "hot"}, "temperature", "temperature: Input should be a valid number"),
    ({"temperature": 2.5}, "temperature", "temperature must be <= 2.0"),
    ({"top_p": 0}, "top_p", "top_p must be in (0, 1]"),
    ({"seed": -1}, "seed", "seed=-1 is out of range"),
    ({"n": 2}, "n", "n=2 is not supported"),
    ({"logprobs": True}, "logprobs", "logprobs are not available"),
    ({"presence_penalty": 0.5}, "presence_penalty", "presence_penalty is not supported"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tools are not supported"),
    ({"stop": [""]}, "stop", "stop[0] is empty"),
    ({"speculation": {"gamma_max": 7}}, "speculation.gamma_max",
     "speculation.gamma_max must be in [0, 6] (the operator's spec.gamma_min, spec.gamma_max), got 7"),
    ({"speculation": {"tree_width": 3}}, "speculation.tree_width",
     "speculation.tree_width must be in [1, 2]"),
    ({"speculation": {"policy": "bogus"}}, "speculation.policy", "speculation.policy 'bogus' is not one of"),
    ({"speculation": {"gamma": 3}}, "speculation.gamma", "Extra inputs are not permitted"),
    ({"messages": []}, "messages", "messages: List should have at least 1 item"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role",
     "messages.0.role: Input should be"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content.0",
     "only text parts are supported"),
    ({"messages": [{"role": "user", "content": "x" * 64}]}, None, "prompt has"),
]


@pytest.mark.parametrize(("fields", "param", "message"), BAD, ids=[m for _, _, m in BAD])
def test_bad_chat_requests_are_400_with_openai_errors(server, fields, param, message) -> None:
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], **fields}
    status, out = post(f"{server['url']}/v1/chat/completions", body)
    assert status == 400, out
    assert out["error"]["type"] == "invalid_request_error" and message in out["error"]["message"]
    assert out["error"]["param"] == param


def test_the_openai_client_raises_its_own_error_classes(server) -> None:
    c = server["client"]
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}], max_tokens=99)
    assert "max_tokens must be in [1, 32]" in str(err.value)
    with pytest.raises(openai.NotFoundError) as err:
        c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert "the model 'gpt-4o' does not exist; this server serves 'fake'" in str(err.value)
    assert [m.id for m in c.models.list()] == ["fake"]


def test_bad_bodies_paths_and_methods(server) -> None:
    url = server["url"]
    status, out = post(f"{url}/v1/chat/completions", b"{not json")
    assert status == 400 and "not valid JSON" in out["error"]["message"]
    status, out = post(f"{url}/v1/chat/completions", b"[1, 2]")
    assert status == 400 and "must be a JSON object" in out["error"]["message"]
    status, out = post(f"{url}/v1/completions", {"model": "fake", "prompt": ["a", "b"]})
    assert status == 400 and out["error"]["param"] == "prompt"
    assert "one prompt per request" in out["error"]["message"]
    status, out = post(f"{url}/v1/embeddings", {"input": "x"})
    assert status == 404 and out["error"]["type"] == "not_found_error"
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"{url}/v1/chat/completions", timeout=10)
    assert err.value.code == 405 and "POST" in json.loads(err.value.read())["error"]["message"]
    with urllib.request.urlopen(f"{url}/health", timeout=10) as resp:
        assert resp.status == 200
    # the server is still fine afterwards
    assert server["client"].completions.create(model="fake", prompt="A", max_tokens=2, temperature=0
                                               ).choices[0].text == "BC"


def test_oversized_body_is_413_before_it_is_read() -> None:
    lt = LoopThread()
    target = FakeTarget(max_slots=2)
    stack = start_stack(lt, target, FakeDrafter(target), max_body_bytes=2048)
    try:
        status, out = post(f"{stack[2].url}/v1/completions", {"model": "fake", "prompt": "x" * 4096})
        assert status == 413 and "at most 2048" in out["error"]["message"]
        assert out["error"]["code"] == "request_too_large"
        body = {"prompt": "A", "max_tokens": 2, "temperature": 0}
        status, out = post(f"{stack[2].url}/v1/completions", body)
        assert status == 200 and out["choices"][0]["text"] == "BC"
    finally:
        stop_stack(lt, *stack)
        lt.close()


@pytest.mark.slow
def test_sse_through_curl(server) -> None:
    body = json.dumps({"model": "fake", "messages": [{"role": "user", "content": "E"}], "max_tokens": 4,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
    out = subprocess.run(["curl", "-sN", f"{server['url']}/v1/chat/completions", "-H",
                          "Content-Type: application/json", "-d", body],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    events = [line for line in out.split("\n\n") if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-1]]
    text = "".join(p["choices"][0]["delta"].get("content", "") for p in payloads if p["choices"])
    assert text == decode(target_only(chat_prompt("E"), 4))
    assert payloads[-1]["usage"]["completion_tokens"] == 4


def test_a_client_that_goes_away_frees_its_slots(server) -> None:
    target, drafter, sched = server["target"], server["drafter"], server["sched"]
    target.delay = 0.05
    try:
        stream = server["client"].chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "F"}], max_tokens=32, temperature=0,
            stream=True, extra_body={"speculation": {"enabled": False}})
        next(iter(stream))
        wait_for(lambda: target.running, "the request decoding")
        stream.close()
        wait_for(lambda: not target.running and not drafter.running and sched.running() == 0,
                 "slots freed after the stream was closed")
        # a unary request whose connection is dropped mid-way is cancelled too
        host, port = server["url"].removeprefix("http://").rsplit(":", 1)
        body = json.dumps({"messages": [{"role": "user", "content": "G"}], "max_tokens": 32}).encode()
        with socket.create_connection((host, int(port))) as sock:
            head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
            sock.sendall(head.encode() + body)
            wait_for(lambda: target.running, "the unary request decoding")
        wait_for(lambda: not target.running and sched.running() == 0, "slots freed after the disconnect")
    finally:
        target.delay = 0.003


def test_full_queue_is_429(server) -> None:
    target, sched = server["target"], server["sched"]
    target.gate.clear()
    results: list = []
    body = {"model": "fake", "prompt": "A", "max_tokens": 3, "temperature": 0}
    threads = [threading.Thread(target=lambda: results.append(post(f"{server['url']}/v1/completions", body)))
               for _ in range(3)]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: sched.running() == 2 and sched.waiting() == 1, "two running, one queued")
        status, out = post(f"{server['url']}/v1/completions", body)
        assert status == 429 and out["error"]["type"] == "rate_limit_error"
        assert "max_queue=1" in out["error"]["message"]
    finally:
        target.gate.set()
    for t in threads:
        t.join(30)
    assert [r[0] for r in results] == [200, 200, 200]


def test_metrics_count_requests_by_endpoint_and_status(server) -> None:
    counter = server["metrics"].http_requests
    before = counter.labels("/v1/completions", "200")._value.get()
    post(f"{server['url']}/v1/completions", {"prompt": "A", "max_tokens": 1})
    post(f"{server['url']}/v1/completions", {"prompt": "A", "max_tokens": 0})
    assert counter.labels("/v1/completions", "200")._value.get() == before + 1
    assert counter.labels("/v1/completions", "400")._value.get() >= 1
    # the same registry as Prometheus text on the API's own port, with the counts just made
    with urllib.request.urlopen(f"{server['url']}/metrics", timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    line = 'specd_http_requests_total{endpoint="/v1/completions",status="200"}'
    assert f"{line} {counter.labels('/v1/completions', '200')._value.get()}" in text


def test_loading_is_503_and_health_follows_serving() -> None:
    lt = LoopThread()
    target = FakeTarget(max_slots=2)
    sched, grpc_srv, http = start_stack(lt, target, FakeDrafter(target), attach=False)
    try:
        status, out = post(f"{http.url}/v1/completions", {"prompt": "A"})
        assert status == 503 and out["error"]["message"] == "the server is loading its models"
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{http.url}/health", timeout=10)
        assert err.value.code == 503
        lt.run(grpc_srv.attach(Backend(sched, ToyCodec(), BOUNDS, "fake", (EOS,), 1, 2, 1)))
        with urllib.request.urlopen(f"{http.url}/health", timeout=10) as resp:
            assert resp.status == 200
        lt.run(grpc_srv.set_serving(False))          # the health prober's verdict
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{http.url}/health", timeout=10)
        assert err.value.code == 503
    finally:
        stop_stack(lt, sched, grpc_srv, http)
        lt.close()


def test_tokens_and_tls_as_on_the_grpc_port(tmp_path) -> None:
    cert, key = self_signed(tmp_path, "server")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    cfg = ServerConfig(tls_cert_file=cert, tls_key_file=key, auth_token_file=str(token_file))
    lt = LoopThread()
    target = FakeTarget(max_slots=2)
    sched, grpc_srv, http = start_stack(lt, target, FakeDrafter(target), server_cfg=cfg)
    try:
        assert http.url.startswith("https://")
        ctx = ssl.create_default_context(cafile=cert)
        import httpx

        def client(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=f"{http.url}/v1", api_key=key, max_retries=0,
                                 http_client=httpx.Client(verify=ctx))

        with pytest.raises(openai.AuthenticationError) as err:
            client("wrong").completions.create(model="fake", prompt="A", max_tokens=2)
        assert "invalid bearer token" in str(err.value)
        out = client(TOKEN).completions.create(model="fake", prompt="A", max_tokens=2, temperature=0)
        assert out.choices[0].text == "BC"
        with urllib.request.urlopen(f"{http.url}/health", timeout=10, context=ctx) as resp:
            assert resp.status == 200                  # probes need no token
        with pytest.raises(urllib.error.HTTPError) as denied:    # the metrics do
            urllib.request.urlopen(f"{http.url}/metrics", timeout=10, context=ctx)
        assert denied.value.code == 401
        metrics = urllib.request.Request(f"{http.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(metrics, timeout=10, context=ctx) as resp:
            assert b"specd_http_requests_total" in resp.read()
        with pytest.raises((urllib.error.URLError, ConnectionError)):     # plaintext HTTP to the TLS port
            urllib.request.urlopen(f"http://{http.address}/health", timeout=10)
    finally:
        stop_stack(lt, sched, grpc_srv, http)
        lt.close()


def test_specd_generate_over_http(server, capsys) -> None:
    from specd.cluster.cli import main

    address = server["url"].removeprefix("http://")
    assert main(["generate", "--http", "--address", address, "--raw", "A", "--max-new-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    assert out == "BCDE\n" and err.startswith("[length] 4 tokens")
    assert main(["generate", "--http", "--address", address, "A", "--max-new-tokens", "5", "--stream"]) == 0
    out, err = capsys.readouterr()
    assert out == decode(target_only(chat_prompt("A"), 5)) + "\n" and "accepted" in err
    assert main(["generate", "--http", "--address", address, "A", "--max-new-tokens", "99"]) == 1
    assert "HTTP 400: max_tokens must be in [1, 32]" in capsys.readouterr().err
