"""`specd bench osd --arms ...`: does online distillation pay beyond the suffix index?

Three arms serve the same stream and are judged on the same held-out prompts, each on a fresh server
(its own managed Redis, version store and suffix index), through gRPC as clients see it:

- `suffix-frozen`: the default drafter (suffix index + model drafter) with the trainer off;
- `default-online`: the same with the online trainer on (what `specd serve` runs);
- `model-online`: the model drafter alone (no suffix index) with the trainer on;
- `offline-frozen` (with `--offline-drafter DIR`): the default drafter from a drafter trained offline on
  the domain, trainer off. Not a serving choice, a ceiling: what arm (b) would reach if online
  distillation produced that drafter at once, with none of its cost to serving.

Per arm: held-out speed before the stream (each held-out prompt served with speculation on, then off,
one at a time, greedy, `ignore_eos` so both produce the same number of tokens: the ratio of the two
wall times is that prompt's speed-up), the stream (`--clients` streaming clients; each request's α,
tokens per step and drafting versions), then held-out speed after the stream on a disjoint set of
held-out prompts (the held-out split's first half before, second half after, so the suffix index has
not seen the "after" prompts' answers). Held-out requests ask for no replay record (`skip_replay`), so
each trainer learns from the stream alone. Versions published and failed requests are counted. `--json`
writes every row; `--plot` draws every arm's tokens per step over the stream with its publish events,
and the held-out speed-ups before and after.

    specd bench osd --arms suffix-frozen,default-online,model-online --domains openchat \\
        --requests-per-domain 200 --heldout 20 --json bench/results/osd-arms-openchat.json \\
        --plot bench/results/osd-arms-openchat.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

ARMS: dict[str, list[str]] = {
    "suffix-frozen": ["drafter.kind=suffix", "drafter.suffix_with_model=true", "trainer.enabled=false"],
    "default-online": ["drafter.kind=suffix", "drafter.suffix_with_model=true", "trainer.enabled=true"],
    "model-online": ["drafter.kind=model", "trainer.enabled=true"],
    "offline-frozen": ["drafter.kind=suffix", "drafter.suffix_with_model=true", "trainer.enabled=false"],
}


def heldout_halves(domain: str, per_phase: int) -> tuple[list[Any], list[Any]]:
    """The held-out split's first `per_phase` prompts (before the stream) and the next `per_phase`
    (after): disjoint, so "after" measures prompts whose answers no arm has served."""
    from specd.workers.prompts import load_split

    rows = load_split(domain, "eval")
    if len(rows) < 2 * per_phase:
        raise SystemExit(f"{domain}: {len(rows)} held-out prompts, fewer than 2 x --heldout {per_phase}")
    return rows[:per_phase], rows[per_phase : 2 * per_phase]


async def heldout_speed(address: str, prompts: list[Any], max_new_tokens: int, desc: str) -> dict[str, Any]:
    """Each prompt served with speculation on, then off, one request at a time. `speedup`: total time
    off / total time on (both produce max_new_tokens tokens); `median_ratio`: the median per prompt."""
    from tqdm import tqdm

    from specd.cluster.client import AsyncSpecdClient
    from specd.workers.prompts import chat_messages

    client = AsyncSpecdClient(address, timeout=3600)
    rows, failed = [], 0
    try:
        for i, prompt in enumerate(tqdm(prompts, desc=desc, unit="prompt")):
            row: dict[str, Any] = {"index": i}
            for mode, on in (("on", True), ("off", False)):
                t0 = time.perf_counter()
                try:
                    # skip_replay: the held-out prompts never reach the trainer, before the stream or after
                    out = await client.generate(messages=chat_messages(prompt), max_new_tokens=max_new_tokens,
                                                ignore_eos=True, temperature=0.0, speculation=on,
                                                skip_replay=True)
                except Exception as exc:  # a failed request is a result of the benchmark, not its end
                    failed += 1
                    row[f"{mode}_error"] = f"{type(exc).__name__}: {exc}"
                    continue
                row[f"{mode}_s"] = time.perf_counter() - t0
                row[f"{mode}_tokens"] = len(out.token_ids)
                if on:
                    u = out.usage
                    row.update(drafted=u.get("drafted", 0), accepted=u.get("accepted", 0),
                               tokens_per_step=u.get("tokens_per_step", 0.0),
                               versions=list(u.get("drafter_versions", [])))
                else:
                    row["same_tokens"] = row.get("on_tokens") == row["off_tokens"]
            rows.append(row)
    finally:
        await client.close()
    ok = [r for r in rows if "on_s" in r and "off_s" in r]
    on_s, off_s = sum(r["on_s"] for r in ok), sum(r["off_s"] for r in ok)
    drafted, accepted = sum(r["drafted"] for r in ok), sum(r["accepted"] for r in ok)
    return {
        "speedup": round(off_s / on_s, 4) if on_s else None,
        "median_ratio": round(statistics.median(r["off_s"] / r["on_s"] for r in ok), 4) if ok else None,
        "alpha": round(accepted / drafted, 4) if drafted else 0.0,
        "tokens_per_step": round(statistics.mean(r["tokens_per_step"] for r in ok), 4) if ok else None,
        "on_tokens_per_s": round(sum(r["on_tokens"] for r in ok) / on_s, 3) if on_s else None,
        "off_tokens_per_s": round(sum(r["off_tokens"] for r in ok) / off_s, 3) if off_s else None,
        "failed_requests": failed,
        "prompts": rows,
    }


def run_arm(arm: str, domain: str, args: argparse.Namespace, base: list[str], work: Path,
            stream: list[tuple[str, Any]], before: list[Any], after: list[Any]) -> dict[str, Any]:
    """One arm on one domain: a fresh server; held-out speed, the stream, held-out speed again."""
    from specd.bench.osd import SWAP_DELAY_S, run_stream, wait_for_trainer
    from specd.bench.osd_versions import published_events
    from specd.bench.serve import ServerProcess

    store = work / f"store-{domain}-{arm}"
    if store.exists():
        shutil.rmtree(store)   # the trainer resumes from a store's CURRENT: an earlier run's would be used
    drafter = args.offline_drafter if arm == "offline-frozen" else args.start_drafter
    overrides = [*base, *ARMS[arm], f"drafter.path={drafter}", f"trainer.out_dir={store}",
                 "trainer.keep_versions=1000"]
    started = time.time()
    server = ServerProcess(overrides, work / f"server-{domain}-{arm}.log")
    try:
        if "trainer.enabled=true" in ARMS[arm]:
            wait_for_trainer(store)
        out: dict[str, Any] = {"arm": arm, "domain": domain, "overrides": ARMS[arm], "drafter": drafter}
        out["before"] = asyncio.run(heldout_speed(server.address, before, args.max_new_tokens,
                                                  f"{domain} {arm} held-out before"))
        out["stream"] = asyncio.run(run_stream(server.address, stream, args.clients, args.max_new_tokens,
                                               f"{domain} {arm} stream"))
        out["after"] = asyncio.run(heldout_speed(server.address, after, args.max_new_tokens,
                                                 f"{domain} {arm} held-out after"))
    finally:
        server.stop()
    out["published"] = published_events(out["stream"]["requests"], store, SWAP_DELAY_S) \
        if (store / "CURRENT").is_file() else []
    out["failed_requests"] = sum(out[k]["failed_requests"] for k in ("before", "stream", "after"))
    out["duration_s"] = round(time.time() - started, 1)
    return out


def summary(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """{domain: {arm: headline figures}} plus, per domain, arm (b) against arm (a): held-out speed after
    the stream and the stream's throughput (trainer on / off)."""
    out: dict[str, dict[str, Any]] = {}
    for r in results:
        s = r["stream"]
        done = [x for x in s["requests"] if x and "error" not in x]
        drafted, accepted = sum(x["drafted"] for x in done), sum(x["accepted"] for x in done)
        out.setdefault(r["domain"], {})[r["arm"]] = {
            "speedup_before": r["before"]["speedup"],
            "speedup_after": r["after"]["speedup"],
            "alpha_before": r["before"]["alpha"],
            "alpha_after": r["after"]["alpha"],
            "tokens_per_step_before": r["before"]["tokens_per_step"],
            "tokens_per_step_after": r["after"]["tokens_per_step"],
            "stream_alpha": round(accepted / drafted, 4) if drafted else 0.0,
            "stream_tokens_per_s": round(s["tokens_per_s"], 3),
            "versions_published": len(r["published"]),
            "failed_requests": r["failed_requests"],
        }
    for arms in out.values():
        a, b = arms.get("suffix-frozen"), arms.get("default-online")
        if a and b and a["speedup_after"] and b["speedup_after"]:
            arms["b_over_a"] = {
                "heldout_speed_after": round(b["speedup_after"] / a["speedup_after"], 4),
                "stream_throughput": round(b["stream_tokens_per_s"] / a["stream_tokens_per_s"], 4),
            }
        c = arms.get("offline-frozen")
        if a and c and a["speedup_after"] and c["speedup_after"]:
            ratio = round(c["speedup_after"] / a["speedup_after"], 4)
            arms["offline_over_a"] = {"heldout_speed_after": ratio}
    return out


