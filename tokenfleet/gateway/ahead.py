"""A replica asked ahead of the quota's answer (issue 25: the reservation's Redis round trip off the path to the
first token). The request's routed stream starts at once and its first piece is awaited in a task; the relay,
started only once the request is admitted, gets that piece and then the rest. A request refused meanwhile has its
stream closed, which cancels it at the replica; nothing of it reached the client or the resume buffer."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from opentelemetry import trace

from tokenfleet.gateway.chunks import Piece
from tokenfleet.router.pool import Route


class Ahead:
    def __init__(self, chunks: AsyncIterator[Piece], route: Route, span: trace.Span) -> None:
        self.route, self.span = route, span  # the routing decision and the relay's span, filled in as it goes
        self._chunks = chunks
        self._first = asyncio.ensure_future(self._pull())

    async def _pull(self) -> Piece | None:
        try:
            return await anext(self._chunks)
        except StopAsyncIteration:
            return None

    async def chunks(self) -> AsyncIterator[Piece]:
        """The whole stream: the piece already asked for, then the rest (an error in either raises here)."""
        async with contextlib.aclosing(self._chunks):
            first = await self._first
            if first is None:
                return
            yield first
            async for piece in self._chunks:
                yield piece

    async def cancel(self) -> None:
        """The request will not run: its replica's stream is closed (the replica stops it)."""
        self._first.cancel()
        await asyncio.gather(self._first, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self._chunks.aclose()  # type: ignore[attr-defined]
