"""The serving core under every front end: one request from validation to its last token.

The gRPC API (cluster/router.py) and the OpenAI-compatible HTTP API (cluster/http_api.py) are thin
front ends over this module: both hand it a `serving_pb2.GenerateRequest`, both get back the same
events (text deltas, then one final event with the usage) and the same errors, so admission, the
scheduler's queue bound, cancellation, stop strings and incremental detokenization behave alike
whichever protocol a client speaks. A front end maps `ServingError.code` to its own status (gRPC
status codes, HTTP status and OpenAI error types); it never reaches past this module into the scheduler.

Cancellation: the event stream aborts its request when it is closed before its final event (a client
that went away, a deadline, a dropped stream), which frees the request's KV slots at the next step
boundary.
"""

from __future__ import annotations

import asyncio
import enum
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from specd.cluster.metrics import SpecdMetrics
from specd.cluster.requests import RequestHandle
from specd.cluster.scheduler import QueueFull, Scheduler, ServedStats, TokensEvent
from specd.cluster.validation import Bounds, InvalidRequest, TextCodec, ValidRequest, validate_request
from specd.proto.specd.v1 import serving_pb2
from specd.workers.engine.types import FinishReason, NewRequest

TOKENIZER_THREADS = 4
LOADING = "the server is loading its models"


class ErrorCode(enum.Enum):
    """Why a request was refused or failed; each front end maps these to its own statuses."""

    INVALID_ARGUMENT = "invalid_argument"        # the client's input
    NOT_FOUND = "not_found"                      # a model or resource the server does not have
    RESOURCE_EXHAUSTED = "resource_exhausted"    # the admission queue is full
    UNAVAILABLE = "unavailable"                  # loading, shutting down, or the replica's target died
    INTERNAL = "internal"                        # a worker failed on the request


class ServingError(Exception):
    """A refusal or failure with the message the client sees; `param` names the offending input field
    where one is known (front ends that speak another request format translate it)."""

    def __init__(self, code: ErrorCode, message: str, param: str | None = None):
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


def first_stop(text: str, stop: tuple[str, ...]) -> int | None:
    """Where `text` ends: at the start of the stop string that is completed first reading left to right
    (the earliest end; at equal ends the longer one). Not simply the earliest start: with overlapping
    stop strings that would depend on how many tokens a step happened to bring at once."""
    hits = [(i + len(s), i) for s, i in ((s, text.find(s)) for s in stop) if i >= 0]
    return min(hits)[1] if hits else None


class TextStream:
    """Incremental detokenization with stop strings.

    Text is held back while it ends in an unfinished UTF-8 character (decoded as U+FFFD) or in what
    could be the start of a stop string, so a delta never has to be taken back.
    """

    def __init__(self, codec: TextCodec, stop: tuple[str, ...] = ()):
        self.codec = codec
        self.stop = stop
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0                 # characters of self.text already handed out
        self.stopped = False
        self._hold = max((len(s) for s in stop), default=1) - 1

    def push(self, ids: list[int]) -> str:
        if self.stopped:
            return ""
        self.ids += ids
        text = self.codec.decode(self.ids)
        hit = first_stop(text, self.stop)
        if hit is not None:
            self.stopped = True
            self.text = text[:hit]
            return self.flush()
        self.text = text
        end = len(text)
        while end > self.sent and text[end - 1] == "\ufffd":
            end -= 1
        for k in range(min(self._hold, end - self.sent), 0, -1):
            if any(s.startswith(text[end - k : end]) for s in self.stop):
                end -= k
                break
        delta, self.sent = text[self.sent : end], end
        return delta

    def flush(self) -> str:
        """Everything not handed out yet (at the end of the request)."""
        delta, self.sent = self.text[self.sent :], len(self.text)
        return delta


@dataclass
class Backend:
    """Everything the front ends need once the models are loaded and warm."""

    scheduler: Scheduler
    codec: TextCodec
    bounds: Bounds
    model: str
    eos_token_ids: tuple[int, ...]
    replicas: int
    pipeline_groups: int
    max_queue: int
    metrics: SpecdMetrics | None = None
    config: dict[str, str] = field(default_factory=dict)   # configs.flatten of the running config
    drafters: list = field(default_factory=list)   # DraftWorker handles, for live drafter.version_pin


