"""A fleet gateway's stream is open, for its relay, once the open has left for Redis, not once Redis has answered (issue
25: the open's round trip off the time to first token). The stream's writes may then reach Redis before the open (they
can go on another connection), so until the open is answered they carry it too, as an entry added only where the
stream does not exist yet: whichever Redis runs first opens the stream, and it holds one open, first, either way."""

from __future__ import annotations

import asyncio
import time
import uuid

import redis.asyncio as aioredis

from tests.gateway.test_copy_before_answer import DELAY_S, slow_redis, stream_ids
from tokenfleet.gateway.resume import APPEND, RedisResumeBuffer, StreamEvent
from tokenfleet.quota.redis_client import ScriptCall, run_scripts


async def entries(direct: aioredis.Redis, key: str) -> list[dict[str, str]]:
    return [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in await direct.xrange(key)]


def test_an_open_and_a_write_that_carries_it_open_the_stream_once_in_either_order():
    async def main() -> None:
        direct = aioredis.Redis.from_url("redis://127.0.0.1:6379")
        prefix = f"tftest:open:{uuid.uuid4().hex}:"
        open_entry = [-4, "open", "acme", "format", "openai"]
        events = [4, "id", 1, "data", "a", 4, "id", 2, "data", "b"]
        try:
            for order, key in (("write first", prefix + "w"), ("open first", prefix + "o")):
                write = ScriptCall(APPEND, [key], [60, 1000, 0, 3, *open_entry, *events])
                opening = ScriptCall(APPEND, [key], [60, 1000, 0, 1, *open_entry])
                for call in (write, opening) if order == "write first" else (opening, write):
                    [reply] = await run_scripts(direct, [call])
                    assert reply == [1]
                assert await entries(direct, key) == [
                    {"open": "acme", "format": "openai"},
                    {"id": "1", "data": "a"},
                    {"id": "2", "data": "b"},
                ], order
                buffer = RedisResumeBuffer(direct, prefix)
                assert await buffer.owner(key.removeprefix(prefix)) == "acme"
        finally:
            await direct.delete(prefix + "w", prefix + "o")
            await direct.aclose()

    asyncio.run(main())


def test_the_open_returns_before_its_answer_and_the_first_write_does_not_wait_for_it():
    async def main() -> None:
        async with slow_redis() as (buffer, direct, prefix):
            started = time.monotonic()
            await buffer.open("r1", "acme")
            assert time.monotonic() - started < DELAY_S / 2, "the open waited for Redis's answer"
            follower = buffer.follow("r1", 0)
            write = asyncio.create_task(buffer.append_many("r1", [StreamEvent(1, "a")]))
            assert [e.id for e in await follower.next(5.0)] == [1]
            assert time.monotonic() - started < DELAY_S / 2, "the first write waited for the open's answer"
            await write
            assert (await entries(direct, prefix + "r1"))[0] == {"open": "acme", "format": "openai"}
            assert await stream_ids(direct, prefix + "r1") == [1]  # one open, then the event
            assert len(await entries(direct, prefix + "r1")) == 2 and buffer.resumable("r1")

    asyncio.run(main())


def test_a_stream_discarded_before_its_open_was_answered_leaves_nothing_in_redis():
    async def main() -> None:
        async with slow_redis() as (buffer, direct, prefix):
            await buffer.open("r2", "acme")  # sent, not answered
            await buffer.discard("r2")  # a refused request: its delete must not overtake the open
            assert await direct.exists(prefix + "r2") == 0
            assert not buffer.local.holds("r2") and buffer.resumable("r2")

    asyncio.run(main())
