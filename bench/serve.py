"""`specd bench serve`: a gRPC load generator, specd against target-only on the same server and run.

N concurrent clients stream greedy completions (EOS ignored, so every request generates exactly its
max_new_tokens) for the held-out GSM8K and HumanEval prompts in the chat template. With `--lengths
fixed` (the default) every request asks for max_new_tokens; target-only decoding then keeps the
clients in lock-step (all finish at one step, all send their next prompt together, and the whole wave's
prefill lands in time to first token, none in TPOT), while speculation spreads their finishing times
and puts other requests' prefills between their tokens. `--lengths mixed` gives request i a length
drawn once, seeded, uniformly from [max_new_tokens / 2, 3 max_new_tokens / 2], the same in every
phase, as traffic whose answers differ in length does. Phases:

    specd               speculation on, the server's pipeline_groups (2: drafting overlaps verifying)
    target-only         the same server, speculation off per request (the baseline)
    specd-unpipelined   a fresh server with server.pipeline_groups=1    (skip: --no-unpipelined)
    in-process          the same workers in this process (workers/engine/spec_engine.py), no router,
                        no Ray: its throughput against specd-unpipelined is the router+Ray overhead
                        (skip: --no-in-process)

Each phase reports throughput, time to first token and per-token latency percentiles, acceptance,
and the workers' busy fractions and overlap (ServerInfo before/after). The server runs as its own
process (`python -m specd.cluster.serve`), stopped with SIGTERM, so clients and router do not share a GIL.

    specd bench serve --quick
    specd bench serve --clients 8 --requests 32 --json out/serve.json drafter.kind=ngram
    specd bench serve --address host:50051     # a running server: the specd and target-only phases only
    specd bench serve --vllm                   # specd on vLLM against vLLM alone (bench/serve_vllm.py)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from specd.bench.datasets import mixed_prompts, request_lengths
from specd.cluster.client import AsyncSpecdClient


def percentiles(values: list[float], ps: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
    """Nearest-rank percentiles (no interpolation: every reported value was measured)."""
    if not values:
        return {f"p{p}": 0.0 for p in ps}
    ordered = sorted(values)
    return {f"p{p}": ordered[min(len(ordered) - 1, max(0, -(-p * len(ordered) // 100) - 1))] for p in ps}


def worker_delta(before: dict, after: dict) -> list[dict[str, float]]:
    """Busy fractions and overlap of each replica over the phase, from two ServerInfo snapshots."""
    out = []
    for b, a in zip(before["workers"], after["workers"], strict=True):
        t = a["target_busy_s"] - b["target_busy_s"]
        d = a["drafter_busy_s"] - b["drafter_busy_s"]
        active = a["active_s"] - b["active_s"]
        scale = 1.0 / active if active > 0 else 0.0
        out.append({"replica": a["replica"], "target_busy_fraction": t * scale,
                    "drafter_busy_fraction": d * scale, "overlap_fraction": max(0.0, t + d - active) * scale,
                    "active_s": active})
    return out


def summarize(timings: list[dict], wall_s: float) -> dict[str, Any]:
    """Phase figures from per-request timings: {tokens, ttft_s, total_s, usage}."""
    tokens = sum(t["tokens"] for t in timings)
    tpot = [(t["total_s"] - t["ttft_s"]) / (t["tokens"] - 1) for t in timings if t["tokens"] > 1]
    usages = [t["usage"] for t in timings if t.get("usage")]
    drafted = sum(u.get("drafted", 0) for u in usages)
    accepted = sum(u.get("accepted", 0) for u in usages)
    steps = sum(u.get("steps", 0) for u in usages)
    emitted = sum(u.get("accepted", 0) + u.get("recovered", 0) + u.get("bonus", 0) for u in usages)
    versions = sorted({v for u in usages for v in u.get("drafter_versions", [])})
    return {
        "requests": len(timings),
        "tokens": tokens,
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "ttft_s": percentiles([t["ttft_s"] for t in timings]),
        "tpot_s": percentiles(tpot),
        "latency_s": percentiles([t["total_s"] for t in timings]),
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "tokens_per_step": emitted / steps if steps else 0.0,
        "drafter_versions": versions,
    }


async def run_phase(address: str, prompts: list[list[dict]], clients: int, lengths: list[int],
                    speculation: bool, desc: str) -> dict[str, Any]:
    from tqdm import tqdm

    client = AsyncSpecdClient(address, timeout=3600)
    todo = iter(zip(prompts, lengths, strict=True))
    timings: list[dict] = []
    bar = tqdm(total=len(prompts), desc=desc, unit="req", leave=True)

    async def one_client() -> None:
        for messages, max_new_tokens in todo:   # a shared iterator: each client takes the next prompt
            t0 = time.perf_counter()
            ttft, tokens, usage = None, 0, None
            async for chunk in client.stream(messages=messages, max_new_tokens=max_new_tokens,
                                             ignore_eos=True, temperature=0.0, speculation=speculation):
                if chunk.token_ids and ttft is None:
                    ttft = time.perf_counter() - t0
                tokens += len(chunk.token_ids)
                usage = chunk.usage or usage
            total = time.perf_counter() - t0
            timings.append({"tokens": tokens, "ttft_s": ttft or total, "total_s": total, "usage": usage})
            bar.update(1)

    try:
        before = await client.server_info()
        t0 = time.perf_counter()
        await asyncio.gather(*[one_client() for _ in range(clients)])
        wall = time.perf_counter() - t0
        after = await client.server_info()
    finally:
        bar.close()
        await client.close()
    out = summarize(timings, wall)
    out["workers"] = worker_delta(before, after)
    out["pipeline_groups"] = after["pipeline_groups"]
    out["_timings"] = timings            # merge_rounds reads them; not written to the JSON
    return out


def merge_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One phase's figures over its rounds: every request's timings together (throughput = all tokens
    over all rounds' wall time), each round's own throughput, TPOT p50 and TTFT p50 in `rounds`, and the
    last round's workers."""
    timings = [t for r in rounds for t in r["_timings"]]
    out = summarize(timings, sum(r["wall_s"] for r in rounds))
    out["workers"] = rounds[-1]["workers"]
    out["pipeline_groups"] = rounds[-1]["pipeline_groups"]
    out["rounds"] = [{"tokens_per_s": r["tokens_per_s"], "tpot_p50_s": r["tpot_s"]["p50"],
                      "ttft_p50_s": r["ttft_s"]["p50"]} for r in rounds]
    return out


