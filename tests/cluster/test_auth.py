"""TLS and bearer-token auth on the real gRPC router (fake workers): a certificate made here, calls
without or with a wrong token get UNAUTHENTICATED, with the token they succeed; health and reflection
stay open; mutual TLS refuses a client without a certificate; the plaintext health port answers."""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from fake_workers import EOS, FakeDrafter, FakeTarget
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from test_router import BOUNDS, LoopThread, ToyCodec

from specd.cluster.auth import BearerAuthInterceptor, ServerSecurity, read_tokens
from specd.cluster.client import Security, SpecdClient
from specd.cluster.router import Backend, GrpcServer, SpecdServicer
from specd.cluster.scheduler import Scheduler
from specd.configs.schema import ServerConfig

TOKEN = "s3cret-token-for-tests"


def self_signed(directory: Path, name: str) -> tuple[str, str]:
    """A self-signed certificate for localhost and 127.0.0.1; returns (cert path, key path)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


@dataclass
class Running:
    address: str
    health_port: int | None
    cert: str
    client_cert: tuple[str, str] | None


def start(lt: LoopThread, server_cfg: ServerConfig, stack: list, health: bool = False) -> GrpcServer:
    """health: a plaintext health port too, on a port the server binds itself (0) and reports back."""
    target = FakeTarget(max_slots=2, delay=0.001)
    drafter = FakeDrafter(target, delay=0.001)

    async def up():
        sched = Scheduler([(target, drafter)], capacity=2, max_queue=4, max_running=2, pipeline_groups=1,
                          eos_token_ids=[EOS])
        await sched.start()
        srv = GrpcServer(SpecdServicer(), server_cfg.host, port=0,
                         security=ServerSecurity.from_config(server_cfg),
                         max_message_bytes=server_cfg.max_message_bytes,
                         health_port=0 if health else None)
        await srv.start()
        await srv.attach(Backend(sched, ToyCodec(), BOUNDS, "fake", (EOS,), 1, 1, 4))
        stack.append((srv, sched))
        return srv

    return lt.run(up())


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tls")
    cert, key = self_signed(tmp, "server")
    token_file = tmp / "tokens"
    token_file.write_text(f"old-token\n{TOKEN}\n")
    lt, stack = LoopThread(), []
    cfg = ServerConfig(tls_cert_file=cert, tls_key_file=key, auth_token_file=str(token_file),
                       max_message_bytes=1 << 16)
    srv = start(lt, cfg, stack, health=True)
    yield Running(f"localhost:{srv.port}", srv.health_port, cert, None)
    for srv, sched in stack:
        lt.run(srv.stop(0))
        lt.run(sched.stop())
    lt.close()


def call_code(client: SpecdClient) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        client.generate(text="hi", max_new_tokens=4)
    return err.value.code()


def test_without_or_with_a_wrong_token_is_unauthenticated(secured) -> None:
    with SpecdClient(secured.address, timeout=30, security=Security(ca_file=secured.cert)) as c:
        assert call_code(c) == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            list(c.stream(text="hi", max_new_tokens=4))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            c.server_info()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "bearer token" in err.value.details()
        # health and reflection stay open: probes and grpcurl need no token
        assert c.health() == "SERVING"
        assert "specd.v1.Specd" in set(ProtoReflectionDescriptorDatabase(c.channel).get_services())
    wrong = Security(ca_file=secured.cert, token="not-the-token")
    with SpecdClient(secured.address, timeout=30, security=wrong) as c:
        assert call_code(c) == grpc.StatusCode.UNAUTHENTICATED


def test_with_the_token_over_tls_succeeds(secured) -> None:
    for token in (TOKEN, "old-token"):      # every line of the token file is accepted (rotation)
        with SpecdClient(secured.address, timeout=30,
                         security=Security(ca_file=secured.cert, token=token)) as c:
            out = c.generate(text="hi", max_new_tokens=4, ignore_eos=True)
            assert len(out.token_ids) == 4 and out.finish_reason == "length"
            chunks = list(c.stream(text="hi", max_new_tokens=3, ignore_eos=True))
            assert chunks[-1].finish_reason == "length"
            assert c.server_info()["model"] == "fake"


def test_a_list_of_router_addresses_over_tls_names_the_certificate(secured) -> None:
    """`ipv4:a:port,b:port` says no host name to check the certificate against; server_name does."""
    port = secured.address.rsplit(":", 1)[1]
    listed = f"ipv4:127.0.0.1:{port},127.0.0.1:{port}"
    with SpecdClient(listed, timeout=10, security=Security(ca_file=secured.cert, token=TOKEN)) as c:
        assert call_code(c) == grpc.StatusCode.UNAVAILABLE          # the hostname check fails
    named = Security(ca_file=secured.cert, token=TOKEN, server_name="localhost")
    with SpecdClient(listed, timeout=30, security=named) as c:
        assert len(c.generate(text="hi", max_new_tokens=4, ignore_eos=True).token_ids) == 4
    wrong = Security(ca_file=secured.cert, token=TOKEN, server_name="elsewhere.example")
    with SpecdClient(listed, timeout=10, security=wrong) as c:
        assert call_code(c) == grpc.StatusCode.UNAVAILABLE


def test_specd_generate_names_the_certificate_of_a_listed_address(secured, monkeypatch, capsys) -> None:
    from specd.cluster.cli import main

    port = secured.address.rsplit(":", 1)[1]
    monkeypatch.setenv("SPECD_TOKEN", TOKEN)
    listed = f"ipv4:127.0.0.1:{port},127.0.0.1:{port}"
    base = ["generate", "hi", "--raw", "--address", listed, "--ca-file", secured.cert,
            "--max-new-tokens", "3", "--timeout", "20"]
    assert main(base) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err                  # no name to check the certificate
    assert main([*base, "--server-name", "localhost"]) == 0
    assert "3 tokens" in capsys.readouterr().err
    assert main([*base, "--server-name", "localhost", "--http"]) == 2
    assert "--server-name is for gRPC" in capsys.readouterr().err


def test_plaintext_client_cannot_talk_to_the_tls_port(secured) -> None:
    with SpecdClient(secured.address, timeout=5, security=Security(token=TOKEN)) as c:
        assert call_code(c) == grpc.StatusCode.UNAVAILABLE


def test_message_size_limit_from_config(secured) -> None:
    with SpecdClient(secured.address, timeout=30, security=Security(ca_file=secured.cert, token=TOKEN)) as c:
        assert call_code_text(c, "x" * (1 << 17)) == grpc.StatusCode.RESOURCE_EXHAUSTED


def call_code_text(client: SpecdClient, text: str) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        client.generate(text=text, max_new_tokens=4)
    return err.value.code()


def test_plaintext_health_port_for_probes(secured) -> None:
    assert secured.health_port
    with grpc.insecure_channel(f"127.0.0.1:{secured.health_port}") as channel:
        resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_mutual_tls_needs_a_client_certificate(tmp_path) -> None:
    cert, key = self_signed(tmp_path, "server")
    client_cert, client_key = self_signed(tmp_path, "client")
    lt, stack = LoopThread(), []
    cfg = ServerConfig(tls_cert_file=cert, tls_key_file=key, tls_client_ca_file=client_cert)
    try:
        srv = start(lt, cfg, stack)
        address = f"localhost:{srv.port}"
        with SpecdClient(address, timeout=5, security=Security(ca_file=cert)) as c:
            assert call_code(c) == grpc.StatusCode.UNAVAILABLE
        mutual = Security(ca_file=cert, cert_file=client_cert, key_file=client_key)
        with SpecdClient(address, timeout=30, security=mutual) as c:
            assert c.generate(text="hi", max_new_tokens=2).token_ids
    finally:
        for srv, sched in stack:
            lt.run(srv.stop(0))
            lt.run(sched.stop())
        lt.close()


def test_tokens_from_file_and_env_and_bad_settings(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPECD_TEST_TOKEN", "from-env")
    f = tmp_path / "t"
    f.write_text("\n a \n\nb\n")
    assert read_tokens(str(f), "SPECD_TEST_TOKEN") == ("a", "b", "from-env")
    with pytest.raises(ValueError, match="server.auth_token_env='SPECD_UNSET_VAR'"):
        read_tokens(None, "SPECD_UNSET_VAR")
    f.write_text("\n")
    with pytest.raises(ValueError, match="holds no token"):
        read_tokens(str(f))
    with pytest.raises(ValueError, match="must be set together"):
        ServerSecurity.from_config(ServerConfig(tls_cert_file=str(f)))
    with pytest.raises(ValueError, match="server.tls_key_file='/nonexistent'"):
        ServerSecurity.from_config(ServerConfig(tls_cert_file=str(f), tls_key_file="/nonexistent"))
    assert ServerSecurity.from_config(ServerConfig()) == ServerSecurity(None, ())
    auth = BearerAuthInterceptor(("tok",))
    assert auth.allowed("Bearer tok") and not auth.allowed("Bearer tok2") and not auth.allowed("tok")
    assert not auth.allowed(None) and not auth.allowed("Basic tok")


def test_specd_generate_takes_tls_and_token_options(secured, monkeypatch, tmp_path, capsys) -> None:
    from specd.cluster.cli import main

    base = ["generate", "hi", "--raw", "--address", secured.address, "--ca-file", secured.cert,
            "--max-new-tokens", "3"]
    monkeypatch.delenv("SPECD_TOKEN", raising=False)
    assert main(base) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    monkeypatch.setenv("SPECD_TOKEN", TOKEN)
    assert main(base) == 0
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    monkeypatch.delenv("SPECD_TOKEN")
    assert main([*base, "--token-file", str(token_file)]) == 0
    assert "3 tokens" in capsys.readouterr().err


def test_open_non_loopback_bind_refused_at_start(capsys) -> None:
    """`specd serve server.host=0.0.0.0` without a token stops at config validation, naming the keys."""
    from specd.cluster.cli import main

    assert main(["serve", "server.host=0.0.0.0", "ray.address=none-needed"]) == 2
    err = capsys.readouterr().err
    assert "server.host='0.0.0.0'" in err
    for key in ("server.auth_token_file", "server.auth_token_env", "server.insecure=true"):
        assert key in err
    for host in ("0.0.0.0", "10.1.2.3", "::", "router.example"):
        with pytest.raises(ValueError, match="server.auth_token_file or server.auth_token_env"):
            ServerSecurity.from_config(ServerConfig(host=host))
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1"):
        assert ServerSecurity.from_config(ServerConfig(host=host)).insecure is False


def test_insecure_on_purpose_is_logged_and_exported(caplog) -> None:
    from prometheus_client import CollectorRegistry

    from specd.cluster.metrics import SpecdMetrics
    from specd.configs import load_config

    cfg = load_config(["server.host=0.0.0.0", "server.insecure=true"])
    with caplog.at_level("WARNING", logger="specd.cluster.auth"):
        security = ServerSecurity.from_config(cfg.server)
    assert security.insecure
    assert any("server.insecure=true" in r.getMessage() and "anyone who reaches the port" in r.getMessage()
               for r in caplog.records)
    metrics = SpecdMetrics(CollectorRegistry())
    metrics.server_insecure.set(1.0 if security.insecure else 0.0)
    assert metrics.registry.get_sample_value("specd_server_insecure") == 1.0


def stop_all(lt: LoopThread, stack: list) -> None:
    for srv, sched in stack:
        lt.run(srv.stop(0))
        lt.run(sched.stop())
    lt.close()


def test_off_loopback_admin_needs_its_own_token(tmp_path, monkeypatch, capsys, caplog) -> None:
    """On 0.0.0.0 a user token never authorizes SetConfig; without an admin token there is no admin
    service at all (said at start); with one, only it works."""
    from specd.cluster.cli import main

    (tmp_path / "user").write_text(TOKEN)
    (tmp_path / "admin").write_text("admin-secret")
    lt, stack = LoopThread(), []
    try:
        with caplog.at_level("WARNING", logger="specd.cluster.auth"):
            srv = start(lt, ServerConfig(host="0.0.0.0", auth_token_file=str(tmp_path / "user")), stack)
        said = [r.getMessage() for r in caplog.records]
        assert any("admin service" in m and "not served" in m for m in said), said
        address = f"127.0.0.1:{srv.port}"
        monkeypatch.delenv("SPECD_ADMIN_TOKEN", raising=False)
        monkeypatch.setenv("SPECD_TOKEN", TOKEN)      # `specd admin set` falls back to the user token
        assert main(["admin", "set", "spec.gamma=2", "--address", address]) == 1
        err = capsys.readouterr().err
        assert "UNIMPLEMENTED" in err and "no admin service" in err
        with SpecdClient(address, timeout=30, security=Security(token=TOKEN)) as c:
            services = set(ProtoReflectionDescriptorDatabase(c.channel).get_services())
            assert "specd.v1.SpecdAdmin" not in services
            assert c.generate(text="hi", max_new_tokens=2).token_ids       # the user API still works

        srv = start(lt, ServerConfig(host="0.0.0.0", auth_token_file=str(tmp_path / "user"),
                                     admin_token_file=str(tmp_path / "admin")), stack)
        address = f"127.0.0.1:{srv.port}"
        assert main(["admin", "set", "spec.gamma=2", "--address", address]) == 1
        assert "UNAUTHENTICATED" in capsys.readouterr().err
    finally:
        stop_all(lt, stack)
    auth = BearerAuthInterceptor(("user",), (), admin_falls_back=False)
    assert auth.allowed("Bearer user") and not auth.allowed("Bearer user", admin=True)
    loopback = BearerAuthInterceptor(("user",), ())
    assert loopback.allowed("Bearer user", admin=True)


def test_token_file_is_re_read_on_change(tmp_path, caplog) -> None:
    token_file = tmp_path / "tokens"
    token_file.write_text("first-token\n")
    lt, stack = LoopThread(), []
    try:
        srv = start(lt, ServerConfig(auth_token_file=str(token_file)), stack)

        def code(token: str) -> grpc.StatusCode:
            with SpecdClient(srv.address, timeout=30, security=Security(token=token)) as c:
                try:
                    c.generate(text="hi", max_new_tokens=2)
                except grpc.RpcError as err:
                    return err.code()
                return grpc.StatusCode.OK

        assert code("first-token") == grpc.StatusCode.OK
        token_file.write_text("second-token\n")          # rotated: no restart
        assert code("second-token") == grpc.StatusCode.OK
        assert code("first-token") == grpc.StatusCode.UNAUTHENTICATED
        with caplog.at_level("WARNING", logger="specd.cluster.auth"):
            token_file.write_text("\n")                  # a half-written rotation keeps the last tokens
            assert code("second-token") == grpc.StatusCode.OK
        assert any("keeping the last tokens" in r.getMessage() for r in caplog.records)
        assert not any("second-token" in r.getMessage() for r in caplog.records)
    finally:
        stop_all(lt, stack)


def tls_version(port: int, ca: str, maximum: ssl.TLSVersion | None = None) -> str:
    """The TLS version a handshake with the server settles on (raises ssl.SSLError if none)."""
    ctx = ssl.create_default_context(cafile=ca)
    ctx.set_alpn_protocols(["h2"])
    if maximum is not None:
        ctx.minimum_version = ssl.TLSVersion.TLSv1
        ctx.set_ciphers("DEFAULT:@SECLEVEL=0")      # let this client offer old versions at all
        ctx.maximum_version = maximum
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            ctx.wrap_socket(raw, server_hostname="localhost") as tls:
        return tls.version()


@pytest.mark.filterwarnings("ignore:ssl.TLSVersion.TLSv1:DeprecationWarning")
def test_tls_versions_and_certificate_reload(tmp_path, caplog) -> None:
    cert, key = self_signed(tmp_path, "server")
    lt, stack = LoopThread(), []
    try:
        srv = start(lt, ServerConfig(tls_cert_file=cert, tls_key_file=key), stack)
        old_ca = str(tmp_path / "old-ca.crt")
        Path(old_ca).write_bytes(Path(cert).read_bytes())
        # TLS 1.3 offered and chosen, 1.2 accepted, 1.1 refused by the server
        assert tls_version(srv.port, old_ca) == "TLSv1.3"
        assert tls_version(srv.port, old_ca, ssl.TLSVersion.TLSv1_2) == "TLSv1.2"
        with pytest.raises(ssl.SSLError) as refused:       # the server hangs up on a TLS 1.1 hello
            tls_version(srv.port, old_ca, ssl.TLSVersion.TLSv1_1)
        assert "NO_PROTOCOLS_AVAILABLE" not in str(refused.value)     # (this client did offer 1.1)
        address = f"localhost:{srv.port}"
        with SpecdClient(address, timeout=30, security=Security(ca_file=old_ca)) as c:
            assert c.generate(text="hi", max_new_tokens=2).token_ids
        new_dir = tmp_path / "new"
        new_dir.mkdir()
        new_cert, new_key = self_signed(new_dir, "server")      # a new key pair, written in place
        Path(cert).write_bytes(Path(new_cert).read_bytes())
        Path(key).write_bytes(Path(new_key).read_bytes())
        with SpecdClient(address, timeout=30, security=Security(ca_file=new_cert)) as c:
            assert c.generate(text="hi", max_new_tokens=2).token_ids
        with pytest.raises(ssl.SSLError, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
            tls_version(srv.port, old_ca)                  # the old certificate is gone
        assert srv.security.certificates.reloads == 1
    finally:
        stop_all(lt, stack)
    with pytest.raises(ValueError, match="grpc/grpc#37305"):
        ServerSecurity.from_config(ServerConfig(tls_cert_file=cert, tls_key_file=key, tls_min_version="1.3"))
    other_cert, _ = self_signed(tmp_path / "new", "other")
    with pytest.raises(ValueError, match="do not load as a pair"):
        ServerSecurity.from_config(ServerConfig(tls_cert_file=other_cert, tls_key_file=key))
