"""Ray workers run on the driver's CPUs, not on the one CPU a preloaded Intel OpenMP pins the raylet to."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from specd.cluster import cpu_affinity

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity calls here")


def test_the_setup_hook_puts_every_thread_on_the_drivers_cpus(monkeypatch) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    stop = threading.Event()
    pinned = threading.Thread(target=stop.wait)
    pinned.start()
    try:
        os.sched_setaffinity(pinned.native_id, cpus[:1])        # as a worker's threads arrive: one CPU
        monkeypatch.setenv(cpu_affinity.ENV, ",".join(map(str, cpus)))
        assert cpu_affinity.apply() == cpus
        assert sorted(os.sched_getaffinity(pinned.native_id)) == cpus
    finally:
        stop.set()
        pinned.join()


def test_without_the_variable_the_hook_changes_nothing(monkeypatch) -> None:
    monkeypatch.delenv(cpu_affinity.ENV, raising=False)
    before = os.sched_getaffinity(0)
    assert cpu_affinity.apply() == [] and os.sched_getaffinity(0) == before


def test_a_local_cluster_passes_the_drivers_cpus_to_its_workers() -> None:
    from specd.cluster.actors import ray_init_kwargs
    from specd.configs import load_config

    env = ray_init_kwargs(load_config([]))["runtime_env"]
    assert env["worker_process_setup_hook"] == "specd.cluster.cpu_affinity.apply"
    assert env["env_vars"][cpu_affinity.ENV] == ",".join(map(str, sorted(os.sched_getaffinity(0))))


_IOMP = Path(sys.prefix) / "lib" / "libiomp5.so"

_PROBE = """
import os, torch, ray
from specd.cluster.actors import ray_init_kwargs
from specd.configs import load_config
torch.set_num_threads(2)
torch.randn(256, 256) @ torch.randn(256, 256)      # the driver's OpenMP runtime starts before ray.init
kwargs = ray_init_kwargs(load_config([]))
kwargs["num_cpus"] = 2
if not WITH_HOOK:
    del kwargs["runtime_env"]
ray.init(**kwargs)
@ray.remote
def cpus():
    return sorted(os.sched_getaffinity(0))
print("WORKER", ray.get(cpus.remote()), "DRIVER", sorted(os.sched_getaffinity(0)))
ray.shutdown()
"""


@pytest.mark.slow     # starts Ray workers
@pytest.mark.skipif(not _IOMP.is_file() or (os.cpu_count() or 1) < 2, reason="needs libiomp5 and 2 CPUs")
def test_real_ray_workers_under_preloaded_intel_openmp_use_every_cpu() -> None:
    def probe(with_hook: bool) -> tuple[str, str]:
        code = _PROBE.replace("WITH_HOOK", str(with_hook))
        out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                             text=True, timeout=240, env={**os.environ, "LD_PRELOAD": str(_IOMP)},
                             cwd=Path(__file__).resolve().parents[2])
        line = next(ln for ln in out.stdout.splitlines() if ln.startswith("WORKER"))
        worker, driver = line.removeprefix("WORKER ").split(" DRIVER ")
        return worker, driver

    worker, driver = probe(with_hook=True)
    assert worker == driver
    pinned, driver = probe(with_hook=False)           # what the hook undoes, on this machine
    assert pinned != driver, "the pin no longer happens: the hook may be unnecessary"
