"""serve._warm_up: what a server sends itself before SERVING, so the first clients do not pay for
compiles and captures (decode=compiled on CUDA specialises one row against several, one new token
against a verify of several)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from specd.cluster.serve import _warm_up
from specd.configs import load_config


class Scheduler:
    """Records each request with the round it came in; answers at once."""

    def __init__(self, fail: bool = False):
        self.rounds: list[list] = []
        self.fail = fail

    async def generate(self, req, ignore_eos: bool):
        assert ignore_eos and req.request_id.startswith("warmup-")   # replay skips the warmup- prefix
        round_ = int(req.request_id.split("-")[1])
        while len(self.rounds) <= round_:
            self.rounds.append([])
        self.rounds[round_].append(req.spec)
        return None, SimpleNamespace(reason="error" if self.fail else "length", error="boom")


CODEC = SimpleNamespace(encode=lambda text: [1, 2, 3])


def test_every_replica_warms_one_row_and_two_side_by_side_drafting_and_not() -> None:
    cfg = load_config([])
    scheduler = Scheduler()
    asyncio.run(_warm_up(scheduler, CODEC, cfg, replicas=2))
    first, second = scheduler.rounds
    assert len(first) == 2 and all(s.policy == cfg.spec.policy and s.enabled for s in first)
    assert len(second) == 4
    drafting = [s for s in second if s.enabled]
    assert len(drafting) == 2 and all(s.policy == "fixed" and s.gamma == cfg.spec.gamma for s in drafting)


def test_a_target_only_server_warms_one_round_and_a_failed_warm_up_raises() -> None:
    scheduler = Scheduler()
    asyncio.run(_warm_up(scheduler, CODEC, load_config(["spec.enabled=false"]), replicas=1))
    assert len(scheduler.rounds) == 1 and not scheduler.rounds[0][0].enabled
    with pytest.raises(RuntimeError, match="warm-up failed: boom"):
        asyncio.run(_warm_up(Scheduler(fail=True), CODEC, load_config([]), replicas=1))
