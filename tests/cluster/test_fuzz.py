"""Property-based fuzzing of the gRPC API: the router on a free port with fake workers, hit by random,
malformed, huge and adversarial requests built straight as protobuf messages (so every value the wire
can carry is reachable: seeds at the uint64 bounds, int32 extremes, NaN and infinite floats, unicode,
prompts at the context limit, overlapping stop strings, cancels after a random number of chunks).

Properties, for every example:
- the status is OK, INVALID_ARGUMENT (exactly when specd.cluster.validation refuses the request) or
  RESOURCE_EXHAUSTED; never INTERNAL, UNKNOWN or a dropped connection;
- an OK answer is the target-only output of the prompt, cut at the first stop string;
- a well-formed request from another client running at the same time is answered correctly;
- after a cancel, the request's KV slots are freed (the fake workers report none running).

CI runs a few derandomized examples per property; run many more with
    SPECD_FUZZ_EXAMPLES=2000 python -m pytest -q tests/cluster/test_fuzz.py
"""

from __future__ import annotations

import os
import threading
import time

import grpc
import pytest
from fake_workers import EOS, FakeDrafter, FakeTarget, target_only
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_router import BOUNDS, LoopThread, ToyCodec

from specd.cluster.client import SpecdClient, build_request
from specd.cluster.router import GrpcServer, SpecdServicer
from specd.cluster.scheduler import Scheduler
from specd.cluster.serving import Backend, TextStream, first_stop
from specd.cluster.validation import InvalidRequest, validate_request
from specd.proto.specd.v1 import serving_pb2

EXAMPLES = int(os.environ.get("SPECD_FUZZ_EXAMPLES", "25"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize="SPECD_FUZZ_EXAMPLES" not in os.environ,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
                database=None)
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
INT32 = (-(2**31), 2**31 - 1)
UINT64_MAX = 2**64 - 1
CODEC = ToyCodec()


@pytest.fixture(scope="module")
def server():
    lt = LoopThread()
    target = FakeTarget(max_slots=4, delay=0.001)
    drafter = FakeDrafter(target, delay=0.001)

    async def up():
        sched = Scheduler([(target, drafter)], capacity=4, max_queue=8, max_running=4, pipeline_groups=2,
                          eos_token_ids=[EOS])
        await sched.start()
        srv = GrpcServer(SpecdServicer(), port=0)
        await srv.start()
        await srv.attach(Backend(sched, CODEC, BOUNDS, "fake", (EOS,), 1, 2, 8))
        return sched, srv

    sched, srv = lt.run(up())
    client = SpecdClient(srv.address, timeout=30)
    yield {"client": client, "target": target, "drafter": drafter, "sched": sched}
    client.close()
    lt.run(srv.stop(0))
    lt.run(sched.stop())
    lt.close()


def wait_idle(s, what: str, timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not s["target"].running and not s["drafter"].running and s["sched"].running() == 0:
            return
        time.sleep(0.005)
    raise AssertionError(f"slots still held after {what}: {s['target'].running}")


# ---- strategies ------------------------------------------------------------------------------------

ascii_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=12)
any_text = st.text(max_size=40)           # every unicode code point but surrogates, incl. NUL and emoji
floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from([0.0, -0.0, 1e-45, 1e-7, 1e-5, 1.0, BOUNDS.temperature_max, 2.0000002, 3.4e38]),
)
int32s = st.one_of(st.integers(*INT32), st.sampled_from([*INT32, -1, 0, 1, 2, 31, 32, 33, 63, 64, 99, 100]))


