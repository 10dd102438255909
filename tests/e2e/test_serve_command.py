"""`specd serve` as a user first runs it: a subprocess, its embedded default configuration, an empty
cache.

From an empty SPECD_CACHE the command converts the target from the model package, builds the seed
drafter (no trained one exists), starts its own Redis for the replay buffer, the trainer, Ray actors and
the router, goes from NOT_SERVING to SERVING, and streams an answer that equals the target-only answer to
the same prompt. SIGINT then shuts it down cleanly. Its console, stdout and stderr together as a user
sees them, holds only specd's own lines (one per start-up phase, in order; no gRPC fork notice, no Ray
warning, no progress bar of a library), and the log file it names holds the rest. The other e2e modules
run the server in-process; this one runs the command.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from specd.cluster.client import SpecdClient

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

# Converting the model (~30 s) and building the seed drafter (seconds) come first; a loaded CI machine
# gets several times that.
STARTUP_S = 900
# the start-up phases' lines, in the order they come (cluster/console.py)
PHASES = ["log file", "gRPC on", "HTTP (OpenAI-compatible) on", "model: de-quantizing", "model SmolLM2",
          "drafter suffix with model drafter seed-", "workers up", "warm"]
PROMPT = "Write a Python function that returns the n-th Fibonacci number."


def _lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)
    out.put(None)


def _wait_for(lines: queue.Queue, pattern: re.Pattern, log: list[str], deadline: float) -> re.Match:
    """The first line of the server's log matching pattern; every line read is kept in log."""
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            continue
        if line is None:
            raise AssertionError("specd serve exited before it said where it listens:\n" + "".join(log[-40:]))
        log.append(line)
        if m := pattern.search(line):
            return m
    raise AssertionError(f"no line matching {pattern.pattern!r} in {STARTUP_S} s:\n" + "".join(log[-40:]))


def test_first_start_from_an_empty_cache_serves_the_default_and_stops_on_sigint(tmp_path) -> None:
    cache = tmp_path / "cache"
    env = dict(os.environ, SPECD_CACHE=str(cache), PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    # Only the ports: bound by the server itself (0), read back from its log. Everything else is the
    # embedded default.
    cmd = [sys.executable, "-m", "specd.cluster.cli", "serve", "server.port=0", "server.http_port=0",
           "server.metrics_port=0"]
    env.pop("GRPC_VERBOSITY", None)
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True).start()
    log: list[str] = []
    try:
        deadline = time.monotonic() + STARTUP_S
        address = _wait_for(lines, re.compile(r"gRPC on (\S+:\d+)"), log, deadline).group(1)
        with SpecdClient(address, timeout=300) as client:
            client.wait_until_serving(timeout=max(deadline - time.monotonic(), 1.0))
            info = client.server_info()
            chunks = list(client.stream(PROMPT, max_new_tokens=48, ignore_eos=True))
            reference = client.generate(PROMPT, max_new_tokens=48, ignore_eos=True, speculation=False)
        streamed = [t for c in chunks for t in c.token_ids]
        assert len(chunks) > 1 and chunks[-1].finish_reason == "length"
        assert streamed == reference.token_ids and len(streamed) == 48
        assert "".join(c.text for c in chunks) == reference.text
        # the default, as built on a first start: the quick drafter beside the suffix index, online
        # training on, records to the Redis the server started itself
        assert (cache / "models").is_dir()
        assert any((cache / "drafters").glob("*/model.safetensors")), list((cache / "drafters").iterdir())
        text = repr(info)
        assert "suffix" in text and "goodput" in text, text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0, "".join(log[-40:])
        while (line := lines.get(timeout=10)) is not None:
            log.append(line)
        _console_is_specds_own(log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _console_is_specds_own(log: list[str]) -> None:
    """Every line the command printed is specd's: "specd: <phase> (N s)", "specd serving ...", or a
    warning of specd's own ("specd warning: ..."); the phases come in order; the log file exists and
    holds what the console left out (Ray's start, at least)."""
    lines = [line.rstrip("\n") for line in log if line.strip()]
    own = ("specd: ", "specd serving ", "specd warning: ")
    foreign = [line for line in lines if not line.startswith(own)]
    assert not foreign, "lines that are not specd's own:\n" + "\n".join(foreign[:20])
    phases = [line.removeprefix("specd: ") for line in lines if line.startswith("specd: ")]
    at = [next((i for i, p in enumerate(phases) if p.startswith(want)), None) for want in PHASES]
    assert None not in at and at == sorted(at), (PHASES, phases)
    assert any(p.startswith("SIGINT: stopping") for p in phases) and phases[-1].startswith("stopped"), phases
    log_file = phases[0].removeprefix("log file ").split(" ")[0]
    text = Path(log_file).read_text()
    assert "Started a local Ray instance" in text and "specd.phase" in text
