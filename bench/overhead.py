"""`specd bench overhead`: the host time of a speculative step, with free forwards.

On a GPU a target step of this project's 135M model takes a few milliseconds; whatever the host does
around the forwards (planning, drafting bookkeeping, suffix lookups, verification, KV bookkeeping,
Sequence.apply, streaming) decides whether speculation pays. This bench measures that host work alone:
target and drafter are the real workers on stand-in models whose forwards return fixed logits and hidden
states at once (bench/free_models.py), so a step's time is all host time.

Systems: target-only (speculation off), chain (model drafter, γ = 3 fixed), tree (model drafter, width
3, depth 3) and default (what `specd serve` runs: suffix + model drafter, goodput γ up to 8). Each at
each batch size, in-process (SpecEngine, the engine the benchmarks drive) and through the router's
scheduler with Ray actors (cluster/scheduler.Scheduler over cluster/actors.create_cluster; no gRPC).
Every cell runs `--steps` timed steps after `--warmup`, and reports medians: the step's host
milliseconds (in-process: the process's CPU time, robust to a loaded machine, with the wall time beside
it; through the router: wall time, the round trips included) and its phases (propose: the drafter's
call with the plan; verify: the target's call; rest: the step's own work, Sequence.apply and
streaming). The stand-ins accept every greedy draft, so
a speculative step does the most bookkeeping it can; with `--drafts rejected` the target's stand-in
accepts none and matches no lookup (held-out traffic: the planner learns to draft nothing), so a
speculative step's time over target-only's is what speculating costs where it buys nothing.

    specd bench overhead --json bench/results/overhead.json --plot bench/results/overhead.png
    specd bench overhead --where in-process --batch-sizes 1 --profile out/prof   # cProfile per cell
    specd bench overhead --real --real-steps 16          # the same cells on the real model beside them

The machine's load average goes into the JSON: host times on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import platform
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from specd.bench.report import save_figure, write_json

SYSTEMS = ("target-only", "chain", "tree", "default")
WHERE = ("in-process", "router")
PROMPT_LEN = 32
MAX_SEQ_LEN = 4096
TREE_MARGIN = 64           # room for a tree's nodes beyond max_new_tokens


def _csv(kind):
    return lambda text: [kind(x) for x in text.split(",") if x.strip()]


def system_setup(system: str, cfg_spec) -> tuple[list[str], Any]:
    """(config overrides, SpecParams) of one system; cfg_spec: the composed config's spec section."""
    from specd.workers.engine.types import SpecParams

    if system == "target-only":
        return [], SpecParams(enabled=False)
    if system == "chain":
        return ["drafter.kind=model"], SpecParams(gamma=3, policy="fixed", tree_width=1)
    if system == "tree":
        return ["drafter.kind=model"], SpecParams(gamma=3, policy="fixed", tree_width=3)
    if system == "default":
        return [], SpecParams.from_config(cfg_spec)
    raise SystemExit(f"unknown system {system!r}; known: {', '.join(SYSTEMS)}")


def base_overrides(target_dir: Path, drafter_dir: Path | None, max_batch: int, free: bool) -> list[str]:
    out = [f"target.model_path={target_dir}", "target.num_threads=1", f"target.max_slots={max_batch}",
           f"target.max_seq_len={MAX_SEQ_LEN}", f"drafter.max_slots={max_batch}"]
    if drafter_dir is not None:
        out.append(f"drafter.path={drafter_dir}")
    if free:
        out += ["target.decode=eager", "drafter.decode=eager"]
    return out


def uncaptured(cfg) -> None:
    """Free forwards answer at once: there is nothing to capture or compile. A captured decode mode the
    user asked for (for the real cells) runs as `static` in the free ones, its bucketing and input
    staging measured all the same."""
    for section in (cfg.target, cfg.drafter):
        if section.decode in ("graph", "compiled"):
            section.decode = "static"


def prompts(batch: int, salt: int) -> list[list[int]]:
    """Distinct prompts of PROMPT_LEN tokens within the drafter's head (no EOS)."""
    return [[2 + (salt * 7919 + i * 131 + j * 17) % 4000 for j in range(PROMPT_LEN)] for i in range(batch)]


def median_ms(values: list[float]) -> float:
    return round(1000 * statistics.median(values), 4) if values else 0.0


class PhaseTimer:
    """CPU seconds per phase of the current step, from wrapped worker methods (in-process)."""

    def __init__(self) -> None:
        self.current: dict[str, float] = {}

    def wrap(self, obj, name: str, phase: str) -> None:
        call = getattr(obj, name)

        def timed(*args, **kwargs):
            t0 = time.process_time()
            try:
                return call(*args, **kwargs)
            finally:
                self.current[phase] = self.current.get(phase, 0.0) + time.process_time() - t0

        setattr(obj, name, timed)


