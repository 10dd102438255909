"""Pods as process trees for tests/helm/test_pods.py: each pod gets its own root directory (its /tmp,
$HOME, cache and data volumes), each container one `bash -c` process tree, and a kubelet-like supervisor
restarts a container whose process exits (restartPolicy Always). Every process of a pod carries the
pod's id in its environment, so the pod is killed exactly: its own processes by pid, nothing else.

What Kubernetes isolates, the pods here isolate too (`unshare`, `nsenter`; root only):
- processes: each container its own PID namespace, its main process PID 1 there, as a container
  runtime starts it; a pod whose spec says shareProcessNamespace gets one namespace for the pod, held by
  a pause process (PID 1, reaping orphans, as the kubelet's pause container does) that each container
  enters. A process sees only its namespace's processes (/proc is mounted for it): a Ray driver finds
  its node's raylet by its process, so this is what decides whether a router can join its node.
- mounts: each namespace has its own mount view: the pod's own tmp directory on /tmp (the emptyDir
  its containers share), its home and cache directories at the paths the spec mounts them
  (/home/specd, /var/cache/specd: a path the router hands its actors in their config names each pod's
  own, as in Kubernetes), a tmpfs of the pod's size on /dev/shm (a Memory emptyDir there, else a
  container runtime's 64 MB default), and every other pod's directory covered by an empty tmpfs.
- network: not isolated. A network namespace of its own has only its own loopback; pods reaching each
  other would need a bridge, a veth pair and an address per pod, created and removed as root on a
  machine others share, and the Services' names resolved to them. Pods share the host's 127.0.0.1 and
  each has ports of its own (tests/helm/release.py)."""

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
CONTAINER_MARKER = "SPECD_TEST_CONTAINER"
RUNTIME_SHM = "64m"         # a container runtime's /dev/shm when the pod mounts none there
# the pause process: PID 1 of a pod's shared namespace, reaping the orphans reparented to it
_PAUSE = ("import os, time\n"
          "while True:\n    try:\n        os.wait()\n    except ChildProcessError:\n        time.sleep(1)")
# a container's process, once in its namespaces: into its working directory, then its command
_ENTER = 'cd "$1" && exec bash -c "$2"'


