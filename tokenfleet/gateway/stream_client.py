"""A small HTTP/1.1 client for the gateway's hot path: POST a JSON body to a replica and read the streamed answer
piece by piece. httptools parses, a protocol object buffers what arrives, and a reader waits on one future at a
time (a timer, not a task, enforces the read timeout). Connections are kept alive and reused.

Only `http://` replicas; httpx does everything else (load reports, health checks, https)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from urllib.parse import urlsplit

import httptools


class UpstreamError(Exception):
    """The exchange with the replica failed below HTTP: no connection, a broken one, garbage, or silence.
    (An error status is not one of these: it is the replica's answer.)"""


class UpstreamConnectError(UpstreamError):
    """No connection could be opened."""


class UpstreamClosed(UpstreamError):
    """The replica closed the connection before its response was complete."""


class UpstreamProtocolError(UpstreamError):
    """The replica's bytes are not a valid HTTP response."""


class UpstreamTimeout(UpstreamError):
    """The replica said nothing for too long."""


class UpstreamConnectTimeout(UpstreamTimeout, UpstreamConnectError):
    """Opening the connection took too long."""


class UpstreamReadTimeout(UpstreamTimeout):
    """No response, or no next piece of it, within the read timeout."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection and the response being read on it; the parser's callbacks fill `pieces` and
    wake the reader."""

    def __init__(self, high_water: int) -> None:
        self.transport: asyncio.Transport | None = None
        self.high_water, self.paused, self.lost = high_water, False, False
        self.waiter: asyncio.Future | None = None
        self.idle_since = 0.0
        self.reset()

    def reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.pieces: list[bytes] = []  # not a deque: that preallocates a block per idle connection
        self.status, self.received, self.sized = 0, False, False
        self.headers_done = self.complete = self.keep_alive = False
        self.error: UpstreamError | None = None

    def send(self, head: bytes, body: bytes) -> None:
        self.transport.writelines((head, body))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def usable(self, now: float, idle_s: float) -> bool:
        return (
            not self.lost and not self.received and not self.transport.is_closing() and now - self.idle_since < idle_s
        )

    # --- asyncio.Protocol -------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:  # a small SSE piece must not wait for an ACK (Nagle) before it leaves
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except (OSError, AttributeError):
                pass

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(UpstreamProtocolError(f"invalid HTTP response: {e}"))
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.headers_done and not self.sized and not self.complete:
            self.complete = True  # a body without length or chunking ends with the connection
        elif not self.complete:
            what = "in the middle of the response" if self.headers_done else "before answering"
            self._fail(UpstreamClosed(f"the replica closed the connection {what}"))
        self._wake()

    # --- httptools callbacks ----------------------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() in (b"content-length", b"transfer-encoding"):
            self.sized = True

    def on_headers_complete(self) -> None:
        self.status, self.headers_done = self.parser.get_status_code(), True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.pieces.append(body)
        if len(self.pieces) >= self.high_water and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete, self.keep_alive = True, self.parser.should_keep_alive()
        self._wake()

    # --- the reader's side ------------------------------------------------------------------------------------

    def _fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def wait(self, timeout_s: float) -> None:
        """Until the parser has news (headers, a piece, the end, an error), or UpstreamReadTimeout."""
        loop = asyncio.get_running_loop()
        self.waiter = waiter = loop.create_future()
        timer = loop.call_later(timeout_s, _expire, waiter, timeout_s)
        try:
            await waiter
        finally:
            timer.cancel()
            self.waiter = None

    def take(self) -> bytes:
        data = self.pieces[0] if len(self.pieces) == 1 else b"".join(self.pieces)
        self.pieces.clear()
        if self.paused and not self.lost:
            self.paused = False
            self.transport.resume_reading()
        return data


def _expire(waiter: asyncio.Future, timeout_s: float) -> None:
    if not waiter.done():
        waiter.set_exception(UpstreamReadTimeout(f"the replica sent nothing for {timeout_s:g} s"))


class StreamResponse:
    """The status of a replica's answer and its body, piece by piece as it arrives."""

    def __init__(self, connection: _Connection, read_timeout_s: float) -> None:
        self._connection, self._read_timeout_s = connection, read_timeout_s
        self.status = connection.status

    async def pieces(self) -> AsyncIterator[bytes]:
        """The body as it arrives (chunked encoding removed); UpstreamError if the exchange breaks."""
        c = self._connection
        while True:
            if c.pieces:
                yield c.take()
            elif c.complete:
                return
            elif c.error is not None:
                raise c.error
            else:
                await c.wait(self._read_timeout_s)

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.pieces()])


