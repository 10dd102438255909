"""End to end, online adaptation on: the real server with its managed redis-server, the replay writer,
the trainer actor and DraftWorkers following its versions (SmolLM2 target, the quick drafter that reads
hidden states). The gate margin is set so that every candidate is published, so swaps happen while
clients stream; greedy output must stay identical to target-only decoding throughout, and the metrics
must show records written, trainer updates and swaps."""

from __future__ import annotations

import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest

from specd.cluster.client import SpecdClient
from tests.e2e.in_process import serving

# README's reliability table says these run in CI: with CI set, a skip here fails the suite
pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.ci_required]

PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is the capital of France? Answer in one sentence.",
    "A train travels 60 miles per hour for 3 hours. How far does it go?",
]


def _metric(text: str, name: str) -> float:
    values = [float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)]
    return sum(values)


def _streamed(client: SpecdClient, max_new_tokens: int, prompt: str) -> list[int]:
    ids: list[int] = []
    for chunk in client.stream(prompt=prompt, max_new_tokens=max_new_tokens):
        ids += list(chunk.token_ids)
    return ids


@pytest.fixture(scope="module")
def server(tmp_path_factory, boot_hidden_drafter_dir):
    """boot_hidden_drafter_dir (tests/conftest.py) builds the quick hidden-state drafter when the cache
    has none, so this runs on a fresh machine too."""
    import ray

    from specd.configs import load_config

    store = tmp_path_factory.mktemp("online-store")
    cfg = load_config([
        "server.port=0", "server.http_port=0", "server.metrics_port=0", "target.max_slots=4",
        "drafter.max_slots=4",
        "target.max_seq_len=512", f"drafter.path={boot_hidden_drafter_dir}", f"trainer.out_dir={store}",
        "trainer.update_every_records=2", "trainer.update_every_s=1", "trainer.holdout_every=2",
        "trainer.steps_per_update=2", "trainer.batch_records=2", "trainer.gate_margin=-1.0",
        "trainer.collapse_alpha=0.0", "trainer.rollback_margin=1.0",
    ])
    ray.init(num_cpus=4, include_dashboard=False, namespace="specd-e2e-online", log_to_driver=False)
    try:
        with serving(cfg) as handle:
            client = SpecdClient(handle.address, timeout=600)
            yield {"client": client, "handle": handle, "store": store}
            client.close()
    finally:
        ray.shutdown()


def test_swaps_while_streaming_keep_greedy_output_exact(server) -> None:
    c, port = server["client"], server["handle"].http_port   # /metrics on the API port
    reference = [c.generate(prompt=p, max_new_tokens=24, speculation=False).token_ids for p in PROMPTS]
    streamed = partial(_streamed, c, 24)

    def metrics() -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()

    deadline = time.monotonic() + 600
    rounds = 0
    with ThreadPoolExecutor(4) as pool:
        while True:
            outputs = list(pool.map(streamed, PROMPTS))
            assert outputs == reference, f"round {rounds}: speculative output differs from target-only"
            rounds += 1
            text = metrics()
            if _metric(text, "specd_drafter_swaps") >= 1 and rounds >= 2:
                break
            assert time.monotonic() < deadline, f"no swap after {rounds} rounds:\n{text[-3000:]}"
    assert _metric(text, "specd_replay_records_written_total") >= len(PROMPTS)
    assert _metric(text, "specd_trainer_publishes") >= 1
    assert (server["store"] / "CURRENT").is_file()


def test_a_request_that_asks_for_no_record_leaves_none(server) -> None:
    """GenerateRequest.skip_replay through the real server: the request is served and nothing reaches
    Redis for it. The writer is first in, first out, so once the plain request after it is written, a
    record of the first would have been too."""
    c, port = server["client"], server["handle"].http_port

    def written() -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        return _metric(text, "specd_replay_records_written_total")

    def settled() -> float:
        """The count once the writer has caught up with the earlier tests' records (one CI run read
        93 for 91 + 1: a record of the previous test was still queued when `before` was read)."""
        last, since, deadline = written(), time.monotonic(), time.monotonic() + 60
        while time.monotonic() - since < 1.0:
            assert time.monotonic() < deadline, "the writer never caught up"
            time.sleep(0.2)
            if (now := written()) != last:
                last, since = now, time.monotonic()
        return last

    before = settled()
    assert len(c.generate(prompt=PROMPTS[2], max_new_tokens=8, skip_replay=True).token_ids) > 0
    c.generate(prompt=PROMPTS[3], max_new_tokens=8)
    deadline = time.monotonic() + 60
    while written() < before + 1:
        assert time.monotonic() < deadline, "the plain request's record was never written"
        time.sleep(0.2)
    assert settled() == before + 1


def _descendants(cmd_prefix: str) -> list:
    """Processes under this one (the server runs in-process: redis-server and Ray's workers are below it)
    whose command line starts with `cmd_prefix`."""
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if " ".join(p.cmdline()).startswith(cmd_prefix):
                out.append(p)
        except psutil.Error:
            continue
    return out


def test_redis_and_trainer_killed_while_serving(server) -> None:
    """The managed redis-server and the trainer actor are SIGKILLed under streaming load: every request
    still succeeds with exact output, records are dropped and counted while Redis is away, specd starts
    Redis again and writing resumes, Ray restarts the trainer and it reads the stream again."""
    c, port = server["client"], server["handle"].http_port
    reference = [c.generate(prompt=p, max_new_tokens=16, speculation=False).token_ids for p in PROMPTS]
    streamed = partial(_streamed, c, 16)

    def metric(name: str) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        return _metric(text, name)

    def serve_until(cond, what: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        with ThreadPoolExecutor(4) as pool:
            while True:
                assert list(pool.map(streamed, PROMPTS)) == reference, f"output changed while {what}"
                if cond():
                    return
                assert time.monotonic() < deadline, f"never happened: {what}"

    (redis,) = _descendants("redis-server")
    redis.kill()

    def records_dropped() -> bool:
        if metric("specd_replay_records_dropped_total") > 0:
            return True
        # specd restarted Redis before a record was written into the outage (a slow machine's requests
        # outlast the outage): kill it again until one is
        for p in _descendants("redis-server"):
            p.kill()
        return False

    serve_until(records_dropped, "Redis is down")
    written = metric("specd_replay_records_written_total")
    serve_until(lambda: metric("specd_replay_records_written_total") > written, "Redis is restarted")
    assert [p.pid for p in _descendants("redis-server")] != [redis.pid]

    (trainer,) = _descendants("ray::TrainerActor")
    trainer.kill()
    serve_until(lambda: [p.pid for p in _descendants("ray::TrainerActor")] not in ([], [trainer.pid]),
                "the trainer is restarted")
    seen = metric("specd_trainer_records_seen")
    serve_until(lambda: metric("specd_trainer_records_seen") not in (0, seen), "the trainer reads again")
