"""The runners of `specd bench engine`'s in-house systems: specd's engine and transformers generate().

Run as `python -m specd.bench.runners JOB OUT --events-fd N` (protocol in bench/child.py), one system per
process; the systems are in bench/systems.py. Every runner warms up once (one short generate), then
times only generation.
"""

from __future__ import annotations

import time
from typing import Any

from specd.bench.child import Events, add_request, child_main, finish_cell, groups, new_cell_result
from specd.bench.steady import Span, drive, latency_from_admission
from specd.bench.systems import SYSTEMS, device_info, specd_overrides

WARMUP_TOKENS = 8

def run_specd(job: dict[str, Any], events: Events) -> dict[str, Any]:
    from specd.configs import load_config
    from specd.workers.core.sampling import SamplingParams
    from specd.workers.drafters.base import SCRATCH_PREFIX
    from specd.workers.engine.build import build_engine
    from specd.workers.engine.types import NewRequest, SpecParams

    system = SYSTEMS[job["system"]]
    cfg = load_config(specd_overrides(system, job))
    if system.defaults:
        from specd.cluster.first_start import ensure_serving_drafter

        ensure_serving_drafter(cfg, job["model_dir"])   # what `specd serve` does on a machine without one
    t0 = time.perf_counter()
    events.emit("phase", phase="loading")
    engine = build_engine(cfg, speculative=system.spec_enabled, max_running=job["max_batch"],
                          vllm_kwargs={"kv_cache_memory_bytes": job["vllm_kv_cache_bytes"]})
    drafter = engine.drafter if system.backend == "torch" else None
    drafter_version = engine.version() if system.backend == "vllm" else drafter and drafter.version()
    spec = SpecParams.from_config(cfg.spec) if system.defaults else SpecParams(
        gamma=system.gamma, policy=system.policy, tree_width=system.tree_width, enabled=system.spec_enabled
    )
    load_s = time.perf_counter() - t0

    events.emit("phase", phase="warmup")
    # scratch ids: a drafter that learns from traffic (suffix) must not learn the bench's own runs
    warm = NewRequest(f"{SCRATCH_PREFIX}warmup", job["warmup_prompt"], SamplingParams(), WARMUP_TOKENS,
                      spec)
    t0 = time.perf_counter()
    engine.generate([warm], ignore_eos=True)
    # untimed warm-ups in all: where decode=compiled compiles and CUDA graphs are captured
    warmup_s = time.perf_counter() - t0

    cells = []
    for cell in job["cells"]:
        events.emit("cell", workload=cell["workload"], batch=cell["batch"], temperature=cell["temperature"])
        result = new_cell_result(cell)
        result.update(drafted=0, accepted=0, steps=0, emitted=0)
        suffix = getattr(drafter, "drafter", None) if system.backend == "torch" else None
        if hasattr(suffix, "clear_index"):
            # Every cell runs the same prompts: a cell must not draft from an earlier cell's outputs.
            suffix.clear_index()
        tag = f"{cell['workload']}-b{cell['batch']}-t{cell['temperature']}"
        # vLLM's speculation is engine-wide: it cannot switch off per request, so no paired baseline there.
        paired = bool(job.get("paired")) and system.spec_enabled and system.backend == "torch"
        if paired:
            result.update(paired_base_wall_s=0.0, paired_base_tokens=0, paired_groups=[])
        if job.get("warm_each_cell"):
            prompts, seeds = next(groups(cell["prompts"], cell["seeds"], cell["batch"]))
            lengths = cell_lengths(job, cell)[: len(prompts)]
            warm_group = [
                NewRequest(f"{SCRATCH_PREFIX}warm-{tag}-{i}", list(p),
                           SamplingParams(temperature=cell["temperature"], seed=seed), n, spec)
                for i, (p, seed, n) in enumerate(zip(prompts, seeds, lengths, strict=True))
            ]
            t0 = time.perf_counter()
            engine.generate(warm_group, ignore_eos=True)
            warmup_s += time.perf_counter() - t0
        first_before = first_uses(engine)
        # --continuous: the cell's prompts are one group, a queue of which at most `batch` run at a time
        continuous = bool(job.get("continuous"))
        size = len(cell["prompts"]) if continuous else cell["batch"]
        lengths = cell_lengths(job, cell)
        for g, (prompts, seeds) in enumerate(groups(cell["prompts"], cell["seeds"], size)):
            # (request id, prompt, sampling, tokens to generate) of each request of the group
            made = [(f"{tag}-{g}-{i}", list(p), SamplingParams(temperature=cell["temperature"], seed=seed),
                     lengths[g * size + i])
                    for i, (p, seed) in enumerate(zip(prompts, seeds, strict=True))]
            # --paired: the same engine with speculation off per request, before the system on even
            # groups and after it on odd ones, so drift in machine speed falls on both alike.
            order = (["base", "spec"] if g % 2 == 0 else ["spec", "base"]) if paired else ["spec"]
            before = (result.get("paired_base_wall_s"), result.get("paired_base_tokens"), result["wall_s"])
            admitted: dict[str, float] = {}
            if paired and job.get("lockstep"):
                order = []    # both at once, below
                mine = [NewRequest(rid, p, sp, n, spec) for rid, p, sp, n in made]
                seqs = _run_lockstep(engine, mine, made, cell["batch"], job["max_new_tokens"], result,
                                     on_step=lambda _s, emitted: events.tokens(len(emitted)),
                                     continuous=continuous, admitted=admitted)
            for phase in order:
                if phase == "base":
                    _run_paired_base(engine, made, result)
                    continue
                mine = [NewRequest(rid, p, sp, n, spec) for rid, p, sp, n in made]
                on_step = lambda _s, emitted: events.tokens(len(emitted))   # noqa: E731
                if continuous:
                    span = Span(cell["batch"])
                    queue = span.watch("spec", engine.batch(mine, max_running=cell["batch"], ignore_eos=True,
                                                            on_step=span.counter("spec", on_step)))
                    drive([queue], admitted, span=span)
                    seqs = queue.sequences()
                    seconds, tokens = span.timed("spec")
                    result["wall_s"] += seconds
                    result["timed_tokens"] = result.get("timed_tokens", 0) + tokens
                else:
                    start = time.perf_counter()
                    seqs = engine.generate(mine, on_step=on_step, ignore_eos=True)
                    result["wall_s"] += time.perf_counter() - start
            if paired and not continuous:
                # this group's pair, for the paired ratio's interval (bench/report.py paired_interval)
                result["paired_groups"].append([
                    result["paired_base_wall_s"] - before[0], result["paired_base_tokens"] - before[1],
                    result["wall_s"] - before[2], sum(len(s.output) for s in seqs)])
            for seq in seqs:
                requested = seq.request.max_new_tokens
                add_request(result, seq.output, latency_from_admission(seq, admitted), requested)
                if system.spec_enabled:
                    result["drafted"] += seq.stats.drafted
                    result["accepted"] += seq.stats.accepted
                    result["steps"] += seq.stats.steps
                    result["emitted"] += seq.stats.emitted
        if not system.spec_enabled:
            result.update(drafted=None, accepted=None, steps=None, emitted=None)
        if first_before is not None:
            # static-decode buckets the timed run used first (on a GPU each one a CUDA graph capture, timed
            # with the cell: a short run that meets many reads slower than the steps themselves are)
            after = first_uses(engine)
            result["first_use_buckets"] = after[0] - first_before[0]
            result["first_use_s"] = round(after[1] - first_before[1], 4)
        if hasattr(suffix, "clear_index"):
            # drafted / accepted tokens by source: local (own context), global (cross-request), model
            result["suffix_sources"] = suffix.stats()["sources"]
        events.flush()
        cells.append(finish_cell(result))
    return {
        "cells": cells, "load_s": load_s, "warmup_s": warmup_s, "drafter_version": drafter_version,
        "device": device_info(cfg.target.device),
    }