def round_figures(results: dict[str, dict]) -> dict[str, Any]:
    """specd against target-only round by round (each round's pair ran back to back on the same prompts):
    the throughput and TPOT p50 ratios of every round and their medians."""
    if "rounds" not in results.get("specd", {}) or "rounds" not in results.get("target-only", {}):
        return {}
    pairs = list(zip(results["specd"]["rounds"], results["target-only"]["rounds"], strict=True))
    speed = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in pairs if b["tokens_per_s"] > 0]
    tpot = [a["tpot_p50_s"] / b["tpot_p50_s"] for a, b in pairs if b["tpot_p50_s"] > 0]
    return {"speedup_rounds": speed, "speedup_median": statistics.median(speed) if speed else None,
            "tpot_p50_ratio_rounds": tpot, "tpot_p50_ratio_median": statistics.median(tpot) if tpot else None}


def run_in_process(overrides: list[str], prompt_ids: list[list[int]], clients: int,
                   lengths: list[int], model_dir: str) -> dict[str, Any]:
    """The same workers and prompts without router or Ray (the unpipelined in-process engine)."""
    import torch
    from tqdm import tqdm

    from specd.cluster.first_start import ensure_serving_drafter
    from specd.configs import load_config
    from specd.workers.core.sampling import SamplingParams
    from specd.workers.engine.build import build_engine
    from specd.workers.engine.types import NewRequest, SpecParams

    cfg = load_config(overrides)
    # the drafter the server serves with: without a bootstrapped one, the quick one (cluster/first_start.py)
    ensure_serving_drafter(cfg, model_dir)
    # Like a Ray actor with num_cpus=n, which gets OMP_NUM_THREADS=n.
    torch.set_num_threads(cfg.target.num_threads or max(1, int(cfg.target.num_cpus)))
    engine = build_engine(cfg, max_running=clients)
    spec = SpecParams.from_config(cfg.spec)
    engine.generate([NewRequest("warmup", prompt_ids[0], SamplingParams(), 4, spec)], ignore_eos=True)
    reqs = [NewRequest(f"bench-{i}", ids, SamplingParams(), length, spec)
            for i, (ids, length) in enumerate(zip(prompt_ids, lengths, strict=True))]
    bar = tqdm(total=len(reqs), desc="in-process", unit="req")

    def on_step(seq, _emitted) -> None:
        if seq.finished:
            bar.update(1)

    t0 = time.perf_counter()
    seqs = engine.generate(reqs, on_step=on_step, ignore_eos=True)
    wall = time.perf_counter() - t0
    bar.close()
    timings = [{"tokens": len(s.output), "ttft_s": s.ttft or 0.0, "total_s": s.latency or 0.0,
                "usage": s.stats.to_dict()} for s in seqs]
    out = summarize(timings, wall)
    out["note"] = "all requests arrive at once (max_running = clients): TTFT includes queueing"
    return out


