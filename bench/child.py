"""The child side of `specd bench engine`: one system per process, JSON in, JSON out.

The parent (bench/engine.py) starts `python -m specd.bench.runners` or
`python -m specd.bench.vllm_runner` with a job file and an output path, and passes one pipe end as
`--events-fd`. The child writes progress as JSON lines on that pipe (its own stdout and stderr go to
a log file: vLLM logs to stdout, which must not mix with the protocol) and its raw measurements to
the output file. Everything a child measures is raw (token counts, wall times, per-request latencies,
draft counts); the parent turns them into rows, so every system is aggregated by the same code.

Peak RSS is the child's own: `ru_maxrss` of the process, or for vLLM, whose engine runs in processes
of its own, the peak of the summed RSS of the process tree sampled every 50 ms, whichever is larger.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


class Events:
    """Progress messages to the parent, one JSON object a line. Token counts are batched so that a
    fast engine does not spend its time writing to the pipe."""

    def __init__(self, fd: int | None, flush_every_s: float = 0.5):
        self._out = os.fdopen(fd, "w", buffering=1) if fd is not None else None
        if fd is not None:
            # vLLM spawns processes; they must not hold the pipe open after this child exits.
            os.set_inheritable(fd, False)
        self._pending = 0
        self._last = time.perf_counter()
        self._flush_every_s = flush_every_s

    def emit(self, event: str, **fields: Any) -> None:
        if self._out is not None:
            self._out.write(json.dumps({"event": event, **fields}) + "\n")

    def tokens(self, n: int, force: bool = False) -> None:
        self._pending += n
        now = time.perf_counter()
        if self._pending and (force or now - self._last >= self._flush_every_s):
            self.emit("tokens", n=self._pending)
            self._pending, self._last = 0, now

    def flush(self) -> None:
        self.tokens(0, force=True)

    def close(self) -> None:
        self.flush()
        if self._out is not None:
            self._out.close()
            self._out = None


class TreeRssSampler:
    """Peak of the summed RSS of this process and all its descendants, sampled in a thread."""

    def __init__(self, interval_s: float = 0.05):
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TreeRssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import psutil

        me = psutil.Process()
        while not self._stop.is_set():
            total = 0
            for proc in [me, *me.children(recursive=True)]:
                try:
                    total += proc.memory_info().rss
                except psutil.Error:
                    continue  # a process that ended between listing and reading
            self.peak_bytes = max(self.peak_bytes, total)
            self._stop.wait(self.interval_s)


def own_peak_rss_mb() -> float:
    """ru_maxrss of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def groups(prompts: list[list[int]], seeds: list[int], batch: int) -> Iterator[tuple[list, list]]:
    """Consecutive groups of `batch` prompts (the last one may be smaller), run together."""
    for start in range(0, len(prompts), batch):
        yield prompts[start : start + batch], seeds[start : start + batch]


def new_cell_result(cell: dict[str, Any]) -> dict[str, Any]:
    """Raw measurements of one (workload, batch, temperature) cell, filled in by a runner."""
    return {
        "workload": cell["workload"],
        "batch": cell["batch"],
        "temperature": cell["temperature"],
        "num_prompts": len(cell["prompts"]),
        "requested_tokens": 0,      # max_new_tokens summed over requests
        "generated_tokens": 0,      # counted from the outputs, never taken from max_new_tokens
        "wall_s": 0.0,              # summed over groups: only generation, no loading or warm-up
        "request_ms_per_token": [],  # per request: its latency / its generated tokens
        "drafted": None,            # speculation counts (None: the system does not speculate)
        "accepted": None,
        "steps": None,
        "emitted": None,
        "outputs": [],              # generated token ids per request (greedy agreement check)
        # --paired: target-only on the same groups in the same process, interleaved with the system
        "paired_base_wall_s": None,
        "paired_base_tokens": None,
        "paired_groups": None,      # per group: [base wall s, base tokens, system wall s, system tokens]
        # 1-min load average at the cell's start and end. It counts this process's own threads too, so
        # on its own it cannot say whether anything else ran: other_cpus can (finish_cell)
        "loadavg": [os.getloadavg()[0]],
        "_cpu_start": cpu_sample(),
    }


def cpu_sample() -> tuple[float, float, float] | None:
    """(machine busy CPU-seconds, this process's CPU-seconds, monotonic seconds) now; None off Linux."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
    except OSError:
        return None
    busy = sum(ticks) - ticks[3] - ticks[4]         # all but idle and iowait
    return busy / os.sysconf("SC_CLK_TCK"), time.process_time(), time.monotonic()


def finish_cell(result: dict[str, Any]) -> dict[str, Any]:
    """Closes the cell's load record: other_cpus is the CPUs the rest of the machine kept busy on
    average while the cell ran (machine busy time minus this process's, over the wall time)."""
    result["loadavg"].append(os.getloadavg()[0])
    start, end = result.pop("_cpu_start", None), cpu_sample()
    if start is not None and end is not None and end[2] > start[2]:
        others = (end[0] - start[0]) - (end[1] - start[1])
        result["other_cpus"] = round(max(others, 0.0) / (end[2] - start[2]), 3)
    return result


def add_request(result: dict[str, Any], output: list[int], latency_s: float, requested: int) -> None:
    result["requested_tokens"] += requested
    result["generated_tokens"] += len(output)
    result["outputs"].append(list(output))
    if output:
        result["request_ms_per_token"].append(1000.0 * latency_s / len(output))


Runner = Callable[[dict[str, Any], Events], dict[str, Any]]


def child_main(runners: dict[str, Runner], argv: list[str] | None = None) -> int:
    """Entry of a child process: read the job, run the named system, write the result (or the error)."""
    parser = argparse.ArgumentParser(description="run one system of `specd bench engine` (internal)")
    parser.add_argument("job", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--events-fd", type=int, default=None)
    args = parser.parse_args(argv)
    job = json.loads(args.job.read_text())
    events = Events(args.events_fd)
    try:
        import torch

        torch.set_num_threads(int(job.get("threads", 2)))
        runner = runners[job["runner"]]
        with TreeRssSampler() as sampler:
            result = runner(job, events)
        result["peak_rss_mb"] = max(own_peak_rss_mb(), sampler.peak_bytes / 2**20)
        result["ok"] = True
    except Exception as exc:  # the parent reports it and goes on with the next system
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    events.close()
    result["system"] = job["system"]
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.rename(args.out)
    sys.stdout.flush()
    return 0 if result["ok"] else 1
