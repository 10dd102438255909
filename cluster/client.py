"""A small Python client of the specd gRPC API (sync and asyncio).

    with SpecdClient("127.0.0.1:50051") as c:
        out = c.generate("What is 2 + 3?", max_new_tokens=32)          # chat message, rendered by the server
        print(out.text, out.usage["tokens_per_step"])
        for chunk in c.stream(text="def fib(n):", max_new_tokens=64):
            print(chunk.text, end="", flush=True)

`prompt` is one user chat message; pass `messages=[{"role": ..., "content": ...}]` for a conversation,
`text=` for raw text or `token_ids=` for token ids. Errors surface as grpc.RpcError with the server's
status code and message.

The address may name several routers: a DNS name with one record per router (a headless Service,
`dns:///specd-router-headless:50051`) or `ipv4:10.0.0.7:50051,10.0.0.8:50051`. Calls are spread over
them (round robin), and a call that fails UNAVAILABLE before its first response (a router loading,
draining, restarting or gone) is tried again, on another router where there is one (gRPC's retry
policy, `Security.attempts`). A stream that has sent a token is never retried: gRPC commits a call at
its first response, so a failure after it reaches the caller.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specd.proto.specd.v1 import serving_pb2, serving_pb2_grpc

FINISH_NAMES = {
    serving_pb2.FINISH_REASON_UNSPECIFIED: "",
    serving_pb2.FINISH_REASON_LENGTH: "length",
    serving_pb2.FINISH_REASON_EOS: "eos",
    serving_pb2.FINISH_REASON_STOP: "stop",
    serving_pb2.FINISH_REASON_CANCELLED: "cancelled",
}


@dataclass
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: dict


@dataclass
class Chunk:
    """One streamed piece; the last one has finish_reason and usage set."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: dict | None = None


def _dict(msg: Message) -> dict:
    """Every field of a message as plain Python values (json_format would turn 64-bit ints into strings)."""
    out = {}
    for f in msg.DESCRIPTOR.fields:
        value = getattr(msg, f.name)
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            out[f.name] = dict(value)
        elif f.message_type is not None:
            out[f.name] = [_dict(v) for v in value] if _is_repeated(f) else _dict(value)
        else:
            out[f.name] = list(value) if _is_repeated(f) else value
    return out


def _is_repeated(f: FieldDescriptor) -> bool:
    # protobuf >= 6 has is_repeated and dropped label; older versions only have label
    if hasattr(f, "is_repeated"):
        return f.is_repeated
    return f.label == FieldDescriptor.LABEL_REPEATED


def build_request(
    prompt: str | None = None,
    *,
    messages: list[dict[str, str]] | None = None,
    text: str | None = None,
    token_ids: list[int] | None = None,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    stop: list[str] | tuple[str, ...] = (),
    seed: int | None = None,
    ignore_eos: bool = False,
    speculation: bool | None = None,
    gamma: int | None = None,
    tree_width: int | None = None,
    gamma_policy: str = "",
    request_id: str = "",
    domain: str = "",
    skip_replay: bool = False,
) -> serving_pb2.GenerateRequest:
    """A GenerateRequest from keyword arguments; unset options take the server's defaults."""
    inputs = [x is not None for x in (prompt, messages, text, token_ids)]
    if sum(inputs) != 1:
        raise ValueError("pass exactly one of prompt, messages, text or token_ids")
    req = serving_pb2.GenerateRequest(request_id=request_id, domain=domain, skip_replay=skip_replay)
    if prompt is not None:
        messages = [{"role": "user", "content": prompt}]
    if messages is not None:
        req.chat.messages.extend(serving_pb2.ChatMessage(**m) for m in messages)
        if not messages:
            req.chat.SetInParent()  # an explicit empty conversation, so the server can say so
    elif text is not None:
        req.text = text
    else:
        req.token_ids.ids.extend(token_ids)
        if not token_ids:
            req.token_ids.SetInParent()
    s = req.sampling
    for name, value in (("max_new_tokens", max_new_tokens), ("temperature", temperature),
                        ("top_k", top_k), ("top_p", top_p), ("seed", seed)):
        if value is not None:
            setattr(s, name, value)
    s.stop.extend(stop)
    s.ignore_eos = ignore_eos
    sp = req.speculation
    for name, value in (("enabled", speculation), ("gamma", gamma), ("tree_width", tree_width)):
        if value is not None:
            setattr(sp, name, value)
    sp.gamma_policy = gamma_policy
    return req


def _completion(resp: serving_pb2.GenerateResponse) -> Completion:
    return Completion(resp.request_id, resp.text, list(resp.token_ids),
                      FINISH_NAMES.get(resp.finish_reason, ""), _dict(resp.usage))


def _chunk(msg: serving_pb2.GenerateStreamResponse) -> Chunk:
    if msg.HasField("delta"):
        return Chunk(msg.request_id, list(msg.delta.token_ids), msg.delta.text)
    return Chunk(msg.request_id, [], msg.final.text, FINISH_NAMES.get(msg.final.finish_reason, ""),
                 _dict(msg.final.usage))