class ServerProcess:
    """`python -m specd.cluster.serve` as a child process; the address is read from its ready line."""

    READY = re.compile(r"specd serving .*? on (\S+?)(,|$)")
    METRICS = re.compile(r"metrics on (\S+/metrics)")

    def __init__(self, overrides: list[str], log_path: Path, timeout_s: float = 1800,
                 env: dict[str, str] | None = None, module: str = "specd.cluster.serve",
                 cwd: Path | None = None):
        self.log_path = log_path
        self.log = open(log_path, "w")  # noqa: SIM115 (lives as long as the process)
        self.proc = subprocess.Popen([sys.executable, "-m", module, *overrides],
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env,
                                     cwd=cwd)
        deadline = time.monotonic() + timeout_s
        self.address = ""
        self.metrics_url = ""          # the Prometheus endpoint, where the server exposes one
        for line in self.proc.stdout:
            self.log.write(line)
            match = self.READY.search(line)
            if match:
                self.address = match.group(1)
                metrics = self.METRICS.search(line)
                self.metrics_url = metrics.group(1) if metrics else ""
                break
            if time.monotonic() > deadline:
                break
        if not self.address:
            self.stop()
            raise RuntimeError(f"the server did not come up; see {log_path}")
        # Keep draining stdout (Ray forwards worker output there): a full pipe would stall the server.
        self._drain = threading.Thread(target=self._copy_stdout, daemon=True)
        self._drain.start()

    def _copy_stdout(self) -> None:
        for line in self.proc.stdout:
            self.log.write(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "_drain", None) is not None:
            self._drain.join(timeout=10)
        self.log.close()


def render(results: dict[str, dict], figures: dict[str, Any]) -> str:
    lines = [f"{'phase':18s} {'tok/s':>7s} {'ttft p50':>9s} {'p90':>7s} {'p99':>7s} {'tpot p50':>9s} "
             f"{'p90':>7s} {'p99':>7s} {'α':>5s} {'tok/st':>5s} {'busy T/D':>10s} {'overlap':>7s}"]
    for name, r in results.items():
        w = (r.get("workers") or [{}])[0]
        busy = f"{w.get('target_busy_fraction', 0):.2f}/{w.get('drafter_busy_fraction', 0):.2f}" if w else "-"
        lines.append(
            f"{name:18s} {r['tokens_per_s']:7.2f} {r['ttft_s']['p50']:9.3f} {r['ttft_s']['p90']:7.3f} "
            f"{r['ttft_s']['p99']:7.3f} {r['tpot_s']['p50']:9.3f} {r['tpot_s']['p90']:7.3f} "
            f"{r['tpot_s']['p99']:7.3f} {r['acceptance_rate']:5.2f} {r['tokens_per_step']:5.2f} "
            f"{busy:>10s} {w.get('overlap_fraction', 0):7.2f}"
        )
    lines += [f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}" for k, v in figures.items()]
    return "\n".join(lines)


def derived_figures(results: dict[str, dict]) -> dict[str, Any]:
    def tps(name):
        return results[name]["tokens_per_s"] if name in results else None

    figures: dict[str, Any] = {}
    if tps("specd") and tps("target-only"):
        figures["speedup_specd_vs_target_only"] = tps("specd") / tps("target-only")
    if tps("specd") and tps("specd-unpipelined"):
        figures["pipeline_gain"] = tps("specd") / tps("specd-unpipelined") - 1.0
    served = tps("specd-unpipelined") or tps("specd")
    if served and tps("in-process"):
        figures["router_ray_overhead"] = 1.0 - served / tps("in-process")
        figures["router_ray_overhead_against"] = "specd-unpipelined" if tps("specd-unpipelined") else "specd"
    if "specd" in results and results["specd"].get("workers"):
        figures["pipeline_overlap_fraction"] = results["specd"]["workers"][0]["overlap_fraction"]
    return figures


