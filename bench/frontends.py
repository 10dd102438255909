"""`specd bench frontends`: what a streamed token costs through the HTTP API against gRPC.

Both front ends sit over one serving core (cluster/serving.py); this bench measures what each adds to a
streamed token between the scheduler handing it out and a client reading it. The server runs in a child
process with the real front ends and serving core over a scripted scheduler: each request emits one
token every `--interval-ms`, and each token's id is the server's monotonic clock in microseconds at
emission, which a stand-in codec decodes to text ("%010d;"). The client (this process, one asyncio
loop: grpc.aio for gRPC, aiohttp reading Server-Sent Events for HTTP) parses each token's emission
time out of the text it receives, so the latency of every token is measured on one clock
(CLOCK_MONOTONIC is shared by the processes of a machine) with no model in the way.

Cells: each front end at each client count; gRPC and HTTP cells alternate within a round, and the
medians of `--rounds` rounds are reported with the added latency (HTTP minus gRPC median) per count.

    specd bench frontends --clients 1,16 --json bench/results/frontends.json \
        --plot bench/results/frontends.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

WRAP = 2**31                       # token ids are int32: the clock in µs modulo this


def _now_us() -> int:
    return int(time.perf_counter() * 1e6) % WRAP


class ClockCodec:
    """Token ids are emission times; text is their fixed-width decimal form, one per token."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode("".join(m["content"] for m in messages))

    def decode(self, token_ids: list[int]) -> str:
        return "".join(f"{t:010d};" for t in token_ids)


class ScriptedScheduler:
    """What the serving core asks of a scheduler (submit, abort, admission, liveness): every request
    emits `tokens` one-token events, `interval` seconds apart, each id the clock at emission."""

    def __init__(self, interval: float):
        self.interval = interval
        self.tasks: dict[str, asyncio.Task] = {}

    def submit(self, new, *, ignore_eos: bool = False):
        from specd.cluster.requests import FinishEvent, ServedStats, TokensEvent
        from specd.workers.engine.types import FinishReason

        queue: asyncio.Queue = asyncio.Queue()
        stats = ServedStats(prompt_tokens=len(new.prompt_token_ids), arrival=time.perf_counter())

        async def emit() -> None:
            for _ in range(new.max_new_tokens):
                await asyncio.sleep(self.interval)
                queue.put_nowait(TokensEvent([_now_us()]))
            stats.finished_at = time.perf_counter()
            queue.put_nowait(FinishEvent(FinishReason.LENGTH, stats))

        self.tasks[new.request_id] = asyncio.get_running_loop().create_task(emit())
        return _Handle(new.request_id, queue)

    def abort(self, request_id: str, reason=None) -> None:
        task = self.tasks.pop(request_id, None)
        if task is not None:
            task.cancel()

    def loops_alive(self) -> bool:
        return True

    def can_admit(self) -> bool:
        return True


class _Handle:
    def __init__(self, request_id: str, queue: asyncio.Queue):
        self.request_id, self.queue, self.done = request_id, queue, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        from specd.cluster.requests import FinishEvent

        if self.done:
            raise StopAsyncIteration
        event = await self.queue.get()
        self.done = isinstance(event, FinishEvent)
        return event


def _serve(interval: float, ports, stop) -> None:
    """The child: gRPC and HTTP front ends over one core and the scripted scheduler."""
    from specd.cluster.http_api import HttpApi, HttpServer
    from specd.cluster.router import GrpcServer, SpecdServicer
    from specd.cluster.serving import Backend, ServingCore
    from specd.cluster.validation import Bounds

    async def main() -> None:
        core = ServingCore()
        grpc_srv = GrpcServer(SpecdServicer(core), port=0)
        await grpc_srv.start()
        http = HttpServer(HttpApi(core), "127.0.0.1", 0)
        await http.start()
        bounds = Bounds(vocab_size=WRAP, max_seq_len=4096, max_new_tokens_cap=1024)
        backend = Backend(ScriptedScheduler(interval), ClockCodec(), bounds, "clock", (), 1, 1, 64)
        await grpc_srv.attach(backend)
        ports.put((grpc_srv.port, http.port))
        while not stop.is_set():
            await asyncio.sleep(0.1)
        await http.stop()
        await grpc_srv.stop(0)

    asyncio.run(main())


def _latencies_us(text: str, arrival_us: int) -> list[int]:
    return [(arrival_us - int(t)) % WRAP for t in text.split(";") if t]


async def _grpc_request(address: str, tokens: int) -> list[int]:
    import grpc

    from specd.proto.specd.v1 import serving_pb2, serving_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = serving_pb2_grpc.SpecdStub(channel)
        request = serving_pb2.GenerateRequest(text="go", sampling=serving_pb2.SamplingOptions(
            max_new_tokens=tokens, ignore_eos=True))
        out: list[int] = []
        async for msg in stub.GenerateStream(request):
            if msg.HasField("delta"):
                out += _latencies_us(msg.delta.text, _now_us())
        return out