def first_uses(engine) -> tuple[int, float] | None:
    """Static-decode buckets first used by the engine's target and drafter so far, and the seconds that
    took; None for an engine that is not specd's own (vLLM, transformers)."""
    target = getattr(engine, "target", None)
    if not hasattr(target, "first_uses"):
        return None
    count, seconds = target.first_uses()
    drafter = getattr(engine, "drafter", None)
    if drafter is not None:
        more = drafter.first_uses()
        count, seconds = count + more[0], seconds + more[1]
    return count, seconds


def cell_lengths(job: dict[str, Any], cell: dict[str, Any]) -> list[int]:
    """Tokens each of the cell's requests generates (--lengths mixed: its own; else max_new_tokens)."""
    return cell.get("lengths") or [job["max_new_tokens"]] * len(cell["prompts"])


def _run_paired_base(engine, made: list, result: dict[str, Any]) -> None:
    """--paired: the same requests on the same engine with speculation off (scratch ids, so a drafter
    that learns from traffic never sees them); adds their wall time and tokens to `result`."""
    from specd.workers.drafters.base import SCRATCH_PREFIX
    from specd.workers.engine.types import NewRequest, SpecParams

    off = SpecParams(enabled=False)
    requests = [NewRequest(f"{SCRATCH_PREFIX}{rid}-base", p, sp, n, off) for rid, p, sp, n in made]
    start = time.perf_counter()
    base = engine.generate(requests, ignore_eos=True)
    result["paired_base_wall_s"] += time.perf_counter() - start
    result["paired_base_tokens"] += sum(len(s.output) for s in base)


