"""The Redis resume buffer batches the events that all streams write within one event-loop tick into one script call
(one round trip), and keeps what a resume relies on: every event of a stream in Redis, in order, before its writer
goes on; a write Redis refuses fails only its own stream; the gateway's alive mark comes with the stream's open.
Writes are counted by a connection class that wraps redis-py's; the streams are read back by a second buffer, as
another gateway would."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from tokenfleet.gateway.resume import RedisResumeBuffer, StreamEvent

STREAMS, EVENTS = 40, 12


class CountingConnection(aioredis.Connection):
    writes: list[bytes] = []  # every write that adds to a stream, as sent

    async def send_packed_command(self, command, check_health: bool = True) -> None:
        data = command if isinstance(command, bytes) else b"".join(command)
        if b"XADD" in data or b"EVAL" in data:  # a script call, or a command of its own
            CountingConnection.writes.append(data)
        await super().send_packed_command(command, check_health)


@pytest.fixture
def prefix():
    value = f"tftest:resume:{uuid.uuid4().hex}:"
    yield value

    async def cleanup():
        client = aioredis.Redis.from_url("redis://127.0.0.1:6379")
        keys = [k async for k in client.scan_iter(match=value + "*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()

    asyncio.run(cleanup())


def counted_client() -> aioredis.Redis:
    CountingConnection.writes = []
    pool = aioredis.ConnectionPool.from_url("redis://127.0.0.1:6379", connection_class=CountingConnection)
    return aioredis.Redis(connection_pool=pool)


async def relay(buffer: RedisResumeBuffer, request_id: str) -> None:
    """What a relay does: open, then each event awaited before the next, then close."""
    await buffer.open(request_id, owner="org_a")
    for i in range(1, EVENTS + 1):
        await buffer.append(request_id, StreamEvent(i, f"{request_id}-e{i}", usage='{"completion_tokens": 1}'))
    await buffer.close(request_id)


def test_concurrent_streams_share_round_trips_and_every_event_is_kept_in_order(prefix):
    async def main():
        client = counted_client()
        writer = RedisResumeBuffer(client, prefix, ttl_s=60, block_ms=50, owner_lease_s=5.0)
        ids = [f"r{i}" for i in range(STREAMS)]
        await asyncio.gather(*(relay(writer, request_id) for request_id in ids))
        trips = len(CountingConnection.writes)
        assert EVENTS + 2 <= trips <= STREAMS * (EVENTS + 2) / 10  # 560 events in about 14 round trips, not 560

        other = RedisResumeBuffer(aioredis.Redis.from_url("redis://127.0.0.1:6379"), prefix, block_ms=50)
        for request_id in ids:
            got = [e async for e in other.read(request_id, after=0)]
            assert [(e.id, e.data) for e in got] == [(i, f"{request_id}-e{i}") for i in range(1, EVENTS + 1)]
            assert await other.owner(request_id) == "org_a"
            assert 0 < await client.ttl(prefix + request_id) <= 60
        resumed = [e.id async for e in other.read("r7", after=EVENTS - 3)]
        assert resumed == [EVENTS - 2, EVENTS - 1, EVENTS]
        assert await client.exists(f"{prefix}gateway-alive:{writer.gateway_id}")  # set with the opens
        await client.aclose()
        await other.redis.aclose()

    asyncio.run(main())


def test_a_write_redis_refuses_fails_only_its_own_stream(prefix):
    async def main():
        client = counted_client()
        buffer = RedisResumeBuffer(client, prefix, ttl_s=60, block_ms=50)
        await client.set(prefix + "broken", "not a stream")  # XADD to it fails: WRONGTYPE
        results = await asyncio.gather(
            buffer.append("broken", StreamEvent(1, "lost")),
            buffer.append("fine", StreamEvent(1, "kept")),
            return_exceptions=True,
        )
        assert isinstance(results[0], ResponseError) and "WRONGTYPE" in str(results[0])
        assert results[1] is None
        assert len(CountingConnection.writes) == 1  # both were in one round trip
        await buffer.close("fine")
        assert [e.data async for e in buffer.read("fine", after=0)] == ["kept"]
        await client.aclose()

    asyncio.run(main())
