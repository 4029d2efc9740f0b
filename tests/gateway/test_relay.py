"""The gateway's relay and SSE response in process: heartbeats, slow readers cut off and resuming, the buffers."""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import replace

import pytest
import redis.asyncio as redis

from tests.gateway.inprocess import MODEL, inprocess_gateway
from tokenfleet.api.errors import APIError
from tokenfleet.config import default_tiers
from tokenfleet.gateway.auth import Caller
from tokenfleet.gateway.formats import OpenAIFormat
from tokenfleet.gateway.gateway import Gateway
from tokenfleet.gateway.resume import MemoryResumeBuffer, RedisResumeBuffer, StreamEvent
from tokenfleet.gateway.sse_response import SSEResponse


class FakeUpstream:
    """Stands in for a replica: `count` chat chunks, `delay` seconds apart."""

    name = "fake"
    kind = "tokenfleet"

    def __init__(self, count: int, delay: float = 0.0) -> None:
        self.count, self.delay = count, delay

    async def stream(self, kind: str, body: dict):
        for i in range(self.count):
            await asyncio.sleep(self.delay)
            yield {
                "id": "x",
                "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}],
            }
        yield {"id": "x", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": self.count}}

    async def load(self) -> dict:
        return {}


async def run_response(response: SSEResponse, send_delay: float = 0.0) -> list[bytes]:
    """Drives an ASGI response like a server would, with a client that reads `send_delay` seconds per message."""
    sent: list[bytes] = []

    async def receive():
        await asyncio.Event().wait()  # the client never disconnects

    async def send(message):
        if message["type"] == "http.response.body":
            await asyncio.sleep(send_delay)
            sent.append(message.get("body", b""))

    await response({"type": "http"}, receive, send)
    return sent


def make_gateway(model_dir, upstream, buffer=None, **settings) -> Gateway:
    return inprocess_gateway(model_dir, [upstream], buffer=buffer, **settings)


async def start(gateway: Gateway, include_usage: bool = False):
    p = await gateway.preparation.prepare(
        "chat", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}, gateway.auth.open_caller
    )
    return await gateway.start_relay(p, OpenAIFormat(p.request_id, include_usage))


def test_heartbeats_while_the_stream_is_idle(demo_model_dir):
    async def scenario():
        gateway = make_gateway(demo_model_dir, FakeUpstream(3, delay=0.25), ping_interval_s=0.05)
        relay = await start(gateway)
        body = b"".join(await run_response(gateway.streams.sse(relay.request_id, 0))).decode()
        assert body.count(": ping\n\n") >= 6
        assert body.rstrip().endswith("data: [DONE]")

    asyncio.run(scenario())


def test_slow_reader_is_cut_off_and_resumes_everything(demo_model_dir):
    async def scenario():
        gateway = make_gateway(demo_model_dir, FakeUpstream(60), max_lag_events=5)
        relay = await start(gateway, include_usage=True)
        endings = []
        response = gateway.streams.sse(relay.request_id, 0)
        response.on_end = lambda how, inner=response.on_end: (endings.append(how), inner(how))
        sent = await run_response(response, send_delay=0.01)
        assert endings == ["slow"]
        await relay.finished.wait()
        assert not relay.task.cancelled() and relay.usage.completion_tokens == 60, "generation must go on"
        got = [int(line[4:]) for chunk in sent for line in chunk.decode().splitlines() if line.startswith("id: ")]
        resumed = [e async for e in gateway.buffer.read(relay.request_id, got[-1])]
        ids = got + [e.id for e in resumed]
        assert ids == list(range(1, relay.last_id + 1))
        assert resumed[-1].data == "[DONE]" and json.loads(resumed[-2].data)["usage"]["completion_tokens"] == 60

    asyncio.run(scenario())


def test_cancel_stops_generation_and_closes_the_stream(demo_model_dir):
    async def scenario():
        gateway = make_gateway(demo_model_dir, FakeUpstream(1000, delay=0.01))
        relay = await start(gateway)
        relay.owner = gateway.auth.open_caller.tenant
        await asyncio.sleep(0.05)
        stranger = Caller(replace(gateway.auth.open_caller.principal, org_id="someone-else"), default_tiers()["paid"])
        with pytest.raises(APIError) as refused:
            gateway.streams.cancel(relay.request_id, stranger)
        assert refused.value.status == 404, "another tenant's request looks like no request at all"
        assert gateway.streams.cancel(relay.request_id, gateway.auth.open_caller)
        await relay.finished.wait()
        events = [e async for e in gateway.buffer.read(relay.request_id, 0)]
        assert events[-1].data == "[DONE]" and len(events) < 100

    asyncio.run(scenario())


@pytest.fixture
def redis_buffer():
    prefix = f"tokenfleet-test:{uuid.uuid4().hex}:"

    async def cleanup():
        client = redis.Redis(host="127.0.0.1", port=6379)
        keys = [k async for k in client.scan_iter(match=prefix + "*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()

    yield prefix
    asyncio.run(cleanup())


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_buffers_replay_after_an_id_then_follow_live(backend, redis_buffer):
    async def scenario():
        client = redis.Redis(host="127.0.0.1", port=6379) if backend == "redis" else None
        buffer = (
            RedisResumeBuffer(client, redis_buffer, ttl_s=60, block_ms=50) if client else MemoryResumeBuffer(ttl_s=60)
        )
        await buffer.open("r1", owner="org_a")
        for i in range(1, 4):
            await buffer.append("r1", StreamEvent(i, f"e{i}"))
        assert await buffer.owner("r1") == "org_a" and await buffer.owner("r2") is None

        async def produce_later():
            await asyncio.sleep(0.1)
            await buffer.append("r1", StreamEvent(4, "e4", event="done"))
            await buffer.close("r1")

        producer = asyncio.create_task(produce_later())
        got = [e async for e in buffer.read("r1", after=2)]
        await producer
        assert [(e.id, e.data) for e in got] == [(3, "e3"), (4, "e4")] and got[-1].event == "done"
        assert [e.id async for e in buffer.read("r1", after=0)] == [1, 2, 3, 4]
        if client is not None:
            assert 0 < await client.ttl(redis_buffer + "r1") <= 60
            await client.aclose()

    asyncio.run(scenario())


def test_memory_buffer_expires_streams_by_their_last_touch():
    async def scenario():
        buffer = MemoryResumeBuffer(ttl_s=0.3)
        await buffer.open("early", owner="org_a")
        await buffer.open("late", owner="org_a")
        await asyncio.sleep(0.2)
        await buffer.append("early", StreamEvent(1, "e1"))  # touched again: now the newest
        await asyncio.sleep(0.2)
        assert await buffer.owner("late") is None, "untouched for longer than the TTL: gone"
        assert await buffer.owner("early") == "org_a"
        await buffer.close("early")
        assert [e.id async for e in buffer.read("early", 0)] == [1]

    asyncio.run(scenario())
