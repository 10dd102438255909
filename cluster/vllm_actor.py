"""One target replica of `specd serve target.backend=vllm`: a Ray actor running a vLLM engine with specd's
drafter as its custom_class proposer (workers/engine/vllm_engine.py, workers/engine/vllm_proposer.py).

Why a step thread over VllmEngine rather than the router driving steps. vLLM schedules itself (continuous
batching, its paged KV cache, its rejection sampler): the router can only add requests, abort them and
read what each engine step emitted. The actor therefore steps the engine on its own thread whenever a
request is live, and the router long-polls `poll()` for the events (emitted tokens; a request's end with its
RequestStats and each step's Draft and VerifyResult, which VllmEngine aligns from vLLM's per-request
counters and the proposer's filed drafts).
Everything that touches the engine holds one lock, so submit() and abort() land between two steps.

The engine core runs in this actor's process (VLLM_ENABLE_V1_MULTIPROCESSING=0): vLLM's spawned engine
process needs an `if __name__ == "__main__"` guard that a Ray worker's entry point does not have, and the
proposer then lives here too, beside the engine.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

from specd.workers.core.stats import RequestStats
from specd.workers.engine.types import Draft, FinishReason, NewRequest, VerifyResult

log = logging.getLogger(__name__)


@dataclass
class TokensOut:
    request_id: str
    tokens: list[int]                    # emitted (already cut at EOS, stop ids and max_new_tokens)


@dataclass
class FinishOut:
    request_id: str
    reason: str                          # a FinishReason value
    stats: RequestStats
    steps: list[tuple[Draft, VerifyResult]] = field(default_factory=list)   # each step after the prefill
    drafter_version: str | None = None
    error: str = ""


class VllmTarget:
    """The actor's class (wrapped with ray.remote by the scheduler's bring-up); usable in-process too."""

    def __init__(self, cfg, teacher_topk: int = 0, versions: str | dict | None = None):
        """versions: the published version store the proposer's drafter follows (None: it keeps its own)."""
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from specd.workers.engine.vllm_engine import VllmEngine

        speculation = cfg.target.vllm_speculation if cfg.spec.enabled else None
        self.engine = VllmEngine(cfg, speculation=speculation, teacher_topk=teacher_topk, versions=versions)
        self._lock = threading.Condition()            # the engine and the live set
        self._events: list[TokensOut | FinishOut] = []
        self._events_cv = threading.Condition()
        self._records: dict[str, list[tuple[Draft, VerifyResult]]] = {}
        self._closed = False
        self.steps = 0
        self.busy_s = 0.0
        self.failed = ""
        self._thread = threading.Thread(target=self._loop, name="vllm-steps", daemon=True)
        self._thread.start()

    # ---- the router's calls ---------------------------------------------------------------------
    def info(self) -> dict:
        return {**self.engine.info(), "load_s": self.engine.load_s, "profile_s": self.engine.profile_s}

    def submit(self, requests: list[NewRequest], ignore_eos: bool = False) -> None:
        with self._lock:
            self.engine.submit(requests, ignore_eos)
            self._lock.notify_all()

    def abort(self, request_ids: list[str]) -> None:
        """Frees the requests' vLLM slots and KV blocks at once. A FinishOut (CANCELLED) follows for each
        request that was still live, carrying its step records: a request cut short by a stop string, a
        cancel or a deadline leaves its training signal too, as one that ends at EOS does."""
        with self._lock:
            wanted = set(request_ids)
            live = {rid: seq for rid, seq in self.engine.live().items() if rid in wanted}
            self.engine.abort(request_ids)
            ended = [FinishOut(rid, str(FinishReason.CANCELLED), seq.stats, self._records.pop(rid, []),
                               self.engine.version()) for rid, seq in live.items()]
            for rid in request_ids:
                self._records.pop(rid, None)
        self._emit(ended)

    def poll(self, timeout_s: float = 0.5) -> list[TokensOut | FinishOut]:
        """The events since the last poll; waits up to timeout_s for the first one."""
        with self._events_cv:
            if not self._events:
                self._events_cv.wait(timeout_s)
            events, self._events = self._events, []
        return events

    def stats(self) -> dict:
        """Live counts: requests this actor tracks and vLLM's own unfinished count (a cancelled stream's
        request must leave both)."""
        with self._lock:
            return {
                "running": len(self.engine.live()),
                "vllm_unfinished": self.engine.llm.llm_engine.get_num_unfinished_requests(),
                "steps": self.steps,
                "busy_s": self.busy_s,
                "drafter_version": self.engine.version(),
                "swaps": self.engine.swap_stats(),
                "speculation": self.engine.mode,
                "failed": self.failed,
            }

    def load_drafter(self, path: str) -> str:
        """Hot swap: the proposer loads these weights before its next proposal (vLLM's own draft model:
        at once, between two steps)."""
        with self._lock:
            return self.engine.load_drafter(path)

    def close(self) -> None:
        self._closed = True
        with self._lock:
            self._lock.notify_all()
        self._thread.join(timeout=30)
        self.engine.close()

    # ---- the step thread ------------------------------------------------------------------------
    def _emit(self, events: list) -> None:
        if events:
            with self._events_cv:
                self._events += events
                self._events_cv.notify_all()

    def _loop(self) -> None:
        while not self._closed:
            with self._lock:
                while not self._closed and not self.engine.has_unfinished():
                    self._lock.wait()
                if self._closed:
                    return
                events: list = []
                t0 = time.perf_counter()
                try:
                    finished = self._step(events)
                except Exception as exc:  # a failed step ends every live request, never the actor
                    log.exception("vLLM engine step failed")
                    self.failed = repr(exc)
                    events += self._fail_all(repr(exc))
                    finished = []
                self.busy_s += time.perf_counter() - t0
                self.steps += 1
                for seq in finished:
                    reason = seq.finish_reason or FinishReason.CANCELLED
                    events.append(FinishOut(seq.request_id, str(reason), seq.stats,
                                            self._records.pop(seq.request_id, []), self.engine.version()))
            self._emit(events)

    def _step(self, events: list) -> list:
        def on_step(seq, emitted):
            events.append(TokensOut(seq.request_id, list(emitted)))

        def on_record(seq, draft, result):
            self._records.setdefault(seq.request_id, []).append((draft, result))

        return self.engine.step(on_step, on_record)

    def _fail_all(self, error: str) -> list[FinishOut]:
        ids = list(self.engine.live())
        try:
            self.engine.abort(ids)
        except Exception:  # the engine is broken already; the router still gets the ends
            log.exception("abort after a failed step failed")
            self.engine.forget_all()
        return [FinishOut(rid, str(FinishReason.ERROR), RequestStats(), error=error) for rid in ids]
