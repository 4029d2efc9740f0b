"""The resume buffer: every event of a stream, kept for a few minutes so a client that reconnects with
Last-Event-ID gets what it missed, exactly once, then the live events. In memory when embedded; a capped,
expiring Redis Stream per request in a fleet (so any gateway can resume any stream)."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol


@dataclass(frozen=True)
class StreamEvent:
    id: int  # 1, 2, 3, ... within one request
    data: str
    event: str | None = None


class ResumeBuffer(Protocol):
    async def open(self, request_id: str, owner: str = "") -> None:
        """Creates the stream before its first event, so a reader arriving early waits instead of ending.
        `owner` is the tenant the stream belongs to: only it may resume the stream."""

    async def append(self, request_id: str, event: StreamEvent) -> None: ...

    async def close(self, request_id: str) -> None:
        """Marks the stream complete: readers stop after its last event."""

    async def owner(self, request_id: str) -> str | None:
        """The stream's owner, or None when there is no such stream (never existed, or expired)."""

    def read(self, request_id: str, after: int) -> AsyncIterator[StreamEvent]:
        """Events with id > after, then live ones until the stream is closed."""


@dataclass
class _Log:
    events: list[StreamEvent] = field(default_factory=list)
    closed: bool = False
    owner: str = ""
    expires_at: float = 0.0
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class MemoryResumeBuffer:
    def __init__(self, ttl_s: float = 300.0, max_events: int = 100_000) -> None:
        self.ttl_s, self.max_events = ttl_s, max_events
        self._logs: dict[str, _Log] = {}

    async def open(self, request_id: str, owner: str = "") -> None:
        log = self._log(request_id)
        log.owner = owner
        self._touch(log)

    async def append(self, request_id: str, event: StreamEvent) -> None:
        log = self._log(request_id)
        if len(log.events) < self.max_events:
            log.events.append(event)
        self._touch(log)

    async def close(self, request_id: str) -> None:
        log = self._log(request_id)
        log.closed = True
        self._touch(log)

    async def owner(self, request_id: str) -> str | None:
        self._expire()
        log = self._logs.get(request_id)
        return None if log is None else log.owner

    async def read(self, request_id: str, after: int) -> AsyncIterator[StreamEvent]:
        log = self._logs.get(request_id)
        if log is None:
            return
        position = next((i for i, e in enumerate(log.events) if e.id > after), len(log.events))
        while True:
            while position < len(log.events):
                event = log.events[position]
                position += 1
                if event.id > after:  # a reader may ask for an id the stream has not reached yet
                    yield event
            if log.closed:
                return
            log.changed.clear()
            if position < len(log.events) or log.closed:
                continue
            await log.changed.wait()

    def _log(self, request_id: str) -> _Log:
        self._expire()
        return self._logs.setdefault(request_id, _Log())

    def _touch(self, log: _Log) -> None:
        log.expires_at = time.monotonic() + self.ttl_s
        log.changed.set()

    def _expire(self) -> None:
        now = time.monotonic()
        for request_id in [r for r, log in self._logs.items() if log.expires_at and log.expires_at < now]:
            del self._logs[request_id]


class RedisResumeBuffer:
    """One Redis Stream per request, `{prefix}{request_id}`: capped length, expiring after `ttl_s`."""

    END = "end"
    OPEN = "open"

    def __init__(self, redis, prefix: str = "tokenfleet:stream:", ttl_s: int = 300, max_events: int = 100_000,
                 block_ms: int = 1000) -> None:
        self.redis, self.prefix, self.ttl_s = redis, prefix, ttl_s
        self.max_events, self.block_ms = max_events, block_ms

    def _key(self, request_id: str) -> str:
        return self.prefix + request_id

    async def open(self, request_id: str, owner: str = "") -> None:
        await self._add(request_id, {self.OPEN: owner})

    async def append(self, request_id: str, event: StreamEvent) -> None:
        fields = {"id": event.id, "data": event.data}
        if event.event is not None:
            fields["event"] = event.event
        await self._add(request_id, fields)

    async def close(self, request_id: str) -> None:
        await self._add(request_id, {self.END: 1})

    async def _add(self, request_id: str, fields: dict) -> None:
        key = self._key(request_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xadd(key, fields, maxlen=self.max_events, approximate=True)
            pipe.expire(key, self.ttl_s)
            await pipe.execute()

    async def owner(self, request_id: str) -> str | None:
        first = await self.redis.xrange(self._key(request_id), count=1)
        if not first:
            return None
        fields = {_text(k): _text(v) for k, v in first[0][1].items()}
        return fields.get(self.OPEN, "")

    async def read(self, request_id: str, after: int) -> AsyncIterator[StreamEvent]:
        key, cursor = self._key(request_id), "0-0"
        while True:
            reply = await self.redis.xread({key: cursor}, count=500, block=self.block_ms)
            if not reply:
                if not await self.redis.exists(key):
                    return  # expired or never existed
                continue
            for entry_id, fields in reply[0][1]:
                cursor = entry_id
                fields = {_text(k): _text(v) for k, v in fields.items()}
                if self.END in fields:
                    return
                if self.OPEN in fields:
                    continue
                event = StreamEvent(int(fields["id"]), fields["data"], fields.get("event"))
                if event.id > after:
                    yield event


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
