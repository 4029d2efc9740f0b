"""The resume stream is opened while the quota decides (issue 25: its Redis round trip off the first token's path):
a refused request leaves no stream in memory or Redis and never reaches a replica; an admitted one streams and is
resumable as before; after a long wait for room the relay opens the stream again (the early open may have
expired)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
import redis.asyncio as aioredis

from tests.gateway.inprocess import inprocess_gateway
from tests.gateway.test_admission import RecordingUpstream
from tokenfleet.gateway.app import create_gateway_app
from tokenfleet.gateway.fleet_buffer import FleetResumeBuffer
from tokenfleet.gateway.resume import MemoryResumeBuffer, RedisResumeBuffer
from tokenfleet.quota.base import Decision
from tokenfleet.quota.memory import MemoryQuota

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}


class Refusing(MemoryQuota):
    async def reserve(self, request_id, scopes, tokens, tier=None, **kw):
        await asyncio.sleep(0.05)  # a Redis round trip; the open runs meanwhile
        return Decision(False, None, reason="requests_per_minute", scope="org:x", retry_after_s=1.0)


@dataclass
class Setup:
    http: httpx.AsyncClient
    buffer: MemoryResumeBuffer | FleetResumeBuffer
    redis: aioredis.Redis
    prefix: str

    async def redis_keys(self) -> list[bytes]:
        return [k async for k in self.redis.scan_iter(match=self.prefix + "*")]


@contextlib.asynccontextmanager
async def gateway(backend: str, model_dir, upstream: RecordingUpstream, **options) -> AsyncIterator[Setup]:
    """An in-process gateway with a memory or a fleet (Redis) resume buffer under a prefix of its own."""
    client = aioredis.Redis.from_url("redis://127.0.0.1:6379")
    prefix = f"tftest:early:{uuid.uuid4().hex}:"
    buffer = (
        MemoryResumeBuffer() if backend == "memory" else FleetResumeBuffer(RedisResumeBuffer(client, prefix, ttl_s=60))
    )
    options.setdefault("buffer", buffer)
    app = create_gateway_app(inprocess_gateway(model_dir, [upstream], **options))
    setup = Setup(
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw"), buffer, client, prefix
    )
    try:
        async with setup.http:
            yield setup
    finally:
        keys = await setup.redis_keys()
        if keys:
            await client.delete(*keys)
        await client.aclose()


@pytest.mark.parametrize("backend", ["memory", "fleet"])
def test_a_refused_request_leaves_no_stream(backend, demo_model_dir):
    upstream = RecordingUpstream()

    async def main() -> None:
        async with gateway(backend, demo_model_dir, upstream, open_tier="free", quota=Refusing()) as gw:
            response = await gw.http.post("/v1/chat/completions", json=CHAT)
            assert response.status_code == 429, response.text
            await asyncio.sleep(0.2)
            local = gw.buffer if backend == "memory" else gw.buffer.local
            assert not local._logs, list(local._logs)
            assert [k for k in await gw.redis_keys() if b"gateway-alive" not in k] == []

    asyncio.run(main())
    assert upstream.bodies == []


@pytest.mark.parametrize("backend", ["memory", "fleet"])
def test_an_admitted_request_streams_and_is_resumable(backend, demo_model_dir):
    async def main() -> None:
        async with gateway(backend, demo_model_dir, RecordingUpstream(count=4)) as gw:
            response = await gw.http.post("/v1/chat/completions", json=CHAT, headers={"x-tokenfleet-resumable": "true"})
            assert response.status_code == 200, response.text
            assert response.text.rstrip().endswith("data: [DONE]"), response.text
            if backend == "fleet":
                events = [e async for e in gw.buffer.shared.read(response.headers["x-request-id"], 2)]
                assert [e.id for e in events] == [3, 4, 5], events
                assert events[-1].data == "[DONE]"

    asyncio.run(main())


@pytest.mark.parametrize("backend", ["memory", "fleet"])
def test_after_a_long_wait_for_room_the_relay_opens_the_stream_again(backend, demo_model_dir, monkeypatch):
    from tokenfleet.gateway import gateway as gateway_module

    monkeypatch.setattr(gateway_module, "REOPEN_AFTER_S", 0.0)
    opens: list[str] = []

    async def main() -> None:
        async with gateway(backend, demo_model_dir, RecordingUpstream(count=4)) as gw:
            open_stream = gw.buffer.open

            async def counting(request_id: str, *args, **kwargs) -> None:
                opens.append(request_id)
                await open_stream(request_id, *args, **kwargs)

            gw.buffer.open = counting
            response = await gw.http.post("/v1/chat/completions", json=CHAT)
            assert response.status_code == 200 and response.text.rstrip().endswith("data: [DONE]"), response.text
            request_id = response.headers["x-request-id"]
            assert opens == [request_id, request_id]
            if backend == "fleet":
                assert await gw.buffer.shared.owner(request_id) is not None
                assert [e.id async for e in gw.buffer.shared.read(request_id, 0)] == [1, 2, 3, 4, 5]

    asyncio.run(main())
