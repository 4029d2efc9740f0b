"""An SSE response that never lets a client hold up anything: heartbeats while idle, a send timeout and a lag
limit for slow readers, and it tells its owner how the connection ended."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from tokenfleet.api.sse import PING, SSE_HEADERS


class SlowClient(Exception):
    """The reader fell too far behind the stream; cut it off, it can resume."""


class SSEResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], headers: dict, ping_interval_s: float, send_timeout_s: float,
                 on_end: Callable[[str], None]) -> None:
        self.status_code, self.background = 200, None
        self.init_headers({**SSE_HEADERS, **headers})  # no body attribute: no content-length, it streams
        self.events, self.ping_interval_s, self.send_timeout_s = events, ping_interval_s, send_timeout_s
        self.on_end = on_end  # called with "complete", "disconnect", "slow" or "error"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        disconnected = asyncio.create_task(_wait_disconnect(receive))
        ending = "error"
        try:
            ending = await self._pump(send, disconnected)
            if ending == "complete":
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except SlowClient:
            ending = "slow"
        except (OSError, asyncio.TimeoutError):
            ending = "slow"
        finally:
            disconnected.cancel()
            self.on_end(ending)

    async def _pump(self, send: Send, disconnected: asyncio.Task) -> str:
        events = aiter(self.events)
        try:
            while True:
                upcoming = asyncio.ensure_future(anext(events))
                while True:
                    done, _ = await asyncio.wait({upcoming, disconnected}, timeout=self.ping_interval_s,
                                                 return_when=asyncio.FIRST_COMPLETED)
                    if disconnected in done:
                        upcoming.cancel()
                        await asyncio.gather(upcoming, return_exceptions=True)  # let the generator unwind first
                        return "disconnect"
                    if upcoming in done:
                        break
                    await self._send(send, PING)
                try:
                    text = upcoming.result()
                except StopAsyncIteration:
                    return "complete"
                await self._send(send, text)
        finally:
            await events.aclose()

    async def _send(self, send: Send, text: str) -> None:
        message = {"type": "http.response.body", "body": text.encode(), "more_body": True}
        await asyncio.wait_for(send(message), self.send_timeout_s)


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