def run_in_process(system: str, batch: int, target, drafters: dict, cfg, steps: int, warmup: int,
                   profile_dir: Path | None, salt: int, forwards: str = "free") -> dict[str, Any]:
    """Median host time of `steps` steps of `batch` requests on one SpecEngine: the process's CPU time
    (nothing waits with free forwards, so that is the host work, and unlike wall time it does not grow
    with what else runs on a shared machine), and its wall time beside it."""
    from specd.workers.core.sampling import SamplingParams
    from specd.workers.engine.handles import run_sync
    from specd.workers.engine.spec_engine import SpecEngine
    from specd.workers.engine.types import NewRequest

    overrides, spec = system_setup(system, cfg.spec)
    drafter = drafters.get("model" if overrides else cfg.drafter.kind) if spec.enabled else None
    clear = getattr(getattr(drafter, "drafter", None), "clear_index", None)
    if clear is not None:
        clear()
    engine = SpecEngine(target, drafter, max_running=batch)
    timer = PhaseTimer()
    timer.wrap(target, "verify", "verify")
    if drafter is not None:
        for name in ("prepare", "propose"):         # the drafter's calls: commit and hint, then draft
            timer.wrap(drafter, name, "propose")
        for name in ("begin", "take_hints", "decide", "observe"):   # the SpeculationPlanner's share
            timer.wrap(engine.step.planner, name, "plan")
    streamed = [0]
    max_new = MAX_SEQ_LEN - PROMPT_LEN - TREE_MARGIN
    reqs = [NewRequest(f"overhead-{system}-{batch}-{salt}-{i}", p, SamplingParams(), max_new, spec)
            for i, p in enumerate(prompts(batch, salt))]

    def stream(_seq, toks: list[int]) -> None:     # what a server would hand its client
        streamed[0] += len(toks)

    run = engine.batch(reqs, ignore_eos=True, on_step=stream)
    run.advance()                               # admission (prefills) and the first step: not timed
    totals: list[float] = []
    walls: list[float] = []
    phases: dict[str, list[float]] = {"plan": [], "propose": [], "verify": [], "rest": []}
    tokens = 0
    profiler = cProfile.Profile() if profile_dir is not None else None
    try:
        for i in range(warmup + steps):
            timer.current = {}
            before = streamed[0]
            if profiler is not None and i >= warmup:
                profiler.enable()
            t0, c0 = time.perf_counter(), time.process_time()
            run.advance()
            took, wall = time.process_time() - c0, time.perf_counter() - t0
            if profiler is not None:
                profiler.disable()
            if i < warmup:
                continue
            if run.done:
                raise RuntimeError("a request finished during timing: fewer --steps")
            totals.append(took)
            walls.append(wall)
            tokens += streamed[0] - before
            plan, propose = timer.current.get("plan", 0.0), timer.current.get("propose", 0.0)
            verify = timer.current.get("verify", 0.0)
            phases["plan"].append(plan)
            phases["propose"].append(propose)
            phases["verify"].append(verify)
            phases["rest"].append(took - plan - propose - verify)
        gpu = gpu_busy(run, forwards, target)
    finally:
        run_sync(engine.step.release(list(run.running)))
        del target.verify
        if drafter is not None:
            del drafter.prepare, drafter.propose
    if profiler is not None:
        profile_dir.mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(str(profile_dir / f"{forwards}-{system}-b{batch}.pstats"))
    return {**gpu, "system": system, "batch": batch, "where": "in-process",
            "host_ms_per_step": median_ms(totals),
            "wall_ms_per_step": median_ms(walls), "clock": "process CPU time",
            "phases_ms": {k: median_ms(v) for k, v in phases.items()}, "steps": len(totals),
            "tokens_per_step": round(tokens / max(len(totals), 1), 3)}


GPU_STEPS = 8
GPU_TOP_KERNELS = 15


def gpu_busy(run, forwards: str, target) -> dict[str, Any]:
    """On CUDA with the real model: how much of a step the GPU is busy, from the kernels' own times
    (torch.profiler; CUDA graph replays included) over `GPU_STEPS` more steps, beside their wall time.
    Busy time well under wall time means the host, not the GPU, sets the step's pace."""
    import torch

    if forwards != "real" or not str(getattr(target, "device", "cpu")).startswith("cuda"):
        return {}
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            steps = 0
            while steps < GPU_STEPS and not run.done:
                run.advance()
                steps += 1
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    except RuntimeError as err:      # a profiler that cannot start (no CUPTI) leaves the row without
        return {"gpu_busy_error": str(err)[:200]}
    steps = max(steps, 1)
    busy_us = sum(e.device_time_total for e in kernels)
    return {"gpu_busy_ms_per_step": round(busy_us / 1000 / steps, 4),
            "gpu_wall_ms_per_step": round(1000 * wall / steps, 4), "gpu_steps": steps,
            "gpu_kernels": top_kernels(kernels, steps)}


