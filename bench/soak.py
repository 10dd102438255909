"""`specd bench soak`: many streaming clients for a long time against the embedded default server.

One `specd serve` child process with the defaults (managed Redis, online trainer, model drafter), N
clients that each stream one greedy request after another (GSM8K and HumanEval eval prompts in turn)
for D minutes. It counts errors (any failed request is one), samples the RSS of every process of the
server's tree (router, Ray workers, redis-server) every few seconds, and reports TPOT p50/p99 per time
window. After the warm-up it compares each process's RSS with its RSS at the end of the warm-up: the
growth is the figure docs/reliability.md bounds. `--json` writes everything, `--plot` a PNG of RSS and
TPOT over time.

    specd bench soak                                    # 32 clients, 10 minutes
    specd bench soak --clients 4 --minutes 0.5          # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from specd.bench.report import save_figure
from specd.bench.serve import ServerProcess
from specd.cluster.client import AsyncSpecdClient


def process_label(cmdline: list[str], name: str) -> str:
    """A stable label for a process of the server's tree (Ray names its workers ray::<Actor>)."""
    joined = " ".join(cmdline)
    if name.startswith("ray::"):
        return name.split(".")[0]
    if "redis-server" in joined or name == "redis-server":
        return "redis-server"
    if "specd.cluster.serve" in joined:
        return "router"
    if "raylet" in name or "gcs_server" in name:
        return name
    return "other"


def sample_rss(root_pid: int) -> dict[str, float]:
    """MiB of resident memory per label over the process tree of `root_pid` (labels summed)."""
    import psutil

    out: dict[str, float] = defaultdict(float)
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return {}
    for p in procs:
        try:
            label = process_label(p.cmdline(), p.name())
            out[label] += p.memory_info().rss / 2**20
        except psutil.Error:
            continue
    return dict(out)


def growth(samples: list[dict], warmup_s: float) -> dict[str, dict[str, float]]:
    """Per label: RSS at the end of the warm-up, the largest RSS after it, and the difference (MiB)."""
    after = [s for s in samples if s["t"] >= warmup_s]
    if not after:
        return {}
    out = {}
    for label in sorted({k for s in after for k in s["rss_mib"]}):
        series = [s["rss_mib"].get(label, 0.0) for s in after]
        out[label] = {"at_warmup_end": round(series[0], 1), "max_after": round(max(series), 1),
                      "growth": round(max(series) - series[0], 1)}
    total = [sum(s["rss_mib"].values()) for s in after]
    out["total"] = {"at_warmup_end": round(total[0], 1), "max_after": round(max(total), 1),
                    "growth": round(max(total) - total[0], 1)}
    return out


def p99(sorted_xs: list[float]) -> float:
    return sorted_xs[min(len(sorted_xs) - 1, int(0.99 * len(sorted_xs)))]


