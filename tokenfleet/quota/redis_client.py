"""The Redis side of the quota: key names, running scripts by their SHA (loading them on NOSCRIPT), and turning every
way Redis can be unreachable into QuotaStoreError, within a hard deadline.

Script calls are batched (batcher.py): the calls of one event-loop tick go to Redis as one pipelined write of EVALSHA
commands on one connection, packed by hiredis, and their replies are read back in order. Each is still its own
script call, atomic on its own, exactly as if it had been sent alone; only the round trips are shared."""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    BusyLoadingError,
    ClusterDownError,
    NoScriptError,
    ReadOnlyError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tokenfleet.quota.base import QuotaStoreError
from tokenfleet.quota.batcher import TickBatcher

UNREACHABLE = (
    RedisConnectionError,
    RedisTimeoutError,
    BusyLoadingError,
    ReadOnlyError,
    ClusterDownError,
    TryAgainError,
    OSError,
    asyncio.TimeoutError,
)


MAX_BATCH = 128  # script calls per round trip


class Script:
    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class ScriptCall:
    script: Script
    keys: Sequence[str]
    args: Sequence[Any]  # str, bytes, int or float

    def packed(self, by_sha: bool = True) -> bytes:
        head = ("EVALSHA", self.script.sha) if by_sha else ("EVAL", self.script.source)
        packed: bytes = hiredis.pack_command((*head, len(self.keys), *self.keys, *self.args))
        return packed


def connect(
    url: str, *, connect_timeout_s: float = 0.25, socket_timeout_s: float = 0.25, max_connections: int = 16
) -> aioredis.Redis:
    """A client for the quota: short timeouts, and no retries, because a script whose reply was lost may have run
    (retrying a reserve would charge twice). A bounded pool whose callers queue for a free connection."""
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=None,
        socket_connect_timeout=connect_timeout_s,
        socket_timeout=socket_timeout_s,
        retry=Retry(NoBackoff(), 0),
    )
    return aioredis.Redis(connection_pool=pool)


class RedisStore:
    """At most `max_in_flight` batches of script calls talk to Redis at once; the others queue here, outside the
    deadline, so a burst is not mistaken for an outage. A call that fails marks the time: the calls of batches that
    were queued before then fail at once instead of each paying its own timeout."""

    def __init__(self, client: aioredis.Redis, prefix: str, call_timeout_s: float, max_in_flight: int = 16) -> None:
        if "{" in prefix or "}" in prefix:
            raise ValueError(f"the key prefix must not contain braces (they mark the hash tag), got {prefix!r}")
        if call_timeout_s <= 0 or max_in_flight < 1:
            raise ValueError("call_timeout_s must be positive and max_in_flight at least 1")
        self.client, self.prefix, self.call_timeout_s = client, prefix, call_timeout_s
        self.batcher: TickBatcher[ScriptCall] = TickBatcher(self._run_batch, MAX_BATCH)
        self._slots = asyncio.Semaphore(max_in_flight)
        self._failed_at = float("-inf")

    def key(self, tag: str, *parts: str) -> str:
        """`{prefix}{tag}:part:...`: every key of one request carries the same hash tag, so one cluster slot."""
        return f"{self.prefix}{{{tag}}}:" + ":".join(parts)

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """The script's reply; QuotaStoreError when Redis cannot be reached in time, ResponseError when it fails."""
        return await self.batcher.submit(ScriptCall(script, keys, args))

    async def command(self, *args: Any) -> Any:
        return await self._bounded(lambda: self.client.execute_command(*args))

    async def close(self) -> None:
        """Waits for the batches in flight (each ends within the deadline)."""
        await self.batcher.wait_idle()

    async def _run_batch(self, calls: list[ScriptCall]) -> list[Any]:
        queued = time.monotonic()
        async with self._slots:
            if self._failed_at > queued:
                return [QuotaStoreError(QUEUED_IN_OUTAGE) for _ in calls]
            try:
                async with asyncio.timeout(self.call_timeout_s):
                    replies = await run_scripts(self.client, calls, read_timeout_s=math.inf)
            except UNREACHABLE as e:
                self._failed_at = time.monotonic()
                return [QuotaStoreError(f"quota store unreachable: {type(e).__name__}: {e}") for _ in calls]
        for i, reply in enumerate(replies):
            if isinstance(reply, UNREACHABLE):  # e.g. LOADING, READONLY: Redis answered, but cannot decide
                self._failed_at = time.monotonic()
                replies[i] = QuotaStoreError(f"quota store unreachable: {type(reply).__name__}: {reply}")
        return replies

    async def _bounded(self, call: Callable[[], Awaitable[Any]]) -> Any:
        queued = time.monotonic()
        async with self._slots:
            if self._failed_at > queued:
                raise QuotaStoreError(QUEUED_IN_OUTAGE)
            try:
                async with asyncio.timeout(self.call_timeout_s):
                    return await call()
            except UNREACHABLE as e:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    # the caller was cancelled and the client's clean-up turned that into a timeout or connection
                    # error: honour the cancellation (a task that swallows it never ends)
                    raise asyncio.CancelledError() from e
                self._failed_at = time.monotonic()
                raise QuotaStoreError(f"quota store unreachable: {type(e).__name__}: {e}") from e


QUEUED_IN_OUTAGE = "quota store unreachable (failed while this call was queued)"


async def run_scripts(
    client: aioredis.Redis, calls: Sequence[ScriptCall], read_timeout_s: float | None = None
) -> list[Any]:
    """The calls' replies, in order, from one write on one pooled connection; an error reply is returned in its
    place, not raised. Scripts Redis does not know (NOSCRIPT: a restarted or failed-over server) are sent again with
    their source, which also caches them there. A connection error is retried as the client's own retry policy says
    (redis-py's `retry`); a timeout or a lost connection raises. `read_timeout_s`: per reply (None: the client's
    socket timeout; math.inf: none, the caller keeps a deadline of its own)."""
    pool = client.connection_pool
    connection = await pool.get_connection()

    async def exchange() -> list[Any]:
        replies = await _exchange(connection, [call.packed() for call in calls], read_timeout_s)
        unknown = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if unknown:
            again = await _exchange(connection, [calls[i].packed(by_sha=False) for i in unknown], read_timeout_s)
            for i, reply in zip(unknown, again):
                replies[i] = reply
        return replies

    async def disconnect(error: Exception) -> None:
        await connection.disconnect()

    try:
        replies: list[Any] = await connection.retry.call_with_retry(exchange, disconnect)
        return replies
    except BaseException:
        await connection.disconnect(nowait=True)  # replies may be left unread on it
        raise
    finally:
        await pool.release(connection)


async def _exchange(connection: AbstractConnection, packed: list[bytes], read_timeout_s: float | None) -> list[Any]:
    """Sends the packed commands in one write and reads one reply per command; an error reply is returned."""
    await connection.send_packed_command(b"".join(packed))
    replies: list[Any] = []
    for _ in packed:
        try:
            replies.append(await connection.read_response(timeout=read_timeout_s))
        except ResponseError as e:
            replies.append(e)
    return replies


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
