"""cluster/compiled_calls.py: a worker's calls through a compiled Ray graph keep `.remote`'s meaning.

The actor is a small worker of this module, shipped to Ray by value (the tests folder is not importable
in Ray's workers); the scheduler over compiled calls is exercised in test_faults.py and
tests/bench/test_overhead.py."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time

import pytest

from specd.cluster import compiled_calls
from specd.cluster.compiled_calls import CompiledCalls, serialised, wait_compiled
from specd.cluster.scheduler import is_dead_actor
from specd.workers.engine.handles import TargetHandle


class Echo:
    """Records which thread ran each call and whether two calls ever overlapped."""

    def __init__(self, delay: float = 0.0):
        self.delay = delay
        self.running = 0
        self.overlapped = False
        self.threads: list[str] = []

    def verify(self, value, times: int = 1):     # a step call: the graph carries it
        if value == "crash":
            os._exit(1)
        self.running += 1
        self.overlapped |= self.running > 1
        self.threads.append(threading.current_thread().name)
        time.sleep(self.delay)
        self.running -= 1
        if value == "bad":
            raise ValueError("bad value")
        return [value] * times

    def busy_seconds(self) -> float:      # the handle's probe (wait_compiled calls it)
        return 0.0

    def seen(self) -> tuple[list[str], bool]:
        return self.threads, self.overlapped


def test_a_serialised_worker_runs_one_call_at_a_time_and_dispatches_public_methods():
    worker = serialised(Echo)(delay=0.02)
    assert type(worker).__name__ == "Echo" and isinstance(worker, Echo)
    threads = [threading.Thread(target=worker.verify, args=(i,)) for i in range(4)]
    threads.append(threading.Thread(target=worker.specd_dispatch, args=(("verify", (9,), {"times": 2}),)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(worker.threads) == 5 and not worker.overlapped
    assert worker.specd_dispatch(("verify", ("x",), {"times": 3})) == ["x", "x", "x"]
    for name in ("_private", "specd_dispatch", "__init__"):
        with pytest.raises(AttributeError, match="no public method"):
            worker.specd_dispatch((name, (), {}))


@pytest.fixture(scope="module")
def ray_echo():
    ray = pytest.importorskip("ray")
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=4, include_dashboard=False, namespace="specd-test-compiled", log_to_driver=False)
    yield ray
    ray.shutdown()


def _handle(ray, idle_s: float = 0.0, **options):
    actor = ray.remote(serialised(Echo)).options(**options).remote()
    return actor, TargetHandle(actor, "verify", "actor", CompiledCalls(actor, "verify", idle_s))


def test_calls_go_through_the_graph_with_remote_semantics(ray_echo):
    actor, handle = _handle(ray_echo)

    async def main():
        assert await handle._call("verify", 1) == [1]              # plain: the graph compiles after it
        await wait_compiled([handle])
        before = handle.transport.compiled_calls
        out = [await handle._call("verify", i, times=2) for i in range(5)]
        with pytest.raises(ValueError, match="bad value"):       # the method's own error, as .remote
            await handle._call("verify", "bad")
        after_error = await handle._call("verify", "ok")           # the graph survived it
        # a plain call while the graph serves must not run at the same time as a graph call
        both = await asyncio.gather(handle._call("verify", "g"), actor.verify.remote("p"))
        carried = handle.transport.compiled_calls
        await handle.busy_seconds()                              # not a step call: stays plain
        return before, out, after_error, both, carried

    try:
        before, out, after_error, both, carried = asyncio.run(main())
        threads, overlapped = ray_echo.get(actor.seen.remote())
        assert out == [[i, i] for i in range(5)] and after_error == ["ok"] and both == [["g"], ["p"]]
        assert carried == handle.transport.compiled_calls == before + 8   # 5, the error, "ok" and "g"
        assert handle.transport.compiles == 1 and handle.transport.compiled
        assert not overlapped
        assert threads[0] == "MainThread" and threads[-3] != "MainThread"   # the graph's own thread
    finally:
        handle.close()
    assert not handle.transport.compiled


def test_an_idle_graph_is_torn_down_and_compiled_again_when_calls_return(ray_echo, monkeypatch):
    _, handle = _handle(ray_echo, idle_s=0.8)

    async def main():
        await handle._call("verify", 1)
        await wait_compiled([handle])
        # idle: the watcher tears the spinning loop down after 0.8 s; polled (not one fixed sleep), so a
        # loaded machine that runs the watcher late only makes this wait longer
        deadline = asyncio.get_running_loop().time() + 60
        while handle.transport.compiled and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
        idle_state = handle.transport.compiled
        assert await handle._call("verify", 2) == [2]               # plain meanwhile
        await wait_compiled([handle])
        return idle_state, await handle._call("verify", 3)

    try:
        idle_state, last = asyncio.run(main())
        assert idle_state is False and last == [3]
        assert handle.transport.compiles == 2
    finally:
        handle.close()


def test_a_dead_actor_raises_as_remote_does_and_calls_go_plain_until_it_is_back(ray_echo, monkeypatch):
    monkeypatch.setattr(compiled_calls, "RECOMPILE_AFTER_S", 0.0)
    actor, handle = _handle(ray_echo, max_restarts=1)

    async def main():
        await handle._call("verify", 1)
        await wait_compiled([handle])
        with pytest.raises(Exception) as died:
            await handle._call("verify", "crash")
        broken = handle.transport.compiled
        deadline, back = time.monotonic() + 60, None
        while time.monotonic() < deadline:        # Ray restarts it; a plain call then answers
            try:
                back = await handle._call("verify", "back")
                break
            except Exception:  # still restarting
                await asyncio.sleep(0.2)
        await wait_compiled([handle])             # and the graph is compiled again on it
        return died.value, broken, back, await handle._call("verify", "again")

    try:
        died, broken, back, again = asyncio.run(main())
        assert is_dead_actor(died)                # what the scheduler's fault handling reads
        assert broken is False and back == ["back"] and again == ["again"]
        assert handle.transport.compiles == 2
    finally:
        handle.close()
