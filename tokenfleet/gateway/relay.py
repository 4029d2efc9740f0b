"""A relay runs one request's generation in the background, independent of any client connection, and writes
every event to the resume buffer; client connections read from there at their own pace. So a slow or dropped
client never blocks generation, and a reconnecting client resumes where it left off.

The events a relay makes within one event-loop tick (those of all the chunks one read from the replica brought) go
to the buffer as one write, by a writer task of the relay's own that starts once the relay waits for its replica
again: one Redis entry of the tick's script call and one wake-up of the readers, who send them in one message,
instead of one of each per event. The relay's writes still happen one after another, in order, and it ends only
once all of them are held by the buffer."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field

from tokenfleet.api.errors import APIError
from tokenfleet.api.usage import Usage
from tokenfleet.gateway.chunks import Chunk, Piece
from tokenfleet.gateway.formats import Event, EventFormat
from tokenfleet.gateway.resume import ResumeBuffer, StreamEvent
from tokenfleet.metering.outage import raise_if_cancelled

log = logging.getLogger(__name__)
MAX_QUEUED = 256  # events a relay queues ahead of its buffer's writes before it waits for them


@dataclass(frozen=True, slots=True)
class _Queued:
    """An event made but not yet written, with the replica's count as of its chunk."""

    id: int
    data: str
    name: str | None
    usage: Usage | None


