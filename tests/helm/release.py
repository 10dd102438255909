"""A rendered release as pods on this machine, for tests/helm/test_pods.py: every pod of the release its own
process tree (tests/helm/pods.py) started from the rendered manifests.

- Redis: the StatefulSet's container command (its /data on the pod's volume when the chart asks for a
  PersistentVolumeClaim, else on an emptyDir that a restart empties).
- Ray: the head's and each worker group's `ray start`, composed from the rendered RayCluster exactly as the
  KubeRay operator composes them, GCS fault tolerance included (tests/helm/kuberay.py), and run through
  `bash -c`; probed as the kubelet probes what KubeRay injects (HTTP GET /api/healthz on the agent port).
- The routers: the Deployment's two containers per pod, its own `ray start` and `specd serve` with the
  rendered overrides file (the Services' hostnames -> 127.0.0.1, devices -> cpu; TLS and tokens from
  files written here), probed with the gRPC health check on the health port.

Kubernetes gives every pod its own IP; here every pod shares 127.0.0.1, so each pod of a group (and each
router) gets ports of its own: the only thing this stand-in changes in a pod's command.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import re
import shutil
import urllib.request
from pathlib import Path

import yaml

from tests.helm import kuberay
from tests.helm.pods import Container, Pod, free_port, free_ports, grpc_serving, http_ok, self_signed, tcp_ok

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "specd"
REDIS_ADDRESS = "rel-specd-redis.specd.svc:6379"   # the Redis Service's, as the chart renders it
STORAGE_NAMESPACE = "rel-uid"           # the RayCluster's UID: KubeRay's GCS storage namespace
_RAY_PORTS = ("node-manager-port", "object-manager-port", "dashboard-agent-listen-port",
              "dashboard-agent-grpc-port", "metrics-export-port", "runtime-env-agent-port")


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
    own /tmp/ray: in Kubernetes every pod has its own /tmp and IP. Test-only rayStartParams."""
    names = list(_RAY_PORTS) + (["port", "ray-client-server-port"] if head else [])
    ports = {n: str(free_port()) for n in names}
    base = free_ports(61)
    ports.update({"min-worker-port": str(base), "max-worker-port": str(base + 60),
                  "object-store-memory": "80000000", "temp-dir": str(pod_root / "tmp" / "ray")})
    return ports


def router_ports() -> dict[str, int]:
    return {"grpc": free_port(), "health": free_port(), "metrics": free_port(), "http": free_port()}


def render(image_target: Path, image_drafter: Path, ports: dict, root: Path, config: dict,
           routers: int) -> list[dict]:
    small = {"cpu": "2", "memory": "2Gi", "gpus": 0}
    values = {
        "model": {"path": str(image_target), "drafterPath": str(image_drafter)},
        "head": {"cpu": "1", "memory": "2Gi", "rayStartParams": ray_params(root / "head", True)},
        "router": {"replicas": routers, "port": ports["grpc"], "healthPort": ports["health"],
                   "metricsPort": ports["metrics"], "httpPort": ports["http"], "cpu": "1", "memory": "2Gi",
                   "rayStartParams": ray_params(root / "router", False)},
        "target": {**small, "rayStartParams": ray_params(root / "target", False)},
        "draft": {**small, "rayStartParams": ray_params(root / "draft", False)},
        "trainer": {**small, "rayStartParams": ray_params(root / "trainer", False)},
        "config": config,
    }
    import helm_python

    with helm_python.Chart.load(str(CHART)) as chart:
        out = chart.render(values, name="rel", namespace="specd")
    return [d for path, text in sorted(out.items()) if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]


def secret_value(docs: list[dict], name: str, key: str) -> str:
    secret = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == name)
    return base64.b64decode(secret["data"][key]).decode()


def own_ports(command: str, pod_root: Path) -> str:
    """A pod's rendered `ray start` with ports (and /tmp) of its own: its own IP's stand-in."""
    for name in _RAY_PORTS:
        command = re.sub(rf"--{name}=\d+", f"--{name}={free_port()}", command)
    base = free_ports(61)
    command = re.sub(r"--min-worker-port=\d+", f"--min-worker-port={base}", command)
    command = re.sub(r"--max-worker-port=\d+", f"--max-worker-port={base + 60}", command)
    return re.sub(r"--temp-dir=\S+", f"--temp-dir={pod_root / 'tmp' / 'ray'}", command)


