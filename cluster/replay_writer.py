"""ReplayWriter: records of finished requests -> a Redis Stream, off the serving path.

`submit()` only puts the record into a bounded queue (never blocks, never raises); one daemon thread
serialises records and XADDs them in pipelined batches with `MAXLEN ~ replay.maxlen`. When Redis is
down or slow the thread's writes fail after `socket_timeout_s`: the batch is dropped, counted, and
logged once per outage; meanwhile the queue fills and further records are dropped at `submit()`.
The thread retries every `retry_s`, and writing resumes by itself when Redis returns. Serving pays
only for a queue put.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time

import redis
from prometheus_client import CollectorRegistry, Counter

from specd.cluster.redis_server import RedisEndpoint
from specd.proto.replay_codec import encode_record
from specd.proto.specd.v1.replay_pb2 import ReplayRecord

log = logging.getLogger(__name__)
RECORD_FIELD = b"r"       # the stream entry's one field: the serialised ReplayRecord
_BATCH = 64


class ReplayWriter:
    def __init__(self, endpoint: RedisEndpoint, stream: str, *, maxlen: int, queue_size: int = 1024,
                 socket_timeout_s: float = 1.0, retry_s: float = 1.0,
                 registry: CollectorRegistry | None = None):
        self.endpoint = endpoint
        self.stream = stream
        self.maxlen = maxlen
        self.retry_s = retry_s
        self.socket_timeout_s = socket_timeout_s
        self._queue: queue.Queue[ReplayRecord | None] = queue.Queue(maxsize=queue_size)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.written = 0
        self.dropped = 0
        self._outage = False          # an outage is being logged already
        registry = registry if registry is not None else CollectorRegistry()
        self._m_written = Counter("specd_replay_records_written", "Replay records written to Redis",
                                  registry=registry)
        self._m_dropped = Counter("specd_replay_records_dropped", "Replay records dropped", ["reason"],
                                  registry=registry)

    # ---- serving side --------------------------------------------------------------------------
    def submit(self, record: ReplayRecord) -> bool:
        """Queue a record; False (and counted as dropped) when the queue is full. Never blocks."""
        try:
            self._queue.put_nowait(record)
            return True
        except queue.Full:
            self._drop(1, "queue_full")
            return False

    # ---- life cycle ----------------------------------------------------------------------------
    def start(self) -> ReplayWriter:
        self._thread = threading.Thread(target=self._run, name="specd-replay-writer", daemon=True)
        self._thread.start()
        return self

    def stop(self, flush_timeout_s: float = 2.0) -> None:
        """Write what is queued (for at most flush_timeout_s), then stop the thread."""
        deadline = time.monotonic() + flush_timeout_s
        while not self._queue.empty() and time.monotonic() < deadline and not self._outage:
            time.sleep(0.01)
        self._stop.set()
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)   # wakes the thread
        if self._thread is not None:
            self._thread.join(timeout=flush_timeout_s + self.socket_timeout_s + 1)

    def pending(self) -> int:
        return self._queue.qsize()

    # ---- the writer thread ---------------------------------------------------------------------
    def _run(self) -> None:
        client: redis.Redis | None = None
        while not self._stop.is_set():
            batch = self._take_batch()
            if not batch:
                continue
            try:
                if client is None:
                    client = self.endpoint.client(socket_timeout=self.socket_timeout_s)
                pipe = client.pipeline(transaction=False)
                for rec in batch:
                    pipe.xadd(self.stream, {RECORD_FIELD: encode_record(rec)}, maxlen=self.maxlen,
                              approximate=True)
                pipe.execute()
            except (redis.RedisError, OSError) as exc:
                self._drop(len(batch), "redis_error")
                if not self._outage:
                    self._outage = True
                    log.warning("replay: Redis unavailable (%s); dropping records until it returns",
                                type(exc).__name__)
                if client is not None:
                    client.close()
                client = None
                self._stop.wait(self.retry_s)
                continue
            if self._outage:
                self._outage = False
                log.info("replay: Redis is back; writing records again (%d dropped so far)", self.dropped)
            with self._lock:
                self.written += len(batch)
            self._m_written.inc(len(batch))
        if client is not None:
            client.close()

    def _take_batch(self) -> list[ReplayRecord]:
        try:
            first = self._queue.get(timeout=0.5)
        except queue.Empty:
            return []
        batch = [] if first is None else [first]
        while len(batch) < _BATCH:
            try:
                rec = self._queue.get_nowait()
            except queue.Empty:
                break
            if rec is not None:
                batch.append(rec)
        return batch

    def _drop(self, n: int, reason: str) -> None:
        with self._lock:
            self.dropped += n
        self._m_dropped.labels(reason=reason).inc(n)

