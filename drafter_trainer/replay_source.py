"""Reading the replay stream through a Redis consumer group: at least once, resumable.

A trainer reads with XREADGROUP as consumer `consumer` of group `group`. Entries it has read but not
acknowledged (XACK) stay in its pending list; after a restart it first reads its own pending entries
(id 0) and only then new ones (id >), so nothing it had not finished with is lost. The trainer
acknowledges an entry it trains on only once the update it fed is durable (checkpointed or published,
drafter_trainer/online.py), and at once one it will not train on; the delivery is at least once: a
crash between reading and acknowledging replays the entry.

An entry the trainer cannot use (it fails decode_record's checks) is moved to the dead-letter stream
`<stream>:dead` with its reason and acknowledged in one transaction: it is never read again, and an
operator can inspect it (XRANGE <stream>:dead - +).
"""

from __future__ import annotations

import logging

import redis

log = logging.getLogger(__name__)
RECORD_FIELD = b"r"
REASON_FIELD = b"reason"
ENTRY_FIELD = b"entry"
DEAD_SUFFIX = ":dead"
DEAD_MAXLEN = 10_000            # dead letters kept (approximately, MAXLEN ~): the newest


class ReplaySource:
    def __init__(self, client: redis.Redis, stream: str, group: str, consumer: str):
        self.client = client
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.dead_stream = stream + DEAD_SUFFIX
        self._pending_cursor: str | None = "0"   # None once this consumer's pending list is re-read

    def ensure_group(self) -> None:
        """Create the group at the start of the stream (the stream too) unless it exists."""
        try:
            self.client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def read(self, count: int = 64, block_ms: int = 1000) -> list[tuple[str, bytes]]:
        """Up to `count` (entry id, record bytes): this consumer's pending entries first, then new ones."""
        if self._pending_cursor is not None:
            # id 0 re-reads the pending list from its start; the cursor walks it once
            got = self._read(self._pending_cursor, count, None)
            if got:
                self._pending_cursor = got[-1][0]
                return got
            self._pending_cursor = None
        return self._read(">", count, block_ms)

    def _read(self, start: str, count: int, block_ms: int | None) -> list[tuple[str, bytes]]:
        try:
            reply = self.client.xreadgroup(self.group, self.consumer, {self.stream: start}, count=count,
                                           block=block_ms)
        except redis.ResponseError as exc:
            if "NOGROUP" in str(exc):          # the stream was deleted (e.g. a fresh managed Redis)
                self.ensure_group()
                return []
            raise
        out = []
        for _, entries in reply or []:
            for entry_id, fields in entries:
                eid = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                data = (fields or {}).get(RECORD_FIELD)
                if data is None:
                    # trimmed by MAXLEN while pending: nothing left to train on, acknowledge it away
                    self.ack([eid])
                    continue
                out.append((eid, data))
        return out

    def rewind(self) -> None:
        """Read this consumer's pending list again from its start (after a round that failed half-way)."""
        self._pending_cursor = "0"

    def ack(self, entry_ids: list[str]) -> int:
        if not entry_ids:
            return 0
        return int(self.client.xack(self.stream, self.group, *entry_ids))

    def dead_letter(self, entry_id: str, data: bytes, reason: str) -> None:
        """Move one entry to the dead-letter stream and acknowledge it, atomically (MULTI/EXEC)."""
        pipe = self.client.pipeline(transaction=True)
        pipe.xadd(self.dead_stream, {RECORD_FIELD: data, REASON_FIELD: reason[:1000], ENTRY_FIELD: entry_id},
                  maxlen=DEAD_MAXLEN, approximate=True)
        pipe.xack(self.stream, self.group, entry_id)
        pipe.execute()

    def pending(self) -> int:
        """Entries of the group read but not acknowledged."""
        return int(self.client.xpending(self.stream, self.group)["pending"])
