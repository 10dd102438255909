"""The chart, run as pods: every pod of the rendered release as its own process tree on this machine, with
its own /tmp, $HOME, cache and volumes, and nothing shared on disk but what every pod's image holds (the
target and the first-start drafter, tests/helm/pods.py).

- Redis: the StatefulSet's container command (its /data on the pod's own volume).
- Ray: the head's and each worker group's `ray start`, composed from the rendered RayCluster exactly as the
  KubeRay operator composes them (tests/helm/kuberay.py, copied from its pod.go) and run through
  `bash -c`; probed as the kubelet probes what KubeRay injects (HTTP GET /api/healthz on the agent port).
- The router: the head pod's second container, its own command with the rendered overrides file
  (the Redis Service's hostname -> 127.0.0.1, devices -> cpu; TLS and tokens from files written here),
  probed with the gRPC health check on the health port.

Then real gRPC traffic: every answer equals target-only greedy decoding, the trainer pod's published
version drafts on the draft pod (responses' drafter_versions and the per-version metrics), and each
pod is killed and started again once: serving recovers and the draft pod comes back on the version
that serves. The figures (first request -> first cross-pod swap, each restart's effect on clients) are
printed. The target and drafter are tiny random Llamas with SmolLM2's tokenizer, so it runs on CPU.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml

from tests.helm import kuberay
from tests.helm.pods import (
    Container,
    Pod,
    free_port,
    free_ports,
    grpc_serving,
    http_ok,
    self_signed,
    tcp_ok,
    wait_for,
)

helm_python = pytest.importorskip("helm_python")
pytestmark = [pytest.mark.e2e, pytest.mark.slow,    # four Ray nodes, Redis, the router: minutes
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")]

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "specd"
PROMPTS = ["What is 2 + 3?", "Name a colour.", "Write one word about the sea.", "Count to five."]
NEW_TOKENS = 12
# what a quick test needs of the trainer: publish every candidate, often
TEST_CONFIG = {
    "target.device": "cpu", "drafter.device": "cpu", "drafter.kind": "model", "drafter.dtype": "float32",
    "drafter.pack": "none", "spec.policy": "fixed", "spec.gamma": 3, "target.max_seq_len": 256,
    "target.max_slots": 4, "drafter.max_slots": 4, "trainer.update_every_records": 2,
    "trainer.update_every_s": 1, "trainer.holdout_every": 2, "trainer.steps_per_update": 2,
    "trainer.batch_records": 2, "trainer.gate_margin": -1.0, "trainer.collapse_alpha": 0.0,
    "trainer.rollback_margin": 1.0, "trainer.num_cpus": 1, "server.health_probe_s": 0,
}


def build_image(root: Path) -> tuple[Path, Path]:
    """What every pod's image carries: a target (a tiny random Llama with SmolLM2's tokenizer and
    vocabulary) and the first-start drafter cut from it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specd.workers.models.loader import ensure_target_model
    from tests.drafter_trainer.online_helpers import make_tiny_drafter

    real = ensure_target_model()
    target = root / "models" / "target"
    target.mkdir(parents=True)
    for f in real.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", ".done"):
            shutil.copy(f, target / f.name)
    real_cfg = json.loads((real / "config.json").read_text())
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=real_cfg["vocab_size"], hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=True, initializer_range=0.3,
                      bos_token_id=real_cfg.get("bos_token_id"), eos_token_id=real_cfg.get("eos_token_id"))
    LlamaForCausalLM(cfg).eval().save_pretrained(target, safe_serialization=True)
    drafter = make_tiny_drafter(target, root / "drafters" / "tiny")
    return target, drafter


def ray_params(pod_root: Path, head: bool) -> dict[str, str]:
    """Ports no other Ray cluster on this machine uses (other engineers run theirs beside), and the pod's
    own /tmp/ray: in Kubernetes every pod has its own /tmp, here a joining node would otherwise use the
    head's temp dir path. Test-only rayStartParams, given through the chart's values."""
    names = ["node-manager-port", "object-manager-port", "dashboard-agent-listen-port",
             "dashboard-agent-grpc-port", "metrics-export-port", "runtime-env-agent-port"]
    if head:
        names += ["port", "ray-client-server-port"]
    ports = {n: str(free_port()) for n in names}
    base = free_ports(61)
    ports.update({"min-worker-port": str(base), "max-worker-port": str(base + 60),
                  "object-store-memory": "80000000", "temp-dir": str(pod_root / "tmp" / "ray")})
    return ports