def _run_lockstep(engine, mine: list, made: list, batch: int, max_new_tokens: int, result: dict[str, Any],
                  on_step=None, continuous: bool = False, admitted: dict[str, float] | None = None) -> list:
    """--lockstep: the group's speculative requests and its target-only twins (scratch ids, speculation
    off) as two batches on one engine, a step of one then a step of the other (which goes first alternates),
    each timed on its own steps; adds both to `result` and returns the speculative sequences.

    continuous (--continuous: the group is the cell's queue): each side is timed over the steady span
    (bench/steady.py), and the paired interval's pairs are windows of `max_new_tokens` turns in it;
    result["timed_tokens"] gets the speculative side's tokens in the span. admitted: as drive() fills it."""
    from specd.workers.drafters.base import SCRATCH_PREFIX
    from specd.workers.engine.types import NewRequest, SpecParams

    off = SpecParams(enabled=False)
    twins = [NewRequest(f"{SCRATCH_PREFIX}{rid}-base", p, sp, n, off) for rid, p, sp, n in made]
    span = Span(batch)
    spec = span.watch("spec", engine.batch(mine, max_running=batch, on_step=span.counter("spec", on_step),
                                           ignore_eos=True))
    base = span.watch("base", engine.batch(twins, max_running=batch, on_step=span.counter("base"),
                                           ignore_eos=True))
    turn, mark = 0, (0.0, 0, 0.0, 0)
    while not (spec.finished and base.finished):
        drive((spec, base) if turn % 2 == 0 else (base, spec), admitted, once=True, span=span)
        turn += 1
        if not continuous or mark is None:
            continue
        steady = span.ended is None
        if turn % max_new_tokens == 0 or not steady:
            now = (*span.timed("base"), *span.timed("spec"))
            window = [a - b for a, b in zip(now, mark, strict=True)]
            if window[1] > 0 and window[3] > 0:     # the span's end can fall on a window's
                result["paired_groups"].append(window)
            mark = now if steady else None
    if continuous:
        (spec_s, spec_tokens), (base_s, base_tokens) = span.timed("spec"), span.timed("base")
        result["timed_tokens"] = result.get("timed_tokens", 0) + spec_tokens
    else:
        spec_s, base_s = spec.seconds, base.seconds
        base_tokens = sum(len(s.output) for s in base.sequences())
    result["wall_s"] += spec_s
    result["paired_base_wall_s"] += base_s
    result["paired_base_tokens"] += base_tokens
    return spec.sequences()


def run_transformers(job: dict[str, Any], events: Events) -> dict[str, Any]:
    """transformers generate(): left padding for batches, min_new_tokens = max_new_tokens (no early stop)."""
    import torch
    from transformers import AutoModelForCausalLM

    from specd.configs import load_config
    from specd.workers.models.device_settings import resolve_dtype

    system = SYSTEMS[job["system"]]
    target = load_config(job.get("overrides", [])).target
    device = target.device
    t0 = time.perf_counter()
    events.emit("phase", phase="loading")
    dtype = resolve_dtype(target.dtype, device)
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=dtype).to(device).eval()
    static: dict[str, Any] = {}
    if system.compiled:
        from transformers import CompileConfig

        # transformers' static cache keeps shapes fixed, and generate() then compiles its decode steps
        # itself (torch.compile, reduce-overhead: CUDA graphs) and marks each step for cudagraph trees; a
        # forward compiled by hand fails there once a graph's output is overwritten by the next replay.
        config = CompileConfig(fullgraph=True, mode="reduce-overhead")
        config._compile_all_devices = True   # generate() compiles on GPUs only unless told otherwise
        static = {"cache_implementation": "static", "compile_config": config}
    load_s = time.perf_counter() - t0
    pad = job["pad_token_id"]

    def generate(prompts: list[list[int]], temperature: float, seed: int, n: int) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long, device="cpu")      # [b, width]
        mask = torch.zeros(len(prompts), width, dtype=torch.long, device="cpu")          # [b, width]
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long, device="cpu")
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(device), mask.to(device)
        kwargs: dict[str, Any] = dict(
            max_new_tokens=n, min_new_tokens=n, pad_token_id=pad, do_sample=False, **static
        )
        if temperature > 0:
            # top_k=0 and top_p=1 switch off the truncations generate() may otherwise apply by default.
            kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
            torch.manual_seed(seed)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)  # [b, width + generated]
        return out[:, width:].tolist()

    events.emit("phase", phase="warmup")
    generate([job["warmup_prompt"]], 0.0, 0, WARMUP_TOKENS)

    cells = []
    for cell in job["cells"]:
        events.emit("cell", workload=cell["workload"], batch=cell["batch"], temperature=cell["temperature"])
        result = new_cell_result(cell)
        if job.get("warm_each_cell"):
            prompts, seeds = next(groups(cell["prompts"], cell["seeds"], cell["batch"]))
            generate(prompts, cell["temperature"], seeds[0], job["max_new_tokens"])
        for prompts, seeds in groups(cell["prompts"], cell["seeds"], cell["batch"]):
            start = time.perf_counter()
            outputs = generate(prompts, cell["temperature"], seeds[0], job["max_new_tokens"])
            wall = time.perf_counter() - start
            result["wall_s"] += wall
            # A static batch finishes together: every request's latency is the group's wall time.
            for output in outputs:
                add_request(result, output, wall, job["max_new_tokens"])
            events.tokens(sum(len(o) for o in outputs), force=True)
        cells.append(finish_cell(result))
    return {"cells": cells, "load_s": load_s, "device": device_info(device)}


RUNNERS = {"specd": run_specd, "transformers": run_transformers}


if __name__ == "__main__":
    raise SystemExit(child_main(RUNNERS))
