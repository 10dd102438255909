"""Where does the default's time go against target-only, and does the goodput cost model price it right?

One in-process engine, the default configuration (`specd serve`'s, no overrides but sizes), alternating
groups of `batch` prompts of one workload with speculation off per request ("base") and on ("spec"), in
ABBA order so drift in machine speed falls on both alike, the way `specd bench engine --paired` does. It
times every worker call (target start and verify, drafter start and propose), the garbage collector's
pauses, and for each verify the cost model's prediction beside the measured seconds (plain and drafting
verifies per batch size), and for each drafting step the plan's expected tokens and seconds beside what
it emitted and took. Extra config overrides follow the arguments (e.g. spec.guard_in_process=true).

    python scripts/step_costs.py 8 64 0 humaneval              # batch, prompts, temperature, workload
    python scripts/step_costs.py 4,8,16 64 0,0.7 gsm8k         # the grid's cells in turn, one process
    python scripts/step_costs.py 4 64 0 gsm8k spec.guard_in_process=true

Export LD_PRELOAD=<python prefix>/lib/libiomp5.so first, as the benches do.
"""

from __future__ import annotations

import collections
import gc
import statistics
import sys
import time

from specd.bench.datasets import workload_prompts
from specd.cluster.first_start import ensure_serving_drafter
from specd.configs import load_config
from specd.workers.core.sampling import SamplingParams
from specd.workers.drafters.base import SCRATCH_PREFIX
from specd.workers.engine.build import build_engine
from specd.workers.engine.types import NewRequest, SpecParams
from specd.workers.models.loader import ensure_target_model, load_tokenizer

NEW_TOKENS = 64


