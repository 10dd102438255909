"""Held-out chat through the server: does the default speed up traffic nobody trained for, fresh and after
the drafter has served (and learned from) a stream of other chat?

One server in the configuration given (default: the default), then three phases:
1. fresh: each held-out chat prompt (data/chat_prompts.jsonl, rows no drafter, test or stream has seen)
   sent with speculation on, then off, one request at a time; greedy outputs must be equal;
2. stream: --stream requests of other open chat (the openchat stream rows) from --clients clients, the
   traffic the trainer learns from (speculation on, as users get it);
3. after: the other half of the held-out prompts, on then off, as in 1.
The speed-up of a phase is its target-only time over its speculative time for the same tokens (and the
median of the per-prompt ratios). Each phase also reads the server's drafted and accepted tokens per
drafter version from /metrics before and after it: which source drafted (the suffix index's drafts under
its `suffix-N` version, the model drafter's under its boot- or online- version, a draft without one under
"none") and how often it was right, figures that do not depend on timing. `specd bench chat --json PATH`
writes every figure and a PNG beside it.

Issue 61 asks for >= 1.4x after 200 requests and >= 1.05x fresh on this 2-core CPU; docs/benchmarks.md
keeps the runs.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from specd.bench.serve import ServerProcess, run_phase

HELDOUT_SOURCE, STREAM_SOURCE = "chat", "openchat"


def heldout_halves(count: int) -> tuple[list, list]:
    """Two disjoint sets of `count` held-out chat prompts (fresh, after)."""
    from specd.workers.prompts import chat_messages, load_split

    prompts = [chat_messages(p) for p in load_split(HELDOUT_SOURCE, "eval")]
    if 2 * count > len(prompts):
        raise ValueError(f"--prompts {count}: the held-out chat set has {len(prompts)} prompts (two halves)")
    return prompts[:count], prompts[count: 2 * count]


def stream_prompts(count: int) -> list:
    from specd.workers.prompts import chat_messages, load_split

    rows = [chat_messages(p) for p in load_split(STREAM_SOURCE, "train")]
    return [rows[i % len(rows)] for i in range(count)]


def on_then_off(address: str, prompts: list, max_new_tokens: int, label: str) -> dict[str, Any]:
    """Each prompt with speculation on, then off; per-prompt times, usage and the phase's ratios."""
    from tqdm import tqdm

    from specd.cluster.client import SpecdClient

    client = SpecdClient(address, timeout=3600)
    rows, mismatched = [], 0
    try:
        for messages in tqdm(prompts, desc=label, unit="prompt"):
            timed = {}
            for speculation in (True, False):
                t0 = time.perf_counter()
                out = client.generate(messages=messages, max_new_tokens=max_new_tokens, ignore_eos=True,
                                      temperature=0.0, speculation=speculation)
                timed[speculation] = (time.perf_counter() - t0, out)
            (on_s, on), (off_s, off) = timed[True], timed[False]
            mismatched += on.token_ids != off.token_ids
            rows.append({"on_s": on_s, "off_s": off_s, "tokens": len(on.token_ids), "usage": on.usage})
    finally:
        client.close()
    usage = [r["usage"] for r in rows]
    drafted, accepted = sum(u.get("drafted", 0) for u in usage), sum(u.get("accepted", 0) for u in usage)
    steps = sum(u.get("steps", 0) for u in usage)
    return {
        "prompts": len(rows),
        "speedup": sum(r["off_s"] for r in rows) / sum(r["on_s"] for r in rows),
        "speedup_median": statistics.median(r["off_s"] / r["on_s"] for r in rows),
        "on_tokens_per_s": sum(r["tokens"] for r in rows) / sum(r["on_s"] for r in rows),
        "off_tokens_per_s": sum(r["tokens"] for r in rows) / sum(r["off_s"] for r in rows),
        "drafted_per_step": drafted / steps if steps else 0.0,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "drafter_versions": sorted({v for u in usage for v in u.get("drafter_versions", [])}),
        "greedy_mismatches": mismatched,
        "per_prompt": [{k: r[k] for k in ("on_s", "off_s", "tokens")} for r in rows],
    }


