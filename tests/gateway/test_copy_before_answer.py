"""A fleet gateway's clients read an event as soon as its write has left for Redis, not once Redis has answered (issue
25: Redis's round trip off the time to first token), and the write is in Redis by then: a gateway dying after its
client got an event still leaves that event where metering bills from. Redis is reached through a proxy that holds
its replies for DELAY_S, so "before the answer" and "after it" are far apart."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator

import redis.asyncio as aioredis

from tests.quota.helpers import Proxy
from tokenfleet.gateway.chunks import Chunk
from tokenfleet.gateway.fleet_buffer import FleetResumeBuffer
from tokenfleet.gateway.formats import OpenAIFormat
from tokenfleet.gateway.relay import Relay
from tokenfleet.gateway.resume import RedisResumeBuffer, StreamEvent

DELAY_S = 0.4


@contextlib.asynccontextmanager
async def slow_redis() -> AsyncIterator[tuple[FleetResumeBuffer, aioredis.Redis, str]]:
    """A fleet buffer whose Redis answers DELAY_S late, a direct client, and the buffer's key prefix."""
    proxy = Proxy(reply_delay_s=DELAY_S)
    await proxy.start()
    slow = aioredis.Redis.from_url(f"redis://127.0.0.1:{proxy.port}")
    direct = aioredis.Redis.from_url("redis://127.0.0.1:6379")
    prefix = f"tftest:copy:{uuid.uuid4().hex}:"
    # connected ahead: a connection's handshake is several answers, each DELAY_S late
    await asyncio.gather(*(slow.ping() for _ in range(4)))
    try:
        yield FleetResumeBuffer(RedisResumeBuffer(slow, prefix, ttl_s=60)), direct, prefix
    finally:
        keys = [k async for k in direct.scan_iter(match=prefix + "*")]
        if keys:
            await direct.delete(*keys)
        await slow.aclose()
        await direct.aclose()
        await proxy.stop()


async def stream_ids(direct: aioredis.Redis, key: str) -> list[int]:
    return [int(fields[b"id"]) for _, fields in await direct.xrange(key) if b"id" in fields]


def test_a_reader_here_gets_a_write_once_it_left_for_redis_and_redis_holds_it_then():
    async def main() -> None:
        async with slow_redis() as (buffer, direct, prefix):
            await buffer.open("r1", "acme")
            follower = buffer.follow("r1", 0)
            started = time.monotonic()
            write = asyncio.create_task(buffer.append_many("r1", [StreamEvent(1, "a"), StreamEvent(2, "b")]))
            events = await follower.next(5.0)
            read_after = time.monotonic() - started
            assert [e.id for e in events] == [1, 2]
            assert read_after < DELAY_S / 2, f"the reader waited {read_after:.3f} s: for Redis's answer"
            assert not write.done(), "the write's answer cannot have come yet"
            for _ in range(50):  # what the proxy forwarded is applied within a moment, long before its answer
                if await stream_ids(direct, prefix + "r1") == [1, 2]:
                    break
                await asyncio.sleep(0.002)
            assert await stream_ids(direct, prefix + "r1") == [1, 2], "a reader got events Redis does not hold"
            assert not write.done()
            await write
            assert time.monotonic() - started >= DELAY_S * 0.9, "append_many returned before Redis answered"
            assert buffer.resumable("r1")

    asyncio.run(main())


def test_a_write_redis_refuses_stays_in_the_copy_and_the_stream_goes_on_unshared():
    async def main() -> None:
        async with slow_redis() as (buffer, direct, prefix):
            await buffer.open("r2", "acme")
            await direct.delete(prefix + "r2")
            await direct.set(prefix + "r2", "not a stream")  # XADD now fails: WRONGTYPE
            await buffer.append_many("r2", [StreamEvent(1, "a")])
            assert not buffer.resumable("r2"), "a refused write left the stream marked as kept in Redis"
            await buffer.append_many("r2", [StreamEvent(2, "b")])
            await buffer.close("r2")
            assert [e.id async for e in buffer.local.read("r2", 0)] == [1, 2], "each event once, in order"

    asyncio.run(main())


async def replica(texts: list[str], pause_s: float) -> AsyncIterator[Chunk]:
    for text in texts:
        await asyncio.sleep(pause_s)
        yield Chunk(
            {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]}
        )


def test_the_relay_starts_and_its_first_token_reaches_a_reader_before_any_answer_of_redis():
    async def main() -> None:
        async with slow_redis() as (buffer, direct, prefix):
            relay = Relay("r3", buffer, OpenAIFormat("r3", include_usage=False), disconnect_grace_s=5.0)
            started = time.monotonic()
            await relay.start(replica(["Hi", " there"], pause_s=0.05))
            started_after = time.monotonic() - started
            # no answer on the way: the open is sent, and the writes carry it (test_open_before_answer.py)
            assert started_after < DELAY_S / 2, f"start took {started_after:.3f} s"
            follower, texts = buffer.follow("r3", 0), []
            while not texts:
                for event in await follower.next(5.0) or []:
                    choices = json.loads(event.data).get("choices") if event.data != "[DONE]" else None
                    texts += [c["delta"]["content"] for c in choices or [] if c["delta"].get("content")]
            first_token_after = time.monotonic() - started
            assert texts[0] == "Hi"
            # the replica's 0.05 s; before, the open, the start events' write and the token's each added an answer
            assert first_token_after < DELAY_S / 2, f"the first token reached a reader after {first_token_after:.3f} s"
            await asyncio.wait_for(relay.finished.wait(), 10)
            assert relay.written_id == relay.last_id
            assert await stream_ids(direct, prefix + "r3") == list(range(1, relay.last_id + 1))

    asyncio.run(main())