def render(image_target: Path, image_drafter: Path, router_ports: dict, root: Path) -> list[dict]:
    small = {"cpu": "2", "memory": "2Gi", "gpus": 0}
    values = {
        "model": {"path": str(image_target), "drafterPath": str(image_drafter)},
        "head": {"cpu": "1", "memory": "2Gi", "rayStartParams": ray_params(root / "head", True)},
        "router": {"port": router_ports["grpc"], "healthPort": router_ports["health"],
                   "metricsPort": router_ports["metrics"], "httpPort": router_ports["http"],
                   "cpu": "1", "memory": "2Gi"},
        "target": {**small, "rayStartParams": ray_params(root / "target", False)},
        "draft": {**small, "rayStartParams": ray_params(root / "draft", False)},
        "trainer": {**small, "rayStartParams": ray_params(root / "trainer", False)},
        "config": TEST_CONFIG,
    }
    with helm_python.Chart.load(str(CHART)) as chart:
        out = chart.render(values, name="rel", namespace="specd")
    return [d for path, text in sorted(out.items()) if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]


def secret_value(docs: list[dict], name: str, key: str) -> str:
    secret = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == name)
    return base64.b64decode(secret["data"][key]).decode()


def container_env(docs, container: dict, pod: Pod, extra: dict) -> dict[str, str]:
    """The container's rendered env (Secret references resolved), its mounts mapped to the pod's dirs."""
    import os

    mounts = {"/home/specd": str(pod.path("home")), "/var/cache/specd": str(pod.path("cache"))}
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "TMPDIR": str(pod.path("tmp")),
           "RAY_TMPDIR": str(pod.path("tmp")), "RAY_USAGE_STATS_ENABLED": "0",
           # a worker whose head is gone exits after this long, and the kubelet starts it again
           "RAY_gcs_rpc_server_reconnect_timeout_s": "20", "OMP_NUM_THREADS": "1"}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = mounts.get(e["value"], e["value"])
        else:
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = secret_value(docs, ref["name"], ref["key"])
    env.update(extra)
    return env


def router_overrides(text: str, redis_port: int, files: dict[str, str], trainer_store: Path) -> str:
    out = []
    for line in text.splitlines():
        line = re.sub(r"redis://[^/\"]+/", f"redis://127.0.0.1:{redis_port}/", line)
        line = re.sub(r"^((target|drafter|trainer)\.device)=.*", r"\1=cpu", line)
        line = re.sub(r"^((target|drafter|trainer)\.num_gpus)=.*", r"\1=0", line)
        line = line.replace("server.host=0.0.0.0", "server.host=127.0.0.1")
        line = line.replace("/var/lib/specd/trainer", str(trainer_store))
        for path, local in files.items():
            line = line.replace(path, local)
        out.append(line)
    return "\n".join(out) + "\n"


