"""The Helm chart, without a cluster: Helm's own Go SDK (helm-python-sdk) lints and renders it with
the default values and three other value sets; every rendered manifest is validated against the
Kubernetes 1.30 schemas (kubernetes-validate, strict), the RayCluster against KubeRay's CRD schema
(tests/helm/crds, copied from KubeRay with its licence), and every Hydra override the ConfigMap
carries is accepted by specd's own config validation (configs.load_config)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import yaml

helm_python = pytest.importorskip("helm_python")
kubernetes_validate = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "specd"
CRD = Path(__file__).parent / "crds" / "ray.io_rayclusters.yaml"
K8S_VERSION = "1.30"

VALUE_SETS = {
    "default": {},
    # a CPU image, drafters sharing the target pods, external Redis, auth off, user config overrides
    "cpu-shared-external-redis": {
        "image": {"flavor": "cpu", "tag": "dev"},
        "target": {"replicas": 2, "gpus": 0, "cpu": "8", "memory": "24Gi"},
        "draft": {"shareTargetGPUs": True, "gpuFraction": 0.5},
        "trainer": {"enabled": False},
        "auth": {"enabled": False},
        "tls": {"enabled": True, "existingSecret": "my-tls"},
        "redis": {"enabled": False, "externalUrl": "rediss://redis.example:6380/0",
                  "password": {"existingSecret": "redis-creds", "key": "pw"}},
        "config": {"target.device": "cpu", "drafter.device": "cpu", "drafter.kind": "ngram",
                   "spec.tree_width": 3, "spec.policy": "egag", "target.max_seq_len": 1024,
                   "drafter.max_seq_len": None},
    },
    # mutual TLS, a persistent Redis, a ServiceMonitor, placement, a given token
    "mtls-persistent-monitored": {
        "imagePullSecrets": [{"name": "regcred"}],
        "target": {"replicas": 3, "gpus": 2, "nodeSelector": {"gpu": "h100"},
                   "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
        "tls": {"mutual": True},
        "auth": {"token": "operator-chosen-token", "admin": {"existingSecret": "ops-admin"}},
        "redis": {"persistence": {"enabled": True, "size": "20Gi", "storageClass": "fast"}},
        "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
        "router": {"service": {"type": "LoadBalancer"}, "metricsPort": 9100},
        "config": {"spec.gamma_max": 6, "spec.gamma": 5, "server.max_queue": 128},
    },
    # no metrics port: no metrics Service port, no ServiceMonitor even when asked
    "no-metrics": {"router": {"metricsPort": 0}, "serviceMonitor": {"enabled": True}},
}


def render(values: dict) -> list[dict]:
    with helm_python.Chart.load(str(CHART)) as chart:
        out = chart.render(values, name="rel", namespace="specd")
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def strict_schema(schema: dict) -> dict:
    """The CRD schema as the API server applies it: objects with listed properties take no others
    (the server prunes unknown fields, which would silently drop a typo)."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if (node.get("type") == "object" and "properties" in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node.setdefault("additionalProperties", False)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@pytest.fixture(scope="module")
