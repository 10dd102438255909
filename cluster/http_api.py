"""The OpenAI-compatible HTTP API, served by the router process itself (aiohttp on the router's loop).

    POST /v1/chat/completions   the model's own chat template; streaming as Server-Sent Events
    POST /v1/completions        raw text or token ids
    GET  /v1/models             the served model
    GET  /health                200 while serving, 503 while loading, failing or shutting down

A thin front end over the serving core (cluster/serving.py), like the gRPC API: the same admission,
queue bound, cancellation, limits and tokens. A client that disconnects cancels its handler
(aiohttp's handler_cancellation), which closes its request stream and frees its KV slots at once.
The admin RPCs are not served here.

Errors are OpenAI's `{"error": {"message", "type", "param", "code"}}`, with the gRPC API's statuses
mapped: INVALID_ARGUMENT 400, UNAUTHENTICATED 401, NOT_FOUND 404, RESOURCE_EXHAUSTED 429,
UNAVAILABLE 503, INTERNAL 500; a body over server.max_message_bytes is 413 before it is read, bad JSON
400. An error after a stream has started goes out as one `data: {"error": ...}` event before
`data: [DONE]`, as vLLM's server does.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from specd.cluster import openai_protocol as oai
from specd.cluster.serving import DeltaEvent, ErrorCode, FinalEvent, RequestStream, ServingCore, ServingError

log = logging.getLogger(__name__)

_HTTP_STATUS = {
    ErrorCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    ErrorCode.NOT_FOUND: (404, "not_found_error"),
    ErrorCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    ErrorCode.UNAVAILABLE: (503, "service_unavailable_error"),
    ErrorCode.INTERNAL: (500, "internal_error"),
}
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def error_body(status: int, kind: str, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code or str(status)}}


def _error_response(status: int, kind: str, message: str, param: str | None = None,
                    code: str | None = None, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(error_body(status, kind, message, param, code), status=status, headers=headers)


def _serving_error(err: ServingError) -> web.Response:
    status, kind = _HTTP_STATUS[err.code]
    return _error_response(status, kind, err.message, oai.param_of(err), err.code.value)


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class HttpApi:
    """The aiohttp application over a serving core."""

    def __init__(self, core: ServingCore, *, authorize: Callable[[str | None], str | None] | None = None,
                 serving: Callable[[], bool] | None = None, max_body_bytes: int = 4 << 20):
        """authorize(authorization header) -> None when allowed, else the 401 message (None = open);
        serving() -> the /health verdict (None: serving once a backend is attached)."""
        self.core = core
        self.authorize = authorize
        self.serving = serving or (lambda: core.backend is not None)
        self.max_body_bytes = max_body_bytes
        self.app = web.Application(client_max_size=max_body_bytes, middlewares=[self._guard])
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/metrics", self.metrics)

    # ---- cross-cutting: auth, body size, unknown paths, metrics ------------------------------------
    @web.middleware
    async def _guard(self, request: web.Request, handler) -> web.StreamResponse:
        response = await self._checked(request, handler)
        metrics = self.core.backend.metrics if self.core.backend is not None else None
        if metrics is not None:
            resource = request.match_info.route.resource
            endpoint = resource.canonical if resource is not None else "unknown"
            metrics.http_requests.labels(endpoint, str(response.status)).inc()
        return response

    async def _checked(self, request: web.Request, handler) -> web.StreamResponse:
        if request.path != "/health" and self.authorize is not None:
            refused = self.authorize(request.headers.get("Authorization"))
            if refused is not None:
                return _error_response(401, "authentication_error", refused, code="invalid_api_key",
                                       headers={"WWW-Authenticate": "Bearer"})
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            return _error_response(413, "invalid_request_error",
                                   f"the request body has {request.content_length} bytes; at most "
                                   f"{self.max_body_bytes} (server.max_message_bytes)",
                                   code="request_too_large")
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:          # a chunked body that grew past the limit
            return _error_response(413, "invalid_request_error", f"the request body is over "
                                   f"{self.max_body_bytes} bytes (server.max_message_bytes)",
                                   code="request_too_large")
        except web.HTTPNotFound:
            return _error_response(404, "not_found_error",
                                   f"no such endpoint: {request.method} {request.path}")
        except web.HTTPMethodNotAllowed as exc:
            return _error_response(405, "invalid_request_error",
                                   f"{request.method} is not allowed on {request.path} "
                                   f"(allowed: {', '.join(sorted(exc.allowed_methods))})")
        except ServingError as err:
            return _serving_error(err)
        except (ConnectionResetError, web.HTTPException):
            raise
        except Exception:       # one request's fault must not take the server down; the log has it
            log.exception("HTTP %s %s failed", request.method, request.path)
            return _error_response(500, "internal_error", "internal error (see the server log)")

    async def _json(self, request: web.Request) -> Any:
        raw = await request.read()
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise oai.invalid(f"the request body is not valid JSON: {exc}") from None

    def _model(self, requested: str | None) -> str:
        served = self.core.ready().model
        if requested not in (None, served):
            raise ServingError(ErrorCode.NOT_FOUND, f"the model {requested!r} does not exist; this server "
                               f"serves {served!r}", "model")
        return served

    # ---- endpoints ---------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if self.serving():
            return web.Response(status=200)
        return _error_response(503, "service_unavailable_error",
                               "not serving (loading, failing or shutting down)")

    async def metrics(self, request: web.Request) -> web.Response:
        """The Prometheus text of server.metrics_port, on the API's port too (as vLLM's API server serves
        it): for a scraper that reaches only this port, and for a caller that bound port 0 and reads the
        one port back. Behind the same token as the API: request counts and timings are the operator's."""
        metrics = self.core.ready().metrics
        if metrics is None:
            return _error_response(404, "not_found_error", "this server keeps no metrics")
        return web.Response(body=generate_latest(metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        b = self.core.ready()
        card = {"id": b.model, "object": "model", "created": int(time.time()), "owned_by": "specd",
                "max_model_len": b.bounds.max_seq_len}
        return web.json_response({"object": "list", "data": [card]})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, oai.ChatCompletionRequest, "chat.completion")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, oai.CompletionRequest, "text_completion")

    async def _generate(self, request: web.Request, model: type, kind: str) -> web.StreamResponse:
        body = oai.parse(model, await self._json(request))
        served = self._model(body.model)
        proto = oai.to_generate_request(body, self.core.ready().bounds,
                                        request.headers.get("X-Request-Id", ""))
        stream = await self.core.start(proto)       # refusals raise here, before any byte is sent
        async with stream:                          # leaving early (a disconnect) aborts the request
            if body.stream:
                return await self._stream(request, stream, body, kind, served)
            return await self._collect(stream, kind, served)

    async def _collect(self, stream: RequestStream, kind: str, model: str) -> web.Response:
        pieces: list[str] = []
        async for event in stream:
            pieces.append(event.text)
        final: FinalEvent = event
        out = oai.envelope(kind, stream.request_id, model)
        text = "".join(pieces)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if kind == "chat.completion"
                  else {"index": 0, "text": text})
        out["choices"] = [{**choice, "logprobs": None, "finish_reason": oai.finish_reason(final)}]
        out["usage"] = oai.usage(final)
        return web.json_response(out)

    async def _stream(self, request: web.Request, stream: RequestStream, body, kind: str,
                      model: str) -> web.StreamResponse:
        chat = kind == "chat.completion"
        options = body.stream_options or oai.StreamOptions()
        head = oai.envelope("chat.completion.chunk" if chat else "text_completion", stream.request_id, model)
        if options.include_usage:
            head["usage"] = None

        def chunk(text: str | None, finish: str | None = None, role: bool = False) -> dict[str, Any]:
            if chat:
                delta = ({"role": "assistant", "content": ""} if role
                         else {} if text is None else {"content": text})
                choice = {"index": 0, "delta": delta}
            else:
                choice = {"index": 0, "text": text or ""}
            return {**head, "choices": [{**choice, "logprobs": None, "finish_reason": finish}]}

        response = web.StreamResponse(headers=_SSE_HEADERS)
        await response.prepare(request)
        try:
            if chat:
                await response.write(_sse(chunk(None, role=True)))
            async for event in stream:
                if isinstance(event, DeltaEvent):
                    if event.text:
                        await response.write(_sse(chunk(event.text)))
                    continue
                if event.text:
                    await response.write(_sse(chunk(event.text)))
                await response.write(_sse(chunk(None, oai.finish_reason(event))))
                if options.include_usage:
                    await response.write(_sse({**head, "choices": [], "usage": oai.usage(event)}))
            await response.write(_sse("[DONE]"))
        except ServingError as err:
            status, error_kind = _HTTP_STATUS[err.code]
            await response.write(_sse(error_body(status, error_kind, err.message, code=err.code.value)))
            await response.write(_sse("[DONE]"))
        except ConnectionResetError:       # the client went away: `async with stream` aborts the request
            return response
        await response.write_eof()
        return response