def by_version(metrics_url: str) -> dict[str, dict[str, float]]:
    """{drafter_version: {"drafted", "accepted"}} from the server's Prometheus counters ({} without them)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    if not metrics_url:
        return {}
    out: dict[str, dict[str, float]] = {}
    text = urllib.request.urlopen(metrics_url, timeout=30).read().decode()
    for family in text_string_to_metric_families(text):
        key = {"specd_drafted_tokens": "drafted", "specd_accepted_tokens": "accepted"}.get(family.name)
        for sample in family.samples if key else ():
            if sample.name.endswith("_total"):
                version = sample.labels.get("drafter_version") or "none"
                out.setdefault(version, {"drafted": 0.0, "accepted": 0.0})[key] += sample.value
    return out


def phase_sources(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """Per drafter version, what a phase drafted and accepted (the counters' growth) and its α."""
    out = {}
    for version, now in after.items():
        was = before.get(version, {"drafted": 0.0, "accepted": 0.0})
        drafted, accepted = now["drafted"] - was["drafted"], now["accepted"] - was["accepted"]
        if drafted > 0:
            out[version] = {"drafted": drafted, "accepted": accepted, "acceptance_rate": accepted / drafted}
    return out


def server_tree(tree: Path, scratch: Path) -> tuple[dict[str, str], str]:
    """The environment and module with which the server runs the code of another checkout `tree` (a `git
    worktree` of an older commit, to measure it side by side with this one; the bench's client stays this
    checkout's). Since 1add2c9 `specd.*` is a namespace package: a folder of links named as the tree's
    pyproject maps them, first on PYTHONPATH, is found before the installed checkout. Before it the
    packages were top-level (`cluster.serve`), which nothing installed here shadows; the server then runs
    in `tree` (`python -m` puts its working directory first on sys.path)."""
    import tomllib

    setuptools = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]
    root, module = tree.resolve(), "cluster.serve"
    if "package-dir" in setuptools:
        root, module = scratch / "server-tree", "specd.cluster.serve"
        (root / "specd").mkdir(parents=True, exist_ok=True)
        for package, folder in setuptools["package-dir"].items():
            link = root / "specd" / package.removeprefix("specd.")
            if not link.is_symlink():
                link.symlink_to((tree / folder).resolve(), target_is_directory=True)
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH", "")]))
    return {**os.environ, "PYTHONPATH": path}, module


def fresh_cache(root: Path) -> Path:
    """A cache of the server's own: no drafter, no trainer state, no versions (the server builds its
    first-start drafter as on a new machine); the converted target linked and the teacher's cached
    generations copied from the shared cache, which both are pure functions of the target and the prompts.
    Needed to compare commits: an older trainer that keeps versions on disk resumes from whatever another
    run left in ~/.cache/specd."""
    from specd.workers.models.loader import default_cache_dir

    shared = default_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    if (shared / "models").is_dir() and not (root / "models").exists():
        (root / "models").symlink_to((shared / "models").resolve(), target_is_directory=True)
    if (shared / "bootstrap_data").is_dir() and not (root / "bootstrap_data").exists():
        shutil.copytree(shared / "bootstrap_data", root / "bootstrap_data")
    return root


def served_commit(tree: str | None) -> str:
    """The commit the server ran (`<sha>+dirty` with uncommitted changes; "" outside a git checkout)."""
    import subprocess

    where = Path(tree) if tree else Path(__file__).resolve().parents[1]
    git = ["git", "-C", str(where)]
    try:
        sha = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""
    return f"{sha}+dirty" if dirty else sha


def start_idle_load(fraction: float | None):
    """bench/idle_load.py beside the server for the run (None: no load)."""
    if fraction is None:
        return None
    import subprocess

    from specd.bench.idle_load import check_fraction

    check_fraction(fraction)
    return subprocess.Popen([sys.executable, "-m", "specd.bench.idle_load", str(fraction)])


