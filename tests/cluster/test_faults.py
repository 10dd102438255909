"""Faults with real processes: a DraftWorker actor killed mid-stream (Ray restarts it).

The workers are the fake ones of fake_workers.py placed as real Ray actors (their output is known), so
the test checks the fault handling of the step and the scheduler, not a model."""

from __future__ import annotations

import asyncio
import time

import fake_workers
import pytest
from fake_workers import EOS, target_only

from cluster import actors
from cluster.scheduler import Scheduler
from configs.schema import SpecdConfig
from workers.core.sampling import SamplingParams
from workers.engine.types import FinishReason, NewRequest, SpecParams


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    ray.cloudpickle.register_pickle_by_value(fake_workers)
    ray.init(num_cpus=4, include_dashboard=False, namespace="specd-test-faults", log_to_driver=False)
    yield ray
    ray.shutdown()


def _request(rid: str, first: int, n: int) -> NewRequest:
    return NewRequest(rid, [first], SamplingParams(), n, SpecParams(gamma=3), (EOS,))


def test_killed_drafter_requests_finish_target_only_and_speculation_resumes(ray_session) -> None:
    cfg = SpecdConfig(name="test")
    cfg.drafter.max_restarts = 2
    cluster = actors.create_cluster(cfg, "/nonexistent", fake_workers.RayFakeTarget,
                                    fake_workers.RaySlowFakeDrafter)
    backs: list[int] = []

    async def drafter_back(replica: int) -> None:
        backs.append(replica)

    async def main():
        pairs = [(r.target, r.drafter) for r in cluster.replicas]
        sched = Scheduler(pairs, capacity=4, max_queue=8, max_running=8, pipeline_groups=1,
                          eos_token_ids=[EOS], on_drafter_back=drafter_back)
        await sched.start()
        running = [asyncio.create_task(sched.generate(_request(f"r{i}", i + 1, 60))) for i in range(3)]
        while sched.tokens_generated < 9:           # every request is mid-stream
            await asyncio.sleep(0.005)
        ray_session.kill(cluster.replicas[0].drafter, no_restart=False)
        outs = await asyncio.gather(*running)
        during = await sched.worker_stats()
        after, deadline = None, time.monotonic() + 60
        while time.monotonic() < deadline:          # the actor restarts; new requests speculate again
            after = await sched.generate(_request(f"after-{time.monotonic()}", 10, 20))
            if after[1].stats.spec.drafted > 0:
                break
            await asyncio.sleep(0.2)
        final = await sched.worker_stats()
        await sched.stop()
        return outs, during, after, final

    try:
        ray_session.get(cluster.placement_group.ready(), timeout=60)
        outs, during, after, final = asyncio.run(main())
    finally:
        actors.shutdown_cluster(cluster)
    # every running request finished, exactly as target-only decoding, none restarted from scratch
    assert [tokens for tokens, _ in outs] == [target_only([i + 1], 60) for i in range(3)]
    assert all(fin.reason == FinishReason.LENGTH for _, fin in outs)
    assert all(fin.stats.spec.drafted > 0 for _, fin in outs)        # they speculated before the kill
    assert during[0]["drafter_failures"] >= 1 and during[0]["drafter_fallback_requests"] == 3
    # the restarted actor was set up again and drafts for new requests
    assert after is not None and after[0] == target_only([10], 20) and after[1].stats.spec.drafted > 0
    assert backs and set(backs) == {0}
    assert not final[0]["drafter_down"]
