"""The chart, run as pods: every pod of the rendered release as its own process tree on this machine, with
its own /tmp, $HOME, cache and volumes, and nothing shared on disk but what every pod's image holds (the
target and the first-start drafter). tests/helm/release.py says how each pod's command comes from the
rendered manifests (KubeRay's `ray start` from tests/helm/kuberay.py, the routers' Deployment as written).

The release as the chart makes it by default: two routers in their own pods, each a Ray node and driver
owning its own target and draft pods' actors, one trainer pod, the head (GCS only) with GCS fault
tolerance in the chart's Redis. Then real gRPC traffic through both routers (a client given both
addresses, as a Service spreads connections):
- every answer equals target-only greedy decoding; the trainer pod's published version drafts on the
  draft pods of both routers (responses' drafter_versions and each router's per-version metrics);
- the trainer, a draft, a target and the Redis pod are each killed and started again: serving recovers
  and the draft pods come back on the version that serves;
- the head pod is killed and started again while 4 clients stream: no request fails;
- a router pod is killed and started again while 4 clients send requests: the retrying client loses
  none (a call cut before its answer is tried again on the other router), and the restarted router
  serves again with actors of its own;
- the other router pod is deleted gracefully (SIGTERM, as a drain or a rolling update does) while 4
  clients stream: its streams finish, new calls go to the other router, none fails.
The figures (first request -> first cross-pod swap, each restart's effect on clients) are printed. The
target and drafter are tiny random Llamas with SmolLM2's tokenizer, so it runs on CPU.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest

from tests.helm.pods import wait_for
from tests.helm.release import Release, build_image, render, router_ports

helm_python = pytest.importorskip("helm_python")
pytestmark = [pytest.mark.e2e, pytest.mark.slow,    # eight Ray nodes, Redis, two routers: minutes
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")]

PROMPTS = ["What is 2 + 3?", "Name a colour.", "Write one word about the sea.", "Count to five."]
NEW_TOKENS = 12
ROUTERS = 2                                     # the chart's default router.replicas
AFTER_HEAD_S = 45                               # serving watched after the head's return
# what a quick test needs of the trainer: publish every candidate, often
TEST_CONFIG = {
    "target.device": "cpu", "drafter.device": "cpu", "drafter.kind": "model", "drafter.dtype": "float32",
    "drafter.pack": "none", "spec.policy": "fixed", "spec.gamma": 3, "target.max_seq_len": 256,
    "target.max_slots": 4, "drafter.max_slots": 4, "trainer.update_every_records": 2,
    "trainer.update_every_s": 1, "trainer.holdout_every": 2, "trainer.steps_per_update": 2,
    "trainer.batch_records": 2, "trainer.gate_margin": -1.0, "trainer.collapse_alpha": 0.0,
    "trainer.rollback_margin": 1.0, "trainer.num_cpus": 1, "server.health_probe_s": 0,
}


@pytest.fixture(scope="module")
def release():
    root = Path(tempfile.mkdtemp(prefix="kp", dir="/tmp"))       # short: Ray's socket paths live below
    try:
        target, drafter = build_image(root / "image")
        ports = [router_ports() for _ in range(ROUTERS)]
        rel = Release(root, render(target, drafter, ports[0], root, TEST_CONFIG, ROUTERS), ports)
        try:
            for pod in rel.pods.values():
                pod.start()
            for name in rel.pods:
                wait_for(lambda n=name: rel.ready(n), 600, f"pod {name} ready", tail=rel.tail)
            yield rel
        finally:
            for pod in rel.pods.values():
                pod.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(release) -> dict[str, list[int]]:
    with release.client() as c:
        return {p: c.generate(prompt=p, max_new_tokens=NEW_TOKENS, speculation=False).token_ids
                for p in PROMPTS}


def versions_of(completion) -> list[str]:
    return list(completion.usage.get("drafter_versions", []))


class Load:
    """`clients` threads, each with its own retrying client over both routers, sending requests (streams
    or unary calls) one after another until stop(); every answer is checked against target-only."""

    def __init__(self, release, reference: dict, stream: bool, clients: int = 4):
        self.release, self.reference, self.stream = release, reference, stream
        self.ok = self.failed = 0
        self.errors: list[str] = []
        self.wrong: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def _one(self, c, prompt: str) -> list[int]:
        if self.stream:
            return [t for ch in c.stream(prompt=prompt, max_new_tokens=NEW_TOKENS, timeout=120)
                    for t in ch.token_ids]
        return c.generate(prompt=prompt, max_new_tokens=NEW_TOKENS, timeout=120).token_ids

    def _run(self, i: int) -> None:
        with self.release.client() as c:
            n = i
            while not self._stop.is_set():
                prompt = PROMPTS[n % len(PROMPTS)]
                n += 1
                try:
                    ids = self._one(c, prompt)
                except grpc.RpcError as err:
                    with self._lock:
                        self.failed += 1
                        self.errors.append(f"{err.code()}: {err.details()}")
                    time.sleep(0.5)
                    continue
                with self._lock:
                    self.ok += 1
                    if ids != self.reference[prompt]:
                        self.wrong.append(prompt)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=180)

    def assert_all_answered_exactly(self) -> None:
        assert not self.wrong, self.wrong
        assert self.failed == 0, self.errors[:5]

    def wait_served(self, count: int, timeout: float = 300) -> None:
        """Until `count` more requests have been answered."""
        target = self.ok + count
        wait_for(lambda: self.ok >= target, timeout, f"{count} more requests answered", period=0.2,
                 tail=self.release.tail)


def test_pods_serve_learn_across_pods_and_survive_restarts(release, reference) -> None:
    c = release.client()
    # the chart's HTTP port: the OpenAI SDK through TLS and the token, greedy as over gRPC
    http = release.openai()
    model = http.models.list().data[0].id
    out = http.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[0]}],
                                       max_tokens=NEW_TOKENS, temperature=0)
    assert out.choices[0].message.content == c.generate(prompt=PROMPTS[0], max_new_tokens=NEW_TOKENS,
                                                        speculation=False).text
    http.close()
    t0 = time.monotonic()
    swapped_at, online = None, None
    while swapped_at is None:
        for p in PROMPTS:
            out = c.generate(prompt=p, max_new_tokens=NEW_TOKENS)
            assert out.token_ids == reference[p], "speculative output differs from target-only"
            online = next((v for v in versions_of(out) if v.startswith("online-")), None)
            if online:
                swapped_at = time.monotonic() - t0
                break
        assert time.monotonic() - t0 < 600, f"no trainer version drafted within 600 s\n{release.tail()}"
    print(f"\nfirst request -> a trainer-pod version drafting on a draft pod: {swapped_at:.1f} s ({online})")
    # the one trainer's versions draft through every router, each on its own draft pod
    names = set()
    for i in range(ROUTERS):
        with release.client([i]) as one:
            deadline = time.monotonic() + 300
            while True:
                out = one.generate(prompt=PROMPTS[0], max_new_tokens=NEW_TOKENS)
                assert out.token_ids == reference[PROMPTS[0]]
                drafted = [v for v in versions_of(out) if v.startswith("online-")]
                if drafted:
                    break
                assert time.monotonic() < deadline, f"router {i} drafts no trainer version\n{release.tail()}"
        series = rf'specd_drafted_tokens_total{{drafter_version="{drafted[0]}"}} [1-9]'
        metrics = release.metrics(i)
        assert re.search(series, metrics), f"router {i}: no drafted tokens of {drafted[0]}"
        names.add(re.search(r'specd_router_info\{router="([^"]+)"\}', metrics).group(1))
        # each router reads the one trainer (a trainer of its own would wait forever for the trainer pod)
        assert re.search(r"^specd_trainer_up 1\.0$", metrics, re.M), f"router {i}: trainer not up"
        print(f"router {i} drafts with {drafted[0]}")
    assert names == {f"router-{i}" for i in range(ROUTERS)}, names

    effects = {}
    # Redis holds the GCS's tables (fault tolerance): its pod killed, the head's GCS exits and the head
    # restarts, which fails below HEAD_RESTART_MIN_CORES as the head-restart phase does
    killed_pods = ("trainer", "draft-0", "target-0")
    if enough_cores_for_a_head_restart():
        killed_pods += ("redis",)
    for name in killed_pods:
        pod = release.pods[name]
        serving_before = release.redis_current()
        killed = time.monotonic()
        pod.kill()
        ok = failed = 0
        recovered = None
        pod.start(fresh=True)
        while recovered is None:
            p = PROMPTS[(ok + failed) % len(PROMPTS)]
            try:
                out = c.generate(prompt=p, max_new_tokens=NEW_TOKENS, timeout=60)
                assert out.token_ids == reference[p], f"after {name} restart: output differs"
                ok += 1
                time.sleep(0.2)                   # a steady client, not a flood on 2 shared cores
                if release.ready(name):
                    recovered = time.monotonic() - killed
            except grpc.RpcError:             # counted: the client's view of the outage; a wrong answer fails
                failed += 1
                time.sleep(1.0)
            assert time.monotonic() - killed < 600, f"{name}: no recovery\n{release.tail()}"
        effects[name] = (recovered, ok, failed)
        print(f"restart of pod {name}: ready again after {recovered:.1f} s; meanwhile {ok} requests "
              f"succeeded (exact), {failed} failed", flush=True)
        if name == "trainer":
            # the restarted trainer pod learns and publishes again: a version after the one that served
            deadline, i = time.monotonic() + 600, 0
            while release.redis_current() == serving_before:
                p = PROMPTS[i % len(PROMPTS)]
                assert c.generate(prompt=p, max_new_tokens=NEW_TOKENS).token_ids == reference[p]
                i += 1
                assert time.monotonic() < deadline, f"no publish after the trainer restart\n{release.tail()}"
            print(f"the restarted trainer published {release.redis_current()} after {serving_before}",
                  flush=True)
        if name == "draft-0":
            # the restarted DraftWorker drafts with the version that serves, from Redis
            serving = release.redis_current()
            deadline = time.monotonic() + 300
            while True:
                out = c.generate(prompt=PROMPTS[0], max_new_tokens=NEW_TOKENS)
                assert out.token_ids == reference[PROMPTS[0]]
                if serving in versions_of(out):
                    break
                assert time.monotonic() < deadline, (name, serving, versions_of(out))
                serving = release.redis_current()
    assert set(effects) == set(killed_pods)
    c.close()


def restart(release, name: str) -> tuple[float, float]:
    """The pod deleted (every process SIGKILLed) and created again: (when it was killed, seconds until
    it was ready again)."""
    pod = release.pods[name]
    killed = time.monotonic()
    pod.kill()
    pod.start(fresh=True)
    return killed, wait_for(lambda: release.ready(name), 600, f"{name} ready again", tail=release.tail)


# The restarted head's raylet waits a fixed ~15 s for its dashboard agent's port files (Ray 2.60,
# WaitForDashboardAgentPorts: `ray start` does not pass the raylet the agent's fixed listen port); with
# every pod on two shared cores the agent misses it (what was measured and tried: docs/reliability.md).
HEAD_RESTART_MIN_CORES = 4


def enough_cores_for_a_head_restart() -> bool:
    return (os.cpu_count() or 1) >= HEAD_RESTART_MIN_CORES


@pytest.mark.skipif(not enough_cores_for_a_head_restart(),
                    reason=f"the restarted head's raylet gives up on its dashboard agent on fewer than "
                           f"{HEAD_RESTART_MIN_CORES} cores shared by every pod (Ray's fixed port-file wait)")
def test_a_head_restart_fails_no_request(release, reference) -> None:
    """GCS fault tolerance: the routers and the actors live on other pods and keep serving while the head
    is gone; the restarted GCS takes the cluster back from Redis."""
    with Load(release, reference, stream=True) as load:
        load.wait_served(8)
        killed, recovered = restart(release, "head")
        during = load.ok
        # and after: without fault tolerance the new GCS does not know the old nodes and their raylets
        # go, with every actor (seen in a control run with gcsFaultTolerance.enabled=false); give that
        # time to show
        time.sleep(AFTER_HEAD_S)
        load.wait_served(8)
    print(f"restart of pod head: ready again after {recovered:.1f} s; 4 streaming clients: {load.ok} "
          f"requests succeeded (exact; {during} by the head's return), {load.failed} failed "
          f"(restart began {time.monotonic() - killed:.0f} s ago)", flush=True)
    load.assert_all_answered_exactly()


def test_a_router_restart_fails_no_request_through_the_retrying_client(release, reference) -> None:
    """A router pod killed mid-request: calls cut before their answer are tried again on the other router;
    the restarted router starts actors of its own again (its old ones died with it) and serves."""
    with Load(release, reference, stream=False) as load:
        load.wait_served(8)
        killed, recovered = restart(release, "router-0")
        load.wait_served(8)
    print(f"restart of pod router-0: ready again after {recovered:.1f} s; 4 clients: {load.ok} requests "
          f"succeeded (exact), {load.failed} failed ({time.monotonic() - killed:.0f} s)", flush=True)
    load.assert_all_answered_exactly()
    with release.client([0]) as c:      # the restarted router itself
        assert c.generate(prompt=PROMPTS[1], max_new_tokens=NEW_TOKENS).token_ids == reference[PROMPTS[1]]


def test_a_drained_router_finishes_its_streams(release, reference) -> None:
    """A rolling update or a node drain deletes a router pod gracefully: SIGTERM to both its containers.
    The router stops taking requests (the client tries them on the other router) and finishes the
    streams it has; the replacement pod serves again."""
    grace = release.router_grace_s
    with Load(release, reference, stream=True) as load:
        load.wait_served(8)
        took = release.pods["router-1"].terminate(grace)
        release.pods["router-1"].start(fresh=True)
        recovered = wait_for(lambda: release.ready("router-1"), 600, "router-1 ready again",
                             tail=release.tail)
        load.wait_served(8)
    print(f"drain of pod router-1: its containers exited {took:.1f} s after SIGTERM (grace {grace} s), "
          f"the new one ready after {recovered:.1f} s; 4 streaming clients: {load.ok} requests "
          f"succeeded (exact), {load.failed} failed", flush=True)
    load.assert_all_answered_exactly()
    assert took < grace, "a container outlived the grace period and was killed"
