"""A step whose plan drafts nothing asks the drafter beside the verify, not before it (step.py).

Real tiny workers behind thread handles (the router's actors are another process; a thread is the same
concurrency in one process). A barrier of two parties shows the overlap: the drafter's propose for a plan
of γ 0 and the target's verify each wait at it, so they pass only when both calls run at once. Run one
after the other, the first to arrive waits out the barrier's timeout and the step records a broken
barrier.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from specd.configs import load_config
from specd.workers.core.sampling import SamplingParams
from specd.workers.engine.draft_worker import DraftWorker
from specd.workers.engine.handles import DrafterHandle, TargetHandle
from specd.workers.engine.sequence import Sequence
from specd.workers.engine.step import SpecStep
from specd.workers.engine.target_worker import TargetWorker
from specd.workers.engine.types import NewRequest, SpecParams

PROMPTS = [[5, 9, 13, 2], [7, 7, 7, 7, 7, 7, 30, 31], [40]]
NEW_TOKENS = 12
BARRIER_S = 5.0


class _MeetingTarget(TargetWorker):
    def __init__(self, cfg, barrier: threading.Barrier | None) -> None:
        super().__init__(cfg)
        self.barrier, self.met, self.broken = barrier, 0, 0

    def verify(self, drafts, return_hidden=False):
        if self.barrier is not None:
            try:
                self.barrier.wait()
                self.met += 1
            except threading.BrokenBarrierError:
                self.broken += 1
                self.barrier.reset()
        return super().verify(drafts, return_hidden)


class _MeetingDrafter(DraftWorker):
    def __init__(self, *args, barrier: threading.Barrier | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.barrier, self.gammas = barrier, []

    def propose(self, items):
        self.gammas.append([item.gamma for item in items])
        if self.barrier is not None and not any(item.gamma for item in items):
            try:
                self.barrier.wait()
            except threading.BrokenBarrierError:
                self.barrier.reset()
        return super().propose(items)


@pytest.fixture(scope="module")
def cfg(tiny_target_dir, tiny_drafter_dir):
    return load_config([
        f"target.model_path={tiny_target_dir}", f"drafter.path={tiny_drafter_dir}", "drafter.kind=model",
        "target.max_slots=4", "drafter.max_slots=4", "target.max_seq_len=128",
    ])


def _generate(target, drafter, spec: SpecParams) -> list[list[int]]:
    async def run() -> list[list[int]]:
        step = await SpecStep.create(TargetHandle(target, "target", "thread"),
                                     DrafterHandle(drafter, "drafter", "thread") if drafter else None)
        seqs = [Sequence(NewRequest(f"r{i}", p, SamplingParams(), NEW_TOKENS, spec), ())
                for i, p in enumerate(PROMPTS)]
        await step.start(seqs)
        while not all(s.finished for s in seqs):
            await step.step(seqs)
        await step.release([s.request_id for s in seqs])
        return [s.output for s in seqs]
    return asyncio.run(run())


def test_a_plan_of_gamma_zero_asks_the_drafter_beside_the_verify(cfg) -> None:
    base = _generate(TargetWorker(cfg.target), None, SpecParams(enabled=False))
    barrier = threading.Barrier(2, timeout=BARRIER_S)
    target = _MeetingTarget(cfg.target, barrier)
    drafter = _MeetingDrafter(cfg.drafter, cfg.spec, str(target.model_dir), barrier=barrier)
    out = _generate(target, drafter, SpecParams(gamma=0, policy="fixed"))
    assert out == base
    # every step planned γ 0 for every request, and each propose met its step's verify
    assert drafter.gammas and all(g == [0] * len(g) for g in drafter.gammas)
    assert target.met == len(drafter.gammas) and target.broken == 0
    assert target.free_slots() == cfg.target.max_slots and not drafter.requests


def test_a_plan_that_drafts_waits_for_its_drafts(cfg) -> None:
    """With γ > 0 the verify needs the drafts: the propose runs first, and the output stays exact."""
    base = _generate(TargetWorker(cfg.target), None, SpecParams(enabled=False))
    target = TargetWorker(cfg.target)
    drafter = _MeetingDrafter(cfg.drafter, cfg.spec, str(target.model_dir))
    out = _generate(target, drafter, SpecParams(gamma=3, policy="fixed"))
    assert out == base
    assert sum(map(sum, drafter.gammas)) > 0
    assert not drafter.requests