@dataclass(frozen=True)
class Security:
    """How a client reaches a secured server. tls: use TLS (ca_file verifies the server, None = the
    system roots; cert_file/key_file for mutual TLS). token: sent as `authorization: Bearer <token>`;
    read it with specd.cluster.auth.client_token from a file or environment variable."""

    tls: bool = False
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    token: str | None = None
    max_message_bytes: int | None = None
    attempts: int = 5          # tries of a call failing UNAVAILABLE before any response (1..5)
    # TLS: the name the server's certificate must carry when the address does not say it (a list of
    # router IPs, `ipv4:10.0.0.7:50051,10.0.0.8:50051`, behind a certificate for the Service's name)
    server_name: str | None = None

    def channel_args(self) -> list[tuple[str, int | str]]:
        n = self.max_message_bytes
        sizes = [("grpc.max_receive_message_length", n), ("grpc.max_send_message_length", n)] if n else []
        name = [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
        return [*sizes, *name, ("grpc.enable_retries", int(self.attempts > 1)),
                ("grpc.service_config", service_config(self.attempts))]

    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        return (("authorization", f"Bearer {self.token}"),) if self.token else None

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not (self.tls or self.ca_file or self.cert_file):
            return None
        from specd.cluster.auth import client_channel_credentials

        return client_channel_credentials(self.ca_file, self.cert_file, self.key_file)

    def channel(self, address: str, api=grpc):
        """A channel to `address` from `api` (grpc, or grpc.aio for the async client): TLS when
        configured, plaintext otherwise."""
        creds = self.credentials()
        if creds is not None:
            return api.secure_channel(address, creds, options=self.channel_args())
        return api.insecure_channel(address, options=self.channel_args())


def service_config(attempts: int) -> str:
    """The channel's gRPC service config: round robin over every address the target resolves to, and
    retries of the serving calls on UNAVAILABLE with a short exponential backoff (gRPC's own limits:
    at most 5 attempts, and only while the call is uncommitted, i.e. before any response arrived)."""
    if not 1 <= attempts <= 5:
        raise ValueError(f"attempts must be in [1, 5] (gRPC's limit), not {attempts}")
    method: dict = {"name": [{"service": "specd.v1.Specd"}]}
    if attempts > 1:
        method["retryPolicy"] = {"maxAttempts": attempts, "initialBackoff": "0.1s", "maxBackoff": "2s",
                                 "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}
    return json.dumps({"loadBalancingConfig": [{"round_robin": {}}], "methodConfig": [method]})


class SpecdClient:
    def __init__(self, address: str = "127.0.0.1:50051", timeout: float | None = None,
                 security: Security | None = None):
        self.address = address
        self.timeout = timeout
        sec = security or Security()
        self.channel = sec.channel(address, grpc)
        self.metadata = sec.metadata()
        self.stub = serving_pb2_grpc.SpecdStub(self.channel)
        self.admin_stub = serving_pb2_grpc.SpecdAdminStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kw) -> Completion:
        resp = self.stub.Generate(build_request(prompt, **kw), timeout=timeout or self.timeout,
                                  metadata=self.metadata)
        return _completion(resp)

    def stream(self, prompt: str | None = None, *, timeout: float | None = None, **kw) -> Iterator[Chunk]:
        """Chunks as they arrive; break out of the loop (or call .cancel() on the call) to cancel."""
        call = self.stub.GenerateStream(build_request(prompt, **kw), timeout=timeout or self.timeout,
                                        metadata=self.metadata)
        try:
            for msg in call:
                yield _chunk(msg)
        finally:
            call.cancel()   # no-op when the stream already ended; frees the server's slots otherwise

    def server_info(self) -> dict:
        return _dict(self.stub.ServerInfo(serving_pb2.ServerInfoRequest(), timeout=self.timeout or 30,
                                          metadata=self.metadata))

    def set_config(self, overrides: list[str]) -> dict[str, str]:
        """Live tuning (SpecdAdmin.SetConfig): e.g. ["spec.gamma=5"]; returns {key: new value} changed."""
        resp = self.admin_stub.SetConfig(serving_pb2.SetConfigRequest(overrides=list(overrides)),
                                         timeout=self.timeout or 30, metadata=self.metadata)
        return dict(resp.changed)

    def health(self, service: str = "") -> str:
        resp = self.health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def wait_until_serving(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.health() == "SERVING":
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.address} was not SERVING after {timeout} s")
            time.sleep(0.5)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> SpecdClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncSpecdClient:
    """The same calls over grpc.aio, for many concurrent requests from one process (benchmarks)."""

    def __init__(self, address: str = "127.0.0.1:50051", timeout: float | None = None,
                 security: Security | None = None):
        self.address = address
        self.timeout = timeout
        sec = security or Security()
        self.channel = sec.channel(address, grpc.aio)
        self.metadata = sec.metadata()
        self.stub = serving_pb2_grpc.SpecdStub(self.channel)

    async def generate(self, prompt: str | None = None, **kw) -> Completion:
        return _completion(await self.stub.Generate(build_request(prompt, **kw), timeout=self.timeout,
                                                    metadata=self.metadata))

    async def stream(self, prompt: str | None = None, **kw) -> AsyncIterator[Chunk]:
        call = self.stub.GenerateStream(build_request(prompt, **kw), timeout=self.timeout,
                                        metadata=self.metadata)
        try:
            async for msg in call:
                yield _chunk(msg)
        finally:
            call.cancel()

    async def server_info(self) -> dict:
        return _dict(await self.stub.ServerInfo(serving_pb2.ServerInfoRequest(), timeout=self.timeout,
                                                metadata=self.metadata))

    async def close(self) -> None:
        await self.channel.close()
