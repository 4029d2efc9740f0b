"""The events of one read from a replica go through the gateway together: one write to the resume buffer (one entry
of Redis's script call) and one ASGI body message to the client, each event in it still a complete SSE event in
OpenAI's shape, as the openai SDK parses it; only the first token goes out on its own, at once. Also what that must not change: the events' order, the usage stored
beside them for metering after a crash, a failed write ending the stream with an error, the open in the buffer
before any event (while the replica is already asked). A real gateway over HTTP (uvicorn), a real replica socket
that writes a burst of chunks at once, real Redis."""

from __future__ import annotations

import asyncio
import json
import uuid

import openai
import pytest
import redis.asyncio as aioredis
import uvicorn
from redis.exceptions import ResponseError

from tests.gateway.inprocess import MODEL, inprocess_gateway
from tests.servers import free_port
from tokenfleet.api.usage import Usage
from tokenfleet.gateway.app import create_gateway_app
from tokenfleet.gateway.chunks import Chunk
from tokenfleet.gateway.formats import OpenAIFormat
from tokenfleet.gateway.relay import Relay
from tokenfleet.gateway.resume import MemoryResumeBuffer, RedisResumeBuffer, StreamEvent
from tokenfleet.gateway.upstream import HttpUpstream

BURST, SECOND_BURST = 12, 3  # chunks the replica writes at once, then more after a pause


def usage(completion: int) -> dict:
    return {
        "prompt_tokens": 5,
        "completion_tokens": completion,
        "total_tokens": 5 + completion,
        "prompt_tokens_details": {"cached_tokens": 0},
        "engine_s": 0.001 * completion,
    }


def sse(data: dict | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


def chunked(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(body), body)


class BurstReplica:
    """An OpenAI-compatible replica on a real socket: its headers, a pause, BURST chat chunks (continuous usage) in
    one write, a pause, SECOND_BURST more, the usage chunk and [DONE] in one more write."""

    def __init__(self, pause_s: float = 0.3) -> None:
        self.pause_s, self.requests = pause_s, 0

    async def __aenter__(self) -> BurstReplica:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    def _chunk(self, i: int, total: int) -> dict:
        delta = {"role": "assistant", "content": f"w{i} "} if i == 0 else {"content": f"w{i} "}
        finish = "length" if i == total - 1 else None
        return {
            "id": "replica-chunk-id",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, "token_ids": [i]}],
            "usage": usage(i + 1),
        }

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                await reader.readexactly(length)
                self.requests += 1
                total = BURST + SECOND_BURST
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                )
                await writer.drain()
                await asyncio.sleep(self.pause_s)  # the client is reading by then: what the first token's read is
                writer.write(chunked(b"".join(sse(self._chunk(i, total)) for i in range(BURST))))
                await writer.drain()
                await asyncio.sleep(self.pause_s)
                rest = b"".join(sse(self._chunk(i, total)) for i in range(BURST, total))
                closing = {"id": "replica-chunk-id", "object": "chat.completion.chunk", "created": 1, "model": MODEL}
                rest += sse({**closing, "choices": [], "usage": usage(total)}) + sse("[DONE]")
                writer.write(chunked(rest) + b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


class BodyRecorder:
    """ASGI middleware: the body messages each streamed response sent, as sent."""

    def __init__(self, app) -> None:
        self.app, self.bodies = app, []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
            return await self.app(scope, receive, send)
        bodies: list[bytes] = []
        self.bodies.append(bodies)

        async def recording(message):
            if message["type"] == "http.response.body" and message.get("body"):
                bodies.append(message["body"])
            await send(message)

        return await self.app(scope, receive, recording)


@pytest.fixture
def redis_prefix():
    prefix = f"tftest:coalesce:{uuid.uuid4().hex}:"
    yield prefix

    async def cleanup():
        client = aioredis.Redis.from_url("redis://127.0.0.1:6379")
        keys = [k async for k in client.scan_iter(match=prefix + "*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()

    asyncio.run(cleanup())


def events_of(body: bytes) -> list[str]:
    """The data of each SSE event in a body message; fails unless the message is whole events only."""
    text = body.decode()
    assert text.endswith("\n\n"), f"a body message ends mid-event: {text[-80:]!r}"
    events = text[:-2].split("\n\n")
    for event in events:
        assert event.startswith("data: ") and "\n" not in event, f"not one OpenAI data line: {event!r}"
    return [event[6:] for event in events]


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_a_burst_from_the_replica_reaches_the_openai_sdk_as_one_message_of_whole_events(
    backend, demo_model_dir, redis_prefix
):
    async def main():
        client = aioredis.Redis.from_url("redis://127.0.0.1:6379") if backend == "redis" else None
        buffer = RedisResumeBuffer(client, redis_prefix, ttl_s=60, block_ms=50) if client else MemoryResumeBuffer()
        async with BurstReplica() as replica:
            gateway = inprocess_gateway(demo_model_dir, [HttpUpstream(replica.url, "r")], buffer=buffer)
            app = BodyRecorder(create_gateway_app(gateway))
            port = free_port()
            server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
            serving = asyncio.create_task(server.serve())
            try:
                while not server.started:
                    await asyncio.sleep(0.02)
                sdk = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
                raw = await sdk.chat.completions.with_raw_response.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "Hi"}],
                    stream=True,
                    stream_options={"include_usage": True},
                )
                request_id = raw.headers["x-request-id"]
                chunks = [c async for c in raw.parse()]
                await sdk.close()
            finally:
                server.should_exit = True
                await serving
        total = BURST + SECOND_BURST
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "".join(f"w{i} " for i in range(total))
        assert all(c.id == request_id and c.object == "chat.completion.chunk" for c in chunks)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert all(c.usage is None for c in chunks[:-1]), "usage only where the client asked: the last chunk"
        final = chunks[-1]
        assert final.choices == [] and final.usage.completion_tokens == total and final.usage.total_tokens == 5 + total
        assert "engine_s" not in (final.usage.model_extra or {}), "metering's engine time never reaches clients"
        assert all("token_ids" not in (c.choices[0].model_extra or {}) for c in chunks if c.choices)

        [bodies] = app.bodies
        messages = [events_of(body) for body in bodies]
        # the first token at once, the rest of the first read in one message, the second read's (its chunks, the
        # usage chunk, [DONE]) in another
        assert [len(m) for m in messages] == [1, BURST - 1, SECOND_BURST + 2], [len(m) for m in messages]
        assert messages[-1][-1] == "[DONE]"
        contents = [json.loads(d)["choices"][0]["delta"]["content"] for d in messages[0] + messages[1]]
        assert contents == [f"w{i} " for i in range(BURST)]

        if client is not None:  # what another gateway resumes from: every event, in order, the newest count last
            entries = await client.xrange(redis_prefix + request_id)
            ids = [int(f[b"id"]) for _, f in entries if b"id" in f]
            assert ids == list(range(1, total + 3))
            assert Usage.from_json(entries[-2][1][b"usage"]).completion_tokens == total
            assert (await buffer.last_usage(request_id)).completion_tokens == total
            await client.aclose()

    asyncio.run(main())


