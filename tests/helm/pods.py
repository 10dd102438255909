"""Pods as process trees for tests/helm/test_pods.py: each pod gets its own root directory (its /tmp,
$HOME, cache and data volumes), each container one `bash -c` process tree, and a kubelet-like supervisor
restarts a container whose process exits (restartPolicy Always). Every process of a pod carries the
pod's id in its environment, so the pod is killed exactly: its own processes by pid, nothing else."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil

MARKER = "SPECD_TEST_POD"


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# The pods' ports come from below the kernel's ephemeral range, each handed out once. A port picked by
# binding to 0 comes from that range, and between the pick and the pod's own bind any outgoing connection on
# the machine may take it as its source port; a restarted container binds the same port again, so such a
# collision lasted the whole test (a worker pod's raylet failed to start for 600 s in one CI run).
_EPHEMERAL_LOW = _ephemeral_low()
_next_port = random.randrange(10000, max(10001, _EPHEMERAL_LOW - 4000))


def free_ports(count: int = 1) -> int:
    """The first of `count` consecutive ports that nothing holds now, below the ephemeral range, none of
    them handed out before by this process."""
    global _next_port
    while True:
        first, _next_port = _next_port, _next_port + count
        if _next_port > _EPHEMERAL_LOW:
            raise RuntimeError(f"no free block of {count} ports below {_EPHEMERAL_LOW}")
        if all(_bindable(port) for port in range(first, first + count)):
            return first


def free_port() -> int:
    return free_ports(1)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


@dataclass
class Container:
    name: str
    command: str                     # run by bash -c, as KubeRay's args are
    env: dict[str, str]
    pre_stop: list[str] | None = None    # lifecycle.preStop.exec.command: run before its SIGTERM
    proc: subprocess.Popen | None = None
    restarts: int = 0


@dataclass
class Pod:
    name: str
    root: Path
    containers: list[Container] = field(default_factory=list)
    alive: bool = False
    uid: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    _threads: list[threading.Thread] = field(default_factory=list)
    _dirs: set[Path] = field(default_factory=set)      # the pod's mounts: there again after a restart

    def path(self, *parts: str) -> Path:
        p = self.root.joinpath(*parts)
        p.mkdir(parents=True, exist_ok=True)
        self._dirs.add(p)
        return p

    def _spawn(self, c: Container) -> None:
        log = open(self.path("logs") / f"{c.name}.log", "ab")   # noqa: SIM115 (the child owns it)
        env = {**c.env, MARKER: self.uid}
        c.proc = subprocess.Popen(["bash", "-c", c.command], env=env, cwd=self.path("work"),
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def _supervise(self, c: Container) -> None:
        while self.alive:
            if c.proc is not None and c.proc.poll() is not None and self.alive:
                time.sleep(1.0)                              # the kubelet's back-off, shortened
                if self.alive:
                    c.restarts += 1
                    self._spawn(c)
            time.sleep(0.5)

    def start(self, fresh: bool = False) -> None:
        """fresh: the pod was deleted and is created again: its emptyDirs (everything but `volume`, a
        PersistentVolumeClaim's stand-in, and the logs) start empty."""
        if fresh:
            for child in self.root.iterdir():
                if child.name not in ("volume", "logs", "config"):
                    shutil.rmtree(child, ignore_errors=True)
            for d in self._dirs:
                d.mkdir(parents=True, exist_ok=True)
        self.alive = True
        self._threads = []
        for c in self.containers:
            self._spawn(c)
            t = threading.Thread(target=self._supervise, args=(c,), daemon=True)
            t.start()
            self._threads.append(t)

    def processes(self) -> list[psutil.Process]:
        out = []
        work = str(self.root / "work")
        for p in psutil.process_iter():
            try:
                # Ray's dashboard agent gets an environment of its own (no marker) and leaves the
                # container's process group, but keeps its working directory: found by neither, a killed
                # pod's agents outlived it, holding the pod's fixed agent ports
                if p.environ().get(MARKER) == self.uid or p.cwd().startswith(work):
                    out.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return out

    def kill(self) -> None:
        """The pod is deleted: SIGKILL to every process of it (the node's view of a lost pod)."""
        self.alive = False
        for t in self._threads:
            t.join(timeout=5)
        for c in self.containers:
            # the container's own process group (a process that rewrites its environment, as
            # redis-server's title does, is not found by the marker)
            if c.proc is not None and c.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(c.proc.pid, signal.SIGKILL)
        for p in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
        for c in self.containers:
            if c.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    c.proc.wait(timeout=30)

    def terminate(self, grace_s: float) -> float:
        """The pod deleted gracefully, as the kubelet deletes it (a drain, a rolling update): SIGTERM to
        each container's main process at once, SIGKILL to what is left after the grace period. Returns
        the seconds until every container had exited."""
        self.alive = False
        for t in self._threads:
            t.join(timeout=5)
        t0 = time.monotonic()

        def stop(c: Container) -> None:         # per container, all at once: its preStop, then SIGTERM
            if c.pre_stop:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    subprocess.run(c.pre_stop, env=c.env, timeout=grace_s)
            if c.proc is not None and c.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(c.proc.pid, signal.SIGTERM)

        for c in self.containers:
            threading.Thread(target=stop, args=(c,), daemon=True).start()
        while time.monotonic() - t0 < grace_s and any(
                c.proc is not None and c.proc.poll() is None for c in self.containers):
            time.sleep(0.2)
        took = time.monotonic() - t0
        self.kill()
        return took

    def stop(self) -> None:
        """Graceful end of the test: SIGTERM, then what is left is killed."""
        self.alive = False
        for p in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.5)
        self.kill()

    def log_tail(self, chars: int = 3000) -> str:
        parts = []
        for c in self.containers:
            path = self.root / "logs" / f"{c.name}.log"
            if path.exists():
                parts.append(f"--- {self.name}/{c.name} ---\n" + path.read_text(errors="replace")[-chars:])
        return "\n".join(parts)


def self_signed(directory: Path, name: str) -> tuple[str, str]:
    """A self-signed certificate for localhost and 127.0.0.1 (as tests/cluster/test_auth.py makes one);
    returns (cert path, key path)."""
    import datetime
    import ipaddress

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


def http_ok(port: int, path: str) -> bool:
    """The kubelet's httpGet probe: success is a 2xx/3xx answer within the timeout."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return 200 <= r.status < 400
    except OSError:
        return False


def tcp_ok(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return True
    except OSError:
        return False


def grpc_serving(port: int) -> bool:
    """The kubelet's grpc probe: grpc.health.v1 Check with the empty service name, plaintext."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        except grpc.RpcError:
            return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def wait_for(check, timeout: float, what: str, period: float = 1.0, tail=None) -> float:
    """Seconds until check() held; fails with the pods' logs after `timeout`."""
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{what}: not within {timeout:.0f} s\n{tail() if tail else ''}")
        time.sleep(period)
    return time.monotonic() - t0
