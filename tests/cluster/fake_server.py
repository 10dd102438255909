"""A router process with fake workers, for the signal tests: `python tests/cluster/fake_server.py GRACE`.

It wires the real pieces `specd serve` uses for shutdown (specd.cluster.serve.SignalStop, GrpcServer.stop with
the grace period, then the scheduler) around the fake workers, and prints its two addresses (the API and
the plaintext health port) once SERVING. Slow fake steps keep requests in flight while a signal lands.
"""

from __future__ import annotations

import asyncio
import sys

from fake_workers import EOS, FakeDrafter, FakeTarget

from specd.cluster.router import Backend, GrpcServer, SpecdServicer
from specd.cluster.scheduler import Scheduler
from specd.cluster.serve import SignalStop
from specd.cluster.validation import Bounds

BOUNDS = Bounds(vocab_size=100, max_seq_len=64, max_new_tokens_default=8, max_new_tokens_cap=60)


class ToyCodec:
    def encode(self, text: str) -> list[int]:
        return [ord(c) - 32 if 32 <= ord(c) < 127 else 31 for c in text]

    def render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode("".join(m["content"] for m in messages))

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(32 + i) for i in token_ids if i < 95)


async def main(grace_s: float) -> int:
    stop = asyncio.Event()
    signals = SignalStop(asyncio.get_running_loop(), stop)
    signals.install()
    target = FakeTarget(max_slots=4, delay=0.03)
    sched = Scheduler([(target, FakeDrafter(target, delay=0.03))], capacity=4, max_queue=8, max_running=4,
                      pipeline_groups=2, eos_token_ids=[EOS])
    await sched.start()
    srv = GrpcServer(SpecdServicer(), port=0, health_port=0)
    await srv.start()
    await srv.attach(Backend(sched, ToyCodec(), BOUNDS, "fake", (EOS,), 1, 2, 8))
    print(srv.address, f"127.0.0.1:{srv.health_port}", flush=True)
    await stop.wait()
    await srv.stop(grace=grace_s)
    await sched.stop()
    signals.remove()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(float(sys.argv[1]))))
