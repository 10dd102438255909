"""The pods harness isolates what Kubernetes isolates (tests/helm/pods.py): a container sees its own
processes only, or its pod's when the pod shares one process namespace; its /tmp is its pod's, its
/dev/shm the pod's size, and other pods' directories are empty to it. Seconds, no Ray."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pytest

from tests.helm.pods import Container, Pod, isolation_available, wait_for

pytestmark = [pytest.mark.slow,         # processes in namespaces of their own, a few seconds
              pytest.mark.skipif(isolation_available() is not None, reason=str(isolation_available()))]

# what each container prints of its view (once both of a pod's have started), then waits to be killed
LOOK = ("sleep 1; echo pid=$$; for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done;"
        " ls /tmp; df -k /dev/shm | tail -1; ls {other}; ls /var/cache/specd; echo end-of-look;"
        " touch /tmp/{name}; exec -a look-{name} sleep 300")


def run(root: Path, share: bool) -> tuple[dict[str, str], Pod, Pod]:
    pods = [Pod(name, root / name, share_processes=share) for name in ("a", "b")]
    a, b = pods
    a.shm = "100m"
    for pod in pods:
        (pod.path("volume") / f"own-{pod.name}").write_text(pod.name)
        pod.volumes = {"/var/cache/specd": "volume"}      # the spec's mount path: its own volume there
        other = b if pod is a else a
        pod.hidden = [other.root]
        for name in ("first", "second"):
            pod.containers.append(Container(name, LOOK.format(other=other.root / "volume", name=name),
                                            {"PATH": "/usr/bin:/bin"}))
    for pod in pods:
        pod.start()
    logs = {}
    for pod in pods:
        for c in pod.containers:
            path = pod.root / "logs" / f"{c.name}.log"
            wait_for(lambda p=path: p.exists() and "end-of-look" in p.read_text(), 30, f"{pod.name}/{c.name}")
            logs[f"{pod.name}/{c.name}"] = path.read_text()
    return logs, a, b


@pytest.mark.parametrize("share", [False, True])
def test_each_container_or_pod_sees_its_own(share: bool) -> None:
    root = Path(tempfile.mkdtemp(prefix="iso", dir="/var/tmp"))
    pods = []
    try:
        logs, a, b = run(root, share)
        pods = [a, b]
        for key, log in logs.items():
            lines = log.splitlines()
            # PID 1 of its own namespace, or a process of the pod's (the pause is PID 1)
            assert (lines[0] == "pid=1") != share, (key, log)
            other = "second" if key.endswith("/first") else "first"
            # the other container's process, before or after its exec
            assert (f"touch /tmp/{other}" in log or f"look-{other}" in log) == share, (key, log)
            mine, theirs = ("a", "b") if key.startswith("a/") else ("b", "a")
            assert f"own-{mine}" in log and f"own-{theirs}" not in log, (key, log)   # the other's is hidden
            size_kb = int(next(x for x in lines if x.startswith("shm")).split()[1])
            assert size_kb == (100 * 1024 if key.startswith("a/") else 64 * 1024), (key, size_kb)
        time.sleep(0.5)
        # the pod's tmp is its containers' /tmp, and only theirs
        assert sorted(p.name for p in (a.root / "tmp").iterdir()) == ["first", "second"]
        namespaces = a.pid_namespaces()
        assert (len(namespaces["first"] | namespaces["second"]) == 1) == share, namespaces
        assert not (namespaces["first"] & b.pid_namespaces()["first"])
        # SIGTERM reaches each container's main process. As PID 1 of its own namespace a process without
        # a handler for it ignores it (`sleep` here) and is killed at the end of the grace period, as in
        # Kubernetes; in a pod's shared namespace the pause is PID 1 and SIGTERM's default ends it
        took = a.terminate(6)
        assert (took < 3) == share, took
        assert not a.processes()
    finally:
        for pod in pods:
            pod.kill()
        shutil.rmtree(root, ignore_errors=True)