class Release:
    """The release's pods, started from the rendered manifests."""

    def __init__(self, root: Path, docs: list[dict], ports: dict):
        self.docs, self.ports = docs, ports
        ray = next(d for d in docs if d["kind"] == "RayCluster")
        self.ray_version = ray["spec"]["rayVersion"]
        self.head_group = ray["spec"]["headGroupSpec"]
        self.groups = {g["groupName"]: g for g in ray["spec"]["workerGroupSpecs"]}
        self.pods: dict[str, Pod] = {}
        secrets = root / "secrets"
        secrets.mkdir()
        self.cert, key = self_signed(secrets, "router")
        self.token = secret_value(docs, "rel-specd-token", "token").splitlines()[0]
        (secrets / "token").write_text(self.token + "\n")
        (secrets / "admin").write_text(secret_value(docs, "rel-specd-admin-token", "token") + "\n")
        files = {"/etc/specd/tls/tls.crt": self.cert, "/etc/specd/tls/tls.key": key,
                 "/etc/specd/token/token": str(secrets / "token"),
                 "/etc/specd/admin/token": str(secrets / "admin")}

        redis_sts = next(d for d in docs if d["kind"] == "StatefulSet")
        redis_c = redis_sts["spec"]["template"]["spec"]["containers"][0]
        self.redis_port = free_port()
        pod = self.pods["redis"] = Pod("redis", root / "redis")
        cmd = redis_c["command"][2].replace("--dir /data", f"--dir {pod.path('data')}")
        cmd += f" --port {self.redis_port} --bind 127.0.0.1"
        pod.containers.append(Container("redis", cmd, container_env(docs, redis_c, pod, {})))

        head = self.pods["head"] = Pod("head", root / "head")
        hspec = self.head_group["template"]["spec"]["containers"]
        head.containers.append(Container("ray-head", kuberay.ray_start_command(self.head_group, head=True),
                                         container_env(docs, hspec[0], head, {})))
        config = next(d for d in docs
                      if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "rel-specd-config")
        overrides = head.path("config") / "overrides.txt"
        self.trainer_store = root / "trainer" / "volume"      # the trainer's PVC
        overrides.write_text(router_overrides(config["data"]["overrides.txt"], self.redis_port, files,
                                              self.trainer_store))
        router = next(c for c in hspec if c["name"] == "router")
        assert router["command"][-1] == "/etc/specd/config/overrides.txt"
        cmd = " ".join(router["command"][:-1] + [str(overrides)])
        head.containers.append(Container("router", cmd, container_env(docs, router, head, {})))

        port = kuberay.head_port(self.head_group)
        for name, group in self.groups.items():
            pod = self.pods[name] = Pod(name, root / name)
            c = group["template"]["spec"]["containers"][0]
            pod.containers.append(Container("ray-worker", kuberay.ray_start_command(group, head=False,
                                                                                 head_port=port),
                                            container_env(docs, c, pod, {})))

    def tail(self) -> str:
        return "\n".join(p.log_tail() for p in self.pods.values())

    def ray_ready(self, name: str) -> bool:
        group = self.head_group if name == "head" else self.groups[name]
        return http_ok(*kuberay.ray_probe(group, self.ray_version))

    def ready(self, name: str) -> bool:
        if name == "redis":
            return tcp_ok(self.redis_port)
        if name == "head":
            return self.ray_ready("head") and grpc_serving(self.ports["health"])
        return self.ray_ready(name)

    def client(self):
        from specd.cluster.client import Security, SpecdClient

        return SpecdClient(f"127.0.0.1:{self.ports['grpc']}", timeout=120,
                           security=Security(tls=True, ca_file=self.cert, token=self.token))

    def openai(self):
        """The OpenAI SDK against the router's HTTP API, with the same TLS and token as gRPC."""
        import ssl

        import httpx
        import openai

        return openai.OpenAI(base_url=f"https://127.0.0.1:{self.ports['http']}/v1", api_key=self.token,
                             max_retries=0, timeout=120,
                             http_client=httpx.Client(verify=ssl.create_default_context(cafile=self.cert)))

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.ports['metrics']}/metrics"
        return urllib.request.urlopen(url, timeout=10).read().decode()

    def redis_current(self) -> str | None:
        import redis

        pw = secret_value(self.docs, "rel-specd-redis", "redis-password")
        client = redis.Redis(port=self.redis_port, password=pw, socket_timeout=5)
        value = client.get("specd:replay:drafters:CURRENT")
        return value.decode() if value else None


@pytest.fixture(scope="module")
def release():
    root = Path(tempfile.mkdtemp(prefix="kp", dir="/tmp"))       # short: Ray's socket paths live below
    try:
        target, drafter = build_image(root / "image")
        ports = {"grpc": free_port(), "health": free_port(), "metrics": free_port(), "http": free_port()}
        rel = Release(root, render(target, drafter, ports, root), ports)
        try:
            for name in ("redis", "head", "target", "draft", "trainer"):
                rel.pods[name].start()
            for name in ("redis", "target", "draft", "trainer", "head"):
                wait_for(lambda n=name: rel.ready(n), 600, f"pod {name} ready", tail=rel.tail)
            yield rel
        finally:
            for pod in rel.pods.values():
                pod.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def versions_of(completion) -> list[str]:
    return list(completion.usage.get("drafter_versions", []))


def test_pods_serve_learn_across_pods_and_survive_restarts(release) -> None:
    c = release.client()
    plain = {p: c.generate(prompt=p, max_new_tokens=NEW_TOKENS, speculation=False) for p in PROMPTS}
    reference = {p: out.token_ids for p, out in plain.items()}
    # the chart's HTTP port: the OpenAI SDK through TLS and the token, greedy as over gRPC
    http = release.openai()
    model = http.models.list().data[0].id
    out = http.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[0]}],
                                       max_tokens=NEW_TOKENS, temperature=0)
    assert out.choices[0].message.content == plain[PROMPTS[0]].text
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
    print(f"\nfirst request -> a trainer-pod version drafting on the draft pod: {swapped_at:.1f} s "
          f"({online})")
    assert re.search(rf'specd_drafted_tokens_total{{drafter_version="{online}"}} [1-9]', release.metrics())

    effects = {}
    for name in ("trainer", "draft", "target", "redis", "head"):
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
        if name in ("draft", "head"):
            # the (re)started DraftWorker drafts with the version that serves, from Redis
            serving = release.redis_current()
            deadline = time.monotonic() + 300
            while True:
                out = c.generate(prompt=PROMPTS[0], max_new_tokens=NEW_TOKENS)
                assert out.token_ids == reference[PROMPTS[0]]
                if serving in versions_of(out):
                    break
                assert time.monotonic() < deadline, (name, serving, versions_of(out))
                serving = release.redis_current()
    assert set(effects) == {"trainer", "draft", "target", "redis", "head"}
    c.close()
