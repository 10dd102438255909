"""A Ray actor's calls carried by a compiled graph: about 0.25 ms a round trip where `.remote` costs ~1.

Why: a router step at batch 1 makes two actor calls in sequence (propose on the drafter, then verify
on the target), and on a host a plain actor call costs about a millisecond of Ray's own work (task
submission, the raylet-free direct transport, the object's owner bookkeeping), which is a GPU step's
size ([docs/overhead.md](../docs/overhead.md)). A compiled graph (`ray.dag`, "Compiled Graphs") sets
up once a shared-memory channel to a loop running in the actor and then passes each call's arguments
and result through it. Decision record: docs/decisions/compiled-actor-calls.md.

How:
- The actor class is served through `serialised(cls)`: every public method takes one lock, and
  `specd_dispatch((method, args, kwargs))` runs any of them. The graph's loop runs its method on a
  thread of its own while plain `.remote` calls (admin, the online trainer's version follow-up) still
  run on the actor's main thread; the lock keeps the workers' one-call-at-a-time invariant.
- `CompiledCalls` is a handle transport (workers/engine/handles.py): once the actor has answered a plain
  call (so its constructor, which may load a model for minutes, is done) it compiles the graph
  `InputNode -> actor.specd_dispatch` and sends the handle's later step calls (STEP_CALLS) through it,
  from one thread of its own (a compiled graph is driven synchronously; the router's event loop awaits that
  thread). Only when the actor lives on the caller's node: shared memory is what makes it fast.
- The cost: Ray 2.60's channel reads spin. The actor's loop burns a CPU core while it waits for a
  call, and so does the caller's thread while it waits for a result (measured here: an idle actor
  with a compiled graph used 1.0 CPU-second per second, 0.007 without). On a GPU host with cores to
  spare that buys ~0.7 ms per call; on this 2-core machine the spinning loops take CPU from the
  workers themselves. Hence opt-in (`ray.compiled_calls`), and a graph idle for `idle_s` is torn down
  so an idle server does not spin.

Failures keep `.remote`'s meaning, which the scheduler's fault handling reads: an exception the method
raised comes back as a RayTaskError that is also an instance of its cause, and the graph stays. A dead or
unreachable actor raises RayActorError (ActorUnavailableError); the graph is torn down, the handle's
calls go plain, and the graph is compiled again after a plain call succeeds RECOMPILE_AFTER_S later (a
restarted actor).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

log = logging.getLogger(__name__)
RECOMPILE_AFTER_S = 5.0      # a graph that broke is not compiled again sooner
TEARDOWN_TIMEOUT_S = 10.0    # close() waits this long for the graph's loop to stop
IDLE_TEARDOWN_S = 10.0       # a graph without step calls this long is torn down (its loops spin)
# The calls of a step and of a request's start and end: the graph carries these. Everything else
# (stats polls, probes, set-up, version follow-up) stays a plain call and does not keep a graph up.
STEP_CALLS = frozenset({"start", "prepare", "propose", "verify", "release"})


def serialised(cls: type) -> type:
    """`cls` with every public method under one lock, and `specd_dispatch` to call any of them.

    A subclass, so the worker classes stay free of Ray; the name is kept (Ray names actors by class).
    """

    def locked(fn):
        @functools.wraps(fn)
        def run(self, *args, **kwargs):
            with self._specd_lock:
                return fn(self, *args, **kwargs)

        return run

    def __init__(self, *args, **kwargs):
        self._specd_lock = threading.RLock()
        cls.__init__(self, *args, **kwargs)

    def specd_dispatch(self, call: tuple[str, tuple, dict]) -> Any:
        method, args, kwargs = call
        if method.startswith("_") or method == "specd_dispatch":
            raise AttributeError(f"{cls.__name__} has no public method {method!r}")
        return getattr(self, method)(*args, **kwargs)

    def specd_node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    namespace: dict[str, Any] = {
        "__init__": __init__, "specd_dispatch": specd_dispatch, "specd_node_id": specd_node_id,
        "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
    }
    for name, fn in inspect.getmembers(cls, inspect.isfunction):
        if not name.startswith("_"):
            namespace[name] = locked(fn)
    return type(cls.__name__, (cls,), namespace)


class CompiledCalls:
    """A handle transport: the actor's calls through a compiled graph, plain `.remote` until it is up
    and whenever it is down (see the module's docstring)."""

    def __init__(self, actor: Any, name: str, idle_s: float = IDLE_TEARDOWN_S):
        """idle_s > 0: tear the graph down after that long without a call (its loops spin; see the
        module's docstring) and compile it again, in the background, when calls come back."""
        self.actor, self.name = actor, name
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-graph")
        self._dag: Any = None
        self._compiling = False
        self._local: bool | None = None          # the actor is on this node (asked once)
        self._broken_at: float | None = None      # when the graph last broke
        self._closed = False
        self.compiled_calls = 0                   # calls the graph carried (tests, stats)
        self.compiles = 0
        self.idle_s = idle_s
        self._last_call = time.monotonic()
        self._stop = threading.Event()
        if idle_s > 0:
            threading.Thread(target=self._watch_idle, name=f"{name}-graph-idle", daemon=True).start()

    @property
    def compiled(self) -> bool:
        return self._dag is not None

    async def call(self, method: str, args: tuple, kwargs: dict) -> Any:
        if method not in STEP_CALLS:          # stats, probes, set-up: plain, and not activity
            return await getattr(self.actor, method).remote(*args, **kwargs)
        self._last_call = time.monotonic()
        if self._dag is not None:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor, self._through_graph, (method, args, kwargs))
        result = await getattr(self.actor, method).remote(*args, **kwargs)
        if self._should_compile():
            # compiling takes 0.3-2 s here: it runs on the graph's thread while calls go on plain
            self._compiling = True
            self._executor.submit(self._compile)
        return result

    async def compile_now(self) -> bool:
        """Compile the graph if it is due, and wait for it; True when it is up."""
        if self._should_compile():
            self._compiling = True
            await asyncio.get_running_loop().run_in_executor(self._executor, self._compile)
        return self.compiled

    def _should_compile(self) -> bool:
        if self._dag is not None or self._compiling or self._closed or self._local is False:
            return False
        return self._broken_at is None or time.monotonic() - self._broken_at >= RECOMPILE_AFTER_S

    def _compile(self) -> None:
        import ray
        from ray.dag import InputNode

        try:
            if self._closed:
                return
            if self._local is None:
                here = ray.get_runtime_context().get_node_id()
                self._local = ray.get(self.actor.specd_node_id.remote()) == here
                if not self._local:
                    log.info("%s: actor on another node; its calls stay plain Ray calls", self.name)
                    return
            with InputNode() as call:
                dag = self.actor.specd_dispatch.bind(call)
            self._dag = dag.experimental_compile()
            # the idle clock starts when the graph is up: compiling can take longer than idle_s,
            # and a graph torn down as it arrives would be compiled again on the next call
            self._last_call = time.monotonic()
            self.compiles += 1
            log.debug("%s: calls through a compiled graph", self.name)
        except Exception as exc:  # the actor went away meanwhile: stay plain, try again later
            log.warning("%s: compiling its calls failed (%r); they stay plain Ray calls", self.name, exc)
            self._broken_at = time.monotonic()
        finally:
            self._compiling = False

    def _through_graph(self, call: tuple[str, tuple, dict]) -> Any:
        import ray
        from ray.exceptions import RayTaskError

        dag = self._dag
        if dag is None:                       # broke while this call waited for the thread
            method, args, kwargs = call
            return ray.get(getattr(self.actor, method).remote(*args, **kwargs))
        try:
            result = ray.get(dag.execute(call), timeout=-1)
        except RayTaskError:
            self.compiled_calls += 1
            raise                             # the method's own exception: the graph is fine
        except Exception as exc:
            log.warning("%s: compiled graph broke (%s); calls go plain Ray calls", self.name,
                        type(exc).__name__)
            self._teardown()
            self._broken_at = time.monotonic()
            raise
        self.compiled_calls += 1
        return result

    def _watch_idle(self) -> None:
        while not self._stop.wait(self.idle_s / 2):
            if self._dag is not None and time.monotonic() - self._last_call >= self.idle_s:
                with contextlib.suppress(RuntimeError):      # the executor shut down meanwhile
                    self._executor.submit(self._teardown_if_idle)

    def _teardown_if_idle(self) -> None:
        if time.monotonic() - self._last_call >= self.idle_s:
            log.debug("%s: idle for %.0f s; graph torn down until calls come back", self.name, self.idle_s)
            self._teardown()

    def _teardown(self) -> None:
        dag, self._dag = self._dag, None
        if dag is not None:
            with contextlib.suppress(Exception):     # a dead actor's loop is gone already
                dag.teardown()

    def close(self) -> None:
        """Tear the graph down (before the actor is killed, so its loop ends cleanly)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        try:
            self._executor.submit(self._teardown).result(timeout=TEARDOWN_TIMEOUT_S)
        except Exception as exc:  # a call still blocked on a hung actor: Ray's exit hook tears down
            log.warning("%s: graph teardown did not finish: %r", self.name, exc)
        self._executor.shutdown(wait=False, cancel_futures=True)


async def wait_compiled(handles: list[Any], timeout_s: float = 60.0) -> None:
    """Until every handle with a CompiledCalls transport has its graph up (benches and tests that must
    measure or exercise the graph, not the plain calls while it compiles in the background)."""
    transports = [h.transport for h in handles if isinstance(h.transport, CompiledCalls)]
    deadline = time.monotonic() + timeout_s
    while not all([await t.compile_now() for t in transports]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"compiled graphs not up after {timeout_s:.0f} s")
        await asyncio.sleep(0.05)