def run_bench(args: argparse.Namespace) -> int:
    from specd.configs import load_config
    from specd.workers.models.loader import ensure_target_model, load_tokenizer

    if args.quick:
        args.requests, args.max_new_tokens = min(args.requests, 8), min(args.max_new_tokens, 32)
    if args.vllm:
        from specd.bench.serve_vllm import run

        return run(args)
    overrides = list(args.overrides)
    cfg = load_config(overrides)
    model_dir = str(ensure_target_model(cfg.target.model_path, cfg.cache_dir, cfg.target.model))
    rounds = max(1, args.rounds)
    messages, prompt_ids = mixed_prompts(args.workloads.split(","), args.requests * rounds,
                                         load_tokenizer(model_dir))
    lengths = request_lengths(len(messages), args.max_new_tokens, args.lengths)
    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="specd-bench-serve-"))
    logs.mkdir(parents=True, exist_ok=True)
    serve_overrides = [*overrides, "server.port=0", "server.metrics_port=0", "server.http_port=null",
                       f"server.max_running={max(args.clients, cfg.server.max_running)}"]
    started = time.time()
    results: dict[str, dict] = {}

    def phases(address: str, names: list[tuple[str, bool]]) -> None:
        """Each round sends its own prompts (a drafter must not have seen them); odd rounds run the phases
        in reverse order, so a machine that slows or speeds up over the run favours neither."""
        runs: dict[str, list[dict]] = {name: [] for name, _ in names}
        for r in range(rounds):
            part = slice(r * args.requests, (r + 1) * args.requests)
            for name, speculation in (names if r % 2 == 0 else names[::-1]):
                label = name if rounds == 1 else f"{name} {r + 1}/{rounds}"
                runs[name].append(asyncio.run(run_phase(address, messages[part], args.clients, lengths[part],
                                                        speculation, label)))
        for name, per_round in runs.items():
            results[name] = merge_rounds(per_round) if rounds > 1 else per_round[0]
            results[name].pop("_timings", None)

    if args.address:
        phases(args.address, [("specd", True), ("target-only", False)])
    else:
        server = ServerProcess(serve_overrides, logs / "server.log")
        try:
            phases(server.address, [("specd", True), ("target-only", False)])
        finally:
            server.stop()
        if not args.no_unpipelined:
            server = ServerProcess([*serve_overrides, "server.pipeline_groups=1"], logs / "server-1.log")
            try:
                phases(server.address, [("specd-unpipelined", True)])
            finally:
                server.stop()
        if not args.no_in_process:
            part = slice(0, args.requests)
            results["in-process"] = run_in_process(overrides, prompt_ids[part], args.clients, lengths[part],
                                                   model_dir)
    figures = {**derived_figures(results), **round_figures(results)}
    print(render(results, figures))
    print("device: " + ", ".join(f"{k} {v}" for k, v in _device(overrides).items()))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"clients": args.clients, "requests": len(messages), "max_new_tokens": args.max_new_tokens,
                "lengths": args.lengths, "rounds": rounds, "requested_tokens": sum(lengths),
                "workloads": args.workloads, "overrides": overrides, "address": args.address,
                "host_cpus": os.cpu_count(), "duration_s": time.time() - started, "logs": str(logs),
                "device": _device(overrides)}
        path.write_text(json.dumps({"meta": meta, "phases": results, "figures": figures}, indent=2))
        print(f"wrote {path}")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", type=int, default=4, help="concurrent gRPC clients (default 4)")
    parser.add_argument("--requests", type=int, default=16, help="prompts per phase (default 16)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds of the specd and target-only phases, each on its own --requests "
                             "prompts, alternating their order; medians of the per-round ratios (default 1)")
    parser.add_argument("--lengths", choices=("fixed", "mixed"), default="fixed",
                        help="fixed: every request max_new_tokens; mixed: seeded uniform in [M/2, 3M/2]")
    parser.add_argument("--workloads", default="gsm8k,humaneval", help="comma-separated: gsm8k,humaneval")
    parser.add_argument("--address", default=None, help="bench a running server instead of starting one")
    parser.add_argument("--no-unpipelined", action="store_true", help="skip the pipeline_groups=1 server")
    parser.add_argument("--no-in-process", action="store_true", help="skip the in-process engine phase")
    parser.add_argument("--quick", action="store_true", help="at most 8 requests of 32 tokens")
    parser.add_argument("--json", default=None, metavar="PATH", help="write every figure to PATH")
    parser.add_argument("--log-dir", default=None, help="where server logs go (default: a temp dir)")
    parser.add_argument("--vllm", action="store_true",
                        help="specd on vLLM against vLLM alone and vLLM's n-gram, three servers "
                             "(bench/serve_vllm.py); --requests per client count")
    parser.add_argument("--vllm-clients", default="4,16", help="--vllm: client counts (default 4,16)")
    parser.add_argument("--vllm-systems", default="",
                        help="--vllm: comma-separated servers besides vllm (default: vllm-ngram, specd-vllm, "
                             "specd-draft-model)")
    parser.add_argument("overrides", nargs="*", default=[], help="config overrides, e.g. drafter.kind=ngram")


def main(argv: list[str] | None = None) -> int:
    from specd.bench.cli import run_alone

    return run_alone("serve", sys.modules[__name__], argv)


if __name__ == "__main__":
    raise SystemExit(main())


def _device(overrides: list[str]) -> dict[str, Any]:
    """The target's device as configured for the server, with the GPU's name on CUDA."""
    from specd.bench.systems import device_info
    from specd.configs import load_config

    return device_info(load_config(overrides).target.device)
