"""The gateway's HTTP/1.1 stream client against a real socket: a tiny asyncio HTTP server in the test writes chunked
SSE the way a replica does, or misbehaves (stalls, hangs up mid-stream, answers an error, closes idle connections),
and the failures must reach the router as the failure kinds it acts on."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable

import pytest

from tokenfleet.api.errors import APIError
from tokenfleet.gateway.routing import TIMEOUTS, TRANSPORT_ERRORS, _failure_kind
from tokenfleet.gateway.upstream import HttpUpstream

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, dict], Awaitable[None]]
SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(text: str) -> bytes:
    data = text.encode()
    return b"%x\r\n%s\r\n" % (len(data), data)


def event(i: int) -> str:
    return "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": f"t{i}"}}]}) + "\n\n"


class Replica:
    """An HTTP server on 127.0.0.1 that reads each request (head and body) and hands it to `handler`, on one
    connection after another (keep-alive)."""

    def __init__(self, handler: Handler) -> None:
        self.handler, self.requests, self.connections = handler, [], 0
        self.hung_up = asyncio.Event()  # set when a client closed a connection while a response was being sent

    async def __aenter__(self) -> Replica:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                request = {"line": lines[0], "headers": headers, "body": json.loads(body), "reader": reader}
                self.requests.append(request)
                await self.handler(reader, writer, request)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()


async def collect(upstream: HttpUpstream, got: list | None = None, kind: str = "chat") -> list[dict]:
    got = [] if got is None else got
    async with asyncio.timeout(10):  # a bug here must fail the test, not hang it
        async for piece in upstream.stream(kind, {"model": "m", "messages": []}):
            got.append(piece)
    return got


def test_streams_chunked_sse_and_reuses_the_connection():
    async def sse(reader, writer, request):
        writer.write(SSE_HEAD)
        writer.write(chunk(event(0) + event(1)))
        text = event(2)
        writer.write(chunk(text[:17]))  # one event split over two chunks (and two TCP writes)
        await writer.drain()
        await asyncio.sleep(0.02)
        writer.write(chunk(text[17:] + ": ping\n\nid: 7\nevent: x\n" + event(3).replace("\n", "\r\n", 1)))
        writer.write(chunk("data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()

    async def scenario():
        async with Replica(sse) as replica:
            upstream = HttpUpstream(replica.url, "r")
            first = await collect(upstream)
            second = await collect(upstream)
            await upstream.aclose()
        assert [c["choices"][0]["delta"]["content"] for c in first] == ["t0", "t1", "t2", "t3"]
        assert second == first
        assert replica.connections == 1, "the second request reuses the kept-alive connection"
        request = replica.requests[0]
        assert request["line"] == "POST /v1/chat/completions HTTP/1.1"
        assert request["headers"]["content-type"] == "application/json"
        assert request["body"]["stream"] is True and request["body"]["stream_options"]["include_usage"] is True

    asyncio.run(scenario())


def test_a_replica_that_goes_quiet_mid_stream_is_a_read_timeout():
    async def stall(reader, writer, request):
        writer.write(SSE_HEAD + chunk(event(0)))
        await writer.drain()
        await asyncio.sleep(5)

    async def scenario():
        async with Replica(stall) as replica:
            upstream = HttpUpstream(replica.url, "r", read_timeout_s=0.3)
            got, started = [], time.monotonic()
            with pytest.raises(APIError) as failed:
                await collect(upstream, got)
            waited = time.monotonic() - started
        assert len(got) == 1, "what arrived before the silence is delivered"
        assert 0.3 <= waited < 2.0
        assert failed.value.status == 502 and failed.value.code == "upstream_error"
        assert isinstance(failed.value.__cause__, TIMEOUTS)
        assert _failure_kind(failed.value, streaming=True) == "timeout"

    asyncio.run(scenario())


def test_a_replica_that_never_answers_is_a_read_timeout():
    async def silent(reader, writer, request):
        await asyncio.sleep(5)

    async def scenario():
        async with Replica(silent) as replica:
            with pytest.raises(APIError) as failed:
                await collect(HttpUpstream(replica.url, "r", read_timeout_s=0.2))
        assert _failure_kind(failed.value, streaming=False) == "timeout"

    asyncio.run(scenario())


def test_a_connection_closed_mid_stream_is_a_broken_stream():
    async def hang_up(reader, writer, request):
        writer.write(SSE_HEAD + chunk(event(0)) + b'40\r\ndata: {"cho')  # then gone, mid-chunk
        await writer.drain()
        writer.close()

    async def scenario():
        async with Replica(hang_up) as replica:
            got = []
            with pytest.raises(APIError) as failed:
                await collect(HttpUpstream(replica.url, "r"), got)
        assert len(got) == 1
        cause = failed.value.__cause__
        assert failed.value.code == "upstream_error"
        assert isinstance(cause, TRANSPORT_ERRORS) and not isinstance(cause, TIMEOUTS)
        assert _failure_kind(failed.value, streaming=True) == "stream_broken"
        assert _failure_kind(failed.value, streaming=False) == "connect"  # had it closed before the first chunk

    asyncio.run(scenario())


@pytest.mark.parametrize("status", [400, 429, 500])
def test_an_error_status_is_the_replicas_answer(status):
    error = {
        "error": {
            "message": "max_tokens is too large",
            "type": "invalid_request_error",
            "param": "max_tokens",
            "code": "bad_max",
        }
    }

    async def refuse(reader, writer, request):
        body = json.dumps(error).encode()
        writer.write(
            b"HTTP/1.1 %d Nope\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (status, len(body), body)
        )
        await writer.drain()

    async def scenario():
        async with Replica(refuse) as replica:
            with pytest.raises(APIError) as failed:
                await collect(HttpUpstream(replica.url, "r"))
        e = failed.value
        if status < 500:  # the client's mistake, passed through as the replica said it
            assert (e.status, e.message, e.type, e.param, e.code) == (
                status,
                "max_tokens is too large",
                "invalid_request_error",
                "max_tokens",
                "bad_max",
            )
            assert e.__cause__ is None
        else:
            assert e.status == 502 and e.code == "upstream_error" and "answered 500" in e.message
            assert _failure_kind(e, streaming=False) == "5xx"

    asyncio.run(scenario())


def test_no_replica_listening_is_a_connect_failure():
    async def scenario():
        async with Replica(None) as replica:
            url = replica.url
        with pytest.raises(APIError) as failed:
            await collect(HttpUpstream(url, "r"))
        assert _failure_kind(failed.value, streaming=False) == "connect"

    asyncio.run(scenario())


def test_a_reader_that_leaves_closes_the_replicas_connection():
    async def endless(reader, writer, request):
        writer.write(SSE_HEAD)
        for i in range(1000):
            writer.write(chunk(event(i)))
            await writer.drain()
            await asyncio.sleep(0.01)
            if reader.at_eof():
                replica.hung_up.set()
                return

    async def scenario():
        nonlocal replica
        async with Replica(endless) as replica:
            stream = HttpUpstream(replica.url, "r").stream("chat", {"model": "m"})
            assert "choices" in await anext(stream)
            await stream.aclose()
            async with asyncio.timeout(5):
                await replica.hung_up.wait()  # the replica learns at once: it would cancel the request

    replica = None
    asyncio.run(scenario())


@pytest.mark.parametrize("when", ["while idle", "as the next request arrives"])
def test_a_kept_alive_connection_the_server_closed_is_replaced(when):
    """A server may close an idle keep-alive connection at any moment, even just as a request goes out on it."""
    served = {}

    async def once(reader, writer, request):
        served[writer] = served.get(writer, 0) + 1
        if served[writer] == 2:  # the second request on this connection: gone without a word
            writer.close()
            return
        writer.write(SSE_HEAD + chunk(event(0) + "data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()
        if when == "while idle":
            writer.close()

    async def scenario():
        async with Replica(once) as replica:
            upstream = HttpUpstream(replica.url, "r")
            assert len(await collect(upstream)) == 1
            await asyncio.sleep(0.05)
            assert len(await collect(upstream)) == 1
        assert replica.connections == 2

    asyncio.run(scenario())
