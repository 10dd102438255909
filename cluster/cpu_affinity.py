"""Ray workers on every CPU the server was given, not pinned to one.

With Intel OpenMP preloaded (LD_PRELOAD=libiomp5.so, as vLLM's CPU backend recommends) and a torch op
run before ray.init (the drafter check, a quick bootstrap), the raylet that ray.init starts comes up
pinned to CPU 0, and every worker it forks inherits that: on this 2-core machine the target, the
drafter and the online trainer all ran on CPU 0 while CPU 1 sat idle (docs/decisions/cpu-affinity.md).
Ray keeps a parent's affinity (ray-project/ray#35984).

The driver passes the CPUs it may run on (its own affinity: an operator's `taskset` still holds) to
every worker process of a local cluster, whose setup hook applies them to all its threads before an
actor starts, so the threads an actor creates (torch's pool, the trainer's loop) inherit them.
"""

from __future__ import annotations

import contextlib
import os

ENV = "SPECD_CPU_AFFINITY"


def driver_cpus() -> str | None:
    """The driver's CPUs as "0,1,..." (None where the OS has no affinity calls)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))


def runtime_env() -> dict:
    """Ray runtime_env entries that put every worker process on the driver's CPUs."""
    cpus = driver_cpus()
    if cpus is None:
        return {}
    return {"worker_process_setup_hook": "specd.cluster.cpu_affinity.apply", "env_vars": {ENV: cpus}}


def apply() -> list[int]:
    """Worker setup hook: every thread of this process on the CPUs in $SPECD_CPU_AFFINITY. Returns them."""
    spec = os.environ.get(ENV)
    if not spec or not hasattr(os, "sched_setaffinity"):
        return []
    cpus = [int(c) for c in spec.split(",") if c]
    for tid in os.listdir("/proc/self/task"):
        # a thread that just exited, or CPUs this process may not use: leave it
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), cpus)
    return cpus