def raycluster_validator():
    crd = yaml.safe_load(CRD.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = strict_schema(version["schema"]["openAPIV3Schema"])
    return jsonschema.Draft7Validator(schema)


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def rendered(request):
    return request.param, VALUE_SETS[request.param], render(VALUE_SETS[request.param])


def test_lint_has_no_warnings_or_errors() -> None:
    for name, values in VALUE_SETS.items():
        report = helm_python.lint(str(CHART), values, strict=True, kube_version=f"v{K8S_VERSION}.0")
        assert not report["errors"], (name, report)
        assert [m for m in report["messages"] if m["severity"] >= 2] == [], (name, report)


def test_every_manifest_validates(rendered, raycluster_validator) -> None:
    name, _, docs = rendered
    kinds = {d["kind"] for d in docs}
    assert {"RayCluster", "Service", "ConfigMap"} <= kinds, name
    for doc in docs:
        if doc["kind"] == "RayCluster":
            errors = sorted(raycluster_validator.iter_errors(doc), key=lambda e: list(e.path))
            assert not errors, [f"{list(e.path)}: {e.message}" for e in errors[:5]]
        elif doc["kind"] == "ServiceMonitor":
            # the Prometheus operator's CRD is not vendored here: check the wiring instead
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
            assert doc["spec"]["endpoints"][0]["port"] == "metrics"
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_validation_catches_a_bad_manifest(raycluster_validator) -> None:
    docs = render({})
    ray = copy.deepcopy(by_kind(docs, "RayCluster")[0])
    ray["spec"]["workerGroupSpecs"][0]["replicaz"] = 1
    assert list(raycluster_validator.iter_errors(ray))
    svc = copy.deepcopy(by_kind(docs, "Service")[0])
    svc["spec"]["ports"][0]["port"] = "not-a-port"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(svc, K8S_VERSION, strict=True)


def overrides_of(docs: list[dict]) -> list[str]:
    text = by_kind(docs, "ConfigMap")[0]["data"]["overrides.txt"]
    return [s.strip() for s in text.splitlines() if s.strip() and not s.startswith("#")]


def test_configmap_overrides_pass_specd_validation(rendered) -> None:
    from specd.cluster.serve import read_overrides_file
    from specd.configs import load_config

    name, values, docs = rendered
    lines = overrides_of(docs)
    cfg = load_config(lines)
    assert cfg.server.host == "0.0.0.0" and cfg.ray.address == "auto"
    assert cfg.target.replicas == values.get("target", {}).get("replicas", 1)     # per router
    assert cfg.trainer.lifetime == ("cluster" if cfg.trainer.enabled else "router")   # the one trainer
    for key, value in values.get("config", {}).items():
        section, field = key.split(".")
        expected = value if value is not None else cfg.target.max_seq_len   # None: follows the target
        assert getattr(getattr(cfg, section), field) == expected
    tls = values.get("tls", {})
    assert (cfg.server.tls_client_ca_file is not None) == bool(tls.get("mutual"))
    assert (cfg.server.auth_token_file is not None) == values.get("auth", {}).get("enabled", True)
    # the file the router reads is the same list (serve's reader skips the comment line)
    text = by_kind(docs, "ConfigMap")[0]["data"]["overrides.txt"]
    tmp = Path(__file__).parent / f".overrides-{name}.txt"
    try:
        tmp.write_text(text)
        assert read_overrides_file(str(tmp)) == lines
    finally:
        tmp.unlink()


def test_a_bad_config_value_fails_specd_validation() -> None:
    from specd.configs import load_config

    lines = overrides_of(render({"config": {"spec.gamma": 99}}))
    with pytest.raises(ValueError, match="spec.gamma=99"):
        load_config(lines)


def router_pod(docs: list[dict]) -> dict:
    return next(d for d in by_kind(docs, "Deployment")
                if d["metadata"]["name"].endswith("-router"))["spec"]["template"]["spec"]


def router_container(docs: list[dict]) -> dict:
    return next(c for c in router_pod(docs)["containers"] if c["name"] == "router")


def test_router_service_probes_and_secrets_are_wired(rendered) -> None:
    name, values, docs = rendered
    cfg_lines = dict(line.split("=", 1) for line in overrides_of(docs))
    router = router_container(docs)
    svc = next(d for d in by_kind(docs, "Service") if d["metadata"]["name"].endswith("-router"))
    grpc_port = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc")
    assert grpc_port["appProtocol"] == "grpc" and str(grpc_port["port"]) == cfg_lines["server.port"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert str(router[probe]["grpc"]["port"]) == cfg_lines["server.health_port"]
    assert router["command"][:2] == ["specd", "serve"]
    mounts = {m["mountPath"] for m in router["volumeMounts"]}
    # the overrides file is in a mounted directory (no subPath: the kubelet updates it in place)
    config_mount = next(m for m in router["volumeMounts"] if m["name"] == "config")
    assert "subPath" not in config_mount
    assert Path(router["command"][-1]).parent == Path(config_mount["mountPath"])
    auth = values.get("auth", {})
    admin_on = auth.get("enabled", True) and auth.get("admin", {}).get("enabled", True)
    assert ("server.admin_token_file" in cfg_lines) == admin_on
    for key in ("server.tls_cert_file", "server.auth_token_file", "server.tls_client_ca_file",
                "server.admin_token_file"):
        if key in cfg_lines:
            assert any(cfg_lines[key].startswith(m + "/") for m in mounts), key
    secrets = {d["metadata"]["name"]: d for d in by_kind(docs, "Secret")}
    volumes = router_volumes(docs)
    existing = {values.get("tls", {}).get("existingSecret"), values.get("auth", {}).get("existingSecret"),
                values.get("auth", {}).get("admin", {}).get("existingSecret")} - {None, ""}
    for volume in volumes.values():      # every Secret the router mounts is rendered or named by values
        if "secret" in volume:
            assert volume["secret"]["secretName"] in set(secrets) | existing, volume
    metrics = values.get("router", {}).get("metricsPort", 9464)
    assert bool(by_kind(docs, "ServiceMonitor")) == bool(
        metrics and values.get("serviceMonitor", {}).get("enabled"))


def router_volumes(docs: list[dict]) -> dict:
    return {v["name"]: v for v in router_pod(docs)["volumes"]}


def test_worker_groups_gpus_and_redis(rendered) -> None:
    name, values, docs = rendered
    groups = {g["groupName"]: g for g in by_kind(docs, "RayCluster")[0]["spec"]["workerGroupSpecs"]}
    shared = values.get("draft", {}).get("shareTargetGPUs", False)
    expected = {"target"} | ({"draft"} if not shared else set())
    expected |= {"trainer"} if values.get("trainer", {}).get("enabled", True) else set()
    assert set(groups) == expected
    # every router owns target.replicas target pods (and as many draft pods)
    routers = values.get("router", {}).get("replicas", 2)
    per_router = values.get("target", {}).get("replicas", 1)
    for group in ({"target", "draft"} & set(groups)):
        assert groups[group]["replicas"] == routers * per_router, group
    target_gpus = values.get("target", {}).get("gpus", 1)
    limits = groups["target"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits.get("nvidia.com/gpu", 0) == target_gpus
    cfg_lines = overrides_of(docs)
    for group in groups.values():    # custom resources through the CRD field, never the shell line
        assert "resources" not in group["rayStartParams"]
    advertised = {k: float(v) for k, v in groups["target"]["resources"].items()}
    asked = sum(1 for line in cfg_lines if line.startswith(("+target.resources.specd_target",
                                                              "+drafter.resources.specd_target")))
    assert advertised["specd_target"] == asked     # a shared pod fits its target and its drafter
    redis = values.get("redis", {})
    statefulsets = by_kind(docs, "StatefulSet")
    assert bool(statefulsets) == redis.get("enabled", True)
    if statefulsets:
        claims = statefulsets[0]["spec"].get("volumeClaimTemplates", [])
        assert bool(claims) == redis.get("persistence", {}).get("enabled", True)
        env = statefulsets[0]["spec"]["template"]["spec"]["containers"][0]["env"]
        assert env[0]["valueFrom"]["secretKeyRef"]["key"] == "redis-password"
    url = next(e["value"] for e in router_container(docs)["env"] if e["name"] == "SPECD_REDIS_URL")
    assert url == redis.get("externalUrl") or url.startswith("redis://rel-specd-redis.specd.svc")
    from specd.configs import load_config

    cfg = load_config(cfg_lines)
    assert cfg.replay.redis_url == url           # the replay writer and trainer use the same Redis
    password_env = next(e for e in router_container(docs)["env"] if e["name"] == cfg.replay.password_env)
    assert password_env["valueFrom"]["secretKeyRef"]["key"] == redis.get("password", {}).get(
        "key", "redis-password")
    assert cfg.trainer.enabled == ("trainer" in groups)
    if "trainer" in groups:      # the trainer actor asks for what only the trainer pods advertise
        advertised = groups["trainer"]["resources"]
        assert cfg.trainer.resources == {k: float(v) for k, v in advertised.items()}
        gpus = values.get("trainer", {}).get("gpus", 1)
        assert cfg.trainer.num_gpus == gpus and cfg.trainer.device == ("cuda" if gpus else "cpu")
    # a shared target pod's GPUs hold its target and drafter actors together
    pod_gpus = limits.get("nvidia.com/gpu", 0)
    if shared:
        assert cfg.target.num_gpus + cfg.drafter.num_gpus <= max(pod_gpus, 0) or pod_gpus == 0
        assert pod_gpus == 0 or cfg.drafter.num_gpus > 0


@pytest.mark.parametrize("bad", [
    {"image": {"flavor": "rocm"}},
    {"target": {"replicas": 0}},
    {"redis": {"enabled": False}},             # no external URL either
    {"config": {"Spec Gamma": 3}},
    {"unknownTopLevel": 1},
    {"draft": {"shareTargetGPUs": True, "gpuFraction": 1.0}},   # 1 + 1 GPUs asked of a 1-GPU pod
    {"rayVersion": "2.40.0"},                  # KubeRay's probes would exec wget
    {"router": {"rayNode": {"memory": "lots"}}},   # also the /dev/shm size limit
    {"target": {"rayStartParams": {"resources": '{"x": 1}'}}},   # split by bash -c
    {"podSecurityContext": {"runAsNonRoot": False, "seccompProfile": {"type": "RuntimeDefault"}}},
])
def test_values_schema_rejects_bad_values(bad) -> None:
    with pytest.raises(helm_python.HelmError):
        render(bad)


def pod_specs(docs: list[dict]) -> dict[str, dict]:
    """Every pod template of the release by component: the RayCluster's groups, the routers and Redis."""
    ray = by_kind(docs, "RayCluster")[0]["spec"]
    pods = {"head": ray["headGroupSpec"]["template"]["spec"], "router": router_pod(docs)}
    pods.update({g["groupName"]: g["template"]["spec"] for g in ray["workerGroupSpecs"]})
    for redis in by_kind(docs, "StatefulSet"):
        pods["redis"] = redis["spec"]["template"]["spec"]
    return pods


def test_every_pod_is_restricted_and_pulls_with_the_secrets(rendered) -> None:
    name, values, docs = rendered
    for component, pod in pod_specs(docs).items():
        assert pod["securityContext"]["runAsNonRoot"] is True, component
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", component
        assert pod["automountServiceAccountToken"] is False and pod["serviceAccountName"], component
        assert pod.get("imagePullSecrets", []) == values.get("imagePullSecrets", []), component
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, c["name"]
            assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
            assert sc["readOnlyRootFilesystem"] is True and sc["runAsNonRoot"] is True, c["name"]
    assert {d["kind"] for d in docs} >= {"ServiceAccount", "PodDisruptionBudget", "NetworkPolicy"}


def test_network_policy_lets_only_the_router_ports_in_from_outside() -> None:
    docs = render({})
    policies = {d["metadata"]["name"]: d["spec"] for d in by_kind(docs, "NetworkPolicy")}
    internal, router = policies["rel-specd-internal"], policies["rel-specd-router"]
    # every pod: ingress only from the release's own pods
    assert internal["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "specd",
                                                      "app.kubernetes.io/instance": "rel"}
    assert [list(rule) for rule in internal["ingress"]] == [["from"]]
    peer = internal["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    assert peer["app.kubernetes.io/instance"] == "rel"
    # from anywhere: the routers' gRPC, HTTP API and metrics ports, and no other
    assert router["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
    assert sorted(p["port"] for rule in router["ingress"] for p in rule["ports"]) == [8000, 9464, 50051]
    head = by_kind(docs, "RayCluster")[0]["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["include-dashboard"] == "false"
    ports = {p["containerPort"] for c in head["template"]["spec"]["containers"] for p in c.get("ports", [])}
    assert 8265 not in ports and 10001 not in ports


def test_config_changes_roll_the_routers_only_and_gcs_fault_tolerance_is_on(raycluster_validator) -> None:
    a, b = render({}), render({"config": {"spec.gamma": 4}})
    ray_a, ray_b = by_kind(a, "RayCluster")[0]["spec"], by_kind(b, "RayCluster")[0]["spec"]
    assert ray_a["upgradeStrategy"]["type"] == "Recreate"
    # a config change leaves the Ray pods' templates alone (KubeRay would recreate them all) ...
    assert ray_a == ray_b
    # ... and rolls the routers, one at a time
    checksum = [router_pod_template(docs)["metadata"]["annotations"]["checksum/config"] for docs in (a, b)]
    assert checksum[0] != checksum[1]
    deployment = next(d for d in by_kind(a, "Deployment") if d["metadata"]["name"].endswith("-router"))
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    pdbs = {d["metadata"]["name"]: d["spec"] for d in by_kind(a, "PodDisruptionBudget")}
    assert pdbs["rel-specd-router"]["maxUnavailable"] == 1
    anti = router_pod(a)["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    spread = anti[0]["podAffinityTerm"]["labelSelector"]["matchLabels"]
    assert spread["app.kubernetes.io/component"] == "router"
    svc = next(d for d in by_kind(a, "Service") if d["metadata"]["name"].endswith("-router"))
    assert svc["spec"]["selector"]["app.kubernetes.io/component"] == "router"
    # no router left on the head: its pod is the GCS only
    assert [c["name"] for c in ray_a["headGroupSpec"]["template"]["spec"]["containers"]] == ["ray-head"]
    # the routers' Ray node joins the head's Service, offers no CPU, and waits out a GCS restart
    ray_c = router_pod(a)["containers"][0]
    assert "--address=rel-specd-head-svc.specd.svc.cluster.local:6379" in ray_c["command"][2]
    assert "--num-cpus=0" in ray_c["command"][2] and "--block" in ray_c["command"][2]
    assert {"name": "RAY_gcs_rpc_server_reconnect_timeout_s", "value": "600"} in ray_c["env"]
    # probed where its dashboard agent listens, as KubeRay probes its own worker pods
    agent = re.search(r"--dashboard-agent-listen-port=(\d+)", ray_c["command"][2]).group(1)
    for probe in ("readinessProbe", "livenessProbe"):
        assert ray_c[probe]["httpGet"] == {"path": "/api/healthz", "port": int(agent)}
    ft = by_kind(a, "RayCluster")[0]
    assert not list(raycluster_validator.iter_errors(ft))
    opts = ft["spec"]["gcsFaultToleranceOptions"]
    assert opts["redisAddress"] == "rel-specd-redis.specd.svc:6379"
    assert opts["redisPassword"]["valueFrom"]["secretKeyRef"]["key"] == "redis-password"
    off = by_kind(render({"gcsFaultTolerance": {"enabled": False}}), "RayCluster")[0]
    assert "gcsFaultToleranceOptions" not in off["spec"]


def router_pod_template(docs: list[dict]) -> dict:
    return next(d for d in by_kind(docs, "Deployment")
                if d["metadata"]["name"].endswith("-router"))["spec"]["template"]


def test_grafana_dashboard_shows_the_serving_series() -> None:
    cm = next(d for d in by_kind(render({}), "ConfigMap") if d["metadata"]["name"].endswith("-dashboard"))
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    exprs = " ".join(t["expr"] for p in json.loads(cm["data"]["specd.json"])["panels"] for t in p["targets"])
    for series in ("specd_generated_tokens_total", "specd_time_to_first_token_seconds_bucket",
                   "specd_request_latency_seconds_sum", "specd_accepted_tokens_total",
                   "specd_drafter_version_info", "specd_drafter_swaps", "specd_trainer_rollbacks"):
        assert series in exprs, series
    from specd.cluster.metrics import SpecdMetrics
    from specd.cluster.online import OnlineMetrics

    metrics = SpecdMetrics()
    OnlineMetrics(metrics.registry)
    known = {s.name for m in metrics.registry.collect() for s in m.samples} | {
        m.name for m in metrics.registry.collect()}
    for series in ("specd_drafter_swaps", "specd_trainer_rollbacks", "specd_drafter_version_info"):
        assert series in known, series


def test_a_router_pods_shutdown_fits_its_grace_period(rendered) -> None:
    """Deleted gracefully, a router pod serves on through its preStop delay (the Service dropping its
    endpoint), then drains for server.shutdown_grace_s; its Ray node, whose stop ends the router's actors,
    stops only after that; and all of it ends within the pod's grace period."""
    from specd.configs.schema import ServerConfig

    name, values, docs = rendered
    cfg_lines = dict(line.split("=", 1) for line in overrides_of(docs))
    drain = float(cfg_lines.get("server.shutdown_grace_s", ServerConfig().shutdown_grace_s))
    pod = router_pod(docs)
    delays = {}
    for c in pod["containers"]:
        command = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
        delays[c["name"]] = float(command[1]) if command else 0.0
        if command:
            assert command[0] == "sleep", c["name"]
    expected = values.get("router", {}).get("preStopDelaySeconds", 5)
    assert delays["router"] == expected
    assert delays["router"] + drain < delays["ray-worker"] < pod["terminationGracePeriodSeconds"]


def test_the_router_sees_its_ray_node_and_the_node_has_what_kuberay_gives_a_ray_container(rendered) -> None:
    """A Ray driver attaches only to a raylet whose process it can see (ray/_private/services.py,
    find_node_ids): the router pod shares one process namespace. Its Ray container has the memory-backed
    /dev/shm KubeRay mounts into its own Ray containers (sized to the memory request), probes and
    resources."""
    name, values, docs = rendered
    pod = router_pod(docs)
    assert pod["shareProcessNamespace"] is True, name
    ray_c = next(c for c in pod["containers"] if c["name"] == "ray-worker")
    shm = next(m for m in ray_c["volumeMounts"] if m["mountPath"] == "/dev/shm")
    volume = router_volumes(docs)[shm["name"]]
    memory = ray_c["resources"]["requests"]["memory"]
    assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": memory}
    assert ray_c["resources"]["limits"]["memory"] == memory
    assert {"cpu", "memory"} <= set(ray_c["resources"]["requests"]) and "cpu" in ray_c["resources"]["limits"]
    assert "readinessProbe" in ray_c and "livenessProbe" in ray_c
    # KubeRay's own groups get theirs from the operator, not from the chart
    for group in by_kind(docs, "RayCluster")[0]["spec"]["workerGroupSpecs"]:
        assert "shareProcessNamespace" not in group["template"]["spec"]