class Meter:
    """Seconds per (mode, what), GC pauses per mode, and predicted vs measured verifies."""

    def __init__(self, engine) -> None:
        self.engine, self.mode = engine, "base"
        self.seconds: dict[tuple[str, str], float] = collections.defaultdict(float)
        self.verifies: list[tuple[str, int, bool, float, float]] = []   # mode, batch, drafted, pred, s
        self.plans: list[tuple[float, float, int, float]] = []          # expected, predicted s, emitted, s
        self._plan = None
        self._gc_start = 0.0
        for name in ("start", "release"):
            self._wrap(engine.target, name, "target." + name)
        for name in ("start", "release"):
            self._wrap(engine.drafter, name, "drafter." + name)
        self._verify, self._propose = engine.target.verify, engine.drafter.propose
        engine.target.verify, engine.drafter.propose = self.verify, self.propose
        gc.callbacks.append(self._gc)

    def reset(self) -> None:
        self.seconds.clear()
        self.verifies.clear()
        self.plans.clear()

    def _wrap(self, obj, name: str, label: str) -> None:
        call = getattr(obj, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds[(self.mode, label)] += time.perf_counter() - t0

        setattr(obj, name, timed)

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.seconds[(self.mode, f"gc gen{info['generation']}")] += time.perf_counter() - self._gc_start

    def propose(self, *args, **kwargs):
        t0 = time.perf_counter()
        drafts = self._propose(*args, **kwargs)
        took = time.perf_counter() - t0
        self.seconds[(self.mode, "drafter.propose")] += took
        plan = self.engine.drafter.last_plan
        drafted = any(d.tokens for d in drafts)
        self._plan = (plan.expected_tokens, plan.seconds, took) if plan is not None and drafted else None
        return drafts

    def verify(self, drafts, **kwargs):
        rows = [1 + len(d.tokens) for d in drafts]
        costs = self.engine.drafter.costs
        predicted = costs.step_seconds(rows, [0] * len(rows))
        t0 = time.perf_counter()
        results = self._verify(drafts, **kwargs)
        took = time.perf_counter() - t0
        self.seconds[(self.mode, "target.verify")] += took
        self.verifies.append((self.mode, len(rows), max(rows) > 1, predicted, took))
        if self._plan is not None:
            expected, seconds, propose = self._plan
            self.plans.append((expected, seconds, sum(len(r.new_tokens) for r in results), propose + took))
            self._plan = None
        return results


def main(argv: list[str]) -> None:
    batches = [int(b) for b in argv[0].split(",")]
    temperatures = [float(t) for t in argv[2].split(",")]
    num, workload = int(argv[1]), argv[3]
    base_cfg = load_config([])
    model_dir = ensure_target_model(base_cfg.target.model_path, base_cfg.cache_dir)
    prompts = [ids for _, ids in workload_prompts(workload, num, load_tokenizer(model_dir))]
    top = max(batches)
    cfg = load_config([f"target.model_path={model_dir}", "target.num_threads=2", f"target.max_slots={top}",
                       "target.max_seq_len=512", f"drafter.max_slots={top}", *argv[4:]])
    ensure_serving_drafter(cfg, str(model_dir))
    engine = build_engine(cfg, speculative=True, max_running=top)
    spec = SpecParams.from_config(cfg.spec)
    engine.generate([NewRequest(f"{SCRATCH_PREFIX}warmup", prompts[0], SamplingParams(), 8, spec)],
                    ignore_eos=True)
    meter = Meter(engine)
    # the cells in the grid's order, in one process, as `specd bench engine` runs them
    for batch in batches:
        for temperature in temperatures:
            clear = getattr(engine.drafter.drafter, "clear_index", None)
            if clear is not None:
                clear()   # as the bench does: a cell must not draft from an earlier cell's outputs
            meter.reset()
            wall = run_cell(engine, meter, spec, prompts, batch, temperature)
            print(f"batch {batch}, {num} {workload} prompts, T = {temperature}: base {wall['base']:.2f} s, "
                  f"spec {wall['spec']:.2f} s, spec / target-only {wall['base'] / wall['spec']:.3f}x")
            report(meter, batch)


def run_cell(engine, meter: Meter, spec: SpecParams, prompts, batch: int, temperature: float) -> dict:
    """Groups of `batch` prompts, target-only and speculative in ABBA order; wall seconds per mode."""
    off = SpecParams(enabled=False)
    wall: dict[str, float] = collections.defaultdict(float)
    for g in range(0, len(prompts), batch):
        for mode in (["base", "spec"] if (g // batch) % 2 == 0 else ["spec", "base"]):
            meter.mode = mode
            params = spec if mode == "spec" else off
            # the bench's ids: target-only requests are scratch, so the suffix index never learns them
            prefix = f"{SCRATCH_PREFIX}base" if mode == "base" else "spec"
            requests = [NewRequest(f"{prefix}-{batch}-{temperature}-{g}-{i}", p,
                                   SamplingParams(temperature=temperature, seed=g + i), NEW_TOKENS, params)
                        for i, p in enumerate(prompts[g:g + batch])]
            t0 = time.perf_counter()
            engine.generate(requests, ignore_eos=True)
            wall[mode] += time.perf_counter() - t0
    return wall


def report(meter: Meter, batch: int) -> None:
    for key in sorted(meter.seconds):
        print(f"  {key[0]:5s} {key[1]:16s} {meter.seconds[key]:8.3f} s")
    print("verify seconds, spec mode: batch, kind, count, predicted, measured, measured / predicted")
    cells = collections.defaultdict(list)
    for mode, b, drafted, predicted, took in meter.verifies:
        if mode == "spec":
            cells[(b, "draft" if drafted else "plain")].append((predicted, took))
    for (b, kind), rows in sorted(cells.items()):
        pred, took = sum(p for p, _ in rows), sum(t for _, t in rows)
        print(f"  {b:3d} {kind:5s} {len(rows):5d} {pred:8.2f} {took:8.2f} {took / pred:6.3f}")
    plain = {m: [t for mm, b, d, _, t in meter.verifies if mm == m and b == batch and not d]
             for m in ("base", "spec")}
    print("plain verify at full batch, median ms: " + ", ".join(
        f"{m} {1000 * statistics.median(v):.1f}" for m, v in plain.items() if v))
    if meter.plans:
        expected, predicted, emitted, took = (sum(p[i] for p in meter.plans) for i in range(4))
        print(f"drafting steps {len(meter.plans)}: expected {expected:.0f} tokens in {predicted:.2f} s "
              f"({expected / predicted:.0f} tok/s), emitted {emitted:.0f} in {took:.2f} s "
              f"({emitted / took:.0f} tok/s)")


if __name__ == "__main__":
    main(sys.argv[1:])