def top_kernels(kernels, steps: int, top: int = GPU_TOP_KERNELS) -> list[dict[str, Any]]:
    """The kernels that take most of a step's GPU time: name, launches and microseconds per step.
    Which kernels dominate says what to fuse or replace next (GEMMs, attention, elementwise)."""
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        launches_us = by_name.setdefault(e.name, [0, 0.0])
        launches_us[0] += 1
        launches_us[1] += e.device_time_total
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"name": name[:160], "launches_per_step": round(n / steps, 2),
             "us_per_step": round(us / steps, 2)} for name, (n, us) in ranked]


def free_classes(drafts: str) -> tuple[type, type]:
    """(target, drafter) worker classes of the free cells: `drafts` accepted or rejected."""
    from specd.bench.free_models import FreeDraftWorker, FreeTargetWorker, UnpredictableTargetWorker

    return (FreeTargetWorker if drafts == "accepted" else UnpredictableTargetWorker), FreeDraftWorker


def build_in_process(cfg, free: bool, drafts: str = "accepted") -> tuple[Any, dict]:
    """One target worker and one drafter worker per drafter kind the systems use."""
    from specd.workers.engine.build import worker_seeds
    from specd.workers.engine.draft_worker import DraftWorker
    from specd.workers.engine.target_worker import TargetWorker

    target_cls, drafter_cls = free_classes(drafts) if free else (TargetWorker, DraftWorker)
    target_seed, drafter_seed = worker_seeds(cfg.seed)
    target = target_cls(cfg.target, seed=target_seed, cache_dir=cfg.cache_dir)
    drafters = {}
    for kind in sorted({"model", cfg.drafter.kind}):
        dcfg = replace(cfg.drafter, kind=kind)
        drafters[kind] = drafter_cls(dcfg, cfg.spec, str(target.model_dir), seed=drafter_seed,
                                     cache_dir=cfg.cache_dir)
    return target, drafters


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_cells(args: argparse.Namespace, free: bool, target_dir: Path, drafter_dir: Path | None,
              steps: int, rows: list[dict[str, Any]]) -> None:
    """Every cell of one kind of forwards, appended to `rows` as it is measured."""
    from specd.configs import load_config

    max_batch = max(args.batch_sizes)
    overrides = base_overrides(target_dir, drafter_dir, max_batch, free) + list(args.overrides)
    if free:    # the stand-ins' paths win over a user's model paths, which are meant for the real cells
        overrides += [f"target.model_path={target_dir}", f"drafter.path={drafter_dir}"]
    cfg = load_config(overrides)
    if free:
        uncaptured(cfg)
    if not free:
        from specd.cluster.first_start import ensure_serving_drafter

        ensure_serving_drafter(cfg, str(target_dir))
    forwards = "free" if free else "real"
    drafts = args.drafts if free else "real"
    if "in-process" in args.where:
        target, drafters = build_in_process(cfg, free, args.drafts)
        for system in args.systems:
            for batch in args.batch_sizes:
                row = run_in_process(system, batch, target, drafters, cfg, steps, args.warmup,
                                     args.profile, len(rows), forwards)
                rows.append({**row, "forwards": forwards, "drafts": drafts, "load_average": load_average()})
                print(_line(rows[-1]), flush=True)
        del target, drafters
    if "router" in args.where:
        from specd.bench.overhead_router import run_router_cells

        for row in run_router_cells(cfg, args.systems, args.batch_sizes, steps, args.warmup, free,
                                    args.pipeline_groups, args.drafts):
            rows.append({**row, "forwards": forwards, "drafts": drafts, "load_average": load_average()})
            print(_line(rows[-1]), flush=True)


def _line(row: dict[str, Any]) -> str:
    p = row["phases_ms"]
    return (f"{row['forwards']:4s} {row['where']:10s} {row['system']:11s} batch {row['batch']:2d}: "
            f"{row['host_ms_per_step']:8.3f} ms/step (plan {p.get('plan', 0.0):.3f}, "
            f"propose {p['propose']:.3f}, verify {p['verify']:.3f}, "
            f"rest {p['rest']:.3f}), {row['tokens_per_step']:.2f} tokens/step, load {row['load_average'][0]}"
            + (f", GPU busy {row['gpu_busy_ms_per_step']:.3f} of {row['gpu_wall_ms_per_step']:.3f} ms"
               if "gpu_busy_ms_per_step" in row else "")
            + (f", actors busy: drafter {row['actor_busy_ms']['drafter']:.3f}, "
               f"target {row['actor_busy_ms']['target']:.3f} ms" if "actor_busy_ms" in row else ""))


