"""Same cell, one process: what static groups, one queue, and group pairing measure of the default.

One in-process engine with room for two batches, the default configuration, and one workload's prompts.
Each mode runs the cell once, speculative beside target-only (speculation off per request, scratch ids):
  static  step-paired static groups of `batch` (`specd bench engine --lockstep`)
  queue   step-paired, one queue each of at most `batch` running (`--lockstep --continuous`, but timed to
          the end, drain included)
  abba    group-paired static groups, ABBA order (`--paired`; scripts/step_costs.py's run_cell)
and prints both sides' wall seconds, the ratio, drafted / accepted tokens, the seconds either side spent
outside the workers' calls, and step_costs.py's breakdown (worker calls, verifies by batch size: the
steps a side ran at fewer rows than `batch`).

    python scripts/batching_check.py 4 48 0.7 gsm8k static,queue,abba   # batch, prompts, T, workload, modes

Export LD_PRELOAD=<python prefix>/lib/libiomp5.so first, as the benches do.
"""

from __future__ import annotations

import collections
import sys

from scripts.step_costs import NEW_TOKENS, Meter, report, run_cell
from specd.bench.datasets import workload_prompts
from specd.cluster.first_start import ensure_serving_drafter
from specd.configs import load_config
from specd.workers.core.sampling import SamplingParams
from specd.workers.drafters.base import SCRATCH_PREFIX
from specd.workers.engine.build import build_engine
from specd.workers.engine.types import NewRequest, SpecParams
from specd.workers.models.loader import ensure_target_model, load_tokenizer


def stepped(engine, meter: Meter, spec: SpecParams, prompts, batch: int, temperature: float, size: int):
    """Groups of `size` prompts (size = all: one queue), each side at most `batch` running, a step of one
    then of the other; wall seconds per side and the speculative side's [drafted, accepted]."""
    off = SpecParams(enabled=False)
    wall: dict[str, float] = collections.defaultdict(float)
    drafted = [0, 0]
    def made(prefix: str, params: SpecParams, g: int) -> list[NewRequest]:
        return [NewRequest(f"{prefix}-{size}-{temperature}-{g}-{i}", p,
                           SamplingParams(temperature=temperature, seed=g + i), NEW_TOKENS, params)
                for i, p in enumerate(prompts[g:g + size])]

    for g in range(0, len(prompts), size):
        sides = {"spec": engine.batch(made("spec", spec, g), max_running=batch, ignore_eos=True),
                 "base": engine.batch(made(f"{SCRATCH_PREFIX}base", off, g), max_running=batch,
                                      ignore_eos=True)}
        turn = 0
        while not all(s.finished for s in sides.values()):
            for name in (("spec", "base") if turn % 2 == 0 else ("base", "spec")):
                if not sides[name].finished:
                    meter.mode = name
                    sides[name].advance()
            turn += 1
        for name, side in sides.items():
            wall[name] += side.seconds
        for seq in sides["spec"].sequences():
            drafted[0] += seq.stats.drafted
            drafted[1] += seq.stats.accepted
    return wall, drafted


def main(argv: list[str]) -> None:
    batch, num, temperature, workload = int(argv[0]), int(argv[1]), float(argv[2]), argv[3]
    modes = argv[4].split(",") if len(argv) > 4 else ["static", "queue", "abba"]
    base_cfg = load_config([])
    model_dir = ensure_target_model(base_cfg.target.model_path, base_cfg.cache_dir)
    prompts = [ids for _, ids in workload_prompts(workload, num, load_tokenizer(model_dir))]
    cfg = load_config([f"target.model_path={model_dir}", "target.num_threads=2",
                       f"target.max_slots={2 * batch}", "target.max_seq_len=512",
                       f"drafter.max_slots={2 * batch}"])
    ensure_serving_drafter(cfg, str(model_dir))
    engine = build_engine(cfg, speculative=True, max_running=2 * batch)
    spec = SpecParams.from_config(cfg.spec)
    engine.generate([NewRequest(f"{SCRATCH_PREFIX}warmup", prompts[0], SamplingParams(), 8, spec)],
                    ignore_eos=True)
    meter = Meter(engine)
    for mode in modes:
        clear = getattr(engine.drafter.drafter, "clear_index", None)
        if clear is not None:
            clear()   # as the bench does between cells
        meter.reset()
        drafted = None
        if mode == "abba":
            wall = run_cell(engine, meter, spec, prompts, batch, temperature)
        elif mode in ("static", "queue"):
            size = batch if mode == "static" else len(prompts)
            wall, drafted = stepped(engine, meter, spec, prompts, batch, temperature, size)
        else:
            raise SystemExit(f"unknown mode {mode!r}: static, queue or abba")
        print(f"== {mode}: base {wall['base']:.2f} s, spec {wall['spec']:.2f} s, spec / target-only "
              f"{wall['base'] / wall['spec']:.3f}x, drafted / accepted {drafted}")
        for side in ("base", "spec"):
            inner = sum(v for (m, k), v in meter.seconds.items() if m == side and not k.startswith("gc"))
            print(f"  {side} outside the workers' calls {wall[side] - inner:.3f} s")
        report(meter, batch)


if __name__ == "__main__":
    main(sys.argv[1:])
