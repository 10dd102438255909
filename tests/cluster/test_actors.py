"""Actor options from config, and the scheduler driving fake workers placed as real Ray actors."""

from __future__ import annotations

import asyncio

import fake_workers
import pytest
from fake_workers import EOS, target_only

from specd.cluster import actors
from specd.cluster.scheduler import Scheduler
from specd.configs.schema import SpecdConfig
from specd.workers.core.sampling import SamplingParams
from specd.workers.engine.types import FinishReason, NewRequest, SpecParams


def config(**target) -> SpecdConfig:
    cfg = SpecdConfig(name="test")
    for key, value in target.items():
        setattr(cfg.target, key, value)
    return cfg


def test_bundles_give_target_and_drafter_their_own_devices() -> None:
    cfg = config(replicas=2, num_gpus=1.0, num_cpus=2.0)
    cfg.drafter.num_gpus = 1.0
    assert actors.placement_bundles(cfg) == [{"CPU": 2.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}] * 2
    cpu_only = config()
    assert actors.placement_bundles(cpu_only) == [{"CPU": 1.0}, {"CPU": 1.0}]
    cpu_only.drafter.num_cpus = 0.0
    assert actors.placement_bundles(cpu_only)[1] == {"CPU": actors._MIN_CPU}


@pytest.mark.parametrize(
    "node_gpus,expected",
    [(2, (1.0, 1.0)), (4, (1.0, 1.0)), (1, (0.5, 0.5))],
    ids=["own-gpu", "own-gpu-4", "shared"],
)
def test_gpu_workers_get_their_own_gpu_or_share_one(node_gpus, expected) -> None:
    cfg = config(replicas=2, device="cuda")
    cfg.drafter.device = "cuda"
    assert actors.gpu_shares(cfg, node_gpus) == expected
    target, drafter = expected
    pair = [{"CPU": 1.0, "GPU": target}, {"CPU": 1.0, "GPU": drafter}]
    assert actors.placement_bundles(cfg, node_gpus) == pair * 2
    pytest.importorskip("ray")
    for replica in (0, 1):
        t = actors.target_actor_options(cfg, None, replica, node_gpus=node_gpus)
        d = actors.drafter_actor_options(cfg, None, replica, node_gpus=node_gpus)
        assert (t["num_gpus"], d["num_gpus"]) == expected
        assert t["scheduling_strategy"].placement_group_bundle_index == 2 * replica
        assert d["scheduling_strategy"].placement_group_bundle_index == 2 * replica + 1


def test_gpu_shares_keep_configured_values_and_cpu_workers() -> None:
    cfg = config(device="cuda")
    assert actors.gpu_shares(cfg, 1) == (0.5, 0.5)   # an unset drafter device follows the target's
    # a CPU drafter beside a GPU target: the whole GPU is the target's
    cfg.drafter.device = "cpu"
    assert actors.gpu_shares(cfg, 1) == (1.0, 0.0)
    cfg.drafter.device = "cuda"
    cfg.drafter.num_gpus = 0.25
    assert actors.gpu_shares(cfg, 1) == (0.5, 0.25)  # configured values win, the rest is placed
    assert actors.gpu_shares(config(), 8) == (0.0, 0.0)  # CPU workers ask for no GPU on a GPU node


def test_ray_init_starts_a_local_cluster_or_connects() -> None:
    local = actors.ray_init_kwargs(config(replicas=2))
    assert local["num_cpus"] >= 5 and local["include_dashboard"] is False and local["address"] == "local"
    remote = config()
    remote.ray.address = "ray://head:10001"
    kwargs = actors.ray_init_kwargs(remote)
    assert kwargs["address"] == "ray://head:10001" and "num_cpus" not in kwargs


def test_a_router_joins_through_its_own_nodes_raylet(monkeypatch, tmp_path) -> None:
    """address=auto names this node's temp dir: with several raylets on one host (the pods test), Ray
    would otherwise pick the head's, and the router would die with the head."""
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    cfg = config()
    cfg.ray.address = "auto"
    assert actors.ray_init_kwargs(cfg)["_temp_dir"] == str(tmp_path / "ray")
    cfg.ray.address = "10.0.0.1:6379"
    assert "_temp_dir" not in actors.ray_init_kwargs(cfg)


