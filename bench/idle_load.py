"""A load beside a benchmarked server that uses only CPU time serving leaves idle: what any colocated
background work (the online trainer, under SCHED_IDLE) costs serving on a machine, apart from what that
work is. `specd bench chat --beside-load F` runs it for the whole run.

One thread at the trainer's priority (cluster/trainer_actor.lower_priority with the default trainer
settings: nice 10 and SCHED_IDLE), busy `F` of every 100 ms period with float32 matmuls of a drafter
layer's width, asleep the rest. Under SCHED_IDLE it is preempted whenever serving wants the CPU, so F
bounds what it takes; it never takes more.

    python -m specd.bench.idle_load FRACTION
"""

from __future__ import annotations

import sys
import time

PERIOD_S = 0.1
WIDTH = 576          # SmolLM2-135M's hidden size, the drafter's and the trainer's matmuls


def check_fraction(fraction: float) -> float:
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"idle load fraction {fraction}: must lie in (0, 1]")
    return fraction


def run(fraction: float) -> None:
    from specd.cluster.trainer_actor import lower_priority
    from specd.configs.schema import TrainerConfig

    check_fraction(fraction)
    lower_priority(TrainerConfig())          # before torch starts threads: they inherit it
    import torch
    torch.set_num_threads(1)
    weight = torch.randn(WIDTH, WIDTH) / WIDTH ** 0.5      # [hidden, hidden]
    x = torch.randn(256, WIDTH)                             # [positions, hidden]
    while True:
        start = time.monotonic()
        while time.monotonic() - start < PERIOD_S * fraction:
            x = torch.tanh(x @ weight)
        if fraction < 1.0:
            time.sleep(PERIOD_S * (1.0 - fraction))


if __name__ == "__main__":
    run(float(sys.argv[1]))