@dataclass(eq=False)
class Relay:
    request_id: str
    buffer: ResumeBuffer
    format: EventFormat
    disconnect_grace_s: float
    owner: str = ""  # the tenant (organisation) the request belongs to
    rate_limit_headers: Mapping[str, str] | None = None  # x-ratelimit-* from the quota decision
    route: object = None  # the router's decision (router.pool.Route), for logs and usage records
    usage: Usage | None = None  # the replica's last count: final, or so far if it got cancelled
    last_id: int = 0
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    readers: int = 0
    task: asyncio.Task | None = None
    cancel_reason: str | None = None  # "api" (POST cancel) or "abandoned" (no reader came back in time)
    first_token_at: float | None = None  # time.monotonic() of the first generated text
    failure: str | None = None  # why generation failed, if it did
    _cancel_timer: asyncio.TimerHandle | None = None
    _running: bool = False  # whether the task has begun (a task cancelled before that never runs its clean-up)
    _queued: list[_Queued] = field(default_factory=list)  # events made, not yet taken by the writer
    _writer: asyncio.Task | None = None  # writes what is queued, one write after another
    _write_failure: Exception | None = None  # what the buffer raised on a write, until the relay fails with it
    _usage_json: tuple[Usage | None, str | None] = (None, None)  # the last count encoded, and its JSON
    _ended: bool = False  # whether the format's end is queued (or written)
    _opening: asyncio.Future | None = None  # the stream's open in the buffer
    _written_id: int = 0  # the last event the buffer holds
    _readable_id: int = 0  # the last event readers here can read (a fleet buffer's copy has it before Redis answers)
    _progress: asyncio.Future | None = None  # resolved by the writer at its next write (or its end)

    async def start(self, chunks: AsyncIterator[Piece], opening: asyncio.Future | None = None) -> None:
        """Opens the stream in the buffer (`opening`: its open, when already under way); while the open waits for
        Redis, the relay already asks its replica (the open's round trip and the replica's first token overlap).
        Returns once the stream is open; the relay writes nothing before that, and nothing at all if it could not
        be opened (then it is cancelled, and this raises)."""
        if opening is None:
            opening = asyncio.ensure_future(self.buffer.open(self.request_id, self.owner, self.format.kind))
        self._opening = opening
        self._queue(self.format.start())  # the first events, whatever the replica sends meanwhile
        first_events = self.last_id
        try:
            await asyncio.sleep(0)  # the open's first step: a buffer in memory has finished it now
            if not opening.done():
                self.task = asyncio.create_task(self._run(chunks), name=f"relay-{self.request_id}")
            await asyncio.shield(opening)
        except BaseException:
            opening.cancel()  # start itself was cancelled (the client left while it waited)
            if self.task is not None:
                self.task.cancel()
            raise
        if self.task is None:
            self.task = asyncio.create_task(self._run(chunks), name=f"relay-{self.request_id}")
        await self._written(first_events, readable=True)

    async def _run(self, chunks: AsyncIterator[Piece]) -> None:
        self._running = True
        try:
            async with aclosing(chunks):  # however the relay stops, the replica's stream is closed now
                self._stop_if_cancelled()
                async for chunk in chunks:
                    await self._relay(chunk)
                    self._stop_if_cancelled()
            self._end()  # now: it goes in the same write as the last events
            await self._written()  # a write that fails now fails the relay like one that failed before
        except APIError as e:
            self.failure = e.message
            self._queue(self.format.error(e))
        except asyncio.CancelledError:
            self.cancel_reason = self.cancel_reason or "shutdown"
            log.info("request %s cancelled", self.request_id)
        except Exception as e:  # the replica broke mid-stream: the client gets an error event, not a hang
            log.exception("relay %s failed", self.request_id)
            self.failure = f"generation failed: {e}"
            self._queue(self.format.error(APIError(502, self.failure, "server_error")))
        finally:
            await self._finish()

    async def _relay(self, chunk: Piece) -> None:
        if not isinstance(chunk, Chunk):  # the replica died; the response goes on from another one
            self._queue(self.format.retrying(chunk))
            return
        first = self.first_token_at is None and bool(chunk.choices)
        if first:
            self.first_token_at = time.monotonic()
        if chunk.usage is not None:
            self.usage = chunk.usage
        self._queue(self.format.chunk(chunk))
        # the first token goes out at once, not after the rest of its read (the time to first token); and when the
        # buffer is slower than the replica, the relay waits for it
        if first:
            await self._written(readable=True)
        elif len(self._queued) >= MAX_QUEUED:
            await self._written()

    def _stop_if_cancelled(self) -> None:
        """A cancellation can get lost on its way in: redis-py swallows one that lands just as a reply arrives and
        returns normally, and the relay would then generate to the end. So it checks between events as well; and
        for a write the buffer refused, which stops the relay as it did when the relay awaited each write."""
        if self.cancel_reason is not None:
            raise asyncio.CancelledError()
        raise_if_cancelled()
        self._raise_write_failure()

    def _raise_write_failure(self) -> None:
        failure = self._write_failure
        if failure is not None:
            self._write_failure = None
            self._queued.clear()  # nothing after a lost event (what comes next: the error, the end)
            self._ended = False  # the end may have been lost with it
            raise failure

    def _queue(self, events: list[Event]) -> None:
        """Numbers the events and queues them; the tick's first starts the writer, which runs once the relay waits
        (for its replica, mostly), so it takes all of them at once."""
        if not events:
            return
        usage = self.usage
        for data, name in events:
            self.last_id += 1
            self._queued.append(_Queued(self.last_id, data, name, usage))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write_queued(), name=f"write-{self.request_id}")

    async def _write_queued(self) -> None:
        """What is queued, as one write per turn (more queued meanwhile goes in the next); a failure is kept for the
        relay and drops the rest."""
        try:
            if not await self._opened():
                raise RuntimeError(f"the stream of {self.request_id} could not be opened in the resume buffer")
            while self._queued:
                queued, self._queued = self._queued, []
                await self._write(queued)
                self._written_id = queued[-1].id
                self._readable_id = max(self._readable_id, self._written_id)
                self._wake_waiters()
        except Exception as e:
            self._write_failure = e
            self._queued.clear()
        finally:
            self._wake_waiters()

    def _wake_waiters(self) -> None:
        progress, self._progress = self._progress, None
        if progress is not None and not progress.done():
            progress.set_result(None)

    async def _write(self, queued: list[_Queued]) -> None:
        append_many = getattr(self.buffer, "append_many", None)  # optional (resume.py's buffers have it)
        if append_many is None:  # one event at a time, each with its count (a crash may come between two)
            for q in queued:
                await self.buffer.append(self.request_id, StreamEvent(q.id, q.data, q.name, self._json(q.usage)))
            return
        # one atomic write: the count beside its last event is the newest, which is what metering reads after a crash
        events = [StreamEvent(q.id, q.data, q.name) for q in queued]
        last = queued[-1]
        events[-1] = StreamEvent(last.id, last.data, last.name, self._json(last.usage))
        await append_many(self.request_id, events, lambda: self._readable(last.id))

    def _json(self, usage: Usage | None) -> str | None:
        """The count as stored beside an event, encoded once per count, not once per event."""
        if usage is None:
            return None
        encoded, text = self._usage_json
        if encoded is not usage:
            text = usage.to_json()
            self._usage_json = (usage, text)
        return text

    def _readable(self, upto: int) -> None:
        """The buffer's readers here can read the events up to `upto` (its write may still be on its way)."""
        self._readable_id = max(self._readable_id, upto)
        self._wake_waiters()

    async def _written(self, upto: int | None = None, readable: bool = False) -> None:
        """Until the buffer holds every event queued so far (or up to id `upto`), not those queued meanwhile; raises
        what a write raised. `readable`: only until the buffer's readers here can read them (a fleet buffer's copy
        takes a write once it has left for Redis). Waiting does not stop the writer: a relay cancelled meanwhile
        still has its events written."""
        target = self.last_id if upto is None else upto
        while (
            (self._readable_id if readable else self._written_id) < target
            and self._writer is not None
            and not self._writer.done()
        ):
            if self._progress is None or self._progress.done():  # done: cancelled with a waiter before
                self._progress = asyncio.get_running_loop().create_future()
            await self._progress
        self._raise_write_failure()

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            self._queue(self.format.end())

    async def _opened(self) -> bool:
        """Whether the buffer holds the stream's open, once that is known (waiting for it does not cancel it)."""
        opening = self._opening
        if opening is None:
            return True
        if not opening.done():
            await asyncio.wait({opening})
        return not opening.cancelled() and opening.exception() is None

    async def _finish(self) -> None:
        try:
            if await self._opened():  # else there is no stream to end (start raised, and cancelled this task)
                self._end()
                await self._written()
                await self.buffer.close(self.request_id)
        finally:
            self.finished.set()

    @property
    def written_id(self) -> int:
        """The last event the buffer holds: what a reader can have (last_id counts those still being written)."""
        return self._written_id

    @property
    def status(self) -> str:
        """How it ended, for its usage record: failed, cancelled or finished."""
        return "failed" if self.failure else "cancelled" if self.cancel_reason else "finished"

    def cancel(self, reason: str = "api") -> bool:
        if self.finished.is_set() or self.task is None:
            return False
        self.cancel_reason = reason
        if self._running:  # not yet: _run stops at its start, after which its clean-up runs
            self.task.cancel()
        return True

    def reader_joined(self) -> None:
        self.readers += 1
        if self._cancel_timer is not None:
            self._cancel_timer.cancel()
            self._cancel_timer = None

    def reader_left(self, disconnected: bool) -> None:
        """A client went away; if nobody resumes within the grace period, stop generating (a cost feature)."""
        self.readers -= 1
        if disconnected and self.readers == 0 and not self.finished.is_set():
            loop = asyncio.get_running_loop()
            self._cancel_timer = loop.call_later(self.disconnect_grace_s, self._cancel_if_abandoned)

    def _cancel_if_abandoned(self) -> None:
        if self.readers == 0:
            self.cancel("abandoned")
