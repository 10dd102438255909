"""SIGTERM on a router process under load (tests/cluster/fake_server.py: the real signal handling and
gRPC server of `specd serve` around fake workers): health turns NOT_SERVING at once, new requests are
refused, in-flight streams finish within the grace period, the process exits 0; a second signal exits at
once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from fake_workers import target_only

from specd.cluster.client import Security, SpecdClient

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def start_server():
    procs = []

    def start(grace_s: float):
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        script = str(Path(__file__).with_name("fake_server.py"))
        proc = subprocess.Popen([sys.executable, script, str(grace_s)], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        procs.append(proc)
        address, health_address = proc.stdout.readline().split()
        return proc, SpecdClient(address, timeout=60), SpecdClient(health_address, timeout=10)

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def streams_in_flight(client: SpecdClient, n: int, max_new_tokens: int):
    """n streams, each past its first chunk; the rest is read in background threads."""
    results: list[list] = [[] for _ in range(n)]
    started = threading.Barrier(n + 1)

    def read(i: int) -> None:
        try:
            chunks = client.stream(text=chr(65 + i), max_new_tokens=max_new_tokens, gamma=2)
            for k, chunk in enumerate(chunks):
                results[i].append(chunk)
                if k == 0:
                    started.wait()
        except grpc.RpcError as exc:
            results[i].append(exc)
            started.abort()

    threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    started.wait(30)
    return threads, results


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_then_exits_0(start_server) -> None:
    proc, client, health = start_server(grace_s=30)
    assert health.health() == "SERVING"
    threads, results = streams_in_flight(client, 3, max_new_tokens=40)
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    while health.health() != "NOT_SERVING":
        assert time.monotonic() - t0 < 2, "health still SERVING after SIGTERM"
        time.sleep(0.01)
    # what the router answers a new request, read without the client's retries (they would try again
    # for about 1.5 s, for another router to answer, while the streams below finish)
    with (SpecdClient(client.address, timeout=10, security=Security(attempts=1)) as once,
          pytest.raises(grpc.RpcError) as err):
        once.generate(text="Z", max_new_tokens=2)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert all(t.is_alive() for t in threads), "the load ended before the signal; nothing was drained"
    for t in threads:
        t.join(30)
    for i, chunks in enumerate(results):
        assert chunks[-1].finish_reason == "length", chunks[-1]
        assert [tok for c in chunks for tok in c.token_ids] == target_only([33 + i], 40)
    assert proc.wait(30) == 0


@pytest.mark.slow
def test_grace_period_ends_in_flight_requests_and_second_signal_exits_at_once(start_server) -> None:
    proc, client, _ = start_server(grace_s=0.2)
    threads, results = streams_in_flight(client, 2, max_new_tokens=60)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0                      # the grace period cut the 60-token streams short
    for t in threads:
        t.join(10)
    assert all(isinstance(r[-1], grpc.RpcError) for r in results)

    proc, client, _ = start_server(grace_s=60)
    threads, _ = streams_in_flight(client, 2, max_new_tokens=60)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    assert proc.poll() is None                     # draining: the streams have about a second left
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 128 + signal.SIGTERM
    # "at once" against the 60 s of grace the drain would otherwise take; 10 s is margin for a loaded
    # 2-core machine (an exit here takes well under a second)
    assert time.monotonic() - t0 < 10.0, "the second signal did not exit at once"
