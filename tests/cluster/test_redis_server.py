"""The managed redis-server: listens on a unix socket in a private directory (no TCP port) with a
password, stops cleanly and restarts on the same socket; a configured URL (password from the
environment) is used instead."""

from __future__ import annotations

import os
import shutil
import stat

import psutil
import pytest
import redis

from specd.cluster.redis_server import ManagedRedis, endpoint_from_config, open_redis
from specd.configs.schema import ReplayConfig

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")


@pytest.mark.slow
def test_managed_redis_requires_its_password_and_stops() -> None:
    with ManagedRedis() as server:
        ep = server.endpoint
        assert ep.url.startswith("unix://") and ep.url.endswith("/redis.sock")
        assert ep.password and ep.password not in repr(ep)
        client = ep.client()
        client.xadd("s", {"r": b"x"})
        assert client.xlen("s") == 1
        anonymous = redis.Redis(unix_socket_path=server.socket_path, socket_timeout=1)
        with pytest.raises(redis.AuthenticationError):
            anonymous.xlen("s")
        pid = server.proc.pid
    with pytest.raises(redis.ConnectionError):
        ep.client(socket_timeout=0.5).ping()
    assert server.proc is None and pid > 0


@pytest.mark.slow
def test_managed_redis_listens_on_no_tcp_port_and_its_socket_dir_is_private() -> None:
    with ManagedRedis() as server:
        proc = psutil.Process(server.proc.pid)
        assert proc.net_connections(kind="inet") == []          # no TCP (or UDP) socket, listening or not
        [unix] = [c for c in proc.net_connections(kind="unix") if c.laddr]
        assert unix.laddr == server.socket_path
        directory = os.path.dirname(server.socket_path)
        st = os.stat(directory)
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
        assert stat.S_IMODE(os.stat(os.path.join(directory, "redis.conf")).st_mode) == 0o600  # the password
        assert stat.S_IMODE(os.stat(server.socket_path).st_mode) & 0o077 == 0


@pytest.mark.slow
def test_restart_keeps_the_socket_and_the_endpoint() -> None:
    server = ManagedRedis().start()
    try:
        ep = server.endpoint
        server.stop()
        server.start()
        assert server.endpoint == ep
        assert ep.client().ping()
        assert stat.S_IMODE(os.stat(os.path.dirname(server.socket_path)).st_mode) == 0o700
    finally:
        server.stop()


@pytest.mark.slow
def test_configured_url_takes_its_password_from_the_environment(monkeypatch) -> None:
    with ManagedRedis() as server:
        monkeypatch.setenv("MY_REDIS_PW", server.password)
        cfg = ReplayConfig(redis_url=server.endpoint.url, password_env="MY_REDIS_PW")
        ep, managed = open_redis(cfg)
        assert managed is None
        assert ep.client().ping()
        monkeypatch.delenv("MY_REDIS_PW")
        with pytest.raises(redis.AuthenticationError):
            endpoint_from_config(cfg).client().ping()


@pytest.mark.slow
def test_an_operator_may_still_ask_for_tcp_on_loopback() -> None:
    from specd.cluster.redis_server import free_port

    with ManagedRedis(port=free_port()) as server:
        assert server.endpoint.url == f"redis://127.0.0.1:{server.port}/0" and server.socket_path is None
        assert server.endpoint.client().ping()


def test_tls_options_reach_the_client() -> None:
    cfg = ReplayConfig(redis_url="rediss://example.invalid:6380/0", tls_ca_certs="/ca.pem")
    kwargs = endpoint_from_config(cfg).client().connection_pool.connection_kwargs
    assert kwargs["ssl_ca_certs"] == "/ca.pem"