def write_plot(path: Path, results: list[dict[str, Any]]) -> Path:
    """Left: each arm's tokens per step over the stream (moving mean), publish events dotted. Right: each
    arm's held-out speed-up before and after the stream."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from specd.bench.report import save_figure

    domains = sorted({r["domain"] for r in results})
    fig, axes = plt.subplots(len(domains), 2, figsize=(12, 4 * len(domains)), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 1]})
    for (left, right), domain in zip(axes, domains, strict=True):
        arms = [r for r in results if r["domain"] == domain]
        for i, r in enumerate(arms):
            rows = [x for x in r["stream"]["requests"] if x and "error" not in x]
            ys = [x.get("tokens_per_step", 0.0) for x in rows]
            window = max(1, len(ys) // 20)
            smooth = [statistics.mean(ys[max(0, j - window + 1) : j + 1]) for j in range(len(ys))]
            line = left.plot([x["index"] for x in rows], smooth, label=r["arm"])[0]
            for ev in r["published"]:
                left.axvline(ev["index"], color=line.get_color(), alpha=0.3, linestyle=":")
            before, after = r["before"]["speedup"] or 0.0, r["after"]["speedup"] or 0.0
            right.bar(i - 0.2, before, width=0.4, color=line.get_color(), alpha=0.4)
            right.bar(i + 0.2, after, width=0.4, color=line.get_color())
            right.text(i + 0.2, after, f"{after:.2f}", ha="center", va="bottom", fontsize=8)
        left.set_xlabel("stream request index")
        left.set_ylabel(f"tokens per step (moving mean of {window})")
        left.set_title(f"{domain}: stream (dotted: a version published and serving)")
        left.legend(loc="lower right")
        right.axhline(1.0, color="black", linewidth=0.8)
        right.set_xticks(range(len(arms)), [r["arm"] for r in arms], rotation=20, fontsize=8)
        right.set_ylabel("held-out speed-up vs speculation off")
        right.set_title("before | after the stream")
    fig.tight_layout()
    return save_figure(fig, path)


def run_arms(args: argparse.Namespace) -> int:
    from specd.bench.osd import prepare, stream_prompts

    arms = [a for a in args.arms.split(",") if a]
    unknown = set(arms) - set(ARMS)
    if unknown:
        raise SystemExit(f"--arms: choose from {', '.join(ARMS)} (got {', '.join(sorted(unknown))})")
    if "offline-frozen" in arms and not (Path(args.offline_drafter or "") / "config.json").is_file():
        raise SystemExit("--arms offline-frozen needs --offline-drafter DIR (a drafter directory)")
    overrides, cfg, drafter, work, seen = prepare(args, "specd-bench-osd-arms-")
    args.start_drafter = drafter
    base = [*overrides, "server.port=0", "server.metrics_port=0", "server.http_port=null",
            f"server.max_running={max(args.clients, cfg.server.max_running)}"]
    started = time.time()
    results = []
    for domain in [d for d in args.domains.split(",") if d]:
        stream = stream_prompts((domain,), args.requests_per_domain, "train", seen)
        before, after = heldout_halves(domain, args.heldout)
        for arm in arms:
            results.append(run_arm(arm, domain, args, base, work, stream, before, after))
            print(json.dumps(summary(results)[domain][arm]), flush=True)
    table = summary(results)
    print(json.dumps(table, indent=2))
    plot = write_plot(Path(args.plot) if args.plot else work / "osd-arms.png", results)
    print(f"plot: {plot}")
    if args.json:
        doc = {
            "summary": table,
            "meta": {"arms": {a: ARMS[a] for a in arms}, "requests_per_domain": args.requests_per_domain,
                     "heldout_per_phase": args.heldout, "max_new_tokens": args.max_new_tokens,
                     "clients": args.clients, "start_drafter": drafter,
                     "offline_drafter": args.offline_drafter, "overrides": overrides,
                     "duration_s": round(time.time() - started, 1), "work_dir": str(work)},
            "results": results,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.json}")
    return 0
