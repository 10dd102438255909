"""The router's scheduler with real tiny workers on the goodput policy and the suffix drafter: exact greedy
output, the cost sweep at start, measured goodput in worker_stats, and a finished request's output
drafting a later one (the suffix index learns from traffic through the router, too)."""

from __future__ import annotations

import asyncio

from specd.cluster.metrics import SpecdMetrics
from specd.cluster.scheduler import Scheduler
from specd.configs import load_config
from specd.workers.core.sampling import SamplingParams
from specd.workers.engine.draft_worker import DraftWorker
from specd.workers.engine.spec_engine import SpecEngine
from specd.workers.engine.target_worker import TargetWorker
from specd.workers.engine.types import NewRequest, SpecParams

PROMPTS = [[5, 9, 13, 2], [7, 7, 7, 30, 31], [40, 41]]


def test_goodput_and_suffix_through_the_scheduler(tiny_llama_dir) -> None:
    cfg = load_config([
        f"target.model_path={tiny_llama_dir}", "drafter.kind=suffix", "drafter.suffix_with_model=false",
        "target.max_slots=6", "drafter.max_slots=6", "target.max_seq_len=128", "spec.policy=goodput",
        "spec.goodput_profile_batch_sizes=[1,2]",
    ])
    target = TargetWorker(cfg.target)
    spec = SpecParams(gamma=4, policy="goodput")
    reqs = [NewRequest(f"p{i}", p, SamplingParams(), 24, spec) for i, p in enumerate(PROMPTS)]
    base = [s.output for s in SpecEngine(target).generate(reqs, ignore_eos=True)]
    drafter = DraftWorker(cfg.drafter, cfg.spec, str(target.model_dir))

    async def main():
        sched = Scheduler([(target, drafter)], capacity=6, max_queue=8, max_running=6, pipeline_groups=2)
        await sched.start()
        outs = []
        for round_ in ("a", "b"):  # the second round repeats the first: drafts from the global index
            runs = [NewRequest(f"{round_}{i}", p, SamplingParams(), 24, spec) for i, p in enumerate(PROMPTS)]
            outs.append(await asyncio.gather(*(sched.generate(r, ignore_eos=True) for r in runs)))
        stats = await sched.worker_stats()
        planner = sched.replicas[0].groups[0].step.planner     # the replica's groups share it
        assert all(g.step.planner is planner for g in sched.replicas[0].groups)
        await sched.stop()
        return outs, stats, planner

    outs, stats, planner = asyncio.run(main())
    for round_ in outs:
        assert [tokens for tokens, _ in round_] == base
    assert sorted(planner.costs.verify_table) == [1, 2]
    assert stats[0]["goodput_predicted"] > 0 and stats[0]["goodput_measured"] > 0
    assert drafter.drafter.stats()["sources"]["global"]["accepted"] > 0
    metrics = SpecdMetrics()
    metrics.set_worker_stats(stats)
    measured = metrics.registry.get_sample_value("specd_goodput_measured_tokens_per_second", {"replica": "0"})
    assert measured == stats[0]["goodput_measured"]
    assert target.free_slots() == cfg.target.max_slots
