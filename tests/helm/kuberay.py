"""What the KubeRay operator does to a rendered RayCluster's pods, in Python, for the pods-as-processes test.

Copied from ray-project/kuberay ray-operator/controllers/ray/common/pod.go (commit feeaf72f, the one
tests/helm/crds comes from), function by function, so that the test runs the very `bash -c` line the
operator would write:
- updateRayStartParamsResources: the group-level `resources:` field -> num-cpus / memory / num-gpus, and
  every other name into `resources` as '<json>' (single-quoted: bash keeps it one word);
- setMissingRayStartParams: address (workers), dashboard-host (head), metrics-export-port, block,
  dashboard-agent-listen-port;
- generateRayStartCommand: num-cpus from the CPU limit (else request), memory from the memory limit,
  num-gpus from a GPU limit (addWellKnownAcceleratorResources);
- convertParamMap: sorted ` --key=value ` pairs; "true" a bare flag, "false" dropped, except the listed
  options that take an explicit boolean;
- BuildPod: `ulimit -n ${RAY_START_ULIMIT_OPEN_FILES:-65536}; <ray start ...>`;
- initLivenessAndReadinessProbe: from Ray 2.53 an HTTP GET of /api/healthz on the dashboard agent's
  listen port (before it, `wget` commands);
- configureGCSFaultTolerance / configureRedisFT: with spec.gcsFaultToleranceOptions, the head container
  gets RAY_external_storage_namespace, RAY_REDIS_ADDRESS and REDIS_PASSWORD (and --redis-password=
  $REDIS_PASSWORD), every worker container RAY_gcs_rpc_server_reconnect_timeout_s=600 unless it sets it.
"""

from __future__ import annotations

import copy
import json
import math
import re

DEFAULT_METRICS_PORT = 8080
DEFAULT_DASHBOARD_AGENT_LISTEN_PORT = 52365
RAY_NODE_HEALTH_PATH = "/api/healthz"
_BOOLEAN_VALUED = ("log-color", "include-dashboard", "include-log-monitor")
_SUFFIX = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20,
           "Gi": 2**30, "Ti": 2**40, "m": 1e-3}


def quantity(text) -> float:
    """A Kubernetes quantity ("8", "500m", "32Gi") as a number."""
    m = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(text))
    if not m:
        raise ValueError(f"not a quantity: {text!r}")
    return float(m.group(1)) * _SUFFIX[m.group(2)]


def _value(q: float) -> str:
    """resource.Quantity.Value(): rounded up to an integer."""
    return str(math.ceil(q))


def _is_gpu(name: str) -> bool:
    return name.endswith("gpu")                       # utils.IsGPUResourceKey


def update_params_resources(params: dict[str, str], group_resources: dict[str, str]) -> None:
    custom: dict[str, float] = {}
    for name, q in (group_resources or {}).items():
        low = name.lower()
        if low == "cpu":
            params["num-cpus"] = _value(quantity(q))
        elif low == "memory":
            params["memory"] = _value(quantity(q))
        elif _is_gpu(low):
            params["num-gpus"] = _value(quantity(q))
        else:
            custom[name] = quantity(q)
    if custom:
        # Go's json.Marshal writes a float64 1 as 1
        custom = {k: int(v) if float(v).is_integer() else v for k, v in sorted(custom.items())}
        params["resources"] = f"'{json.dumps(custom, separators=(',', ':'))}'"


def set_missing_params(params: dict[str, str], head: bool, fqdn_ray_ip: str, head_port: str) -> None:
    if not head and "address" not in params:
        params["address"] = f"{fqdn_ray_ip}:{head_port}"
    if head and "dashboard-host" not in params:
        params["dashboard-host"] = "0.0.0.0"
    params.setdefault("metrics-export-port", str(DEFAULT_METRICS_PORT))
    params["block"] = "true"
    params.setdefault("dashboard-agent-listen-port", str(DEFAULT_DASHBOARD_AGENT_LISTEN_PORT))


