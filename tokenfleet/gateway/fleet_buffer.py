"""A fleet gateway's resume buffer: Redis, where any gateway can resume a stream, and a copy in memory of the
streams this gateway relays, which its own clients read. When Redis fails, requests are still served: a new stream
goes on without resume elsewhere (`resumable` is False: the gateway says so in a header), and a stream in flight
goes on from the copy, so its clients never notice.

Every write is on its way to Redis before the copy takes it: the copy (what this gateway's clients read) gets a write
once its bytes have left this process for Redis, not once Redis has answered, so Redis's round trip is off the time to
first token. A gateway dying after that still leaves the events in Redis, where the reaper bills from (metering's bar:
at least what the client received): the kernel delivers what the process handed it, and the Redis write was handed
over before any byte of those events to a client. A write asyncio could not hand to the kernel at once (a full
socket) reaches the copy with Redis's answer, as before; one Redis then refuses stays in the copy, and the stream goes
on unshared, as after any Redis failure."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from tokenfleet.api.errors import APIError
from tokenfleet.api.usage import Usage
from tokenfleet.gateway.resume import (
    REDIS_FAILURES,
    Follower,
    MemoryResumeBuffer,
    RedisResumeBuffer,
    StreamEvent,
    settle,
)
from tokenfleet.quota.redis_client import Once

log = logging.getLogger(__name__)
UNSHARED = "the resume buffer failed while this request streamed: its remaining events could not be kept for a resume"


def redis_client(url: str, connect_timeout_s: float = 0.5, socket_timeout_s: float = 3.0) -> aioredis.Redis:
    """A client that survives a Redis restart: a pooled connection the old server closed is reconnected and the
    command sent again, once, at once (`retry`); one idle for a while is checked with a PING before use. Short
    timeouts, and no retry of a timeout, because a request's stream waits on these calls."""
    return aioredis.Redis.from_url(
        url,
        socket_connect_timeout=connect_timeout_s,
        socket_timeout=socket_timeout_s,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        retry_on_error=[RedisConnectionError],
        health_check_interval=15,
    )


