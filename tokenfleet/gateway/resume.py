"""The resume buffer: every event of a stream, kept for a few minutes so a client that reconnects with
Last-Event-ID gets what it missed, exactly once, then the live events. In memory when embedded; a capped,
expiring Redis Stream per request in a fleet (so any gateway can resume any stream)."""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol


@dataclass(frozen=True)
class StreamEvent:
    id: int  # 1, 2, 3, ... within one request
    data: str
    event: str | None = None


class Follower(Protocol):
    """One reader's position in a stream."""

    async def next(self, wait_s: float) -> list[StreamEvent] | None:
        """The events after the reader's position, waiting at most wait_s for some ([] if none came); None once
        the stream is complete and read to its end, or when there is no such stream."""


class ResumeBuffer(Protocol):
    async def open(self, request_id: str, owner: str = "") -> None:
        """Creates the stream before its first event, so a reader arriving early waits instead of ending.
        `owner` is the tenant the stream belongs to: only it may resume the stream."""

    async def append(self, request_id: str, event: StreamEvent) -> None: ...

    async def close(self, request_id: str) -> None:
        """Marks the stream complete: readers stop after its last event."""

    async def owner(self, request_id: str) -> str | None:
        """The stream's owner, or None when there is no such stream (never existed, or expired)."""

    def follow(self, request_id: str, after: int) -> Follower:
        """A reader of the events with id > after, then of live ones until the stream is closed."""

    def read(self, request_id: str, after: int) -> AsyncIterator[StreamEvent]:
        """Events with id > after, then live ones until the stream is closed."""


async def read_all(follower: Follower, wait_s: float) -> AsyncIterator[StreamEvent]:
    while (events := await follower.next(wait_s)) is not None:
        for event in events:
            yield event


@dataclass(eq=False)
class _Log:
    events: list[StreamEvent] = field(default_factory=list)
    closed: bool = False
    owner: str = ""
    expires_at: float = 0.0
    waiters: list[asyncio.Future] = field(default_factory=list)

    def changed(self) -> None:
        for waiter in self.waiters:
            if not waiter.done():
                waiter.set_result(None)
        self.waiters.clear()

    async def wait(self, timeout_s: float) -> None:
        """Until the next change, or timeout_s (a timer, not a task: an idle reader costs a future)."""
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self.waiters.append(waiter)
        timer = loop.call_later(timeout_s, _settle, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            if self.waiters and waiter in self.waiters:  # timed out or cancelled: no change came
                self.waiters.remove(waiter)


def _settle(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class _MemoryFollower:
    def __init__(self, log: _Log | None, after: int) -> None:
        self.log, self.after, self.position = log, after, 0

    async def next(self, wait_s: float) -> list[StreamEvent] | None:
        if self.log is None:
            return None
        events = self._take()
        if events or self.log.closed:
            return events or None
        await self.log.wait(wait_s)
        events = self._take()
        return events if events or not self.log.closed else None

    def _take(self) -> list[StreamEvent]:
        events = self.log.events
        if self.position >= len(events):
            return []
        new, self.position = events[self.position:], len(events)
        if new[0].id <= self.after:  # a reader may ask for an id the stream has not reached yet
            new = [e for e in new if e.id > self.after]
        return new


class MemoryResumeBuffer:
    def __init__(self, ttl_s: float = 300.0, max_events: int = 100_000) -> None:
        self.ttl_s, self.max_events = ttl_s, max_events
        # least recently touched first: with one TTL for all, that is also the order in which they expire
        self._logs: OrderedDict[str, _Log] = OrderedDict()

    async def open(self, request_id: str, owner: str = "") -> None:
        log = self._log(request_id)
        log.owner = owner
        self._touch(request_id, log)

    async def append(self, request_id: str, event: StreamEvent) -> None:
        log = self._log(request_id)
        if len(log.events) < self.max_events:
            log.events.append(event)
        self._touch(request_id, log)

    async def close(self, request_id: str) -> None:
        log = self._log(request_id)
        log.closed = True
        self._touch(request_id, log)

    async def owner(self, request_id: str) -> str | None:
        self._expire()
        log = self._logs.get(request_id)
        return None if log is None else log.owner

    def follow(self, request_id: str, after: int) -> Follower:
        return _MemoryFollower(self._logs.get(request_id), after)

    def read(self, request_id: str, after: int) -> AsyncIterator[StreamEvent]:
        return read_all(self.follow(request_id, after), 60.0)

    def _log(self, request_id: str) -> _Log:
        self._expire()
        log = self._logs.get(request_id)
        if log is None:
            log = self._logs[request_id] = _Log()
        return log

    def _touch(self, request_id: str, log: _Log) -> None:
        log.expires_at = time.monotonic() + self.ttl_s
        self._logs.move_to_end(request_id)
        log.changed()

    def _expire(self) -> None:
        now = time.monotonic()
        while self._logs:
            request_id, log = next(iter(self._logs.items()))
            if log.expires_at >= now:
                return
            del self._logs[request_id]


class _RedisFollower:
    def __init__(self, buffer: RedisResumeBuffer, request_id: str, after: int) -> None:
        self.buffer, self.key, self.after = buffer, buffer._key(request_id), after
        self.cursor, self.ended = "0-0", False

    async def next(self, wait_s: float) -> list[StreamEvent] | None:
        if self.ended:
            return None
        redis = self.buffer.redis
        block_ms = max(1, int(1000 * min(wait_s, self.buffer.block_ms / 1000)))
        reply = await redis.xread({self.key: self.cursor}, count=500, block=block_ms)
        if not reply:
            return [] if await redis.exists(self.key) else None  # expired or never existed: nothing will come
        events = []
        for entry_id, fields in reply[0][1]:
            self.cursor = entry_id
            fields = {_text(k): _text(v) for k, v in fields.items()}
            if RedisResumeBuffer.END in fields:
                self.ended = True
                break
            if RedisResumeBuffer.OPEN in fields:
                continue
            event = StreamEvent(int(fields["id"]), fields["data"], fields.get("event"))
            if event.id > self.after:
                events.append(event)
        return events if events or not self.ended else None


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

    def follow(self, request_id: str, after: int) -> Follower:
        return _RedisFollower(self, request_id, after)

    def read(self, request_id: str, after: int) -> AsyncIterator[StreamEvent]:
        return read_all(self.follow(request_id, after), self.block_ms / 1000)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