def windows(requests: list[dict], width_s: float) -> list[dict]:
    """TPOT p50/p99 (ms) and request count per time window of request completion."""
    by: dict[int, list[float]] = defaultdict(list)
    for r in requests:
        if r.get("tpot_s") is not None:
            by[int(r["end"] // width_s)].append(r["tpot_s"] * 1000)
    out = []
    for k in sorted(by):
        xs = sorted(by[k])
        out.append({"t": (k + 0.5) * width_s, "requests": len(xs),
                    "tpot_p50_ms": round(statistics.median(xs), 2), "tpot_p99_ms": round(p99(xs), 2)})
    return out


async def run_clients(address: str, clients: int, seconds: float, max_new_tokens: int) -> dict[str, Any]:
    from tqdm import tqdm

    from specd.workers.prompts import chat_messages, load_prompts

    prompts = load_prompts("eval")
    client = AsyncSpecdClient(address, timeout=600)
    t0 = time.perf_counter()
    requests: list[dict] = []
    errors: list[str] = []
    bar = tqdm(total=round(seconds), desc=f"soak ({clients} clients)", unit="s")

    async def one_client(c: int) -> None:
        i = c
        while time.perf_counter() - t0 < seconds:
            prompt = prompts[i % len(prompts)]
            i += clients
            start, first, tokens = time.perf_counter(), None, 0
            try:
                async for chunk in client.stream(messages=chat_messages(prompt),
                                                 max_new_tokens=max_new_tokens, temperature=0.0):
                    if chunk.token_ids and first is None:
                        first = time.perf_counter()
                    tokens += len(chunk.token_ids)
            except Exception as exc:  # an error is a result of the soak, not its end
                errors.append(f"{type(exc).__name__}: {exc}"[:300])
                continue
            end = time.perf_counter()
            tpot = (end - first) / (tokens - 1) if first is not None and tokens > 1 else None
            requests.append({"end": end - t0, "tokens": tokens, "ttft_s": (first or end) - start,
                             "tpot_s": tpot})

    async def ticker() -> None:
        while time.perf_counter() - t0 < seconds:
            await asyncio.sleep(1.0)
            bar.n = min(round(time.perf_counter() - t0), bar.total)
            bar.set_postfix(requests=len(requests), errors=len(errors))

    try:
        await asyncio.gather(ticker(), *[one_client(c) for c in range(clients)])
    finally:
        bar.close()
        await client.close()
    wall = time.perf_counter() - t0
    return {"requests": requests, "errors": errors, "wall_s": wall}


def write_plot(path: Path, samples: list[dict], tpot: list[dict], warmup_s: float, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    labels = sorted({k for s in samples for k in s["rss_mib"]})
    for label in labels:
        ax1.plot([s["t"] / 60 for s in samples], [s["rss_mib"].get(label, 0.0) for s in samples], label=label)
    total = [sum(s["rss_mib"].values()) for s in samples]
    ax1.plot([s["t"] / 60 for s in samples], total, "k--", label="total")
    ax1.axvline(warmup_s / 60, color="grey", linestyle=":", label="end of warm-up")
    ax1.set_ylabel("RSS (MiB)")
    ax1.legend(fontsize=7, ncol=3)
    ax1.set_title(title)
    ax2.plot([w["t"] / 60 for w in tpot], [w["tpot_p50_ms"] for w in tpot], label="TPOT p50")
    ax2.plot([w["t"] / 60 for w in tpot], [w["tpot_p99_ms"] for w in tpot], label="TPOT p99")
    ax2.set_xlabel("minutes")
    ax2.set_ylabel("ms per output token")
    ax2.legend()
    return save_figure(fig, path, dpi=110)


def run_bench(args: argparse.Namespace) -> int:
    work = Path(args.log_dir or tempfile.mkdtemp(prefix="specd-bench-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    overrides = ["server.port=0", "server.metrics_port=0", "server.http_port=null", *args.overrides]
    server = ServerProcess(overrides, work / "server.log")
    samples: list[dict] = []
    stop = threading.Event()
    t0 = time.perf_counter()

    def sampler() -> None:
        while not stop.is_set():
            samples.append({"t": time.perf_counter() - t0, "rss_mib": sample_rss(server.proc.pid)})
            stop.wait(args.sample_s)

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    try:
        run = asyncio.run(run_clients(server.address, args.clients, args.minutes * 60, args.max_new_tokens))
    finally:
        stop.set()
        thread.join(timeout=args.sample_s + 5)
        server.stop()
    warmup_s = args.warmup_minutes * 60
    tpot = windows(run["requests"], args.window_s)
    all_tpot = sorted(r["tpot_s"] * 1000 for r in run["requests"] if r["tpot_s"] is not None)
    doc = {
        "clients": args.clients, "minutes": args.minutes, "max_new_tokens": args.max_new_tokens,
        "requests": len(run["requests"]), "errors": len(run["errors"]), "error_samples": run["errors"][:20],
        "tokens": sum(r["tokens"] for r in run["requests"]),
        "tokens_per_s": round(sum(r["tokens"] for r in run["requests"]) / run["wall_s"], 2),
        "tpot_p50_ms": round(statistics.median(all_tpot), 2) if all_tpot else None,
        "tpot_p99_ms": round(p99(all_tpot), 2) if all_tpot else None,
        "rss_growth_after_warmup_mib": growth(samples, warmup_s), "warmup_minutes": args.warmup_minutes,
        "tpot_windows": tpot, "rss_samples": samples, "overrides": overrides, "log_dir": str(work),
    }
    print(f"{doc['requests']} requests, {doc['errors']} errors, {doc['tokens_per_s']} tok/s, "
          f"TPOT p50 {doc['tpot_p50_ms']} ms p99 {doc['tpot_p99_ms']} ms")
    for label, g in doc["rss_growth_after_warmup_mib"].items():
        print(f"  RSS {label:24s} {g['at_warmup_end']:8.1f} MiB at warm-up end, "
              f"max after {g['max_after']:8.1f} (+{g['growth']:.1f})")
    plot = write_plot(Path(args.plot) if args.plot else work / "soak.png", samples, tpot, warmup_s,
                      f"specd bench soak: {args.clients} streaming clients, {args.minutes:g} min")
    print(f"plot: {plot}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.json}")
    return 1 if doc["errors"] else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", type=int, default=32, help="concurrent streaming clients")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--warmup-minutes", type=float, default=2.0, help="RSS growth is counted after this")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--sample-s", type=float, default=5.0, help="RSS sampling period")
    parser.add_argument("--window-s", type=float, default=60.0, help="TPOT window")
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("--plot", default=None, metavar="PATH", help="PNG path (default: in the log dir)")
    parser.add_argument("--log-dir", default=None, help="server log (default: a temp dir)")
    parser.add_argument("overrides", nargs="*", default=[], help="config overrides of the server")


def main(argv: list[str] | None = None) -> int:
    from specd.bench.cli import run_alone

    return run_alone("soak", sys.modules[__name__], argv)


if __name__ == "__main__":
    raise SystemExit(main())
