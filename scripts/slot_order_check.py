"""Does a batch's KV-slot order change what a decode forward costs? (README: rows in slot order)

The attention reads each run of consecutive KV slots as one cache view; ModelRunner sorts a batch's
rows by slot before every forward, so any order should cost the same. This times one-token extend
forwards of the target at batch 16 with slots in order, reversed and shuffled (median of 30 each),
and counts the cache views per layer each order gets:

    python scripts/slot_order_check.py           # batch 16, 90-token contexts
"""

from __future__ import annotations

import sys
import time

import torch

from specd.workers.engine.host_memory import keep_freed_memory
from specd.workers.engine.runner import ModelRunner
from specd.workers.models import layers
from specd.workers.models.loader import ensure_target_model


def main(batch: int = 16, context: int = 90, reps: int = 30) -> None:
    keep_freed_memory()
    torch.set_num_threads(2)
    runner = ModelRunner(ensure_target_model(), max_slots=batch, max_seq_len=context + 64)
    slots = [runner.allocate() for _ in range(batch)]
    runner.prefill(slots, [[1] + [100 + i] * (context - 1) for i in range(batch)])
    views: list[int] = []
    make = layers.BatchPlan.make.__func__

    def counted(cls, plan_slots, *args, **kwargs):
        plan = make(cls, plan_slots, *args, **kwargs)
        views.append(len(plan.runs))
        return plan

    layers.BatchPlan.make = classmethod(counted)
    shuffled = torch.randperm(batch, generator=torch.Generator().manual_seed(0)).tolist()
    orders = {"in order": slots, "reversed": slots[::-1], "shuffled": [slots[i] for i in shuffled]}
    for name, order in orders.items():
        times = []
        views.clear()
        for _ in range(reps):
            for s in order:
                runner.cache.lengths[s] = context      # the same context every time
            t0 = time.perf_counter()
            runner.extend(order, [[5]] * batch)
            times.append(time.perf_counter() - t0)
        times.sort()
        print(f"{name:9s} {1000 * times[len(times) // 2]:6.1f} ms per forward, "
              f"{max(views)} cache view(s) per layer")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
