"""The resume buffer: every event of a stream, kept for a few minutes so a client that reconnects with
Last-Event-ID gets what it missed, exactly once, then the live events. In memory when embedded; a capped,
expiring Redis Stream per request in a fleet (so any gateway can resume any stream). In Redis, the events that all
streams write within one event-loop tick go in one script call (one round trip), in the order they were written;
`append_many` writes several events of one stream (a relay's events of one read from its replica) as one write:
one wake-up for its readers, one entry in the script call."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from redis.exceptions import RedisError, ResponseError

from tokenfleet.api.errors import APIError
from tokenfleet.api.usage import Usage
from tokenfleet.gateway.formats import ending_with_error
from tokenfleet.metering.outage import raise_if_cancelled
from tokenfleet.quota.batcher import TickBatcher
from tokenfleet.quota.redis_client import Script, ScriptCall, run_scripts

logger = logging.getLogger(__name__)
REDIS_FAILURES = (RedisError, OSError, asyncio.TimeoutError)  # every way a Redis call can fail for want of Redis


@dataclass(frozen=True, slots=True)
class StreamEvent:
    id: int  # 1, 2, 3, ... within one request
    data: str
    event: str | None = None
    usage: str | None = None  # the replica's usage so far (JSON), never sent to clients: what metering reconciles


class Follower(Protocol):
    """One reader's position in a stream."""

    async def next(self, wait_s: float) -> list[StreamEvent] | None:
        """The events after the reader's position, waiting at most wait_s for some ([] if none came); None once
        the stream is complete and read to its end, or when there is no such stream."""


