"""An SSE response that never lets a client hold up anything: heartbeats while idle, a send timeout and a lag
limit for slow readers, and it tells its owner how the connection ended.

One task per stream does all of it: the request's own task reads the resume buffer, writes events and pings, and
times its sends. A second, idle one only waits for the disconnect message (ASGI offers no other way to learn of
it) and interrupts the first when it comes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from tokenfleet.api.sse import PING, SSE_HEADERS, sse_event
from tokenfleet.gateway.resume import Follower, StreamEvent
from tokenfleet.metering.outage import raise_if_cancelled


class SSEResponse(Response):
    media_type = "text/event-stream"

    def __init__(
        self,
        source: Follower,
        headers: dict,
        ping_interval_s: float,
        send_timeout_s: float,
        on_end: Callable[[str], None],
        behind: Callable[[int], bool] | None = None,
        event_ids: bool = True,
    ) -> None:
        """behind(event_id): whether a reader now at this event is too far behind the stream (it is cut off);
        event_ids: whether each event is written with its id and name, or as OpenAI's bare `data:` lines."""
        self.status_code, self.background = 200, None
        self.init_headers({**SSE_HEADERS, **headers})  # no body attribute: no content-length, it streams
        self.source, self.ping_interval_s, self.send_timeout_s = source, ping_interval_s, send_timeout_s
        self.on_end, self.behind = on_end, behind  # on_end: "complete", "disconnect", "slow" or "error"
        self.event_ids = event_ids
        self._client_left = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        task = asyncio.current_task()
        watcher = asyncio.create_task(self._watch(receive, task))
        ending = "error"
        try:
            ending = await self._pump(send)
            if ending == "complete":
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not self._client_left:
                raise  # cancelled from outside (shutdown): not ours to swallow
            task.uncancel()
            ending = "disconnect"
        except (OSError, TimeoutError):
            ending = "slow"
        finally:
            watcher.cancel()
            self.on_end(ending)

    async def _watch(self, receive: Receive, task: asyncio.Task) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._client_left = True
        task.cancel()

    async def _pump(self, send: Send) -> str:
        """Writes what the buffer has as it comes (several events in one write when the reader is behind), a ping
        when nothing was written for ping_interval_s; returns how the stream ended."""
        loop = asyncio.get_running_loop()
        ping_at = loop.time() + self.ping_interval_s
        while True:
            events = await self.source.next(max(0.0, ping_at - loop.time()))
            # a disconnect cancels this task; redis-py may lose that cancellation and return normally, and sends
            # to a closed connection do not fail, so without this the stream would go on to its end unread
            raise_if_cancelled()
            if events is None:
                return "complete"
            if events:
                if self.behind is not None and self.behind(events[0].id):
                    return "slow"
                await self._send(send, _render(events) if self.event_ids else _render_data(events))
            elif loop.time() < ping_at:
                continue
            else:
                await self._send(send, PING)
            ping_at = loop.time() + self.ping_interval_s

    async def _send(self, send: Send, text: str) -> None:
        async with asyncio.timeout(self.send_timeout_s):
            await send({"type": "http.response.body", "body": text.encode(), "more_body": True})


def _render_data(events: list[StreamEvent]) -> str:
    return "".join(sse_event(e.data) for e in events)


def _render(events: list[StreamEvent]) -> str:
    if len(events) == 1:
        e = events[0]
        return sse_event(e.data, e.id, e.event)
    return "".join(sse_event(e.data, e.id, e.event) for e in events)
