"""The Redis side of the quota: key names, running a script by its SHA (loading it on NOSCRIPT), and turning every
way Redis can be unreachable into QuotaStoreError, within a hard deadline."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import BusyLoadingError, ClusterDownError, NoScriptError, ReadOnlyError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tokenfleet.quota.base import QuotaStoreError

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


class Script:
    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()


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
    """At most `max_in_flight` calls talk to Redis at once; the others queue here, outside the deadline, so a burst
    is not mistaken for an outage. A call that fails marks the time: calls that were queued before then fail at
    once instead of each paying its own timeout."""

    def __init__(self, client: aioredis.Redis, prefix: str, call_timeout_s: float, max_in_flight: int = 16) -> None:
        if "{" in prefix or "}" in prefix:
            raise ValueError(f"the key prefix must not contain braces (they mark the hash tag), got {prefix!r}")
        if call_timeout_s <= 0 or max_in_flight < 1:
            raise ValueError("call_timeout_s must be positive and max_in_flight at least 1")
        self.client, self.prefix, self.call_timeout_s = client, prefix, call_timeout_s
        self._slots = asyncio.Semaphore(max_in_flight)
        self._failed_at = float("-inf")

    def key(self, tag: str, *parts: str) -> str:
        """`{prefix}{tag}:part:...`: every key of one request carries the same hash tag, so one cluster slot."""
        return f"{self.prefix}{{{tag}}}:" + ":".join(parts)

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        async def call() -> Any:
            try:
                return await self.client.evalsha(script.sha, len(keys), *keys, *args)
            except NoScriptError:  # a restarted or failed-over server: EVAL runs it and caches it again
                return await self.client.eval(script.source, len(keys), *keys, *args)

        return await self._bounded(call)

    async def command(self, *args: Any) -> Any:
        return await self._bounded(lambda: self.client.execute_command(*args))

    async def _bounded(self, call: Callable[[], Awaitable[Any]]) -> Any:
        queued = time.monotonic()
        async with self._slots:
            if self._failed_at > queued:
                raise QuotaStoreError("quota store unreachable (failed while this call was queued)")
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


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