class ResumeBuffer(Protocol):
    async def open(self, request_id: str, owner: str = "", kind: str = "openai") -> None:
        """Creates the stream before its first event, so a reader arriving early waits instead of ending.
        `owner` is the tenant the stream belongs to: only it may resume the stream. `kind` is its event format
        (formats.py), for the error that ends it should its gateway die."""

    async def append(self, request_id: str, event: StreamEvent) -> None: ...

    # Optional, where a buffer has it (relay.py asks): async def append_many(self, request_id, events, shown=None)
    # -> None, the events in order as one write, held by the buffer (every one of them) when it returns; `shown`, if
    # given, is called once this gateway's readers can read them (at the latest when it returns).

    async def close(self, request_id: str) -> None:
        """Marks the stream complete: readers stop after its last event."""

    async def owner(self, request_id: str) -> str | None:
        """The stream's owner, or None when there is no such stream (never existed, or expired)."""

    def follow(self, request_id: str, after: int) -> Follower:
        """A reader of the events with id > after, then of live ones until the stream is closed."""

    def read(self, request_id: str, after: int) -> AsyncIterator[StreamEvent]:
        """Events with id > after, then live ones until the stream is closed."""

    def resumable(self, request_id: str) -> bool:
        """Whether a client can resume the stream (False when it could not be kept where resumes read)."""

    async def settled(self, request_id: str) -> None:
        """Until `resumable` is known for the stream (its open answered; at once where there is nothing to wait for)."""

    def release(self, request_id: str) -> None:
        """This gateway has stopped relaying the stream; a copy kept only for its own readers may go."""

    async def discard(self, request_id: str) -> None:
        """Removes a stream opened for a request that never started (no event, no reader): wherever it was kept."""


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
        timer = loop.call_later(timeout_s, settle, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            if self.waiters and waiter in self.waiters:  # timed out or cancelled: no change came
                self.waiters.remove(waiter)


def settle(waiter: asyncio.Future) -> None:
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
        new, self.position = events[self.position :], len(events)
        if new[0].id <= self.after:  # a reader may ask for an id the stream has not reached yet
            new = [e for e in new if e.id > self.after]
        return new


class MemoryResumeBuffer:
    def __init__(self, ttl_s: float = 300.0, max_events: int = 100_000) -> None:
        self.ttl_s, self.max_events = ttl_s, max_events
        # least recently touched first: with one TTL for all, that is also the order in which they expire
        self._logs: OrderedDict[str, _Log] = OrderedDict()

    async def open(self, request_id: str, owner: str = "", kind: str = "openai") -> None:
        log = self._log(request_id)
        log.owner = owner
        self._touch(request_id, log)

    async def append(self, request_id: str, event: StreamEvent) -> None:
        log = self._log(request_id)
        if len(log.events) < self.max_events:
            log.events.append(event)
        self._touch(request_id, log)

    async def append_many(
        self, request_id: str, events: list[StreamEvent], shown: Callable[[], None] | None = None
    ) -> None:
        """The events in order, with one wake-up of the stream's readers (who then read them all at once)."""
        self.add_many(request_id, events)
        if shown is not None:
            shown()

    def add_many(self, request_id: str, events: list[StreamEvent]) -> None:
        """append_many, at once."""
        log = self._log(request_id)
        room = self.max_events - len(log.events)
        if room > 0:
            log.events.extend(events if len(events) <= room else events[:room])
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

    def resumable(self, request_id: str) -> bool:
        return True

    async def settled(self, request_id: str) -> None:
        return None

    def release(self, request_id: str) -> None:
        """Nothing to do: this is the stream's only copy, kept until it expires."""

    def written(self, request_id: str) -> bool:
        """Whether the stream holds an event."""
        log = self._logs.get(request_id)
        return log is not None and bool(log.events)

    def holds(self, request_id: str) -> bool:
        self._expire()
        return request_id in self._logs

    def forget(self, request_id: str) -> None:
        """Drops the stream now (readers already following it read on to its end)."""
        self._logs.pop(request_id, None)

    async def discard(self, request_id: str) -> None:
        self.forget(request_id)

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


LOST = "the gateway relaying this request stopped before the generation finished; the rest of it was lost"
# writes per script call (a write: one event, or a relay's events of one tick); more in one tick go in several calls
MAX_WRITES = 512

# The writes of one tick, in order, as one atomic call. KEYS: each write's stream (one stream may come more than
# once), then this gateway's alive key when ARGV[3] > 0. ARGV: ttl_s, max events (approximate MAXLEN), alive lease
# ms (0: none), then per write its number of entries and, per entry, its number of field arguments and the fields
# (name, value, ...). The alive key is set first: a stream never names a gateway not marked alive. A write's entries
# are added in order; the first one Redis refuses ends that write (no gap: nothing after it is added). Returns per
# write 1, or the error that refused it.
APPEND = Script(
    r"""
local ttl, maxlen, alive_ms = ARGV[1], ARGV[2], tonumber(ARGV[3])
local writes = #KEYS
if alive_ms > 0 then
  redis.call('SET', KEYS[writes], '1', 'PX', alive_ms)
  writes = writes - 1
end
local out, at, touched = {}, 4, {}
for k = 1, writes do
  local entries = tonumber(ARGV[at])
  at = at + 1
  local status, added_any = 1, false
  for e = 1, entries do
    local n = tonumber(ARGV[at])
    local only_new = n < 0
    if only_new then
      n = -n
    end
    if status == 1 and not (only_new and redis.call('EXISTS', KEYS[k]) == 1) then
      local added = redis.pcall('XADD', KEYS[k], 'MAXLEN', '~', maxlen, '*', unpack(ARGV, at + 1, at + n))
      if type(added) == 'table' and added.err then
        status = added.err
      else
        added_any = true
      end
    end
    at = at + n + 1
  end
  if added_any and not touched[KEYS[k]] then
    touched[KEYS[k]] = true
    redis.call('EXPIRE', KEYS[k], ttl)
  end
  out[k] = status
end
return out
"""
)


@dataclass(frozen=True, slots=True)
class _Write:
    key: str
    entries: int  # how many stream entries
    args: list[str | int]  # per entry: its number of field arguments, then name, value, name, value, ...
    mark_alive: bool = False
    sent: Callable[[], None] | None = None  # called once the write has left this process


class _RedisFollower:
    """Reads a stream from Redis. It always ends: after the stream's end marker, or, when the stream can no longer
    go on (its gateway died, the stream vanished, Redis failed), after an error event in the stream's format."""

    def __init__(self, buffer: RedisResumeBuffer, request_id: str, after: int) -> None:
        self.buffer, self.request_id, self.key = buffer, request_id, buffer._key(request_id)
        self.last_id = after  # the newest event id handed out (a repeated entry is skipped)
        self.cursor, self.ended = "0-0", False
        self.opened, self.kind, self.gateway = False, "openai", ""  # from the stream's open entry

    async def next(self, wait_s: float) -> list[StreamEvent] | None:
        if self.ended:
            return None
        try:
            return await self._next(wait_s)
        except REDIS_FAILURES as e:
            raise_if_cancelled(e)  # the client left: redis-py may have turned that cancel into a connection error
            return self._end_with(
                APIError(
                    503,
                    f"the resume buffer is unavailable ({type(e).__name__}); resume this stream again shortly",
                    "service_unavailable",
                    code="service_unavailable",
                )
            )

    async def _next(self, wait_s: float) -> list[StreamEvent] | None:
        block_ms = max(1, int(1000 * min(wait_s, self.buffer.block_ms / 1000)))
        reply = await self.buffer.redis.xread({self.key: self.cursor}, count=500, block=block_ms)
        if not reply:
            return await self._idle()
        events = []
        for entry_id, fields in reply[0][1]:
            self.cursor = entry_id
            fields = {_text(k): _text(v) for k, v in fields.items()}
            if RedisResumeBuffer.END in fields:
                self.ended = True
                break
            if RedisResumeBuffer.LOST in fields:
                return events + self._end_with(APIError(502, fields[RedisResumeBuffer.LOST], "server_error"))
            if RedisResumeBuffer.OPEN in fields:
                self.opened = True
                self.kind, self.gateway = fields.get("format", "openai"), fields.get("gateway", "")
                continue
            event = StreamEvent(int(fields["id"]), fields["data"], fields.get("event"))
            if event.id > self.last_id:
                events.append(event)
                self.last_id = event.id
        return events if events or not self.ended else None

    async def _idle(self) -> list[StreamEvent] | None:
        """Nothing new: [] while the stream lives and its gateway does; its end otherwise."""
        exists, owner_alive = await self.buffer.liveness(self.request_id, self.gateway)
        if not exists:  # expired, or lost with Redis's memory: one that was being read ends with an error
            return self._end_with(APIError(502, LOST, "server_error")) if self.opened else None
        if not owner_alive:
            return self._end_with(APIError(502, LOST, "server_error"))
        return []

    def _end_with(self, error: APIError) -> list[StreamEvent]:
        self.ended = True
        endings = ending_with_error(self.kind, self.request_id, error)
        return [StreamEvent(self.last_id + i, data, name) for i, (data, name) in enumerate(endings, 1)]


class RedisResumeBuffer:
    """One Redis Stream per request, `{prefix}{request_id}`: capped length, expiring after `ttl_s`.

    With `owner_lease_s`, this gateway marks itself alive (`keep_alive`, a key expiring after the lease) and names
    itself in each stream it opens, so a reader on another gateway ends a stream whose gateway died with an error
    instead of waiting for events that will never come."""

    END = "end"
    OPEN = "open"
    LOST = "lost"  # the stream could not be kept here to its end: readers get an error event with this message

    def __init__(
        self,
        redis,
        prefix: str = "tokenfleet:stream:",
        ttl_s: int = 300,
        max_events: int = 100_000,
        block_ms: int = 1000,
        owner_lease_s: float | None = None,
    ) -> None:
        self.redis, self.prefix, self.ttl_s = redis, prefix, ttl_s
        self.max_events, self.block_ms = max_events, block_ms
        self.owner_lease_s = owner_lease_s
        self.gateway_id = uuid.uuid4().hex if owner_lease_s else ""
        self._writes: TickBatcher[_Write] = TickBatcher(self._write, MAX_WRITES)
        self._unanswered_opens: dict[str, list[str | int]] = {}  # request id -> its open's entry, until answered

    def _key(self, request_id: str) -> str:
        return self.prefix + request_id

    def _alive_key(self, gateway_id: str) -> str:
        return f"{self.prefix}gateway-alive:{gateway_id}"

    async def open(self, request_id: str, owner: str = "", kind: str = "openai") -> None:
        await self.queue_open(request_id, owner, kind)

    def queue_open(self, request_id: str, owner: str, kind: str) -> asyncio.Future[object]:
        """open, queued for this tick's write now; the future is its answer. Until the answer, this stream's writes
        carry the open too, as an entry added only where the stream does not exist yet: whichever of them Redis runs
        first opens the stream, so a write need not wait for the open's answer (they may go on different
        connections, in any order)."""
        fields: list[str | int] = [self.OPEN, owner, "format", kind]
        if self.gateway_id:
            fields += ["gateway", self.gateway_id]
        entry: list[str | int] = [-len(fields), *fields]  # negative: only where the stream does not exist
        self._unanswered_opens[request_id] = entry
        answer = self._writes.submit(_Write(self._key(request_id), 1, entry, bool(self.gateway_id)))
        answer.add_done_callback(lambda _: self._open_answered(request_id, entry))
        return answer

    def _open_answered(self, request_id: str, entry: list[str | int]) -> None:
        if self._unanswered_opens.get(request_id) is entry:
            del self._unanswered_opens[request_id]

    async def append(self, request_id: str, event: StreamEvent) -> None:
        args: list[str | int] = []
        _event_args(event, args)
        await self._writes.submit(_Write(self._key(request_id), 1, args))

    async def append_many(
        self, request_id: str, events: list[StreamEvent], shown: Callable[[], None] | None = None
    ) -> None:
        """The events as one write of the tick's script call, in order: one stream's events never straddle two calls
        (which could reach Redis out of order). Should Redis refuse one, the ones before it stay and it raises.
        Readers here read Redis: `shown` is called once Redis holds the events."""
        await self.append_sent(request_id, events, None)
        if shown is not None:
            shown()

    async def append_sent(self, request_id: str, events: list[StreamEvent], sent: Callable[[], None] | None) -> None:
        """append_many, calling `sent` (if given) once the write has left this process for Redis, before Redis
        answers: from then on it reaches Redis even if this process dies (the kernel sends what it was handed), or
        not at all if it could not be sent."""
        if not events:
            if sent is not None:
                sent()
            return
        opening = self._unanswered_opens.get(request_id)
        args: list[str | int] = [] if opening is None else list(opening)
        for event in events:
            _event_args(event, args)
        entries = len(events) + (opening is not None)
        alive = opening is not None and bool(self.gateway_id)  # as its open would
        await self._writes.submit(_Write(self._key(request_id), entries, args, alive, sent))

    async def close(self, request_id: str) -> None:
        await self._add(request_id, [self.END, 1])

    async def abandon(self, request_id: str, message: str) -> None:
        """Ends an existing stream with an error for its readers (its events could not all be kept here)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xadd(self._key(request_id), {self.LOST: message}, nomkstream=True)
            pipe.expire(self._key(request_id), self.ttl_s)
            await pipe.execute()

    async def _add(self, request_id: str, fields: list[str | int], mark_alive: bool = False) -> None:
        """Returns once Redis holds the event (raises when it does not): batched with the other streams' writes of
        this tick. One stream's writes are awaited one by one by its relay, and a batch keeps the order of its
        writes, so a stream's events are in Redis in the order they were written."""
        await self._writes.submit(_Write(self._key(request_id), 1, [len(fields), *fields], mark_alive))

    async def _write(self, writes: list[_Write]) -> list[object]:
        keys, args = [w.key for w in writes], [self.ttl_s, self.max_events, 0]
        if any(w.mark_alive for w in writes):  # also here, not only in keep_alive (see APPEND)
            keys.append(self._alive_key(self.gateway_id))
            args[2] = int(self.owner_lease_s * 1000)
        for write in writes:
            args.append(write.entries)
            args.extend(write.args)
        told = [write.sent for write in writes if write.sent is not None]
        [reply] = await run_scripts(self.redis, [ScriptCall(APPEND, keys, args)], on_sent=_calling(told))
        if isinstance(reply, Exception):
            raise reply
        return [None if status == 1 else ResponseError(_text(status)) for status in reply]

    async def owner(self, request_id: str) -> str | None:
        first = await self.redis.xrange(self._key(request_id), count=1)
        if not first:
            return None
        fields = {_text(k): _text(v) for k, v in first[0][1].items()}
        return fields.get(self.OPEN, "")

    async def liveness(self, request_id: str, gateway_id: str) -> tuple[bool, bool]:
        """(whether the stream exists, whether the gateway that relays it is alive; True when it is not known)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.exists(self._key(request_id))
            if gateway_id:
                pipe.exists(self._alive_key(gateway_id))
            replies = await pipe.execute()
        return bool(replies[0]), not gateway_id or bool(replies[1])

    async def last_usage(self, request_id: str) -> Usage | None:
        """The replica's last usage report in the stream (what had been generated when it stopped), or None."""
        for _, fields in await self.redis.xrevrange(self._key(request_id), count=32):
            usage = fields.get(b"usage", fields.get("usage"))
            if usage is not None:
                return Usage.from_json(usage)
        return None

    async def keep_alive(self) -> None:
        """Marks this gateway alive, three times per lease, until cancelled (a gateway service)."""
        failing = False
        while True:
            try:
                await self.redis.set(self._alive_key(self.gateway_id), 1, px=int(self.owner_lease_s * 1000))
                failing = False
            except REDIS_FAILURES as e:
                if not failing:
                    logger.warning("resume buffer: cannot mark this gateway alive in Redis: %r", e)
                failing = True
            await asyncio.sleep(self.owner_lease_s / 3)

    def follow(self, request_id: str, after: int) -> Follower:
        return _RedisFollower(self, request_id, after)

    def read(self, request_id: str, after: int) -> AsyncIterator[StreamEvent]:
        return read_all(self.follow(request_id, after), self.block_ms / 1000)

    def resumable(self, request_id: str) -> bool:
        return True

    async def settled(self, request_id: str) -> None:
        return None

    def release(self, request_id: str) -> None:
        """Nothing to do: Redis expires the stream."""

    async def discard(self, request_id: str) -> None:
        await self.redis.delete(self._key(request_id))


def _calling(callbacks: list[Callable[[], None]]) -> Callable[[], None] | None:
    """One callback that calls each of `callbacks` (None when there are none)."""
    if not callbacks:
        return None

    def call_each() -> None:
        for callback in callbacks:
            callback()

    return call_each


def _event_args(event: StreamEvent, args: list[str | int]) -> None:
    """An event's stream entry as APPEND takes it: its number of field arguments, then the fields."""
    if event.event is None and event.usage is None:
        args += [4, "id", event.id, "data", event.data]
        return
    fields: list[str | int] = ["id", event.id, "data", event.data]
    if event.event is not None:
        fields += ["event", event.event]
    if event.usage is not None:
        fields += ["usage", event.usage]
    args.append(len(fields))
    args.extend(fields)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