@dataclass
class DeltaEvent:
    request_id: str                 # the client's id when it sent one, else the server's
    token_ids: list[int]
    text: str                       # may lag the tokens while a UTF-8 character or stop string is open


@dataclass
class FinalEvent:
    request_id: str
    reason: FinishReason            # LENGTH, EOS, STOP or CANCELLED
    stats: ServedStats
    completion_tokens: int          # tokens handed out in deltas (those after a stop string are not)
    text: str                       # text not yet handed out in a delta (normally empty)


class ServingCore:
    """The backend a front end serves through (None while loading) and the request path."""

    def __init__(self, backend: Backend | None = None):
        self.backend = backend
        # Prompts are tokenized off the event loop, so a long one never stalls the streams, and on a few
        # threads, so one slow prompt does not hold up the next request's (validation bounds a prompt's
        # characters first, so each tokenization is short). Concurrent calls are safe: the router never
        # changes the tokenizer's truncation or padding, the only state a fast tokenizer mutates.
        self.tokenizer_pool = ThreadPoolExecutor(max_workers=TOKENIZER_THREADS,
                                                 thread_name_prefix="specd-tokenize")

    def ready(self) -> Backend:
        if self.backend is None:
            raise ServingError(ErrorCode.UNAVAILABLE, LOADING)
        return self.backend

    async def validate(self, request: serving_pb2.GenerateRequest) -> ValidRequest:
        b = self.ready()
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self.tokenizer_pool, validate_request, request, b.bounds, b.codec)
        except InvalidRequest as exc:
            raise ServingError(ErrorCode.INVALID_ARGUMENT, str(exc)) from exc

    async def start(self, request: serving_pb2.GenerateRequest) -> RequestStream:
        """Validate and admit one request. Refusals (bad input, a full queue, loading) raise
        ServingError here, before anything is streamed; the returned stream must be closed."""
        valid = await self.validate(request)
        return self.submit(valid)

    def submit(self, valid: ValidRequest) -> RequestStream:
        b = self.ready()
        rid = uuid.uuid4().hex
        stop_ids = () if valid.ignore_eos else b.eos_token_ids
        new = NewRequest(
            rid, valid.prompt_token_ids, valid.sampling, valid.max_new_tokens, valid.spec, stop_ids,
            domain=valid.domain, replay=not valid.skip_replay,
        )
        try:
            handle = b.scheduler.submit(new, ignore_eos=valid.ignore_eos)
        except QueueFull as exc:
            raise ServingError(ErrorCode.RESOURCE_EXHAUSTED, str(exc)) from exc
        return RequestStream(b, handle, valid.client_request_id or rid, TextStream(b.codec, valid.stop))

    def close(self) -> None:
        self.tokenizer_pool.shutdown(wait=False)


class RequestStream:
    """One admitted request's events: DeltaEvents, then one FinalEvent. A worker failure raises
    ServingError in place of the final event. aclose() (or leaving `async with`) before the final event
    aborts the request, which frees its KV slots: front ends close it in a `finally`, so a client that
    goes away, a deadline or a dropped stream cancels the work behind it."""

    def __init__(self, backend: Backend, handle: RequestHandle, shown_id: str, text: TextStream):
        self.backend, self.handle, self.text = backend, handle, text
        self.request_id = shown_id          # the client's id when it sent one, else the server's
        self.finished = False
        self._sent_tokens = 0

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> DeltaEvent | FinalEvent:
        while not self.finished:
            event = await self.handle.__anext__()
            if isinstance(event, TokensEvent):
                if self.text.stopped:
                    continue          # generated before the abort took effect; never shown
                delta = self.text.push(event.tokens)
                self._sent_tokens += len(event.tokens)
                if self.text.stopped:
                    self.backend.scheduler.abort(self.handle.request_id, FinishReason.STOP)
                return DeltaEvent(self.request_id, event.tokens, delta)
            self.finished = True
            if event.reason == FinishReason.ERROR:
                code = ErrorCode.UNAVAILABLE if event.unavailable else ErrorCode.INTERNAL
                raise ServingError(code, f"generation failed: {event.error}")
            reason = FinishReason.STOP if self.text.stopped else event.reason
            return FinalEvent(self.request_id, reason, event.stats, self._sent_tokens, self.text.flush())
        raise StopAsyncIteration

    async def aclose(self) -> None:
        if not self.finished:
            self.finished = True
            self.backend.scheduler.abort(self.handle.request_id, FinishReason.CANCELLED)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