@st.composite
def inputs(draw, req: serving_pb2.GenerateRequest, sane_or_wild: Mix) -> None:
    kinds = ["text", "chat", "token_ids", "limit"] + (["none"] if sane_or_wild.wild else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "text":
        req.text = draw(sane_or_wild(ascii_text.filter(bool), any_text))
    elif kind == "limit":            # prompts around the context limit (max_seq_len 64)
        req.text = draw(st.sampled_from("ABz~")) * draw(st.integers(60, 66))
    elif kind == "chat":
        roles = sane_or_wild(st.sampled_from(["system", "user", "assistant", "tool"]),
                             st.sampled_from(["", "robot", "USER", "usér"]))
        msgs = draw(st.lists(st.tuples(roles, sane_or_wild(ascii_text, any_text)), min_size=1, max_size=3))
        req.chat.SetInParent()
        req.chat.messages.extend(serving_pb2.ChatMessage(role=r, content=c) for r, c in msgs)
    elif kind == "token_ids":
        req.token_ids.SetInParent()
        ids = sane_or_wild(st.integers(0, 99), int32s)
        size = st.sampled_from([0, 8, 70]) if sane_or_wild.wild else st.just(8)
        least = 0 if sane_or_wild.wild else 1
        req.token_ids.ids.extend(draw(st.lists(ids, min_size=least, max_size=draw(size))))


class Mix:
    """Half the requests take in-bounds values only (so many examples reach generation); the other half
    take, field by field, mostly in-bounds values and sometimes anything the wire carries."""

    def __init__(self, wild: bool):
        self.wild = wild

    def __call__(self, sane, wild):
        return st.one_of(sane, sane, sane, wild) if self.wild else sane


@st.composite
def requests(draw) -> serving_pb2.GenerateRequest:
    req = serving_pb2.GenerateRequest()
    sane_or_wild = Mix(draw(st.booleans()))
    draw(inputs(req, sane_or_wild))
    s, sp = req.sampling, req.speculation
    optional = {
        "temperature": sane_or_wild(st.sampled_from([0.0, 0.0, 0.7, BOUNDS.temperature_max]), floats),
        "top_p": sane_or_wild(st.floats(0.0625, 1.0, width=32), floats),
        "top_k": sane_or_wild(st.integers(0, 120), int32s),
        "max_new_tokens": sane_or_wild(st.integers(1, BOUNDS.max_new_tokens_cap), int32s),
        "seed": st.one_of(st.integers(0, UINT64_MAX), st.sampled_from([0, 1, 2**63, UINT64_MAX])),
    }
    for name, strategy in optional.items():
        if draw(st.booleans()):
            setattr(s, name, draw(strategy))
    # overlapping stop strings ("CD" inside "BCDE"), unicode ones, empty and over-long ones
    sane_stop = st.one_of(ascii_text.filter(bool), st.sampled_from(["CD", "BCDE", "DE", "D", "EFG", "é"]))
    stop_item = sane_or_wild(sane_stop, st.one_of(any_text, st.sampled_from(["", "x" * 257])))
    size = st.sampled_from([3, 18]) if sane_or_wild.wild else st.just(3)
    s.stop.extend(draw(st.lists(stop_item, max_size=draw(size))))
    s.ignore_eos = draw(st.booleans())
    spec = {"enabled": st.booleans(), "gamma": sane_or_wild(st.integers(0, BOUNDS.gamma_max), int32s),
            "tree_width": sane_or_wild(st.integers(1, BOUNDS.tree_width_max), int32s)}
    for name, strategy in spec.items():
        if draw(st.booleans()):
            setattr(sp, name, draw(strategy))
    sp.gamma_policy = draw(sane_or_wild(st.sampled_from(["", *sorted(BOUNDS.policies)]), any_text))
    wild_id = st.one_of(any_text, st.just("r" * 129))
    req.request_id = draw(sane_or_wild(st.sampled_from(["", "client-1"]), wild_id))
    return req


# ---- the oracle ------------------------------------------------------------------------------------

def expected(req: serving_pb2.GenerateRequest) -> tuple[grpc.StatusCode, str | None]:
    """What the server must answer: INVALID_ARGUMENT with the validator's message, else OK and, for a
    greedy request, its exact text. Any other exception out of validation is a bug in it."""
    try:
        valid = validate_request(req, BOUNDS, CODEC)
    except InvalidRequest as exc:
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if valid.sampling.temperature > 0:
        return grpc.StatusCode.OK, None      # the fake target ignores sampling, but do not rely on it
    eos = None if valid.ignore_eos else EOS
    text = CODEC.decode(target_only(valid.prompt_token_ids, valid.max_new_tokens, eos))
    cut = first_stop(text, valid.stop)
    return grpc.StatusCode.OK, text if cut is None else text[:cut]


class Canary:
    """Another client's well-formed requests, looping while the fuzzed request runs."""

    def __init__(self, client: SpecdClient):
        self.client, self.errors, self.done = client, [], 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stop.is_set():
            try:
                out = self.client.generate(text="A", max_new_tokens=6, gamma=3)
                if out.text != "BCDEFG":
                    self.errors.append(f"wrong output {out.text!r}")
            except grpc.RpcError as exc:
                self.errors.append(f"{exc.code()}: {exc.details()}")
            self.done += 1

    def __enter__(self) -> Canary:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        while self.done == 0 and self.thread.is_alive() and not self.errors:
            time.sleep(0.002)            # at least one canary request overlaps every example
        self.stop.set()
        self.thread.join(timeout=30)
        assert not self.errors, self.errors


def call(client: SpecdClient, req: serving_pb2.GenerateRequest, stream: bool):
    try:
        if stream:
            msgs = list(client.stub.GenerateStream(req, timeout=30))
            assert msgs and msgs[-1].HasField("final") and all(m.HasField("delta") for m in msgs[:-1])
            return grpc.StatusCode.OK, "".join(m.delta.text for m in msgs[:-1]) + msgs[-1].final.text, ""
        resp = client.stub.Generate(req, timeout=30)
        return grpc.StatusCode.OK, resp.text, ""
    except grpc.RpcError as exc:
        return exc.code(), None, exc.details()


# ---- properties ------------------------------------------------------------------------------------

@FUZZ
@given(req=requests(), stream=st.booleans())
def test_any_request_gets_the_right_status_and_others_go_on(server, req, stream) -> None:
    want_code, want = expected(req)
    with Canary(server["client"]):
        code, text, details = call(server["client"], req, stream)
    event(f"status {code.name}")
    assert code in ALLOWED, (code, details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return                           # admission queue full: allowed, nothing else to check
    assert code == want_code, (code, details, want)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert details == want
    elif want is not None:
        assert text == want
    wait_idle(server, "a finished request")


@FUZZ
@given(prompt=ascii_text.filter(bool), n=st.integers(1, 32), after=st.integers(0, 12),
       gamma=st.integers(0, 6), before_first=st.booleans())
def test_cancel_at_any_time_frees_slots(server, prompt, n, after, gamma, before_first) -> None:
    with Canary(server["client"]):
        call_ = server["client"].stub.GenerateStream(
            build_request(text=prompt, max_new_tokens=n, gamma=gamma), timeout=30)
        if not before_first:
            for i, _ in enumerate(call_):
                if i >= after:
                    break
        call_.cancel()
    wait_idle(server, "a cancel")


def test_huge_request_is_resource_exhausted_and_server_survives(server) -> None:
    """A message over gRPC's 4 MiB receive limit is refused by the transport, before any parsing."""
    c = server["client"]
    with pytest.raises(grpc.RpcError) as err:
        c.generate(text="A" * (5 * 2**20))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as err:      # under the limit, over the context: a clear refusal
        c.generate(text="A" * (2**20))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt has" in err.value.details()
    assert c.generate(text="A", max_new_tokens=3).text == "BCD"
    assert c.health() == "SERVING"


def test_cancelled_stream_frees_slots_within_100ms(server) -> None:
    """A client that drops its stream: the request is aborted and its KV slots freed. The time from the
    cancel to the fake target holding no slot is measured over a few trials; the median must be under
    100 ms (one trial can be slow on a loaded CI machine, so not each)."""
    target, c = server["target"], server["client"]
    times = []
    for _ in range(5):
        call_ = c.stub.GenerateStream(build_request(text="A", max_new_tokens=32, gamma=2), timeout=30)
        next(iter(call_))
        assert target.running
        t0 = time.perf_counter()
        call_.cancel()
        while target.running:
            assert time.perf_counter() - t0 < 10, "slots never freed"
            time.sleep(0.0005)
        times.append(time.perf_counter() - t0)
        wait_idle(server, "a cancel")
    times.sort()
    # a fake step takes about a millisecond, so 0.1 s is ~100 steps of margin; the median of five
    # tolerates two stalls of a loaded machine
    assert times[len(times) // 2] < 0.1, f"cancel-to-free times {times}"


@FUZZ
@given(start=st.integers(30, 40), n=st.integers(0, 30), stop=st.lists(st.sampled_from(
    ["CD", "BCDE", "DE", "D", "EFG", "DEFGH", "EF", "~", "!"]), min_size=1, max_size=4), cuts=st.data())
def test_stop_strings_cut_the_same_whatever_the_step_sizes(start, n, stop, cuts) -> None:
    """Overlapping stop strings: where the text ends must not depend on how many tokens each step
    brought (speculation is lossless, so its step sizes must not show in the output)."""
    ids = target_only([start], n, eos=None)     # text like the fake target's: "BCDEFG..." from some letter
    def run(chunks: list[list[int]]) -> str:
        ts = TextStream(CODEC, tuple(stop))
        out = "".join(ts.push(c) for c in chunks)
        return out + ts.flush()

    one_by_one = run([[t] for t in ids])
    bounds = sorted(cuts.draw(st.sets(st.integers(1, max(len(ids) - 1, 1)), max_size=5)))
    edges = [0, *bounds, len(ids)]
    assert run([ids[a:b] for a, b in zip(edges, edges[1:], strict=False)]) == one_by_one
    assert run([ids]) == one_by_one