def test_a_router_waits_for_its_raylet_then_gives_up(monkeypatch) -> None:
    ray = pytest.importorskip("ray")
    calls = []

    def init(**kwargs):
        calls.append(kwargs["address"])
        if len(calls) < 3:
            raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr("time.sleep", lambda s: None)
    cfg = config()
    cfg.ray.address = "auto"
    assert actors.init_ray(cfg) is True and calls == ["auto"] * 3
    calls.clear()
    cfg.ray.connect_timeout_s = 0.0         # never up: the error reaches the caller (and the kubelet)
    monkeypatch.setattr(ray, "init", lambda **kw: (_ for _ in ()).throw(ConnectionError("no raylet")))
    with pytest.raises(ConnectionError, match="no raylet"):
        actors.init_ray(cfg)


def test_router_id_names_the_router(monkeypatch) -> None:
    cfg = config()
    monkeypatch.setenv("HOSTNAME", "rel-specd-router-7c9f-x2")
    assert actors.router_id(cfg) == "rel-specd-router-7c9f-x2"     # a pod's name
    cfg.ray.router_id = "r1"
    assert actors.router_id(cfg) == "r1"



def test_scheduler_over_ray_actor_handles(ray_session) -> None:
    cfg = config(replicas=2)
    cfg.ray.router_id = "router-a"
    cluster = actors.create_cluster(
        cfg, "/nonexistent", fake_workers.RayFakeTarget, fake_workers.RayFakeDrafter
    )
    try:
        ray_session.get(cluster.placement_group.ready(), timeout=60)
        # each actor carries its router's name (several routers share a cluster)
        names = [a["name"] for a in ray_session.util.list_named_actors(all_namespaces=True)
                 if a["name"].startswith(("specd-target-", "specd-drafter-"))]
        assert len([n for n in names if "-router-a-" in n]) == 4, names
        pairs = [(r.target, r.drafter) for r in cluster.replicas]

        async def main():
            sched = Scheduler(pairs, capacity=4, max_queue=8, max_running=8, pipeline_groups=2,
                              eos_token_ids=[EOS])
            assert all(rep.target.mode == rep.drafter.mode == "actor" for rep in sched.replicas)
            await sched.start()
            reqs = [NewRequest(f"r{i}", [i + 1], SamplingParams(), 9, SpecParams(gamma=3), (EOS,))
                    for i in range(4)]
            outs = await asyncio.gather(*[sched.generate(r) for r in reqs])
            stats = await sched.worker_stats()
            await sched.stop()
            return outs, stats

        outs, stats = asyncio.run(main())
    finally:
        actors.shutdown_cluster(cluster)
    assert [t for t, _ in outs] == [target_only([i + 1], 9) for i in range(4)]
    assert all(fin.reason == FinishReason.LENGTH for _, fin in outs)
    assert sorted(fin.stats.replica for _, fin in outs) == [0, 0, 1, 1]
    assert [s["steps"] > 0 for s in stats] == [True, True]


def test_a_failed_local_ray_start_is_retried_once(monkeypatch) -> None:
    ray = pytest.importorskip("ray")
    calls = []

    def flaky_init(**kwargs):
        calls.append("init")
        if calls.count("init") == 1:
            raise Exception("The current node timed out during startup.")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", flaky_init)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    assert actors.init_ray(config()) is True
    assert calls == ["init", "shutdown", "init"]
    remote = config()
    remote.ray.address = "ray-head:6379"     # a cluster's start is not ours to retry
    calls.clear()
    with pytest.raises(Exception, match="timed out"):
        actors.init_ray(remote)
    assert calls == ["init"]


_STALE_SCRIPT = """
import ray
from specd.cluster import actors
from specd.configs import load_config
assert actors.init_ray(load_config(["ray.namespace=stale-test"])) is True
print("NODES", len(ray.nodes()), ray.cluster_resources().get("CPU"))
ray.shutdown()
"""


@pytest.mark.slow     # starts a local Ray cluster
def test_local_start_ignores_a_stale_cluster_address_file(tmp_path) -> None:
    """A <tmp>/ray/ray_current_cluster left by an earlier cluster (here: pointing at nothing) must not be
    followed when no ray.address is configured: specd starts its own local cluster."""
    import os
    import shutil
    import subprocess
    import sys
    import tempfile

    pytest.importorskip("ray")
    # A short private temp dir: Ray's socket paths live under it (108-byte limit), and the real
    # /tmp/ray belongs to whoever else runs Ray on this machine.
    tmp = tempfile.mkdtemp(prefix="rs", dir="/tmp")
    try:
        os.makedirs(f"{tmp}/ray")
        with open(f"{tmp}/ray/ray_current_cluster", "w") as f:
            f.write("127.0.0.1:1\n")
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update(RAY_TMPDIR=tmp, PYTHONPATH=os.getcwd())
        out = subprocess.run([sys.executable, "-c", _STALE_SCRIPT], env=env, capture_output=True,
                             text=True, timeout=300)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "NODES 1" in out.stdout, out.stdout
