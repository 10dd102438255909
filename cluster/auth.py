"""Endpoint security: gRPC TLS (mutual TLS optional) and bearer-token authentication.

Every RPC except grpc.health.v1 (kubelet probes, load balancers) and server reflection needs the
metadata `authorization: Bearer <token>` when the server has tokens; a missing or wrong token gets
UNAUTHENTICATED before the servicer runs. Tokens come from a file (one per line, so a rotation can
hold the old and the new token at once) or an environment variable, never from the command line,
where `ps` would show them to every user of the machine; a token file is re-read when it changes, and
so are the TLS files (cluster/tls.py), so rotations need no restart. All of it is off by default, which
suits the default loopback bind (a non-loopback bind without a token is refused unless
server.insecure=true); the Helm chart turns it on. docs/security.md has the threat model.
"""

from __future__ import annotations

import hmac
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from specd.cluster.tls import ReloadingCertificates, server_credentials
from specd.configs.validate import OPEN_BIND_HELP, is_loopback_host, open_bind_refused

log = logging.getLogger(__name__)

ADMIN_METHOD_PREFIX = "/specd.v1.SpecdAdmin/"
# Prefixes of the methods anyone may call: health for probes, reflection for discovery tools.
OPEN_METHOD_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)


def read_tokens(token_file: str | None = None, token_env: str | None = None,
                key: str = "auth_token") -> tuple[str, ...]:
    """The accepted tokens: non-empty lines of token_file plus the value of $token_env (key names the
    config keys in errors: server.<key>_file, server.<key>_env)."""
    tokens: list[str] = []
    if token_file:
        path = Path(token_file)
        if not path.is_file():
            raise ValueError(f"server.{key}_file={token_file!r}: no such file")
        tokens += [line.strip() for line in path.read_text().splitlines() if line.strip()]
        if not tokens:
            raise ValueError(f"server.{key}_file={token_file!r} holds no token")
    if token_env:
        value = os.environ.get(token_env, "").strip()
        if not value:
            raise ValueError(f"server.{key}_env={token_env!r}: the variable is unset or empty")
        tokens.append(value)
    return tuple(tokens)


class TokenSet:
    """Accepted tokens: the lines of a file, re-read whenever its size or mtime changes (so a rotation
    takes effect without a restart), plus the value of an environment variable (fixed for the
    process). A file that turns unreadable or empty keeps the last good tokens, with a warning: a
    half-written rotation must not lock every client out."""

    def __init__(self, token_file: str | None = None, token_env: str | None = None,
                 key: str = "auth_token", static: tuple[str, ...] = ()):
        self.file, self.key = token_file, key
        self._env = tuple(t.encode() for t in (*static, *read_tokens(None, token_env, key)))
        self._stamp: tuple[int, int] | None = None
        self._from_file: tuple[bytes, ...] = ()
        if token_file:
            self._stamp = self._stat()
            self._from_file = tuple(t.encode() for t in read_tokens(token_file, None, key))

    def _stat(self) -> tuple[int, int]:
        st = os.stat(self.file)
        return st.st_mtime_ns, st.st_size

    def current(self) -> tuple[bytes, ...]:
        if self.file:
            try:
                stamp = self._stat()
                if stamp != self._stamp:
                    self._from_file = tuple(t.encode() for t in read_tokens(self.file, None, self.key))
                    self._stamp = stamp
                    log.info("server.%s_file re-read: %d token(s)", self.key, len(self._from_file))
            except (OSError, ValueError) as exc:
                log.warning("server.%s_file changed but cannot be used (%s); keeping the last tokens",
                            self.key, type(exc).__name__ if isinstance(exc, OSError) else exc)
        return self._from_file + self._env


def _token_set(tokens: TokenSet | tuple[str, ...]) -> TokenSet:
    return tokens if isinstance(tokens, TokenSet) else TokenSet(static=tuple(tokens))


def client_token(token_file: str | None = None, token_env: str | None = None) -> str | None:
    """The token a client sends: the first line of token_file, else $token_env, else None."""
    if token_file:
        lines = [s.strip() for s in Path(token_file).read_text().splitlines() if s.strip()]
        if not lines:
            raise ValueError(f"token file {token_file!r} is empty")
        return lines[0]
    if token_env:
        return os.environ.get(token_env) or None
    return None


