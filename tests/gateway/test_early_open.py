"""The resume stream is opened while the quota decides (issue 25: its Redis round trip off the first token's path):
a refused request leaves no stream in memory or Redis and never reaches a replica; an admitted one streams and is
resumable as before; after a long wait for room the relay opens the stream again (the early open may have
expired)."""

import asyncio
import uuid

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


class Refusing(MemoryQuota):
    def __init__(self, gate=None):
        super().__init__()
        self.gate = gate

    async def reserve(self, request_id, scopes, tokens, tier=None, **kw):
        await asyncio.sleep(0.05)  # a Redis round trip; the open runs meanwhile
        return Decision(False, None, reason="requests_per_minute", scope="org:x", retry_after_s=1.0)


@pytest.mark.parametrize("backend", ["memory", "fleet"])
def test_a_refused_request_leaves_no_stream(backend, demo_model_dir):
    async def main():
        client = aioredis.Redis.from_url("redis://127.0.0.1:6379")
        prefix = f"tftest:early:{uuid.uuid4().hex}:"
        buffer = (
            MemoryResumeBuffer()
            if backend == "memory"
            else FleetResumeBuffer(RedisResumeBuffer(client, prefix, ttl_s=60))
        )
        upstream = RecordingUpstream()
        gw = inprocess_gateway(demo_model_dir, [upstream], open_tier="free", buffer=buffer, quota=Refusing())
        app = create_gateway_app(gw)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as http:
            r = await http.post(
                "/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True},
            )
        assert r.status_code == 429, r.text
        await asyncio.sleep(0.2)
        assert upstream.bodies == []
        local = buffer if backend == "memory" else buffer.local
        assert not local._logs, list(local._logs)
        keys = [k async for k in client.scan_iter(match=prefix + "*")]
        assert [k for k in keys if b"gateway-alive" not in k] == [], keys
        if keys:
            await client.delete(*keys)
        await client.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("backend", ["memory", "fleet"])
def test_an_admitted_request_streams_and_is_resumable(backend, demo_model_dir):
    async def main():
        client = aioredis.Redis.from_url("redis://127.0.0.1:6379")
        prefix = f"tftest:early:{uuid.uuid4().hex}:"
        buffer = (
            MemoryResumeBuffer()
            if backend == "memory"
            else FleetResumeBuffer(RedisResumeBuffer(client, prefix, ttl_s=60))
        )
        upstream = RecordingUpstream(count=4)
        gw = inprocess_gateway(demo_model_dir, [upstream], buffer=buffer)
        app = create_gateway_app(gw)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as http:
            r = await http.post(
                "/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True},
                headers={"x-tokenfleet-resumable": "true"},
            )
            assert r.status_code == 200, r.text
            assert r.text.rstrip().endswith("data: [DONE]"), r.text
            rid = r.headers["x-request-id"]
            if backend == "fleet":
                events = [e async for e in buffer.shared.read(rid, 2)]
                assert [e.id for e in events] == [3, 4, 5], events
                assert events[-1].data == "[DONE]"
        keys = [k async for k in client.scan_iter(match=prefix + "*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("backend", ["memory", "fleet"])
def test_after_a_long_wait_for_room_the_relay_opens_the_stream_again(backend, demo_model_dir, monkeypatch):
    from tokenfleet.gateway import gateway as gateway_module

    monkeypatch.setattr(gateway_module, "REOPEN_AFTER_S", 0.0)
    opens = []

    async def main():
        client = aioredis.Redis.from_url("redis://127.0.0.1:6379")
        prefix = f"tftest:early:{uuid.uuid4().hex}:"
        buffer = (
            MemoryResumeBuffer()
            if backend == "memory"
            else FleetResumeBuffer(RedisResumeBuffer(client, prefix, ttl_s=60))
        )
        orig = buffer.open

        async def counting(*a, **k):
            opens.append(a[0])
            return await orig(*a, **k)

        buffer.open = counting
        gw = inprocess_gateway(demo_model_dir, [RecordingUpstream(count=4)], buffer=buffer)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=create_gateway_app(gw)), base_url="http://gw"
        ) as http:
            r = await http.post(
                "/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True},
            )
            assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
            rid = r.headers["x-request-id"]
            assert opens == [rid, rid]
            if backend == "fleet":
                assert await buffer.shared.owner(rid) == "local" or await buffer.shared.owner(rid) is not None
                assert [e.id async for e in buffer.shared.read(rid, 0)] == [1, 2, 3, 4, 5]
        keys = [k async for k in client.scan_iter(match=prefix + "*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()

    asyncio.run(main())
