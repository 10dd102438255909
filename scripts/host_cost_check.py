"""Does the goodput default stop drafting where a drafting step's host work makes it lose?

On an H100 a step at batch 8 takes ~6 ms and the default's drafting steps took ~20 ms (0.38x target-only,
README "GPUs"): host work no forward accounts for. This CPU check makes drafting steps that slow on
purpose, by sleeping `host_ms` after every propose that drafted, and runs, in one process on one target,
alternating groups of `batch` GSM8K prompts (fresh prompts per group, so no group repeats another's):

    off       speculation off per request (the paired target-only baseline)
    measured  the default, its cost model measuring each step's host work (workers/core/goodput.py),
              with the speculation guard as configured (spec.guard_window_steps)
    blind     the default with that measurement and the guard turned off (the cost model before both)
    guarded   blind, with the speculation guard (workers/core/guard.py): what the guard alone saves
              from a cost model that cannot see the host work

    python scripts/host_cost_check.py 8 100 3          # batch, host_ms, groups
    python scripts/host_cost_check.py 8 0 3            # no added host work: measured should not lose

It prints tokens/s and the ratio to `off` per mode (medians over groups), and the share of steps that
drafted.
"""

from __future__ import annotations

import statistics
import sys
import time

from transformers import AutoTokenizer

from specd.bench.datasets import workload_prompts
from specd.cluster.first_start import ensure_serving_drafter
from specd.configs import load_config
from specd.workers.core.sampling import SamplingParams
from specd.workers.engine.build import build_engine, worker_seeds
from specd.workers.engine.draft_worker import DraftWorker
from specd.workers.engine.spec_engine import SpecEngine
from specd.workers.engine.types import NewRequest, SpecParams
from specd.workers.models.loader import ensure_target_model

NEW_TOKENS = 64


def slowed(drafter: DraftWorker, host_ms: float) -> DraftWorker:
    propose = drafter.propose

    def slow_propose(items, **kw):
        drafts = propose(items, **kw)
        if any(d.tokens for d in drafts):
            time.sleep(host_ms / 1000)
        return drafts

    drafter.propose = slow_propose
    return drafter


def main(batch: int, host_ms: float, groups: int, overrides: list[str]) -> None:
    model_dir = str(ensure_target_model())
    cfg = load_config([f"target.model_path={model_dir}", "target.num_threads=2", f"target.max_slots={batch}",
                       "target.max_seq_len=1024", f"drafter.max_slots={batch}", *overrides])
    ensure_serving_drafter(cfg, model_dir)
    measured = build_engine(cfg, speculative=True, max_running=batch)
    slowed(measured.drafter, host_ms)
    target = measured.target
    engines = {"off": measured, "measured": measured}
    for mode, window in (("blind", 0), ("guarded", cfg.spec.guard_window_steps or 32)):
        drafter = DraftWorker(cfg.drafter, cfg.spec, str(target.model_dir), seed=worker_seeds(cfg.seed)[1],
                              cache_dir=cfg.cache_dir)
        drafter.costs.observe_host = lambda *a, **k: None   # noqa: ARG005 - the cost model before
        engines[mode] = SpecEngine(target, slowed(drafter, host_ms), max_running=batch,
                                   guard_window_steps=window)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [p for _, p in workload_prompts("gsm8k", batch * (groups + 1), tok)]
    rates: dict[str, list[float]] = {m: [] for m in engines}
    drafted: dict[str, list[float]] = {m: [] for m in engines}
    for g in range(groups + 1):                                # group 0 warms every mode up
        group = prompts[g * batch:(g + 1) * batch]
        for mode, engine in engines.items():
            spec = SpecParams.from_config(cfg.spec, enabled=mode != "off")
            reqs = [NewRequest(f"{mode}-{g}-{i}", p, SamplingParams(), NEW_TOKENS, spec)
                    for i, p in enumerate(group)]
            t0 = time.perf_counter()
            seqs = engine.generate(reqs, ignore_eos=True)
            seconds = time.perf_counter() - t0
            steps = sum(s.stats.steps for s in seqs)
            if g:
                rates[mode].append(batch * NEW_TOKENS / seconds)
                drafted[mode].append(sum(x > 0 for s in seqs for x in s.stats.gamma_history) / max(steps, 1))
        if g:
            print(f"group {g}: " + ", ".join(f"{m} {rates[m][-1]:.1f} tok/s" for m in engines), flush=True)
    base = statistics.median(rates["off"])
    for mode in engines:
        r = statistics.median(rates[mode])
        share = statistics.median(drafted[mode])
        print(f"{mode:9s} {r:7.1f} tok/s  {r / base:.2f}x off  steps drafting {share:.0%}")


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