def _deny(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that fails with UNAUTHENTICATED."""

    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover  (makes this an async generator; abort raises first)

    kw = dict(request_deserializer=handler.request_deserializer,
              response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)


def _matches(authorization: str | None, tokens: tuple[bytes, ...]) -> bool:
    if not tokens or not authorization or not authorization.startswith("Bearer "):
        return False
    given = authorization[len("Bearer "):].strip().encode()
    # compare_digest against every token (no early exit), so timing does not reveal which is close
    return sum(hmac.compare_digest(given, t) for t in tokens) > 0


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without `authorization: Bearer <one of tokens>` (health and reflection exempt).

    Admin calls (SpecdAdmin) need one of admin_tokens when there are any; without admin tokens they
    take a user token only where admin_falls_back (a loopback server: whoever can reach it runs on the
    machine already), else they are refused. Off loopback an admin token is always its own secret."""

    def __init__(self, tokens: TokenSet | tuple[str, ...], admin_tokens: TokenSet | tuple[str, ...] = (),
                 admin_falls_back: bool = True):
        self._token_set = _token_set(tokens)
        self._admin_set = _token_set(admin_tokens)
        self._admin_falls_back = admin_falls_back

    @property
    def _tokens(self) -> tuple[bytes, ...]:
        return self._token_set.current()

    @property
    def _admin(self) -> tuple[bytes, ...]:
        return self._admin_set.current()

    def allowed(self, authorization: str | None, admin: bool = False) -> bool:
        if admin:
            return _matches(authorization, self._admin or (self._tokens if self._admin_falls_back else ()))
        tokens = self._tokens
        return not tokens or _matches(authorization, tokens)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        metadata = {k: v for k, v in (handler_call_details.invocation_metadata or ())}
        authorization = metadata.get("authorization")
        authorization = authorization if isinstance(authorization, str) else None
        admin = method.startswith(ADMIN_METHOD_PREFIX)
        if self.allowed(authorization, admin):
            return handler
        if admin and not (self._admin or (self._tokens and self._admin_falls_back)):
            return _deny(handler, "admin RPCs on a non-loopback server need server.admin_token_file or "
                                  "server.admin_token_env")
        reason = "missing bearer token" if not authorization else "invalid bearer token"
        what = "admin token" if admin and self._admin else "token"
        return _deny(handler, f"{reason}: send metadata 'authorization: Bearer <{what}>'")


@dataclass(frozen=True)
class ServerSecurity:
    """What serve needs from the server section: credentials (None = plaintext) and interceptors."""

    credentials: grpc.ServerCredentials | None
    interceptors: tuple[grpc.aio.ServerInterceptor, ...]
    insecure: bool = False      # off loopback without a bearer token (server.insecure=true)
    # SpecdAdmin is served: always on loopback; off loopback only with an admin token of its own
    admin_service: bool = True
    certificates: ReloadingCertificates | None = field(default=None, compare=False)   # TLS files
    bearer: BearerAuthInterceptor | None = field(default=None, compare=False)

    def authorize(self, authorization: str | None) -> str | None:
        """The HTTP API's check of an `Authorization` header against the same user tokens: None when
        allowed, else why not (admin tokens are not asked for: the admin RPCs are gRPC-only)."""
        if self.bearer is None or self.bearer.allowed(authorization):
            return None
        reason = "missing bearer token" if not authorization else "invalid bearer token"
        return f"{reason}: send the header 'Authorization: Bearer <token>'"

    @classmethod
    def from_config(cls, server) -> ServerSecurity:
        """`server` is specd.configs.schema.ServerConfig; file problems fail here, before anything loads."""
        credentials = certificates = None
        if server.tls_cert_file or server.tls_key_file:
            if not (server.tls_cert_file and server.tls_key_file):
                raise ValueError("server.tls_cert_file and server.tls_key_file must be set together")
            credentials, certificates = server_credentials(server)
        elif server.tls_client_ca_file:
            raise ValueError("server.tls_client_ca_file (mutual TLS) needs server.tls_cert_file and "
                             "server.tls_key_file")
        token_set = TokenSet(server.auth_token_file, server.auth_token_env)
        admin_set = TokenSet(server.admin_token_file, server.admin_token_env, key="admin_token")
        tokens, admin = token_set.current(), admin_set.current()
        loopback = is_loopback_host(server.host)
        if open_bind_refused(server.host, bool(tokens), server.insecure):
            raise ValueError(f"server.host={server.host!r}: {OPEN_BIND_HELP}")
        # no interceptor at all only on a loopback host without tokens: everything open there
        needed = tokens or admin or not loopback
        bearer = BearerAuthInterceptor(token_set, admin_set, admin_falls_back=loopback) if needed else None
        interceptors = (bearer,) if bearer else ()
        admin_service = loopback or bool(admin)
        if not admin_service:
            log.warning("no admin token (server.admin_token_file / server.admin_token_env) on non-loopback "
                        "%s: the admin service (SpecdAdmin, `specd admin set`) is not served", server.host)
        if not loopback and not (credentials and tokens):
            log.warning("serving on %s without %s%s: anyone who reaches the port can use it", server.host,
                        " and ".join(n for n, on in (("TLS", credentials), ("auth", tokens)) if not on),
                        " (server.insecure=true)" if not tokens else "")
        return cls(credentials, interceptors, insecure=not loopback and not tokens,
                   admin_service=admin_service, certificates=certificates, bearer=bearer)


def client_channel_credentials(
    ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None
) -> grpc.ChannelCredentials:
    """TLS credentials for a client: ca_file verifies the server (None = system roots);
    cert_file/key_file present a client certificate for mutual TLS."""
    ca = Path(ca_file).read_bytes() if ca_file else None
    if bool(cert_file) != bool(key_file):
        raise ValueError("a client certificate needs both cert_file and key_file")
    key = Path(key_file).read_bytes() if key_file else None
    cert = Path(cert_file).read_bytes() if cert_file else None
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