def convert_param_map(params: dict[str, str]) -> str:
    out = ""
    for key in sorted(params):
        value = params[key]
        if value.lower() in ("true", "false") and key not in _BOOLEAN_VALUED:
            if value.lower() == "true":
                out += f" --{key} "
        else:
            out += f" --{key}={value} "
    return out


def ray_start_command(group: dict, head: bool, fqdn_ray_ip: str = "127.0.0.1",
                      head_port: str = "6379") -> str:
    """The Ray container's args KubeRay writes for a rendered headGroupSpec or workerGroupSpec."""
    params = {k: str(v) for k, v in (group.get("rayStartParams") or {}).items()}
    update_params_resources(params, group.get("resources") or {})
    set_missing_params(params, head, fqdn_ray_ip, head_port)
    container = group["template"]["spec"]["containers"][0]
    limits = container.get("resources", {}).get("limits", {})
    requests = container.get("resources", {}).get("requests", {})
    if "num-cpus" not in params:
        cpu = limits.get("cpu") or requests.get("cpu")
        if cpu is not None and quantity(cpu) > 0:
            params["num-cpus"] = _value(quantity(cpu))
    if "memory" not in params and limits.get("memory"):
        params["memory"] = _value(quantity(limits["memory"]))
    for name in sorted(limits):
        if "num-gpus" not in params and _is_gpu(name) and quantity(limits[name]) > 0:
            params["num-gpus"] = _value(quantity(limits[name]))
    start = ("ray start --head " if head else "ray start ") + convert_param_map(params)
    return "ulimit -n ${RAY_START_ULIMIT_OPEN_FILES:-65536}; " + start


def head_port(head_group: dict) -> str:
    """utils.GetHeadPort: the head's rayStartParams port, else the default GCS port."""
    return str((head_group.get("rayStartParams") or {}).get("port", "6379"))


def ray_probe(group: dict, ray_version: str) -> tuple[int, str]:
    """(port, path) of the HTTP GET KubeRay injects as readiness and liveness probe (Ray >= 2.53)."""
    major, minor, *_ = (int(x) for x in ray_version.split("."))
    if (major, minor) < (2, 53):
        raise AssertionError(f"rayVersion {ray_version}: KubeRay would probe with wget")
    params = group.get("rayStartParams") or {}
    port = int(params.get("dashboard-agent-listen-port", DEFAULT_DASHBOARD_AGENT_LISTEN_PORT))
    return port, RAY_NODE_HEALTH_PATH


DEFAULT_WORKER_GCS_RECONNECT_TIMEOUT_S = "600"


def with_gcs_fault_tolerance(spec: dict, group: dict, head: bool, storage_namespace: str) -> dict:
    """The group as KubeRay runs it when the RayCluster spec asks for GCS fault tolerance (Redis
    backend): a copy with the injected env (Kubernetes env entries) and start parameters."""
    options = spec.get("gcsFaultToleranceOptions")
    if options is None:
        return group
    group = copy.deepcopy(group)
    container = group["template"]["spec"]["containers"][0]
    env = container.setdefault("env", [])
    names = {e["name"] for e in env}
    if not head:
        if "RAY_gcs_rpc_server_reconnect_timeout_s" not in names:
            env.append({"name": "RAY_gcs_rpc_server_reconnect_timeout_s",
                        "value": DEFAULT_WORKER_GCS_RECONNECT_TIMEOUT_S})
        return group
    if "RAY_external_storage_namespace" not in names:
        env.append({"name": "RAY_external_storage_namespace", "value": storage_namespace})
    env.append({"name": "RAY_REDIS_ADDRESS", "value": options["redisAddress"]})
    if "redisPassword" in options:
        group.setdefault("rayStartParams", {})["redis-password"] = "$REDIS_PASSWORD"
        env.append({"name": "REDIS_PASSWORD", **options["redisPassword"]})
    return group
