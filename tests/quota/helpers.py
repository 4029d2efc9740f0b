"""Shared helpers of the quota tests: running a coroutine, scopes, and a TCP proxy to Redis that a test can cut."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from tokenfleet.quota import Limits, Scope

REDIS_URL = "redis://127.0.0.1:6379"
REDIS_PORT = 6379


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coro)


def org(tenant: str = "acme", **limits: int) -> Scope:
    return Scope(f"org:{tenant}", tenant, Limits(**limits))


def user(tenant: str = "acme", number: int = 7, **limits: int) -> Scope:
    return Scope(f"user:{tenant}/{number}", tenant, Limits(**limits))


@contextlib.asynccontextmanager
async def opened(make: Callable[..., Any], **options: Any) -> AsyncIterator[Any]:
    quota = make(**options)
    try:
        yield quota
    finally:
        await quota.close()


class Proxy:
    """Forwards 127.0.0.1:<port> to Redis; stop() drops the listener and every live connection, start() listens
    on the same port again. `reply_delay_s`: Redis's replies are held that long (commands go on at once)."""

    def __init__(self, target_port: int = REDIS_PORT, reply_delay_s: float = 0.0) -> None:
        self.target_port, self.port, self.reply_delay_s = target_port, 0, reply_delay_s
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers |= {writer, up_writer}
        pipes = [
            asyncio.create_task(self._pipe(reader, up_writer, 0.0)),
            asyncio.create_task(self._pipe(up_reader, writer, self.reply_delay_s)),
        ]
        self._tasks.update(pipes)
        await asyncio.gather(*pipes, return_exceptions=True)
        self._tasks.difference_update(pipes)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
        try:
            while data := await reader.read(65536):
                if delay_s:
                    await asyncio.sleep(delay_s)
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()
            self._writers.discard(writer)


async def silent_server() -> asyncio.base_events.Server:
    """Accepts connections and never answers: a hung Redis."""

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the client gives up
        writer.close()

    return await asyncio.start_server(hold, "127.0.0.1", 0)
