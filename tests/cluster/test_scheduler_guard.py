"""The speculation guard through the router's scheduler: two pipeline groups share one guard per replica,
the windows it keeps from drafting change no token, and its state reaches the metrics."""

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

PROMPTS = [[5, 9, 13, 2], [7, 7, 7, 30, 31], [40, 41], [3, 4, 5, 3, 4, 5]]


def test_guard_windows_through_the_scheduler_keep_output_exact(tiny_llama_dir) -> None:
    cfg = load_config([
        f"target.model_path={tiny_llama_dir}", "drafter.kind=suffix", "drafter.suffix_with_model=false",
        "target.max_slots=8", "drafter.max_slots=8", "target.max_seq_len=128",
        "spec.goodput_profile_batch_sizes=[1,2]",
    ])
    target = TargetWorker(cfg.target)
    spec = SpecParams(gamma=4)
    reqs = [NewRequest(f"p{i}", p, SamplingParams(), 32, spec) for i, p in enumerate(PROMPTS)]
    base = [s.output for s in SpecEngine(target).generate(reqs, ignore_eos=True)]
    drafter = DraftWorker(cfg.drafter, cfg.spec, str(target.model_dir))

    async def main():
        sched = Scheduler([(target, drafter)], capacity=8, max_queue=8, max_running=8, pipeline_groups=2,
                          guard_window_steps=2)
        await sched.start()
        guards = {g.step.guard for g in sched.replicas[0].groups}
        outs = []
        for round_ in ("a", "b", "c"):
            runs = [NewRequest(f"{round_}{i}", p, SamplingParams(), 32, spec) for i, p in enumerate(PROMPTS)]
            outs.append(await asyncio.gather(*(sched.generate(r, ignore_eos=True) for r in runs)))
        stats = await sched.worker_stats()
        await sched.stop()
        return outs, stats, guards

    outs, stats, guards = asyncio.run(main())
    assert len(guards) == 1                                  # one guard for both groups of the replica
    (guard,) = guards
    assert {mode for _, mode in guard.history} == {"on", "off"}   # both modes timed
    for round_ in outs:
        assert [tokens for tokens, _ in round_] == base
    s = stats[0]
    assert s["guard_windows_on"] >= 1 and s["guard_windows_off"] >= 1 and s["guarded_steps"] > 0
    # the last closed window's load may have no window of one mode yet (a round's tail runs fewer requests)
    assert s["guard_on_tokens_per_s"] > 0 or s["guard_off_tokens_per_s"] > 0
    metrics = SpecdMetrics()
    metrics.set_worker_stats(stats)
    sample = metrics.registry.get_sample_value
    assert sample("specd_guard_windows_total", {"replica": "0", "mode": "off"}) == s["guard_windows_off"]
    assert sample("specd_guard_skipped_steps_total", {"replica": "0"}) == s["guarded_steps"]
    on = sample("specd_guard_tokens_per_second", {"replica": "0", "mode": "on"})
    assert on == s["guard_on_tokens_per_s"]
    assert sample("specd_guard_speculation_allowed", {"replica": "0"}) in (0.0, 1.0)
    assert target.free_slots() == cfg.target.max_slots
