"""Server TLS: certificates re-read on change, and the minimum protocol version.

gRPC asks `ReloadingCertificates.fetch` before every new handshake (grpc.dynamic_ssl_server_credentials);
it answers None (keep what you have) unless a file's size or mtime changed, and then only with a key
and certificate that belong together, so a rotation that writes the two files one after the other is
picked up once both are in place, and connections already open keep their session.

Minimum TLS version: gRPC core negotiates TLS 1.2 or 1.3 and refuses anything older, so
`server.tls_min_version=1.2` is what every gRPC server does. grpcio's Python server credentials do
not expose a minimum version (grpc/grpc#37305; grpc/grpc#43074 and #43080 add one, unreleased in
grpcio 1.85), so `1.3` cannot be enforced in-process and is refused at start with that reason.
"""

from __future__ import annotations

import logging
import os
import ssl
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

TLS_VERSIONS = ("1.2", "1.3")
TLS13_UNSUPPORTED = (
    "server.tls_min_version=1.3 cannot be enforced: grpcio's server credentials have no minimum TLS "
    "version (grpc/grpc#37305) and gRPC core accepts TLS 1.2 and 1.3; TLS 1.3 is offered and chosen by "
    "every client that supports it. Use 1.2, or terminate TLS 1.3-only in front of specd (an ingress "
    "or proxy)")


class ReloadingCertificates:
    """The server key, certificate and (mutual TLS) client CA, re-read when a file changes."""

    def __init__(self, cert_file: str, key_file: str, client_ca_file: str | None = None):
        self.paths = {"tls_cert_file": cert_file, "tls_key_file": key_file}
        if client_ca_file:
            self.paths["tls_client_ca_file"] = client_ca_file
        for key, path in self.paths.items():
            if not Path(path).is_file():
                raise ValueError(f"server.{key}={path!r}: no such file")
        self.reloads = 0
        self._stamp = self._stamps()
        self.initial = self._load()     # a bad pair at start fails here, before anything loads

    def _stamps(self) -> tuple[tuple[int, int], ...]:
        return tuple((s.st_mtime_ns, s.st_size) for s in (os.stat(p) for p in self.paths.values()))

    def _load(self) -> grpc.ServerCertificateConfiguration:
        cert, key = self.paths["tls_cert_file"], self.paths["tls_key_file"]
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"server.tls_cert_file={cert!r} and server.tls_key_file={key!r} do not "
                             f"load as a pair: {exc}") from exc
        ca = self.paths.get("tls_client_ca_file")
        return grpc.ssl_server_certificate_configuration(
            [(Path(key).read_bytes(), Path(cert).read_bytes())],
            root_certificates=Path(ca).read_bytes() if ca else None)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's certificate_configuration_fetcher: a new configuration, or None to keep the current."""
        try:
            stamp = self._stamps()
            if stamp == self._stamp:
                return None
            config = self._load()
        except (OSError, ValueError) as exc:      # mid-rotation or a bad file: keep serving the old pair
            log.warning("TLS files changed but cannot be used yet (%s); keeping the current certificate",
                        exc)
            return None
        self._stamp = stamp
        self.reloads += 1
        log.info("TLS certificate re-read from %s", self.paths["tls_cert_file"])
        return config


def server_credentials(server) -> tuple[grpc.ServerCredentials, ReloadingCertificates]:
    """TLS credentials for `server` (specd.configs.schema.ServerConfig) that follow its files."""
    if server.tls_min_version not in TLS_VERSIONS:
        raise ValueError(f"server.tls_min_version={server.tls_min_version!r}: one of {list(TLS_VERSIONS)}")
    if server.tls_min_version == "1.3":
        raise ValueError(TLS13_UNSUPPORTED)
    certs = ReloadingCertificates(server.tls_cert_file, server.tls_key_file, server.tls_client_ca_file)
    credentials = grpc.dynamic_ssl_server_credentials(
        certs.initial, certs.fetch, require_client_authentication=server.tls_client_ca_file is not None)
    return credentials, certs