class _Exchange:
    """`async with client.post(...) as response`: the connection goes back to the pool only when the response was
    read to its end; otherwise it is closed, which is how a replica learns that its reader left."""

    def __init__(self, client: StreamClient, path: str, body: bytes, headers: Mapping[str, str]) -> None:
        self._client, self._path, self._body, self._headers = client, path, body, headers
        self._connection: _Connection | None = None

    async def __aenter__(self) -> StreamResponse:
        self._connection = await self._client._exchange(self._path, self._body, self._headers)
        return StreamResponse(self._connection, self._client.read_timeout_s)

    async def __aexit__(self, exc_type, exc, tb) -> None:
        self._client._release(self._connection, clean=exc_type is None)


class StreamClient:
    def __init__(
        self,
        base_url: str,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 30.0,
        max_idle: int = 64,
        idle_s: float = 4.0,
        high_water: int = 256,
    ) -> None:
        """idle_s: how long an idle connection is kept for reuse; below the servers' own keep-alive timeout
        (uvicorn's, and so vLLM's, is 5 s) so that we rarely pick one the server is just closing."""
        url = urlsplit(base_url)
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"StreamClient speaks plain http to a host, not {base_url!r}")
        self.host, self.port = url.hostname, url.port or 80
        self.prefix = url.path.rstrip("/")
        self.connect_timeout_s, self.read_timeout_s = connect_timeout_s, read_timeout_s
        self.max_idle, self.idle_s, self.high_water = max_idle, idle_s, high_water
        self._head = (
            f"Host: {url.netloc}\r\nContent-Type: application/json\r\nAccept: text/event-stream\r\n"
            "User-Agent: tokenfleet-gateway\r\n"
        )
        self._idle: deque[_Connection] = deque()

    def post(self, path: str, body: bytes, headers: Mapping[str, str] | None = None) -> _Exchange:
        """headers: a few more request headers; their names and values must be plain ASCII without line breaks."""
        return _Exchange(self, path, body, headers or {})

    async def aclose(self) -> None:
        while self._idle:
            self._idle.pop().close()

    def _request_head(self, path: str, body: bytes, headers: Mapping[str, str]) -> bytes:
        extra = "".join(f"{name}: {value}\r\n" for name, value in headers.items() if _safe(name) and _safe(value))
        return (f"POST {self.prefix}{path} HTTP/1.1\r\n{self._head}{extra}Content-Length: {len(body)}\r\n\r\n").encode(
            "latin-1"
        )

    async def _exchange(self, path: str, body: bytes, headers: Mapping[str, str]) -> _Connection:
        """Sends the request and waits for the response's headers. A reused connection that turns out to have been
        closed by the server before it answered anything is retried once on a new connection."""
        head = self._request_head(path, body, headers)
        connection = self._reusable()
        if connection is not None:
            try:
                return await self._send(connection, head, body)
            except UpstreamClosed:
                if connection.received:
                    raise
        return await self._send(await self._connect(), head, body)

    async def _send(self, connection: _Connection, head: bytes, body: bytes) -> _Connection:
        try:
            connection.send(head, body)
            while not connection.headers_done:
                if connection.error is not None:
                    raise connection.error
                await connection.wait(self.read_timeout_s)
        except BaseException:
            connection.close()
            raise
        return connection

    def _reusable(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            connection = self._idle.pop()
            if connection.usable(now, self.idle_s):
                return connection
            connection.close()
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, connection = await loop.create_connection(lambda: _Connection(self.high_water), self.host, self.port)
        except TimeoutError as e:  # before OSError: TimeoutError is one
            raise UpstreamConnectTimeout(
                f"no connection to {self.host}:{self.port} within {self.connect_timeout_s:g} s"
            ) from e
        except OSError as e:
            raise UpstreamConnectError(f"cannot connect to {self.host}:{self.port}: {e}") from e
        return connection

    def _release(self, connection: _Connection, clean: bool) -> None:
        reuse = (
            clean
            and connection.complete
            and connection.keep_alive
            and not connection.lost
            and len(self._idle) < self.max_idle
        )
        if not reuse:
            connection.close()
            return
        now = time.monotonic()
        while self._idle and not self._idle[0].usable(now, self.idle_s):
            self._idle.popleft().close()
        connection.reset()
        connection.idle_since = now
        self._idle.append(connection)


def _safe(text: str) -> bool:
    """Whether text can go into a request head as it is (no header injection, nothing latin-1 cannot encode)."""
    return text.isascii() and text.isprintable()