class Release:
    """The release's pods, started from the rendered manifests; `routers` router pods, each with ports of
    its own (ports[i])."""

    def __init__(self, root: Path, docs: list[dict], ports: list[dict]):
        self.docs, self.ports = docs, ports
        ray = next(d for d in docs if d["kind"] == "RayCluster")
        self.ray_spec = ray["spec"]
        self.ray_version = ray["spec"]["rayVersion"]
        self.head_group = kuberay.with_gcs_fault_tolerance(ray["spec"], ray["spec"]["headGroupSpec"], True,
                                                           STORAGE_NAMESPACE)
        self.pods: dict[str, Pod] = {}
        self.probes: dict[str, tuple[int, str]] = {}
        secrets = root / "secrets"
        secrets.mkdir()
        self.cert, key = self_signed(secrets, "router")
        self.token = secret_value(docs, "rel-specd-token", "token").splitlines()[0]
        (secrets / "token").write_text(self.token + "\n")
        (secrets / "admin").write_text(secret_value(docs, "rel-specd-admin-token", "token") + "\n")
        self.files = {"/etc/specd/tls/tls.crt": self.cert, "/etc/specd/tls/tls.key": key,
                      "/etc/specd/token/token": str(secrets / "token"),
                      "/etc/specd/admin/token": str(secrets / "admin")}
        self.redis_port = free_port()
        self.head_port = kuberay.head_port(self.head_group)
        self.trainer_store = root / "trainer" / "volume"      # the trainer's PVC
        self._redis(root)
        head = self.pods["head"] = Pod("head", root / "head")
        c = self.head_group["template"]["spec"]["containers"][0]
        head.containers.append(Container("ray-head", kuberay.ray_start_command(self.head_group, head=True),
                                         self.env(c, head)))
        self.probes["head"] = kuberay.ray_probe(self.head_group, self.ray_version)
        for group in ray["spec"]["workerGroupSpecs"]:
            self._worker_group(root, group)
        config = next(d for d in docs
                      if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "rel-specd-config")
        self.overrides = config["data"]["overrides.txt"]
        deployment = next(d for d in docs if d["kind"] == "Deployment")
        self.routers = [f"router-{i}" for i in range(deployment["spec"]["replicas"])]
        self.router_grace_s = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert len(self.routers) == len(ports), "one set of ports per router pod"
        for i, name in enumerate(self.routers):
            self._router(root, name, deployment["spec"]["template"]["spec"]["containers"], ports[i])

    def env(self, container: dict, pod: Pod) -> dict[str, str]:
        """The container's rendered env (Secret references resolved, Services' hostnames -> 127.0.0.1),
        its mounts mapped to the pod's dirs."""
        mounts = {"/home/specd": str(pod.path("home")), "/var/cache/specd": str(pod.path("cache"))}
        # HOSTNAME: the kubelet sets it to the pod's name in every container
        env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "TMPDIR": str(pod.path("tmp")),
               "HOSTNAME": pod.name,
               "RAY_TMPDIR": str(pod.path("tmp")), "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
        if "gcsFaultToleranceOptions" not in self.ray_spec:
            # a worker whose head is gone exits after this long, and the kubelet starts it again
            env["RAY_gcs_rpc_server_reconnect_timeout_s"] = "20"
        for e in container.get("env", []):
            if "value" in e:
                value = mounts.get(e["value"], e["value"])
                env[e["name"]] = value.replace(REDIS_ADDRESS, f"127.0.0.1:{self.redis_port}")
            else:
                ref = e["valueFrom"]["secretKeyRef"]
                env[e["name"]] = secret_value(self.docs, ref["name"], ref["key"])
        return env

    def _redis(self, root: Path) -> None:
        sts = next(d for d in self.docs if d["kind"] == "StatefulSet")
        c = sts["spec"]["template"]["spec"]["containers"][0]
        pod = self.pods["redis"] = Pod("redis", root / "redis")
        # a PersistentVolumeClaim outlives the pod (the stand-in's `volume`); an emptyDir does not
        data = pod.path("volume" if sts["spec"].get("volumeClaimTemplates") else "data")
        cmd = c["command"][2].replace("--dir /data", f"--dir {data}")
        cmd += f" --port {self.redis_port} --bind 127.0.0.1"
        pod.containers.append(Container("redis", cmd, self.env(c, pod)))

    def _worker_group(self, root: Path, group: dict) -> None:
        name, replicas = group["groupName"], group["replicas"]
        for i in range(replicas):
            pod_name = name if replicas == 1 else f"{name}-{i}"
            pod = self.pods[pod_name] = Pod(pod_name, root / pod_name)
            own = copy.deepcopy(group)
            own["rayStartParams"].update(ray_params(pod.root, head=False))
            own = kuberay.with_gcs_fault_tolerance(self.ray_spec, own, False, STORAGE_NAMESPACE)
            c = own["template"]["spec"]["containers"][0]
            pod.containers.append(Container("ray-worker", kuberay.ray_start_command(own, head=False,
                                                                                 head_port=self.head_port),
                                            self.env(c, pod)))
            self.probes[pod_name] = kuberay.ray_probe(own, self.ray_version)

    def _router(self, root: Path, name: str, containers: list[dict], ports: dict) -> None:
        pod = self.pods[name] = Pod(name, root / name)
        ray_c, router_c = containers
        assert ray_c["command"][:2] == ["bash", "-c"]
        cmd = own_ports(ray_c["command"][2], pod.root)
        cmd = re.sub(r"--address=\S+", f"--address=127.0.0.1:{self.head_port}", cmd)
        pre_stop = ray_c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
        pod.containers.append(Container("ray-worker", cmd, self.env(ray_c, pod), pre_stop=pre_stop))
        agent = int(re.search(r"--dashboard-agent-listen-port=(\d+)", cmd).group(1))
        assert ray_c["readinessProbe"]["httpGet"]["path"] == kuberay.RAY_NODE_HEALTH_PATH
        self.probes[name] = (agent, kuberay.RAY_NODE_HEALTH_PATH)
        overrides = pod.path("config") / "overrides.txt"
        overrides.write_text(self.router_overrides(ports))
        assert router_c["command"][-1] == "/etc/specd/config/overrides.txt"
        cmd = " ".join(router_c["command"][:-1] + [str(overrides)])
        pre_stop = router_c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
        pod.containers.append(Container("router", cmd, self.env(router_c, pod), pre_stop=pre_stop))

    def router_overrides(self, ports: dict) -> str:
        out = []
        for line in self.overrides.splitlines():
            line = re.sub(r"redis://[^/\"]+/", f"redis://127.0.0.1:{self.redis_port}/", line)
            line = re.sub(r"^((target|drafter|trainer)\.device)=.*", r"\1=cpu", line)
            line = re.sub(r"^((target|drafter|trainer)\.num_gpus)=.*", r"\1=0", line)
            line = line.replace("server.host=0.0.0.0", "server.host=127.0.0.1")
            for key, port in (("port", "grpc"), ("health_port", "health"), ("metrics_port", "metrics"),
                              ("http_port", "http")):
                line = re.sub(rf"^server\.{key}=\d+$", f"server.{key}={ports[port]}", line)
            line = line.replace("/var/lib/specd/trainer", str(self.trainer_store))
            for path, local in self.files.items():
                line = line.replace(path, local)
            out.append(line)
        return "\n".join(out) + "\n"

    def tail(self) -> str:
        return "\n".join(p.log_tail() for p in self.pods.values())

    def ready(self, name: str) -> bool:
        if name == "redis":
            return tcp_ok(self.redis_port)
        if name in self.routers:
            health = self.ports[self.routers.index(name)]["health"]
            return http_ok(*self.probes[name]) and grpc_serving(health)
        return http_ok(*self.probes[name])

    def address(self, routers: list[int] | None = None) -> str:
        """The routers' gRPC ports as one target (the Service's stand-in), or some of them."""
        chosen = range(len(self.routers)) if routers is None else routers
        return "ipv4:" + ",".join(f"127.0.0.1:{self.ports[i]['grpc']}" for i in chosen)

    def client(self, routers: list[int] | None = None):
        from specd.cluster.client import Security, SpecdClient

        # the certificate names localhost; the address is a list of IPs
        return SpecdClient(self.address(routers), timeout=120,
                           security=Security(tls=True, ca_file=self.cert, token=self.token,
                                             server_name="localhost"))

    def openai(self, router: int = 0):
        """The OpenAI SDK against a router's HTTP API, with the same TLS and token as gRPC."""
        import ssl

        import httpx
        import openai

        return openai.OpenAI(base_url=f"https://127.0.0.1:{self.ports[router]['http']}/v1",
                             api_key=self.token, max_retries=0, timeout=120,
                             http_client=httpx.Client(verify=ssl.create_default_context(cafile=self.cert)))

    def metrics(self, router: int = 0) -> str:
        url = f"http://127.0.0.1:{self.ports[router]['metrics']}/metrics"
        return urllib.request.urlopen(url, timeout=10).read().decode()

    def redis_current(self) -> str | None:
        import redis

        pw = secret_value(self.docs, "rel-specd-redis", "redis-password")
        client = redis.Redis(port=self.redis_port, password=pw, socket_timeout=5)
        value = client.get("specd:replay:drafters:CURRENT")
        return value.decode() if value else None
