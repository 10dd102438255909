"""The Redis that holds the replay stream: specd's own redis-server, or the one configured.

With `replay.redis_url` unset (the embedded default), `ManagedRedis` starts redis-server on a free
loopback port with a generated password, no persistence and its files in a private temporary
directory, and stops it on exit. With a URL set, `connect` uses that server: its password comes from
the environment variable `replay.password_env` (never from the command line), and a `rediss://` URL
takes the TLS options `replay.tls_*`.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import redis

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RedisEndpoint:
    """Everything a client needs to reach the server; plain values, so it travels to Ray actors."""

    url: str
    password: str | None = None
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None

    def client(self, socket_timeout: float | None = 1.0, **kwargs) -> redis.Redis:
        extra = {}
        if self.url.startswith("rediss://"):
            extra = dict(ssl_ca_certs=self.ssl_ca_certs, ssl_certfile=self.ssl_certfile,
                         ssl_keyfile=self.ssl_keyfile)
        return redis.Redis.from_url(
            self.url, password=self.password, socket_timeout=socket_timeout,
            socket_connect_timeout=socket_timeout, **extra, **kwargs,
        )

    def __repr__(self) -> str:  # the password never reaches a log line
        from specd.cluster.redact import redact_text

        return f"RedisEndpoint(url={redact_text(self.url)!r})"


def endpoint_from_config(replay_cfg) -> RedisEndpoint:
    """The configured server (replay.redis_url must be set)."""
    if not replay_cfg.redis_url:
        raise ValueError("replay.redis_url is not set (unset means a managed redis-server: ManagedRedis)")
    return RedisEndpoint(
        url=replay_cfg.redis_url,
        password=os.environ.get(replay_cfg.password_env) or None,
        ssl_ca_certs=replay_cfg.tls_ca_certs,
        ssl_certfile=replay_cfg.tls_certfile,
        ssl_keyfile=replay_cfg.tls_keyfile,
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ManagedRedis:
    """A private redis-server on 127.0.0.1: `start()`, `endpoint`, `stop()` (also a context manager).

    `port` may be given to restart on the same port (the tests stop and restart it under load)."""

    def __init__(self, binary: str = "redis-server", port: int | None = None, password: str | None = None,
                 maxmemory_mb: int = 0, start_timeout_s: float = 10.0):
        self.binary = binary
        self.port = port
        self.password = password or secrets.token_urlsafe(24)
        self.maxmemory_mb = maxmemory_mb
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self._dir: str | None = None
        self.restarts = 0

    @property
    def endpoint(self) -> RedisEndpoint:
        if self.port is None:
            raise RuntimeError("ManagedRedis is not started")
        return RedisEndpoint(url=f"redis://127.0.0.1:{self.port}/0", password=self.password)

    def start(self) -> ManagedRedis:
        if shutil.which(self.binary) is None:
            raise FileNotFoundError(
                f"{self.binary} not found: install it (scripts/install.sh does: apt-get install -y "
                "redis-server), or set replay.redis_url, or turn replay off with replay.enabled=false"
            )
        self._dir = self._dir or tempfile.mkdtemp(prefix="specd-redis-")
        port = self.port or free_port()
        conf = Path(self._dir) / "redis.conf"
        # The password goes into a 0600 config file, not argv, where `ps` would show it to every user.
        lines = [
            "bind 127.0.0.1", f"port {port}", f"requirepass {self.password}", "protected-mode yes",
            'save ""', "appendonly no", f"dir {self._dir}", "daemonize no", "loglevel warning",
            f"logfile {self._dir}/redis.log",
        ]
        if self.maxmemory_mb:
            lines += [f"maxmemory {self.maxmemory_mb}mb", "maxmemory-policy noeviction"]
        conf.write_text("\n".join(lines) + "\n")
        os.chmod(conf, 0o600)
        self.proc = subprocess.Popen([self.binary, str(conf)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        self.port = port
        self._wait_ready()
        log.info("managed redis-server (pid %d) on 127.0.0.1:%d", self.proc.pid, port)
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        client = self.endpoint.client(socket_timeout=0.5)
        try:
            while True:
                if self.proc is not None and self.proc.poll() is not None:
                    code = self.proc.returncode
                    raise RuntimeError(f"redis-server exited with {code}; see {self._dir}/redis.log")
                try:
                    if client.ping():
                        return
                except redis.RedisError:
                    if time.monotonic() > deadline:
                        raise
                time.sleep(0.05)
        finally:
            client.close()

    def ensure_running(self) -> bool:
        """Start the server again (same port and password, empty) if it died; True when it did. The
        replay writer reconnects by itself and the trainer re-creates its group on the empty stream."""
        if self.proc is None or self.proc.poll() is None:
            return False
        code = self.proc.returncode
        self.start()
        self.restarts += 1
        log.warning("managed redis-server had exited (%s): restarted on 127.0.0.1:%d", code, self.port)
        return True

    def stop(self, remove_files: bool = True) -> None:
        """Terminate the server (it keeps no data: the replay buffer is a cache of recent traffic)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if remove_files and self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> ManagedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def open_redis(replay_cfg) -> tuple[RedisEndpoint, ManagedRedis | None]:
    """The configured server, or a freshly started managed one (the caller stops it on exit)."""
    if replay_cfg.redis_url:
        return endpoint_from_config(replay_cfg), None
    managed = ManagedRedis(binary=replay_cfg.redis_server_bin).start()
    return managed.endpoint, managed
