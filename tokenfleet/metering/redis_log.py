"""The usage log in a fleet: one Redis Stream read by a consumer group (the warehouse writers).

Each entry holds one event as JSON in its `event` field. Acked entries are deleted at once (one group reads this
stream), so the stream holds only what is in flight; MAXLEN (approximate) is a backstop against a writer that is
down for good, and must stay well above the backlog you expect, because trimming drops un-acked entries."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from tokenfleet.metering.event import UsageEvent
from tokenfleet.metering.log import Entry, decode, log

FIELD = "event"
RawEntry = tuple[Any, Any]  # (entry id, fields) as redis-py returns them


class RedisStreamLog:
    def __init__(
        self,
        redis: aioredis.Redis,
        stream_key: str = "tokenfleet:usage",
        group: str = "warehouse",
        *,
        maxlen: int = 1_000_000,
        claim_idle_ms: int = 30_000,
        delete_acked: bool = True,
    ) -> None:
        """`redis`: a redis.asyncio client whose socket timeout is longer than the reads' block_ms."""
        if maxlen < 1 or claim_idle_ms < 1:
            raise ValueError("maxlen and claim_idle_ms must be positive")
        self.redis, self.stream_key, self.group = redis, stream_key, group
        self.maxlen, self.claim_idle_ms, self.delete_acked = maxlen, claim_idle_ms, delete_acked
        self._group_ready = False
        self._owns_client = False
        self._resumed: set[str] = set()  # consumers whose own pending entries (from a past life) were re-read
        self._own_cursor: dict[str, str] = {}
        self._claim_cursor, self._claim_at = "0-0", 0.0

    @classmethod
    def from_url(
        cls,
        url: str,
        stream_key: str = "tokenfleet:usage",
        group: str = "warehouse",
        *,
        connect_timeout_s: float = 1.0,
        socket_timeout_s: float = 10.0,
        **options: Any,
    ) -> RedisStreamLog:
        """A log with its own client. One client-side retry, at once, on a connection error: a pooled connection
        that a restarted Redis closed reconnects (a repeat is harmless: consumers are idempotent); beyond that the
        shipper and the writer retry with backoff."""
        client = aioredis.Redis.from_url(
            url,
            socket_connect_timeout=connect_timeout_s,
            socket_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 1),
            retry_on_error=[RedisConnectionError],
        )
        stream_log = cls(client, stream_key, group, **options)
        stream_log._owns_client = True
        return stream_log

    async def publish(self, events: Sequence[UsageEvent]) -> list[str]:
        for event in events:
            if not isinstance(event, UsageEvent):
                raise ValueError(f"only UsageEvent can be published, got {type(event).__name__}")
        if not events:
            return []
        await self._ensure_group()
        async with self.redis.pipeline(transaction=False) as pipe:
            for event in events:
                pipe.xadd(self.stream_key, {FIELD: event.to_json()}, maxlen=self.maxlen, approximate=True)
            return [_text(entry_id) for entry_id in await pipe.execute()]

    async def read(self, consumer: str, count: int = 100, block_ms: int = 1000) -> list[Entry]:
        if count < 1 or block_ms < 0:
            raise ValueError("count must be at least 1 and block_ms at least 0")
        raw = await self._grouped(lambda: self._own_pending(consumer, count))
        raw = raw or await self._grouped(lambda: self._claim(consumer, count))
        raw = raw or await self._grouped(lambda: self._read_new(consumer, count, block_ms))
        return await self._decoded(raw)

    async def ack(self, entry_ids: Sequence[str]) -> None:
        if not entry_ids:
            return
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xack(self.stream_key, self.group, *entry_ids)
            if self.delete_acked:
                pipe.xdel(self.stream_key, *entry_ids)
            await pipe.execute()

    async def close(self) -> None:
        if self._owns_client:
            await self.redis.aclose()

    async def _ensure_group(self) -> None:
        if self._group_ready:
            return
        try:
            # From id 0: a group made again after Redis lost it re-reads the stream (the warehouse is idempotent).
            await self.redis.xgroup_create(self.stream_key, self.group, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self._group_ready = True

    async def _grouped(self, call: Callable[[], Awaitable[list[RawEntry]]]) -> list[RawEntry]:
        """Runs a group command, creating the group again if Redis lost it (a restart without persistence)."""
        await self._ensure_group()
        try:
            return await call()
        except ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            self._group_ready = False
            await self._ensure_group()
            return await call()

    async def _own_pending(self, consumer: str, count: int) -> list[RawEntry]:
        """A consumer name's un-acked entries from before this process started: they come back at once, without
        waiting for the claim time. Read from id 0 until the consumer's pending list is exhausted."""
        if consumer in self._resumed:
            return []
        cursor = self._own_cursor.get(consumer, "0")
        reply = await self.redis.xreadgroup(self.group, consumer, {self.stream_key: cursor}, count=count)
        raw = _entries(reply)
        if not raw:
            self._resumed.add(consumer)
            return []
        self._own_cursor[consumer] = _text(raw[-1][0])
        return raw

    async def _claim(self, consumer: str, count: int) -> list[RawEntry]:
        """XAUTOCLAIM: entries another consumer read but left un-acked longer than claim_idle_ms. The pending list
        is walked a page per call; after a full pass that found nothing, the next pass waits half the idle time."""
        now = time.monotonic()
        if now < self._claim_at:
            return []
        reply = await self.redis.xautoclaim(
            self.stream_key, self.group, consumer, self.claim_idle_ms, start_id=self._claim_cursor, count=count
        )
        self._claim_cursor = _text(reply[0])
        raw = [(entry_id, fields) for entry_id, fields in reply[1] if entry_id is not None]
        if len(reply) > 2 and reply[2]:
            log.error(
                "usage log %s: %d un-acked entries were trimmed (MAXLEN) before a writer acked them; "
                "Outbox.resend_unwritten() can recover them",
                self.stream_key,
                len(reply[2]),
            )
        if self._claim_cursor == "0-0" and not raw:
            self._claim_at = now + self.claim_idle_ms / 2000
        return raw

    async def _read_new(self, consumer: str, count: int, block_ms: int) -> list[RawEntry]:
        block = block_ms or None  # BLOCK 0 would wait forever
        reply = await self.redis.xreadgroup(self.group, consumer, {self.stream_key: ">"}, count=count, block=block)
        return _entries(reply)

    async def _decoded(self, raw: list[RawEntry]) -> list[Entry]:
        entries, bad = [], []
        for entry_id, fields in raw:
            entry_id = _text(entry_id)
            payload = None if not fields else fields.get(FIELD, fields.get(FIELD.encode()))
            event = decode(entry_id, payload)
            if event is None:
                bad.append(entry_id)
            else:
                entries.append((entry_id, event))
        await self.ack(bad)
        return entries


def _entries(reply: Any) -> list[RawEntry]:
    """The entries of an XREADGROUP reply for one stream (a list in RESP2, a dict in RESP3)."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return [entry for stream in reply.values() for entry in stream[0]]
    return list(reply[0][1])


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
