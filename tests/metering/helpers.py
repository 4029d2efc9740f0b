"""Shared helpers of the metering tests: events, counting warehouse rows, waiting, and a TCP proxy to Redis that a
test can cut and restore."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import func, select

from tokenfleet.metering import UsageEvent
from tokenfleet.store.db import Database
from tokenfleet.store.models import UsageEventRow

REDIS_URL = "redis://127.0.0.1:6379"
REDIS_PORT = 6379
START = datetime(2026, 3, 1, 23, 59, 58, tzinfo=UTC)


def event(n: int = 0, **overrides: Any) -> UsageEvent:
    values: dict[str, Any] = dict(
        request_id=f"chatcmpl-{n:06d}",
        org_id=f"org_{n % 3}",
        user_id=f"user_{n % 5}",
        key_id=f"key_{n % 5}",
        model="demo-2026-01-01",
        replica="10.0.0.7:8100",
        pool="eu-west",
        tier="paid",
        input_tokens=100 + n,
        cached_tokens=n % 50,
        output_tokens=n,
        ttft_s=0.05,
        latency_s=1.5,
        status="finished",
        route="cache-aware prefix=3 load=0.4",
        started_at=START,
        ended_at=START + timedelta(seconds=1.5),
    )
    values.update(overrides)
    return UsageEvent(**values)


def events(count: int, first: int = 0) -> list[UsageEvent]:
    return [event(n) for n in range(first, first + count)]


async def row_counts(db: Database) -> dict[str, int]:
    """request_id -> how many warehouse rows it has (the primary key makes more than one impossible, but the
    tests check what they claim)."""
    query = select(UsageEventRow.request_id, func.count()).group_by(UsageEventRow.request_id)
    async with db.session() as session:
        return dict((await session.execute(query)).all())


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.02)


class Proxy:
    """127.0.0.1:<port> forwarded to Redis. stop() closes the listener and every live connection (Redis looks
    down: refused connections); start() listens on the same port again."""

    def __init__(self, target_port: int = REDIS_PORT) -> None:
        self.target_port, self.port = target_port, 0
        self._server: asyncio.Server | None = None
        self._links: set[asyncio.Task] = set()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._link, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self._server.close()
        for task in list(self._links):
            task.cancel()
        await asyncio.gather(*self._links, return_exceptions=True)
        await self._server.wait_closed()

    async def _link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._links.add(task)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                w.close()
            self._links.discard(task)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:  # one side reset the link (a cut, or a client giving up): the proxy just closes it
        pass
    writer.close()
