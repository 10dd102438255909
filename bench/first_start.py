"""A first start from an empty cache, timed phase by phase.

`specd serve` in its default configuration as a child process with a cache of its own (no converted
model, no drafter, no trainer state), its console (stdout and stderr together, as a user sees them) read
line by line with the second each line came at. A phase ends at the first line that says so; an older
checkout (`--server-tree PATH`, a `git worktree` of an earlier commit) said its phases as INFO log lines,
which the same patterns read. Once it serves: one chat request (seconds to its answer), then SIGINT
(seconds to exit). Also the process tree's peak RSS (Ray's processes are the server's children), how many
console lines it printed and how many of them were not specd's own, and the load average before and
after (a first start on a busy machine is slower: compare runs of one session). `--json PATH` writes
every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# phase: the line that ends it (this version's console | an older version's log)
PHASES = {
    "ports": r"gRPC on \S+:\d+",
    "model": r"specd: model \S+ ready|no bootstrapped drafter in the cache",
    "drafter": r"specd: drafter |quick drafter built in",
    "workers": r"workers up",
    "warm": r"specd: warm|warm after",
    "serving": r"^specd serving ",
}
PROMPT = "What is a hash map? Answer in two sentences."


def mark_phases(ended: dict[str, float], at: float, line: str) -> None:
    """Record `at` as the end of each phase whose line this is, the first time it is seen."""
    for name, pattern in PHASES.items():
        if name not in ended and re.search(pattern, line):
            ended[name] = round(at, 1)


def _tree_rss(pid: int) -> int:
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total


def first_start(server_tree: str | None, timeout_s: float, scratch: Path) -> dict:
    from specd.bench.chat_heldout import server_tree as tree_env
    from specd.cluster.client import SpecdClient

    env, module = (tree_env(Path(server_tree), scratch) if server_tree
                   else (dict(os.environ), "specd.cluster.serve"))
    env.update(SPECD_CACHE=str(scratch / "cache"), PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", module, "server.port=0", "server.http_port=0", "server.metrics_port=0"]
    load_before = os.getloadavg()
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, cwd=Path(server_tree).resolve() if server_tree else None,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[tuple[float, str]] = []
    ended: dict[str, float] = {}
    address: list[str] = []
    serving = threading.Event()

    def read() -> None:
        for raw in proc.stdout:
            for line in raw.replace("\r", "\n").splitlines():
                if not line.strip():
                    continue
                at = time.monotonic() - t0
                lines.append((at, line))
                mark_phases(ended, at, line)
                if not address and (m := re.search(r"gRPC on (\S+:\d+)", line)):
                    address.append(m.group(1))
                if "serving" in ended:
                    serving.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    peak = 0
    try:
        while not serving.is_set():
            if proc.poll() is not None:
                raise RuntimeError("the server exited before serving:\n"
                                   + "\n".join(line for _, line in lines[-30:]))
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"not serving within {timeout_s:.0f} s")
            peak = max(peak, _tree_rss(proc.pid))
            time.sleep(0.5)
        with SpecdClient(address[0], timeout=300) as client:
            client.wait_until_serving(timeout=60)
            t1 = time.monotonic()
            answer = client.generate(PROMPT, max_new_tokens=32)
            request_s = time.monotonic() - t1
        peak = max(peak, _tree_rss(proc.pid))
        t2 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=120)
        stop_s = time.monotonic() - t2
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(timeout=10)
    previous, durations = 0.0, {}
    for name in PHASES:
        if name in ended:
            durations[name] = round(ended[name] - previous, 1)
            previous = ended[name]
    foreign = [line for _, line in lines if not line.startswith("specd")]
    return {
        "server_tree": server_tree, "phase_ends_s": ended, "phase_s": durations,
        "serving_s": ended.get("serving"), "first_request_s": round(request_s, 2),
        "first_answer_tokens": len(answer.token_ids), "stop_s": round(stop_s, 1), "exit_code": code,
        "peak_rss_gb": round(peak / 1e9, 2), "console_lines": len(lines),
        "foreign_console_lines": len(foreign),
        "foreign_examples": foreign[:8], "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server-tree", default=None, metavar="PATH",
                        help="serve the code of another checkout (e.g. a `git worktree` of an older commit)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds to wait for SERVING")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the figures to PATH")


def run_bench(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="specd-first-start-") as scratch:
        result = first_start(args.server_tree, args.timeout, Path(scratch))
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["exit_code"] == 0 else 1
