"""The Redis that holds the replay stream: specd's own redis-server, or the one configured.

With `replay.redis_url` unset (the embedded default), `ManagedRedis` starts redis-server with a
generated password, no persistence, no TCP port, and a unix socket in a private temporary directory
(mode 0700, owned by this user), and stops it on exit. A TCP port would be a race: a port found free is
released before redis-server binds it, and a local process that took it meanwhile would receive the
password and every replay record. The socket's directory admits only this user, so only processes of
this user on this machine reach the server: the router's replay writer and the trainer actor, which
Ray runs on the same node. A multi-node cluster (trainer on another node) needs an external Redis
(`replay.redis_url`). With a URL set, `connect` uses that server: its password comes from
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
    """A port free now (it may be taken before it is bound: for tests and local tools, not for servers
    that hold secrets)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ManagedRedis:
    """A private redis-server on a unix socket: `start()`, `endpoint`, `stop()` (also a context manager).

    A restart (`stop()` then `start()`, or `ensure_running()`) keeps the socket path and password, so
    clients reconnect by themselves. `port` is for an operator who wants TCP on 127.0.0.1 instead."""

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
    def socket_path(self) -> str | None:
        """The unix socket the server listens on (None on TCP or before the first start)."""
        if self.port is not None or self._dir is None:
            return None
        return str(Path(self._dir) / "redis.sock")

    @property
    def endpoint(self) -> RedisEndpoint:
        if self.port is not None:
            return RedisEndpoint(url=f"redis://127.0.0.1:{self.port}/0", password=self.password)
        if self.socket_path is None:
            raise RuntimeError("ManagedRedis is not started")
        return RedisEndpoint(url=f"unix://{self.socket_path}", password=self.password)   # db 0

    def _private_dir(self) -> str:
        """This server's directory, created 0700 by this process; the same path again after a stop
        (unless someone else created it meanwhile: then a new one, and a new socket path)."""
        if self._dir is not None:
            try:
                os.mkdir(self._dir, 0o700)
            except FileExistsError:
                st = os.stat(self._dir)
                if st.st_uid == os.getuid() and (st.st_mode & 0o077) == 0:
                    return self._dir
                self._dir = None
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="specd-redis-")   # mode 0700
        os.chmod(self._dir, 0o700)
        return self._dir

    def start(self) -> ManagedRedis:
        if shutil.which(self.binary) is None:
            raise FileNotFoundError(
                f"{self.binary} not found: install it (scripts/install.sh does: apt-get install -y "
                "redis-server), or set replay.redis_url, or turn replay off with replay.enabled=false"
            )
        directory = self._private_dir()
        conf = Path(directory) / "redis.conf"
        if self.port is None:       # no TCP listener at all: the socket in the private directory only
            listen = ["port 0", f"unixsocket {self.socket_path}", "unixsocketperm 700"]
        else:
            listen = ["bind 127.0.0.1", f"port {self.port}"]
        # The password goes into a 0600 config file, not argv, where `ps` would show it to every user.
        lines = [
            *listen, f"requirepass {self.password}", "protected-mode yes",
            'save ""', "appendonly no", f"dir {directory}", "daemonize no", "loglevel warning",
            f"logfile {directory}/redis.log",
        ]
        if self.maxmemory_mb:
            lines += [f"maxmemory {self.maxmemory_mb}mb", "maxmemory-policy noeviction"]
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        self.proc = subprocess.Popen([self.binary, str(conf)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        self._wait_ready()
        log.info("managed redis-server (pid %d) on %s", self.proc.pid, self.where)
        return self

    @property
    def where(self) -> str:
        return f"127.0.0.1:{self.port}" if self.port is not None else f"unix socket {self.socket_path}"

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
        log.warning("managed redis-server had exited (%s): restarted on %s", code, self.where)
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
            # the path is remembered: a later start() makes it again (0700) and keeps the endpoint
            shutil.rmtree(self._dir, ignore_errors=True)

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


def versions_spec(cfg, endpoint) -> dict:
    """Where DraftWorkers and the trainer find published drafter versions: Redis, under a prefix beside
    the replay stream (workers/drafters/redis_versions.py). A configured server's password stays in each
    process's environment (replay.password_env: every pod has the Secret); a managed server's generated
    one travels, as the trainer's endpoint does."""
    redis = {"url": endpoint.url, "ssl_ca_certs": endpoint.ssl_ca_certs,
             "ssl_certfile": endpoint.ssl_certfile, "ssl_keyfile": endpoint.ssl_keyfile}
    if cfg.replay.redis_url:
        redis["password_env"] = cfg.replay.password_env
    else:
        redis["password"] = endpoint.password
    return {"redis": redis, "prefix": f"{cfg.replay.stream}:drafters"}