def _ssl_context(server) -> ssl.SSLContext:
    """TLS from the same files as the gRPC port (specd.configs.schema.ServerConfig), re-read when they
    change: each handshake checks the files' stamps and moves to a context built from the new pair."""
    paths = [server.tls_cert_file, server.tls_key_file, *([server.tls_client_ca_file]
                                                           if server.tls_client_ca_file else [])]

    def build() -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(server.tls_cert_file, server.tls_key_file)
        if server.tls_client_ca_file:
            ctx.load_verify_locations(server.tls_client_ca_file)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def stamps() -> tuple:
        return tuple((s.st_mtime_ns, s.st_size) for s in (os.stat(p) for p in paths))

    state = {"stamp": stamps(), "ctx": None}
    listening = build()

    def on_handshake(sock: ssl.SSLObject, _name, _ctx) -> None:
        try:
            stamp = stamps()
            if stamp != state["stamp"]:
                state["ctx"] = build()
                state["stamp"] = stamp
                log.info("HTTP TLS certificate re-read from %s", server.tls_cert_file)
        except (OSError, ssl.SSLError) as exc:        # mid-rotation: keep the last good pair
            log.warning("TLS files changed but cannot be used yet (%s); keeping the current certificate", exc)
        if state["ctx"] is not None:
            sock.context = state["ctx"]

    listening.sni_callback = on_handshake
    return listening


class HttpServer:
    """The HTTP API on its own port of the router's host, on the router's event loop."""

    def __init__(self, api: HttpApi, host: str, port: int, server_config=None, grace_s: float = 10.0):
        """server_config: specd.configs.schema.ServerConfig, for TLS (None = plaintext); grace_s: how
        long stop() lets in-flight requests finish before they are cancelled."""
        self.api = api
        self.grace_s = grace_s
        tls = server_config is not None and server_config.tls_cert_file and server_config.tls_key_file
        self.ssl_context = _ssl_context(server_config) if tls else None
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as exc:
            self.sock.close()
            raise OSError(f"could not bind HTTP to {host}:{port} (server.http_port): {exc}") from exc
        self.port = self.sock.getsockname()[1]
        self.address = f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"
        self.url = f"{'https' if self.ssl_context else 'http'}://{self.address}"
        self.runner = web.AppRunner(api.app, handler_cancellation=True, access_log=None,
                                    shutdown_timeout=grace_s)

    async def start(self) -> None:
        await self.runner.setup()
        await web.SockSite(self.runner, self.sock, ssl_context=self.ssl_context).start()

    async def stop(self) -> None:
        """Stop listening, give in-flight requests grace_s to finish, then cancel them."""
        await self.runner.cleanup()