async def chunks_of(counts: list[int], pause_s: float = 0.05):
    """Chat chunks in bursts (the counts), each with its usage so far; a pause between bursts."""
    n = 0
    for burst in counts:
        await asyncio.sleep(pause_s)
        for _ in range(burst):
            n += 1
            data = {"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "t"}}]}
            yield Chunk(data, Usage(3, n))


class OneAtATime(MemoryResumeBuffer):
    """A buffer with no append_many (as any buffer may be): each event is appended on its own; records them."""

    append_many = None  # type: ignore[assignment]

    def __init__(self) -> None:
        super().__init__()
        self.appended: list[StreamEvent] = []

    async def append(self, request_id: str, event: StreamEvent) -> None:
        self.appended.append(event)
        await super().append(request_id, event)


class Batches(MemoryResumeBuffer):
    """Records each write; the first `failing` writes raise, as a Redis outage would."""

    def __init__(self, failing: int = 0) -> None:
        super().__init__()
        self.writes: list[list[StreamEvent]] = []
        self.failing = failing

    async def append_many(self, request_id: str, events: list[StreamEvent], shown=None) -> None:
        await asyncio.sleep(0.01)
        if self.failing:
            self.failing -= 1
            raise ConnectionError("redis is down")
        self.writes.append(events)
        await super().append_many(request_id, events, shown)


async def relayed(buffer, counts: list[int]) -> Relay:
    relay = Relay("r", buffer, OpenAIFormat("r", include_usage=True), disconnect_grace_s=1.0)
    await relay.start(chunks_of(counts))
    await asyncio.wait_for(relay.finished.wait(), 10)
    return relay


def test_each_read_is_one_write_and_the_newest_count_is_stored_with_it():
    async def main():
        buffer = Batches()
        relay = await relayed(buffer, [4, 1, 3])
        sizes = [len(w) for w in buffer.writes]
        assert sizes == [1, 3, 1, 4], sizes  # the first token alone; the last read's chunks and [DONE] together
        events = [e for w in buffer.writes for e in w]
        assert [e.id for e in events] == list(range(1, 10)) and events[-1].data == "[DONE]"
        for write, completion in zip(buffer.writes, (1, 4, 5, 8)):
            assert Usage.from_json(write[-1].usage).completion_tokens == completion
            assert all(e.usage is None for e in write[:-1])
        assert relay.usage.completion_tokens == 8 and relay.written_id == relay.last_id == 9

    asyncio.run(main())


def test_a_buffer_without_batches_gets_every_event_in_order_with_its_own_count():
    async def main():
        buffer = OneAtATime()
        await relayed(buffer, [3, 2])
        assert [e.id for e in buffer.appended] == [1, 2, 3, 4, 5, 6]
        counts = [Usage.from_json(e.usage).completion_tokens for e in buffer.appended[:5]]
        assert counts == [1, 2, 3, 4, 5], "each event with the count of its own chunk (exact after a crash)"

    asyncio.run(main())


def test_a_write_that_fails_ends_the_stream_with_an_error_and_its_end():
    async def main():
        buffer = Batches(failing=1)
        relay = await relayed(buffer, [3, 3])
        events = [e async for e in buffer.read("r", 0)]
        assert relay.failure and "redis is down" in relay.failure
        assert json.loads(events[-2].data)["error"]["type"] == "server_error" and events[-1].data == "[DONE]"
        assert all(json.loads(e.data).get("choices") is None for e in events[:-1]), "nothing after a lost event"

    asyncio.run(main())


class SlowOpen(MemoryResumeBuffer):
    """An open that takes a while (a round trip to Redis), or fails."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.fail, self.opened_at, self.first_write_at = fail, None, None

    async def open(self, request_id: str, owner: str = "", kind: str = "openai") -> None:
        await asyncio.sleep(0.1)
        if self.fail:
            raise ConnectionError("redis is down")
        self.opened_at = asyncio.get_running_loop().time()
        await super().open(request_id, owner, kind)

    async def append_many(self, request_id: str, events: list[StreamEvent], shown=None) -> None:
        self.first_write_at = self.first_write_at or asyncio.get_running_loop().time()
        await super().append_many(request_id, events, shown)


def test_the_replica_is_asked_while_the_open_waits_and_nothing_is_written_before_it():
    async def main():
        asked = []

        async def replica():
            asked.append(asyncio.get_running_loop().time())
            async for chunk in chunks_of([2], pause_s=0):
                yield chunk

        buffer = SlowOpen()
        relay = Relay("r", buffer, OpenAIFormat("r", include_usage=False), disconnect_grace_s=1.0)
        began = asyncio.get_running_loop().time()
        await relay.start(replica())
        assert asked and asked[0] - began < 0.05, "the replica waited for the open"
        await asyncio.wait_for(relay.finished.wait(), 5)
        assert buffer.first_write_at >= buffer.opened_at
        assert [e.id async for e in buffer.read("r", 0)] == [1, 2, 3]

    asyncio.run(main())


def test_a_stream_that_cannot_be_opened_stops_its_replica_and_writes_nothing():
    async def main():
        closed = asyncio.Event()

        async def replica():
            try:
                while True:
                    await asyncio.sleep(0.01)
                    yield Chunk({"id": "x", "choices": [{"index": 0, "delta": {"content": "t"}}]})
            finally:
                closed.set()

        buffer = SlowOpen(fail=True)
        relay = Relay("r", buffer, OpenAIFormat("r", include_usage=False), disconnect_grace_s=1.0)
        with pytest.raises(ConnectionError):
            await relay.start(replica())
        await asyncio.wait_for(closed.wait(), 2)
        await asyncio.sleep(0.05)
        assert buffer.first_write_at is None and not buffer.holds("r")

    asyncio.run(main())


async def _fields(client, key: str):
    for _, fields in await client.xrange(key):
        if b"id" in fields:
            yield fields


def test_redis_batches_of_many_streams_share_a_round_trip_and_a_refused_one_fails_alone(redis_prefix):
    async def main():
        client = aioredis.Redis.from_url("redis://127.0.0.1:6379")
        buffer = RedisResumeBuffer(client, redis_prefix, ttl_s=60, block_ms=50)
        await client.set(redis_prefix + "broken", "not a stream")  # XADD to it fails: WRONGTYPE
        batches = {f"s{i}": [StreamEvent(j, f"s{i}-{j}", usage=f'{{"n":{j}}}') for j in range(1, 6)] for i in range(8)}
        before = buffer._writes.batches
        results = await asyncio.gather(
            buffer.append_many("broken", [StreamEvent(1, "a"), StreamEvent(2, "b")]),
            *(buffer.append_many(rid, events) for rid, events in batches.items()),
            return_exceptions=True,
        )
        assert buffer._writes.batches - before == 1, "all of the tick's batches in one script call"
        assert isinstance(results[0], ResponseError) and "WRONGTYPE" in str(results[0])
        assert results[1:] == [None] * len(batches)
        for rid, events in batches.items():
            await buffer.close(rid)
            got = [e async for e in buffer.read(rid, 0)]
            assert [(e.id, e.data) for e in got] == [(e.id, e.data) for e in events]
            assert 0 < await client.ttl(redis_prefix + rid) <= 60
        stored = [f[b"usage"] async for f in _fields(client, redis_prefix + "s3")]
        assert stored == [f'{{"n":{j}}}'.encode() for j in range(1, 6)], "each entry with its own usage, in order"
        assert await client.type(redis_prefix + "broken") == b"string"
        await client.aclose()

    asyncio.run(main())