async def _http_request(session, url: str, tokens: int) -> list[int]:
    body = {"prompt": "go", "max_tokens": tokens, "ignore_eos": True, "stream": True}
    out: list[int] = []
    async with session.post(f"{url}/v1/completions", json=body) as response:
        async for line in response.content:
            if line.startswith(b"data: {"):
                arrival = _now_us()
                out += _latencies_us(json.loads(line[6:])["choices"][0]["text"], arrival)
    return out


async def _cell(front: str, clients: int, requests: int, tokens: int, ports: tuple[int, int]) -> list[int]:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async def client() -> list[int]:
            got: list[int] = []
            for _ in range(requests):
                got += (await _grpc_request(f"127.0.0.1:{ports[0]}", tokens) if front == "grpc"
                        else await _http_request(session, f"http://127.0.0.1:{ports[1]}", tokens))
            return got

        per_client = await asyncio.gather(*[client() for _ in range(clients)])
    return [x for c in per_client for x in c]


def run_bench(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from specd.bench.report import write_json

    ctx = multiprocessing.get_context("spawn")
    ports_q, stop = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_serve, args=(args.interval_ms / 1e3, ports_q, stop), daemon=True)
    child.start()
    rows: list[dict[str, Any]] = []
    try:
        ports = ports_q.get(timeout=60)
        cells = [(r, n, f) for r in range(args.rounds) for n in args.clients for f in ("grpc", "http")]
        for rnd, clients, front in tqdm(cells, desc="frontends", unit="cell"):
            lat = asyncio.run(_cell(front, clients, args.requests, args.tokens, ports))
            rows.append({"round": rnd, "front_end": front, "clients": clients, "tokens": len(lat),
                         "median_ms": statistics.median(lat) / 1e3,
                         "p90_ms": statistics.quantiles(lat, n=10)[-1] / 1e3})
    finally:
        stop.set()
        child.join(10)
    summary = []
    for clients in args.clients:
        med = {f: statistics.median(r["median_ms"] for r in rows if r["clients"] == clients
                                    and r["front_end"] == f) for f in ("grpc", "http")}
        p90 = {f: statistics.median(r["p90_ms"] for r in rows if r["clients"] == clients
                                    and r["front_end"] == f) for f in ("grpc", "http")}
        summary.append({"clients": clients, "grpc_median_ms": round(med["grpc"], 3),
                        "http_median_ms": round(med["http"], 3),
                        "http_added_ms": round(med["http"] - med["grpc"], 3),
                        "grpc_p90_ms": round(p90["grpc"], 3), "http_p90_ms": round(p90["http"], 3)})
        print(f"{clients:3d} clients: a streamed token's latency, median of {args.rounds} rounds: "
              f"gRPC {med['grpc']:.3f} ms, HTTP {med['http']:.3f} ms "
              f"(added {med['http'] - med['grpc']:+.3f} ms); "
              f"p90 gRPC {p90['grpc']:.3f}, HTTP {p90['http']:.3f}")
    meta = {"bench": "frontends", "interval_ms": args.interval_ms, "tokens": args.tokens,
            "requests_per_client": args.requests, "rounds": args.rounds, "machine": platform.machine(),
            "cpus": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()],
            "summary": summary, "date": time.strftime("%Y-%m-%d")}
    if args.json:
        print(f"wrote {write_json(args.json, rows, meta)}")
    if args.plot:
        print(f"wrote {write_plot(Path(args.plot), summary)}")
    return 0


def write_plot(path: Path, summary: list[dict[str, Any]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from specd.bench.report import save_figure

    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(summary))
    for offset, front in ((-0.2, "grpc"), (0.2, "http")):
        ax.bar([x + offset for x in xs], [s[f"{front}_median_ms"] for s in summary], width=0.38,
               label=f"{front} (median)")
        ax.scatter([x + offset for x in xs], [s[f"{front}_p90_ms"] for s in summary], marker="_", s=200,
                   color="black")
    ax.set_xticks(list(xs), [f"{s['clients']} client(s)" for s in summary])
    ax.set_ylabel("ms from emission to the client")
    ax.set_title("Streamed token latency by front end (bar: median, tick: p90)", fontsize=10)
    ax.legend()
    return save_figure(fig, path)


def _csv_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", type=_csv_ints, default=[1, 16], help="concurrent streams (1,16)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--requests", type=int, default=4, help="requests per client per cell")
    parser.add_argument("--interval-ms", type=float, default=5.0, help="ms between a request's tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