def isolation_available() -> str | None:
    """None when this machine can give pods their own PID and mount namespaces; else why not."""
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        return "needs util-linux unshare and nsenter"
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "--", "bash", "-c",
                            "mount -t tmpfs probe /mnt && umount /mnt && test $$ = 1"],
                           capture_output=True, text=True, timeout=30)
    return None if probe.returncode == 0 else f"cannot make PID and mount namespaces: {probe.stderr.strip()}"


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
    share_processes: bool = False       # the rendered spec's shareProcessNamespace
    shm: str = RUNTIME_SHM              # the size of its /dev/shm (tmpfs size=)
    hidden: list[Path] = field(default_factory=list)     # other pods' directories, covered in its view
    # mount path -> the pod's directory of that name; their parents are covered by a tmpfs in the pod's
    # view (nothing is made on the host), so only paths below /home or /var/cache
    volumes: dict[str, str] = field(default_factory=dict)
    _pause: subprocess.Popen | None = None
    _threads: list[threading.Thread] = field(default_factory=list)
    _dirs: set[Path] = field(default_factory=set)      # the pod's mounts: there again after a restart

    def path(self, *parts: str) -> Path:
        p = self.root.joinpath(*parts)
        p.mkdir(parents=True, exist_ok=True)
        self._dirs.add(p)
        return p

    def _mounts(self) -> str:
        """Shell commands, run in a new mount namespace, that give it the pod's view."""
        tmp, work = self.path("tmp"), self.path("work")
        cmds = [f"mount --bind {tmp} /tmp", f"mount -t tmpfs -o size={self.shm} shm /dev/shm"]
        parents = sorted({str(Path(target).parent) for target in self.volumes})
        assert set(parents) <= {"/home", "/var/cache"}, parents
        cmds += [f"mount -t tmpfs -o size=1m volumes {parent}" for parent in parents]
        for target, name in sorted(self.volumes.items()):
            cmds += [f"mkdir -p {target}", f"mount --bind {self.path(name)} {target}"]
        cmds += [f"mount -t tmpfs -o size=1m hidden {d}" for d in self.hidden if d.is_dir()]
        assert not any(work.is_relative_to(d) for d in self.hidden)
        return " && ".join(cmds)

    @staticmethod
    def _new_namespaces(then: list[str]) -> list[str]:
        return ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "--", *then]

    def _start_pause(self) -> None:
        """The pod's shared PID and mount namespace, held by its pause process."""
        self._pause = subprocess.Popen(
            self._new_namespaces(["bash", "-c", f"{self._mounts()} && exec python3 -c \"$0\"", _PAUSE]),
            env={"PATH": os.environ["PATH"], MARKER: self.uid}, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True)
        # containers enter it once its mounts are made: when its PID 1 runs the pause itself
        wait_for(lambda: "python" in _name(self._pause_pid()), 30, f"{self.name}: pause process", period=0.1)

    def _pause_pid(self) -> int | None:
        return main_pid(self._pause)

    def _spawn(self, c: Container) -> None:
        log = open(self.path("logs") / f"{c.name}.log", "ab")   # noqa: SIM115 (the child owns it)
        env = {**c.env, MARKER: self.uid, CONTAINER_MARKER: f"{self.uid}/{c.name}"}
        enter = ["bash", "-c", _ENTER, c.name, str(self.path("work")), c.command]
        if self.share_processes:
            argv = ["nsenter", f"--target={self._pause_pid()}", "--pid", "--mount", "--", *enter]
        else:
            argv = self._new_namespaces(["bash", "-c", f"{self._mounts()} && exec \"$@\"", "mounts", *enter])
        c.proc = subprocess.Popen(argv, env=env, cwd=self.path("work"),
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def _container_processes(self, c: Container) -> list[psutil.Process]:
        return [p for p in self.processes() if _environ(p).get(CONTAINER_MARKER) == f"{self.uid}/{c.name}"]

    def _supervise(self, c: Container) -> None:
        crashes, started = 0, time.monotonic()
        while self.alive:
            if c.proc is not None and c.proc.poll() is not None and self.alive:
                # the runtime ends what is left of an exited container (in a pod's shared namespace
                # its orphans live on under the pause process otherwise)
                for p in self._container_processes(c):
                    with contextlib.suppress(psutil.Error):
                        p.kill()
                # the kubelet's back-off, shortened (10 s doubling to 300 s there): growing, and apart
                # for each container. Restarted in step, the Ray nodes of every pod on this 2-core
                # machine crashed together again and again (a raylet gives up on an agent that has
                # not started within about 15 s)
                crashes = 0 if time.monotonic() - started > 60 else crashes + 1
                time.sleep(min(16.0, 2.0 ** crashes) * random.uniform(0.5, 1.0))
                if self.alive:
                    c.restarts += 1
                    started = time.monotonic()
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
        if self.share_processes:
            self._start_pause()
        for c in self.containers:
            self._spawn(c)
            t = threading.Thread(target=self._supervise, args=(c,), daemon=True)
            t.start()
            self._threads.append(t)

    def processes(self) -> list[psutil.Process]:
        return [p for p in psutil.process_iter() if _environ(p).get(MARKER) == self.uid]

    def pid_namespaces(self) -> dict[str, set[str]]:
        """The PID namespaces (as /proc/<pid>/ns/pid names them) of each container's main process and its
        descendants (not of unshare or nsenter, which stay in the host's; found from the main process, as
        redis-server's rewritten title hides the marker)."""
        out: dict[str, set[str]] = {}
        for c in self.containers:
            main = main_pid(c.proc)
            if main is None:
                continue
            with contextlib.suppress(psutil.Error):
                for p in [psutil.Process(main), *psutil.Process(main).children(recursive=True)]:
                    with contextlib.suppress(OSError):
                        out.setdefault(c.name, set()).add(os.readlink(f"/proc/{p.pid}/ns/pid"))
        return out

    def kill(self) -> None:
        """The pod is deleted: SIGKILL to every process of it (the node's view of a lost pod)."""
        self.alive = False
        for t in self._threads:
            t.join(timeout=5)
        # a namespace's PID 1 killed ends every process in it: each container's, and the pod's pause
        for proc in [c.proc for c in self.containers] + [self._pause]:
            if proc is not None and proc.poll() is None:
                pid = main_pid(proc)
                for target in ([pid] if pid else []) + [proc.pid]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(target, signal.SIGKILL)
                # the process group too (a process that rewrites its environment, as redis-server's
                # title does, is not found by the marker)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for p in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
        for proc in [c.proc for c in self.containers] + [self._pause]:
            if proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=30)
        self._pause = None

    def terminate(self, grace_s: float) -> float:
        """The pod deleted gracefully, as the kubelet deletes it (a drain, a rolling update): SIGTERM to
        each container's main process at once, SIGKILL to what is left after the grace period. Returns
        the seconds until every container had exited."""
        self.alive = False
        for t in self._threads:
            t.join(timeout=5)
        t0 = time.monotonic()

        def stop(c: Container) -> None:         # per container, all at once: its preStop, then SIGTERM
            main = main_pid(c.proc) if c.proc is not None else None
            if c.pre_stop and main is not None:      # run in the container, as the kubelet execs it
                with contextlib.suppress(subprocess.TimeoutExpired):
                    subprocess.run(["nsenter", f"--target={main}", "--pid", "--mount", "--", *c.pre_stop],
                                   env=c.env, timeout=grace_s)
            # to the container's main process, as the runtime signals it (unshare and nsenter, its
            # parents here, pass no signal on)
            if main is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(main, signal.SIGTERM)

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


def main_pid(proc: subprocess.Popen | None) -> int | None:
    """The host's pid of the process that unshare or nsenter started: a container's main process (PID 1
    of its own namespace), or a pod's pause."""
    if proc is None or proc.poll() is not None:
        return None
    with contextlib.suppress(psutil.Error):
        children = psutil.Process(proc.pid).children()
        if children:
            return children[0].pid
    return None


def _name(pid: int | None) -> str:
    try:
        return psutil.Process(pid).name() if pid is not None else ""
    except psutil.Error:
        return ""


def _environ(p: psutil.Process) -> dict[str, str]:
    try:
        return p.environ()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return {}


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
