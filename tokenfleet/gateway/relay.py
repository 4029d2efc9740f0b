"""A relay runs one request's generation in the background, independent of any client connection, and writes
every event to the resume buffer; client connections read from there at their own pace. So a slow or dropped
client never blocks generation, and a reconnecting client resumes where it left off."""

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
    _usage_json: str | None = None  # self.usage as stored beside each event, for metering after a crash

    async def start(self, chunks: AsyncIterator[Piece]) -> None:
        await self.buffer.open(self.request_id, self.owner, self.format.kind)
        await self._emit_all(self.format.start())
        self.task = asyncio.create_task(self._run(chunks), name=f"relay-{self.request_id}")

    async def _run(self, chunks: AsyncIterator[Piece]) -> None:
        self._running = True
        try:
            async with aclosing(chunks):  # however the relay stops, the replica's stream is closed now
                self._stop_if_cancelled()
                async for chunk in chunks:
                    await self._relay(chunk)
                    self._stop_if_cancelled()
        except APIError as e:
            self.failure = e.message
            await self._emit_all(self.format.error(e))
        except asyncio.CancelledError:
            self.cancel_reason = self.cancel_reason or "shutdown"
            log.info("request %s cancelled", self.request_id)
        except Exception as e:  # the replica broke mid-stream: the client gets an error event, not a hang
            log.exception("relay %s failed", self.request_id)
            self.failure = f"generation failed: {e}"
            await self._emit_all(self.format.error(APIError(502, self.failure, "server_error")))
        finally:
            await self._finish()

    async def _relay(self, chunk: Piece) -> None:
        if not isinstance(chunk, Chunk):  # the replica died; the response goes on from another one
            await self._emit_all(self.format.retrying(chunk))
            return
        if self.first_token_at is None and chunk.choices:
            self.first_token_at = time.monotonic()
        if chunk.usage is not None:
            self.usage = chunk.usage
            self._usage_json = chunk.usage.to_json()
        await self._emit_all(self.format.chunk(chunk))

    def _stop_if_cancelled(self) -> None:
        """A cancellation can get lost on its way in: redis-py swallows one that lands just as a reply arrives and
        returns normally, and the relay would then generate to the end. So it checks between events as well."""
        if self.cancel_reason is not None:
            raise asyncio.CancelledError()
        raise_if_cancelled()

    async def _emit_all(self, events: list[Event]) -> None:
        for data, name in events:
            self.last_id += 1
            await self.buffer.append(self.request_id, StreamEvent(self.last_id, data, name, self._usage_json))

    async def _finish(self) -> None:
        try:
            await self._emit_all(self.format.end())
            await self.buffer.close(self.request_id)
        finally:
            self.finished.set()

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