class FleetResumeBuffer:
    """Hands each write to Redis first, then to the copy: a client here never sees an event that is not on its way
    to Redis (which metering could not find should this gateway die). After a Redis failure, new streams skip Redis for
    `retry_after_s` instead of each waiting for it to fail again."""

    def __init__(self, shared: RedisResumeBuffer, retry_after_s: float = 1.0) -> None:
        self.shared, self.local = shared, MemoryResumeBuffer(shared.ttl_s)
        self.retry_after_s = retry_after_s
        self.unshared: set[str] = set()  # streams relayed here that Redis does not hold (to their end)
        self._skip_until = 0.0
        self._failing = False
        self._answers: dict[str, asyncio.Future] = {}  # request id -> its open's answer, while still to come
        self._settling: dict[str, asyncio.Future] = {}  # request id -> a reader waiting for `settled`

    async def open(self, request_id: str, owner: str = "", kind: str = "openai") -> None:
        """Returns once the open is queued for this tick's write to Redis: the stream's writes may go before the open's
        answer, and even before the open itself, which they carry until it is answered (RedisResumeBuffer.queue_open).
        The answer comes in the background; a failure leaves the stream unshared, like a failed write."""
        await self.local.open(request_id, owner, kind)
        if time.monotonic() < self._skip_until:
            self.unshared.add(request_id)
            return
        answer = self.shared.queue_open(request_id, owner, kind)
        self._answers[request_id] = answer
        answer.add_done_callback(lambda _: self._open_answered(request_id, answer))

    def _open_answered(self, request_id: str, answer: asyncio.Future) -> None:
        if self._answers.get(request_id) is answer:
            del self._answers[request_id]
        if answer.cancelled():  # its write never went out (the loop is shutting down)
            pass
        elif (error := answer.exception()) is not None:
            self._shared_failed(request_id, error)
        else:
            self._shared_ok()
        if not self.local.holds(request_id):  # released meanwhile: the request never started
            self.unshared.discard(request_id)

    async def append(self, request_id: str, event: StreamEvent) -> None:
        if request_id not in self.unshared:
            await self._share(request_id, self.shared.append(request_id, event))
        await self.local.append(request_id, event)

    async def append_many(
        self, request_id: str, events: list[StreamEvent], shown: Callable[[], None] | None = None
    ) -> None:
        def copy_now() -> None:
            self.local.add_many(request_id, events)
            waiter = self._settling.get(request_id)
            if waiter is not None:
                settle(waiter)
            if shown is not None:
                shown()

        copy = Once(copy_now)  # when the write has left for Redis, else after its answer (or without Redis)
        if request_id not in self.unshared:
            await self._share(request_id, self.shared.append_sent(request_id, events, copy))
        copy()

    async def close(self, request_id: str) -> None:
        if request_id not in self.unshared:
            await self._share(request_id, self.shared.close(request_id))
        elif time.monotonic() >= self._skip_until:  # readers elsewhere get an error, not a stream that stalls
            with contextlib.suppress(*REDIS_FAILURES):
                await self.shared.abandon(request_id, UNSHARED)
        await self.local.close(request_id)

    async def _share(self, request_id: str, write: Awaitable[None]) -> None:
        try:
            await write
        except REDIS_FAILURES as e:
            self._shared_failed(request_id, e)
            return
        self._shared_ok()

    def _shared_failed(self, request_id: str, error: BaseException) -> None:
        self.unshared.add(request_id)
        self._skip_until = time.monotonic() + self.retry_after_s
        if not self._failing:
            log.warning("resume buffer: Redis failed (%r); streams go on without resume until it is back", error)
        self._failing = True

    def _shared_ok(self) -> None:
        if self._failing:
            log.warning("resume buffer: Redis is back")
        self._failing = False

    async def owner(self, request_id: str) -> str | None:
        if self.local.holds(request_id):
            return await self.local.owner(request_id)
        try:
            return await self.shared.owner(request_id)
        except REDIS_FAILURES as e:
            raise APIError(
                503,
                f"streams cannot be resumed right now: the resume buffer is unavailable "
                f"({type(e).__name__}); retry shortly",
                "service_unavailable",
                code="service_unavailable",
                headers={"retry-after": "1"},
            ) from e

    def follow(self, request_id: str, after: int) -> Follower:
        source = self.local if self.local.holds(request_id) else self.shared
        return source.follow(request_id, after)

    def read(self, request_id: str, after: int) -> AsyncIterator[StreamEvent]:
        source = self.local if self.local.holds(request_id) else self.shared
        return source.read(request_id, after)

    def resumable(self, request_id: str) -> bool:
        return request_id not in self.unshared

    def release(self, request_id: str) -> None:
        self.local.forget(request_id)
        self.unshared.discard(request_id)

    async def settled(self, request_id: str) -> None:
        """Until the open's answer, or the stream's first write readable here, whichever comes first (so the first
        token never waits for the answer). A Redis that is down has refused the open by then: the first write goes
        in a later script call than the open, and reaches the copy only once it, too, failed."""
        answer = self._answers.get(request_id)
        if answer is None or answer.done() or self.local.written(request_id):
            return
        waiter = asyncio.get_running_loop().create_future()
        self._settling[request_id] = waiter
        answer.add_done_callback(lambda _: settle(waiter))
        try:
            await waiter
        finally:
            self._settling.pop(request_id, None)

    async def discard(self, request_id: str) -> None:
        answer = self._answers.get(request_id)
        if answer is not None:  # the open first: the delete, on another connection, could overtake it
            await asyncio.wait({answer})
        shared = request_id not in self.unshared
        self.release(request_id)
        if shared:  # else Redis may hold its open, left to expire (a request that never started is not resumed)
            with contextlib.suppress(*REDIS_FAILURES):
                await self.shared.discard(request_id)

    async def last_usage(self, request_id: str) -> Usage | None:
        return await self.shared.last_usage(request_id)

    async def keep_alive(self) -> None:
        await self.shared.keep_alive()