def run_bench(args: argparse.Namespace) -> int:
    fresh_prompts, after_prompts = heldout_halves(args.prompts)
    stream = stream_prompts(args.stream)
    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="specd-bench-chat-"))
    logs.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:               # a free port for /metrics (0 would turn the endpoint off)
        s.bind(("127.0.0.1", 0))
        metrics_port = s.getsockname()[1]
    overrides = [*args.overrides, "server.port=0", f"server.metrics_port={metrics_port}"]
    env, module = None, "specd.cluster.serve"
    if args.server_tree:
        env, module = server_tree(Path(args.server_tree), logs)
    if args.fresh_cache:
        env = {**(env or os.environ), "SPECD_CACHE": str(fresh_cache(logs / "cache"))}
    if not args.server_tree or "http_port" in (Path(args.server_tree) / "configs" / "schema.py").read_text():
        overrides.append("server.http_port=null")
    started = time.time()
    server = ServerProcess(overrides, logs / "server.log", env=env, module=module,
                           cwd=Path(args.server_tree).resolve() if args.server_tree else None)
    load = start_idle_load(args.beside_load)
    try:
        counts = [by_version(server.metrics_url)]
        fresh = on_then_off(server.address, fresh_prompts, args.max_new_tokens, "fresh (on, off)")
        counts.append(by_version(server.metrics_url))
        streamed = asyncio.run(run_phase(server.address, stream, args.clients,
                                         [args.max_new_tokens] * len(stream), True, "stream"))
        streamed.pop("_timings", None)
        counts.append(by_version(server.metrics_url))
        after = on_then_off(server.address, after_prompts, args.max_new_tokens, "after (on, off)")
        counts.append(by_version(server.metrics_url))
    finally:
        if load is not None:
            load.kill()
            load.wait()
        server.stop()
    for phase, (before, now) in zip((fresh, streamed, after), itertools.pairwise(counts), strict=True):
        phase["sources"] = phase_sources(before, now)
    result = {"fresh": fresh, "stream": streamed, "after": after}
    for name in ("fresh", "after"):
        r = result[name]
        print(f"{name}: {r['speedup']:.3f}x (median {r['speedup_median']:.3f}x), "
              f"{r['on_tokens_per_s']:.1f} vs {r['off_tokens_per_s']:.1f} tok/s, "
              f"{r['drafted_per_step']:.2f} drafted a step, "
              f"α {r['acceptance_rate']:.2f}, versions {r['drafter_versions']}, "
              f"{r['greedy_mismatches']} greedy mismatches")
    print(f"stream: {streamed['tokens_per_s']:.1f} tok/s over {streamed['requests']} requests from "
          f"{args.clients} clients, α {streamed['acceptance_rate']:.2f}")
    for name in ("fresh", "stream", "after"):
        shown = ", ".join(f"{v} {c['drafted']:.0f} drafted α {c['acceptance_rate']:.2f}"
                          for v, c in result[name]["sources"].items())
        print(f"{name} by drafter version: {shown or 'none drafted'}")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"prompts": args.prompts, "stream": args.stream, "clients": args.clients,
                "server_tree": args.server_tree, "server_commit": served_commit(args.server_tree),
                "fresh_cache": args.fresh_cache, "max_new_tokens": args.max_new_tokens,
                "overrides": list(args.overrides), "beside_load": args.beside_load,
                "host_cpus": os.cpu_count(), "duration_s": time.time() - started, "logs": str(logs)}
        path.write_text(json.dumps({"meta": meta, **result}, indent=2))
        plot(result, path.with_suffix(".png"))
        print(f"wrote {path}")
    return int(fresh["greedy_mismatches"] + after["greedy_mismatches"] > 0)


def plot(result: dict[str, Any], path: Path) -> None:
    """Per-prompt speed-ups, fresh and after the stream, with each phase's aggregate as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for offset, name in enumerate(("fresh", "after")):
        ratios = [p["off_s"] / p["on_s"] for p in result[name]["per_prompt"]]
        xs = [offset * (len(ratios) + 2) + i for i in range(len(ratios))]
        ax.bar(xs, ratios, label=f"{name}: {result[name]['speedup']:.2f}x")
        ax.hlines(result[name]["speedup"], xs[0] - 0.5, xs[-1] + 0.5, colors="black")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_ylabel("target-only time / specd time")
    ax.set_title("held-out chat through the server, per prompt")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _load_fraction(text: str) -> float:
    """--beside-load's F, refused at parse time (before a server starts)."""
    from specd.bench.idle_load import check_fraction

    try:
        return check_fraction(float(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=int, default=16,
                        help="held-out prompts per phase (default 16; 32 exist)")
    parser.add_argument("--stream", type=int, default=128,
                        help="stream requests between the phases (default 128)")
    parser.add_argument("--clients", type=int, default=4, help="the stream's concurrent clients (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--json", default=None, metavar="PATH", help="write every figure to PATH (+ a PNG)")
    parser.add_argument("--log-dir", default=None, help="where the server log goes (default: a temp dir)")
    parser.add_argument("--server-tree", default=None, metavar="PATH",
                        help="serve the code of another checkout (e.g. a `git worktree` of an older commit)")
    parser.add_argument("--fresh-cache", action="store_true",
                        help="the server gets a cache of its own (no drafter, no trainer state), to "
                             "compare commits")
    parser.add_argument("--beside-load", type=_load_fraction, default=None, metavar="F",
                        help="a one-thread load at the trainer's priority (SCHED_IDLE) beside the server, "
                             "busy F of the time (0 < F <= 1): what colocated background work costs "
                             "serving")
    parser.add_argument("overrides", nargs="*", default=[], help="config overrides, e.g. trainer=off")


def main(argv: list[str] | None = None) -> int:
    from specd.bench.cli import run_alone

    return run_alone("chat", sys.modules[__name__], argv)


if __name__ == "__main__":
    raise SystemExit(main())