def write_overhead_plot(path: Path, rows: list[dict[str, Any]]) -> Path:
    """One panel per (where, forwards): bars of host ms per step, one group per batch, one bar per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def panel(r):
        return r["where"], r["forwards"], bool(r.get("compiled_calls"))

    panels = sorted({panel(r) for r in rows}, key=lambda k: (k[1], WHERE.index(k[0]), k[2]))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False, sharey=True)
    for ax, (where, forwards, compiled) in zip(axes[0], panels, strict=True):
        cell = [r for r in rows if panel(r) == (where, forwards, compiled)]
        batches = sorted({r["batch"] for r in cell})
        systems = [s for s in SYSTEMS if any(r["system"] == s for r in cell)]
        width = 0.8 / max(len(systems), 1)
        value = {(r["system"], r["batch"]): r["host_ms_per_step"] for r in cell}
        for i, system in enumerate(systems):
            xs = [b + (i - (len(systems) - 1) / 2) * width for b in range(len(batches))]
            ax.bar(xs, [value.get((system, b), 0.0) for b in batches], width, label=system)
        ax.set_xticks(range(len(batches)))
        ax.set_xticklabels([f"batch {b}" for b in batches])
        ax.set_ylabel("host ms per step (median)")
        ax.set_title(f"{where}{', compiled calls' if compiled else ''}, {forwards} forwards")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize="small")
    return save_figure(fig, path)


def run_bench(args: argparse.Namespace) -> int:
    from specd.bench.free_models import write_stand_ins
    from specd.bench.systems import device_info
    from specd.configs import load_config

    for name in args.systems:
        if name not in SYSTEMS:
            raise SystemExit(f"unknown system {name!r}; known: {', '.join(SYSTEMS)}")
    for name in args.where:
        if name not in WHERE:
            raise SystemExit(f"unknown --where {name!r}; known: {', '.join(WHERE)}")
    meta: dict[str, Any] = {
        "bench": "overhead", "steps": args.steps, "warmup": args.warmup, "prompt_tokens": PROMPT_LEN,
        "pipeline_groups": args.pipeline_groups, "overrides": list(args.overrides), "drafts": args.drafts,
        "machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_average_start": load_average(),
        "note": "medians over steps; forwards free (stand-ins answer at once) unless forwards=real",
        "device": device_info(load_config(list(args.overrides)).target.device),
    }
    rows: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="specd-overhead-") as tmp:
            target_dir, drafter_dir = write_stand_ins(Path(tmp), MAX_SEQ_LEN)
            run_cells(args, True, target_dir, drafter_dir, args.steps, rows)
        if args.real:
            from specd.workers.models.loader import ensure_target_model

            run_cells(args, False, Path(ensure_target_model()), None, args.real_steps, rows)
    finally:
        # what was measured is kept when a later cell fails (a Ray start on an overloaded machine)
        meta["load_average_end"] = load_average()
        _write(args, rows, meta)
    return 0


def _write(args: argparse.Namespace, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    if not rows:
        return
    if args.json:
        write_json(args.json, rows, meta)
        print(f"wrote {args.json}")
    if args.plot:
        write_overhead_plot(Path(args.plot), rows)
        print(f"wrote {args.plot}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--systems", type=_csv(str), default=list(SYSTEMS), help=",".join(SYSTEMS))
    parser.add_argument("--batch-sizes", type=_csv(int), default=[1, 8, 16])
    parser.add_argument("--where", type=_csv(str), default=list(WHERE), help=",".join(WHERE))
    parser.add_argument("--steps", type=int, default=200, help="timed steps per cell")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps per cell before timing")
    parser.add_argument("--pipeline-groups", type=int, default=1,
                        help="router: groups per replica (1: a step is the whole batch, as in-process)")
    parser.add_argument("--drafts", choices=("accepted", "rejected"), default="accepted",
                        help="free cells: the target's stand-in accepts every greedy draft, or none "
                             "(no lookup matches either: the planner learns to draft nothing)")
    parser.add_argument("--real", action="store_true", help="also run every cell on the real model")
    parser.add_argument("--real-steps", type=int, default=16, help="timed steps per cell with --real")
    parser.add_argument("--profile", type=Path, default=None,
                        help="folder for a cProfile .pstats per in-process cell (its timings then include "
                             "the profiler's own cost: profile in a run of its own)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("overrides", nargs="*", help="config overrides (key=value), after the bench's own")


def main(argv: list[str] | None = None) -> int:
    from specd.bench.cli import run_alone

    return run_alone("overhead", __import__(__name__, fromlist=["run_bench"]), argv)


if __name__ == "__main__":
    raise SystemExit(main())
