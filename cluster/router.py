"""The gRPC router (grpc.aio): validates requests, admits them to the scheduler, streams tokens and text.

The tokenizer lives here, not in the workers: prompts are rendered and encoded once, and generated
tokens are decoded incrementally for text deltas and stop strings. Standard grpc.health.v1 (with the
liveness and readiness services of cluster/health_probe.py) says
NOT_SERVING until the backend (models loaded and warm) is attached, and server reflection lets a
generic client (grpcurl, grpcui) discover the API.

Status codes: INVALID_ARGUMENT for bad input (message from specd.cluster.validation), RESOURCE_EXHAUSTED
when the admission queue is full, UNAVAILABLE while loading or shutting down, INTERNAL when a worker
failed on the request. A client cancel or deadline aborts the request, which frees its KV slots.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specd.cluster.admin import AdminServicer
from specd.cluster.auth import ServerSecurity
from specd.cluster.health_probe import SpecdHealth
from specd.cluster.redact import redact_config
from specd.cluster.scheduler import ServedStats
from specd.cluster.serving import LOADING, Backend, DeltaEvent, ErrorCode, ServingCore, ServingError
from specd.configs.validate import is_loopback_host
from specd.proto.specd.v1 import serving_pb2, serving_pb2_grpc
from specd.workers.engine.types import FinishReason

# worker_stats() also carries metrics-only keys (the goodput EMAs) that ServerInfo does not report
_WORKER_FIELDS = frozenset(serving_pb2.WorkerStats.DESCRIPTOR.fields_by_name)

log = logging.getLogger(__name__)

SERVICE_NAME = serving_pb2.DESCRIPTOR.services_by_name["Specd"].full_name   # "specd.v1.Specd"
ADMIN_SERVICE_NAME = serving_pb2.DESCRIPTOR.services_by_name["SpecdAdmin"].full_name
_FINISH = {
    FinishReason.LENGTH: serving_pb2.FINISH_REASON_LENGTH,
    FinishReason.EOS: serving_pb2.FINISH_REASON_EOS,
    FinishReason.STOP: serving_pb2.FINISH_REASON_STOP,
    FinishReason.CANCELLED: serving_pb2.FINISH_REASON_CANCELLED,
}


def usage_proto(stats: ServedStats, completion_tokens: int) -> serving_pb2.Usage:
    spec = stats.spec
    return serving_pb2.Usage(
        prompt_tokens=stats.prompt_tokens,
        completion_tokens=completion_tokens,
        steps=spec.steps,
        drafted=spec.drafted,
        accepted=spec.accepted,
        recovered=spec.recovered,
        bonus=spec.bonus,
        acceptance_rate=spec.acceptance_rate,
        tokens_per_step=spec.tokens_per_step,
        mean_accepted_length=spec.mean_accepted_length,
        drafting_steps=spec.drafting_steps,
        drafter_versions=spec.drafter_versions,
        drafted_per_position=spec.drafted_per_position,
        accepted_per_position=spec.accepted_per_position,
        time_to_first_token_s=stats.time_to_first_token,
        total_time_s=stats.total_time,
        queue_time_s=stats.queue_time,
        replica=max(stats.replica, 0),
    )


_STATUS = {
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
}


class SpecdServicer(serving_pb2_grpc.SpecdServicer):
    """specd.v1.Specd over the serving core (shared with the HTTP front end when one runs)."""

    def __init__(self, core: ServingCore | None = None):
        self.core = core or ServingCore()

    @property
    def backend(self) -> Backend | None:
        return self.core.backend

    @backend.setter
    def backend(self, backend: Backend | None) -> None:
        self.core.backend = backend

    async def _ready(self, context: grpc.aio.ServicerContext) -> Backend:
        if self.backend is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, LOADING)
        return self.backend

    async def _events(
        self, request: serving_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[serving_pb2.GenerateStreamResponse]:
        """The stream of one request: deltas, then one final message. Shared by both RPCs."""
        try:
            stream = await self.core.start(request)
        except ServingError as err:
            await context.abort(_STATUS[err.code], err.message)
        async with stream:        # a cancelled call aborts its request at once (frees its slots)
            try:
                async for event in stream:
                    if isinstance(event, DeltaEvent):
                        yield serving_pb2.GenerateStreamResponse(
                            request_id=event.request_id,
                            delta=serving_pb2.Delta(token_ids=event.token_ids, text=event.text))
                        continue
                    final = serving_pb2.Final(
                        finish_reason=_FINISH.get(event.reason, serving_pb2.FINISH_REASON_UNSPECIFIED),
                        usage=usage_proto(event.stats, event.completion_tokens),
                        text=event.text,
                    )
                    yield serving_pb2.GenerateStreamResponse(request_id=event.request_id, final=final)
            except ServingError as err:
                await context.abort(_STATUS[err.code], err.message)

    async def Generate(self, request, context):
        pieces: list[str] = []
        token_ids: list[int] = []
        response = serving_pb2.GenerateResponse()
        async for msg in self._events(request, context):
            response.request_id = msg.request_id
            if msg.HasField("delta"):
                token_ids += msg.delta.token_ids
                pieces.append(msg.delta.text)
            else:
                pieces.append(msg.final.text)
                response.finish_reason = msg.final.finish_reason
                response.usage.CopyFrom(msg.final.usage)
        response.text = "".join(pieces)
        response.token_ids.extend(token_ids)
        return response

    async def GenerateStream(self, request, context):
        async for msg in self._events(request, context):
            yield msg

    async def ServerInfo(self, request, context):
        b = await self._ready(context)
        workers = await b.scheduler.worker_stats()
        if b.metrics is not None:
            b.metrics.set_worker_stats(workers)
        s, bounds = b.scheduler, b.bounds
        return serving_pb2.ServerInfoResponse(
            model=b.model,
            vocab_size=bounds.vocab_size,
            max_seq_len=bounds.max_seq_len,
            max_new_tokens_default=bounds.max_new_tokens_default,
            max_new_tokens_cap=bounds.max_new_tokens_cap,
            temperature_max=bounds.temperature_max,
            speculation_enabled=bounds.spec_enabled,
            gamma_default=bounds.gamma_default,
            gamma_min=bounds.gamma_min,
            gamma_max=bounds.gamma_max,
            tree_width_max=bounds.tree_width_max,
            gamma_policies=list(bounds.policies),
            replicas=b.replicas,
            pipeline_groups=b.pipeline_groups,
            max_queue=b.max_queue,
            waiting=s.waiting(),
            running=s.running(),
            requests_finished=s.finished,
            tokens_generated=s.tokens_generated,
            drafted=s.drafted,
            accepted=s.accepted,
            workers=[serving_pb2.WorkerStats(**{k: v for k, v in w.items() if k in _WORKER_FIELDS})
                     for w in workers],
            gamma_policy_default=str(bounds.policy_default),
            tree_width_default=bounds.tree_width_default,
            config=redact_config(b.config),      # never a Redis password
        )


class GrpcServer:
    """A grpc.aio server with the Specd service, grpc.health.v1 and server reflection."""

    def __init__(self, servicer: SpecdServicer, host: str = "127.0.0.1", port: int = 0,
                 security: ServerSecurity | None = None, max_message_bytes: int | None = None,
                 health_port: int | None = None):
        """security: TLS credentials and the bearer-token interceptor (None = plaintext, open);
        health_port: a plaintext port serving grpc.health.v1 only, for kubelet probes."""
        self.servicer = servicer
        self.security = security
        options = ([("grpc.max_receive_message_length", max_message_bytes),
                    ("grpc.max_send_message_length", max_message_bytes)] if max_message_bytes else [])
        interceptors = security.interceptors if security else ()
        self.server = grpc.aio.server(interceptors=interceptors, options=options)
        serving_pb2_grpc.add_SpecdServicer_to_server(servicer, self.server)
        # off loopback the admin service exists only with an admin token of its own (ServerSecurity)
        self.admin = security.admin_service if security else is_loopback_host(host)
        if self.admin:
            serving_pb2_grpc.add_SpecdAdminServicer_to_server(AdminServicer(servicer), self.server)
        self.serving_verdict = True          # the HealthProber's last verdict (set_serving)
        self.stopping = False                # stop() was called: draining
        self.health = SpecdHealth(alive=self._alive, ready=self._ready)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        services = (SERVICE_NAME, *((ADMIN_SERVICE_NAME,) if self.admin else ()), health.SERVICE_NAME,
                    reflection.SERVICE_NAME)
        reflection.enable_server_reflection(services, self.server)
        self.bind_host = f"[{host}]" if ":" in host else host
        credentials = security.credentials if security else None
        self.tls = credentials is not None
        self.port = self._bind(self.server, port, credentials)
        self.address = f"{self.bind_host}:{self.port}"
        self.health_server, self.health_port = None, None
        if health_port is not None:
            self.health_server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            self.health_port = self._bind(self.health_server, health_port, None)

    def _bind(self, server, port: int, credentials) -> int:
        target = f"{self.bind_host}:{port}"
        bound = (server.add_secure_port(target, credentials) if credentials
                 else server.add_insecure_port(target))
        if bound == 0:
            raise OSError(f"could not bind gRPC to {target}")
        return bound

    async def start(self) -> None:
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()
        await self.set_serving(True)

    def _alive(self) -> bool:
        backend = self.servicer.backend
        return backend is None or backend.scheduler.loops_alive()

    def _ready(self) -> bool:
        backend = self.servicer.backend
        return backend is not None and self.serving_verdict and backend.scheduler.can_admit()

    def serving(self) -> bool:
        """Loaded, working and passing the health prober: the HTTP API's /health verdict."""
        return (self.servicer.backend is not None and self.serving_verdict and not self.stopping
                and self._alive())

    async def set_serving(self, serving: bool) -> None:
        """The serving verdict ("" and specd.v1.Specd); readiness follows it (cluster/health_probe.py)."""
        states = health_pb2.HealthCheckResponse
        self.serving_verdict = serving
        status = states.SERVING if serving and self.servicer.backend is not None else states.NOT_SERVING
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)
        await self.health.refresh()

    async def attach(self, backend: Backend) -> None:
        """The models are loaded and warm: accept requests and report SERVING."""
        self.servicer.backend = backend
        await self.set_serving(True)

    async def stop(self, grace: float = 5.0) -> None:
        self.stopping = True
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        if self.health_server is not None:
            await self.health_server.stop(0)
        self.servicer.core.close()
