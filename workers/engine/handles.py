"""Typed, awaitable faces of the two workers, whatever carries the call.

The speculative step (workers/engine/step.py) awaits `TargetHandle` and `DrafterHandle` methods, and
the same method names exist on TargetWorker and DraftWorker. How a call travels is the handle's
`mode`:
- "direct": the worker runs the call at once, in the caller's thread. Nothing ever suspends, so
  the in-process engine drives the step without an event loop (`run_sync`).
- "thread": the worker runs on its own thread (one call at a time, like an actor); the router's
  tests use it to put in-process workers behind the pipelined scheduler.
- "actor": a Ray actor handle; each call is `method.remote(...)`, awaited. Ray is never imported
  here: an actor method is recognised by its `.remote`. A `transport` (cluster/compiled_calls.py)
  may carry an actor's calls instead: any object with `async call(method, args, kwargs)` and
  `close()`; it owns how the call travels and what happens when that way breaks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

import torch

from specd.workers.engine.types import Draft, DraftItem, NewRequest, VerifyResult

T = TypeVar("T")
MODES = ("direct", "thread", "actor")


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine whose awaits all complete at once (handles in "direct" mode) to its end."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("run_sync: the coroutine suspended; only direct-mode handles can be run synchronously")


class _Handle:
    def __init__(self, worker: Any, name: str, mode: str | None = None, transport: Any = None):
        if mode is None:
            mode = "actor" if hasattr(getattr(worker, "release", None), "remote") else "thread"
        if mode not in MODES:
            raise ValueError(f"handle mode must be one of {MODES}, got {mode!r}")
        if transport is not None and mode != "actor":
            raise ValueError(f"a transport carries actor calls only; this handle's mode is {mode!r}")
        self.worker, self.name, self.mode, self.transport = worker, name, mode, transport
        # One thread per in-process worker: its calls are serialised like an actor's, while the target
        # and the drafter still compute at the same time (torch releases the GIL).
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=name) if mode == "thread" else None

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.transport is not None:
            return await self.transport.call(method, args, kwargs)
        fn = getattr(self.worker, method)
        if self.mode == "actor":
            return await fn.remote(*args, **kwargs)
        if self.mode == "thread":
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor, partial(fn, *args, **kwargs))
        return fn(*args, **kwargs)

    async def busy_seconds(self) -> float:
        return float(await self._call("busy_seconds"))

    async def release(self, request_ids: list[str]) -> None:
        await self._call("release", request_ids)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


class TargetHandle(_Handle):
    async def info(self) -> dict:
        return await self._call("info")

    async def start(
        self, requests: list[NewRequest], return_hidden: bool = False
    ) -> tuple[list[list[int]], list[torch.Tensor] | None]:
        """Prefill; returns (first tokens per request, prompt hidden states per request or None)."""
        if return_hidden:
            first, hidden = await self._call("start", requests, return_hidden=True)
            return first, hidden
        return await self._call("start", requests), None

    async def verify(self, drafts: list[Draft], return_hidden: bool = False) -> list[VerifyResult]:
        return await self._call("verify", drafts, return_hidden=return_hidden)

    async def profile_verify(self, batch_sizes: list[int], max_tokens: int,
                             budget_s: float | None = None) -> dict:
        return await self._call("profile_verify", batch_sizes=batch_sizes, max_tokens=max_tokens,
                                budget_s=budget_s)


class DrafterHandle(_Handle):
    async def uses_target_hidden(self) -> bool:
        return bool(await self._call("uses_target_hidden"))

    async def max_slots(self) -> int:
        return int(await self._call("max_slots"))

    async def start(
        self,
        requests: list[NewRequest],
        first_tokens: list[list[int]],
        prompt_hidden: list[torch.Tensor] | None = None,
    ) -> None:
        await self._call("start", requests, first_tokens, prompt_hidden)

    async def prepare(self, items: list[DraftItem]) -> dict:
        return await self._call("prepare", items)

    async def propose(self, items: list[DraftItem]) -> list[Draft]:
        return await self._call("propose", items)

    async def planning_info(self) -> dict:
        return await self._call("planning_info")

    async def profile_drafting(self) -> dict:
        return await self._call("profile_drafting")

    async def watch_versions(self, root: str, target_model_dir: str, poll_s: float = 2.0) -> str:
        """Follow the online trainer's version store (hot-swap between steps); returns the serving version."""
        return str(await self._call("watch_versions", root, target_model_dir, poll_s))

    async def swap_stats(self) -> dict:
        return await self._call("swap_stats")

    async def pin_version(self, version: str | None) -> str:
        return str(await self._call("pin_version", version))
