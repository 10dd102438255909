"""The managed redis-server: starts on a free loopback port with a password, stops cleanly; a configured
URL (password from the environment) is used instead."""

from __future__ import annotations

import shutil

import pytest
import redis

from specd.cluster.redis_server import ManagedRedis, endpoint_from_config, open_redis
from specd.configs.schema import ReplayConfig

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")


def test_managed_redis_requires_its_password_and_stops() -> None:
    with ManagedRedis() as server:
        ep = server.endpoint
        assert ep.url.startswith("redis://127.0.0.1:")
        assert ep.password and ep.password not in repr(ep)
        client = ep.client()
        client.xadd("s", {"r": b"x"})
        assert client.xlen("s") == 1
        anonymous = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=1)
        with pytest.raises(redis.AuthenticationError):
            anonymous.xlen("s")
        pid = server.proc.pid
    with pytest.raises(redis.ConnectionError):
        ep.client(socket_timeout=0.5).ping()
    assert server.proc is None and pid > 0


def test_restart_on_the_same_port_keeps_the_endpoint() -> None:
    server = ManagedRedis().start()
    try:
        ep = server.endpoint
        server.stop()
        server.start()
        assert server.endpoint == ep
        assert ep.client().ping()
    finally:
        server.stop()


def test_configured_url_takes_its_password_from_the_environment(monkeypatch) -> None:
    with ManagedRedis() as server:
        monkeypatch.setenv("MY_REDIS_PW", server.password)
        cfg = ReplayConfig(redis_url=f"redis://127.0.0.1:{server.port}/0", password_env="MY_REDIS_PW")
        ep, managed = open_redis(cfg)
        assert managed is None
        assert ep.client().ping()
        monkeypatch.delenv("MY_REDIS_PW")
        with pytest.raises(redis.AuthenticationError):
            endpoint_from_config(cfg).client().ping()


def test_tls_options_reach_the_client() -> None:
    cfg = ReplayConfig(redis_url="rediss://example.invalid:6380/0", tls_ca_certs="/ca.pem")
    kwargs = endpoint_from_config(cfg).client().connection_pool.connection_kwargs
    assert kwargs["ssl_ca_certs"] == "/ca.pem"
